"""The plain log-prob path against the shortcuts, on a demo: which should a newcomer's demo run?

  python -m bench.logprob_paths                     # the reasoning demo, 3 rounds of 6 steps a side
  python -m bench.logprob_paths --demo arith        # the sums demo

common.token_logprobs runs one padded forward; --logprob_path shortcuts runs shortcuts.token_logprobs (a group's
prompt once, packed rows, the output layer in chunks) after its start-up checks. Both are the real script, cold, in
alternating rounds (plain, shortcuts, plain, ...), one thread each, the same seed: the rollouts are the same (our
sampler does not depend on the path), so the sides differ only in the update's forward and backward. Printed per
side: the median of time/update_s and of time/step_s over every step of every round, the ratio plain / shortcuts,
and the largest gap of train/loss between the sides at the same step (the paths' float32 rounding, carried over
the steps). The output is bench/results/logprob_paths.txt.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = ("plain", "shortcuts")


def run(path: str, args, extra: list[str]) -> list[dict]:
    """One cold run of da3po.py on `path`: its training records."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "da3po.py", "--demo", args.demo, "--logprob_path", path, "--steps", str(args.steps),
               "--eval_every", "0", "--eval_size", "8", "--eval_samples", "1", "--out_dir", tmp, *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
        with open(os.path.join(tmp, "metrics.jsonl")) as f:
            return [r for r in map(json.loads, f) if "time/update_s" in r]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demo", default="reasoning", choices=["reasoning", "arith"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    args, extra = p.parse_known_args()
    records = {path: [] for path in PATHS}
    for r in range(args.rounds):
        for path in PATHS:
            records[path].append(run(path, args, extra))
            print(f"round {r + 1}: {path} done", flush=True)
    lines = [f"--demo {args.demo}, {args.rounds} rounds of {args.steps} steps a side, alternating, one thread"]
    medians = {}
    for path in PATHS:
        steps = [s for rnd in records[path] for s in rnd]
        medians[path] = {k: statistics.median(s[f"time/{k}_s"] for s in steps) for k in ("update", "step")}
        lines.append(f"{path:>9}: time/update_s median {medians[path]['update']:.3f}, "
                     f"time/step_s median {medians[path]['step']:.3f} ({len(steps)} steps)")
    for k in ("update", "step"):
        lines.append(f"plain / shortcuts, time/{k}_s: {medians['plain'][k] / medians['shortcuts'][k]:.2f}")
    gaps = [abs(a["train/loss"] - b["train/loss"]) / max(abs(b["train/loss"]), 1e-12)
            for pr, sr in zip(records["plain"], records["shortcuts"]) for a, b in zip(pr, sr)]
    lines.append(f"largest relative gap of train/loss between the paths at the same step: {max(gaps):.2e}")
    print("\n".join(lines))
    out = os.path.join(ROOT, "bench", "results", "logprob_paths.txt")
    with open(out, "a") as f:
        f.write(f"$ python -m bench.logprob_paths {' '.join(sys.argv[1:])}\n" + "\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
