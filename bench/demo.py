"""The demo's learning and wall time, cold cache, for several seeds.
Usage: python bench/demo.py [--script da3po.py] [--seeds 0,1,2] [extra flags for the script...]
Each run gets a fresh cache folder (so the warm start is included in the wall time) and prints one table row."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

parser = argparse.ArgumentParser()
parser.add_argument("--script", default="da3po.py")
parser.add_argument("--seeds", default="0,1,2")
args, extra = parser.parse_known_args()
print(f"{'seed':>4} | {'eval/acc step 0':>15} | {'eval/acc end':>12} | {'gain':>6} | {'wall s':>6}")
for seed in map(int, args.seeds.split(",")):
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        cmd = [sys.executable, args.script, "--seed", str(seed), "--out_dir", f"{tmp}/out", "--cache_dir", f"{tmp}/cache",
               *extra]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        wall = time.time() - t0
        if r.returncode != 0:
            print(f"{seed:4d} | failed: {r.stderr.strip().splitlines()[-1]}")
            continue
        evals = [json.loads(x) for x in open(f"{tmp}/out/metrics.jsonl") if '"eval/acc"' in x]
        first, last = evals[0]["eval/acc"], evals[-1]["eval/acc"]
        print(f"{seed:4d} | {first:15.3f} | {last:12.3f} | {100 * (last - first):+5.1f} | {wall:6.0f}", flush=True)
