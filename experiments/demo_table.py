"""The demo's learning and wall time over seeds and CPU kernel paths: what a new user sees from `python da3po.py`.
Usage: python -m experiments.demo_table [--script da3po.py] [--seeds 0,1,2] [--kernels native,avx2,default]
       [extra script flags]

Each run is the real script in a fresh output folder. --kernels sets ATEN_CPU_CAPABILITY per run (native = unset):
torch then uses other CPU kernels, whose float rounding differs, which is how another machine's result can be seen on
this one. The last lines give the band (min .. max) of the start, the end and the gain over all runs."""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--script", default="da3po.py")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--kernels", default="native", help="ATEN_CPU_CAPABILITY values, comma-separated")
    args, extra = parser.parse_known_args()
    import torch
    print(f"{args.script} {' '.join(extra)} | {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"native kernels {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'kernels':>8} | {'seed':>4} | {'eval/acc step 0':>15} | {'eval/acc end':>12} | {'gain':>6} | "
          f"{'wall s':>6}")
    rows = []
    for kernels in args.kernels.split(","):
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        env.pop("ATEN_CPU_CAPABILITY", None)
        if kernels != "native":
            env["ATEN_CPU_CAPABILITY"] = kernels
        for seed in map(int, args.seeds.split(",")):
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.time()
                cmd = [sys.executable, args.script, "--seed", str(seed), "--out_dir", f"{tmp}/out", *extra]
                r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
                wall = time.time() - t0
                if r.returncode != 0:
                    print(f"{kernels:>8} | {seed:4d} | failed: {r.stderr.strip().splitlines()[-1]}")
                    continue
                evals = [json.loads(x) for x in open(f"{tmp}/out/metrics.jsonl") if '"eval/acc"' in x]
            first, last = evals[0]["eval/acc"], evals[-1]["eval/acc"]
            rows.append((first, last, last - first))
            print(f"{kernels:>8} | {seed:4d} | {first:15.3f} | {last:12.3f} | {100 * (last - first):+5.1f} | "
                  f"{wall:6.0f}", flush=True)
    if rows:
        for name, i, scale, fmt in (("start", 0, 1, ".3f"), ("end", 1, 1, ".3f"), ("gain", 2, 100, "+.1f")):
            values = [r[i] * scale for r in rows]
            print(f"band of {name} over {len(rows)} runs: {min(values):{fmt}} .. {max(values):{fmt}}")


if __name__ == "__main__":
    main()
