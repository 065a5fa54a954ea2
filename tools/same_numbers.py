"""The "same numbers" guard of a restructuring: run the reference runs and save, or compare, their metrics.jsonl
(every key but time/*), record by record.

  python -m tools.same_numbers --save /tmp/before      # on the old code
  python -m tools.same_numbers --compare /tmp/before   # on the new code: prints each run's first difference, exit 1
  python -m tools.same_numbers --compare /tmp/before --flags=--no-pack   # with extra flags
Keys the new code adds (a new metric) are listed but are not a difference; every old key must keep its value.

The reference runs: da3po.py and daro.py, 12 steps, seed 3; a 2-rank torchrun of da3po.py (FSDP2 on gloo); a
da3po.py run with --rollout vllm (skipped with a note when vLLM is not installed). One thread each.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--demo", "arith", "--steps", "12", "--seed", "3"]
RUNS = {
    "da3po": ["da3po.py", *SMALL],
    "daro": ["daro.py", *SMALL],
    "torchrun2": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "da3po.py", "--demo", "arith",
                  "--steps", "4", "--seed", "3", "--prompts_per_step", "8", "--eval_size", "20", "--eval_every", "2"],
    "vllm": ["da3po.py", "--demo", "arith", "--steps", "4", "--seed", "3", "--rollout", "vllm", "--eval_size", "20",
             "--eval_every", "2"],
}


def records(path: str) -> list[dict]:
    """metrics.jsonl without the time/* keys (wall-clock figures differ between any two runs)."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")} for line in open(path)]


def run(name: str, args: list[str], out: str, flags: list[str]) -> list[dict] | None:
    if name == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError:
            print(f"{name}: skipped (vLLM is not installed)")
            return None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, *args, *flags, "--out_dir", out], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"error: run {name} failed:\n{r.stderr[-3000:]}")
    return records(os.path.join(out, "metrics.jsonl"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", metavar="DIR", help="write each run's records to DIR/<run>.json")
    mode.add_argument("--compare", metavar="DIR", help="compare each run's records with DIR/<run>.json")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    p.add_argument("--flags", default="", help="extra flags for every run, space-separated (e.g. --no-pack)")
    a = p.parse_args()
    names = a.runs.split(",")
    bad = [n for n in names if n not in RUNS]
    if bad:
        p.error(f"--runs: unknown {', '.join(bad)} (choose from {', '.join(RUNS)})")
    differ = 0
    for name in names:
        tmp = tempfile.mkdtemp(prefix=f"same_{name}_")
        try:
            got = run(name, RUNS[name], tmp, a.flags.split())
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if got is None:
            continue
        path = os.path.join(a.save or a.compare, f"{name}.json")
        if a.save:
            os.makedirs(a.save, exist_ok=True)
            json.dump(got, open(path, "w"))
            print(f"{name}: saved {len(got)} records to {path}")
            continue
        want = json.load(open(path))
        # a key the new code adds (a new metric) is listed, not a difference; a changed or missing value is one
        diffs = [(i, k, w.get(k), g.get(k)) for i, (w, g) in enumerate(zip(want, got))
                 for k in sorted(set(w) | set(g)) if k in w and w.get(k) != g.get(k)]
        added = sorted({k for w, g in zip(want, got) for k in set(g) - set(w)})
        if len(want) != len(got):
            diffs.append((min(len(want), len(got)), "<records>", len(want), len(got)))
        new = f"; new keys: {', '.join(added)}" if added else ""
        if diffs:
            differ += 1
            i, k, w, g = diffs[0]
            print(f"{name}: DIFFERENT in {len(diffs)} values; first: record {i} {k}: {w} -> {g}{new}")
            numbers = [(abs(g - w) / max(abs(w), 1e-12), k) for _, k, w, g in diffs
                       if isinstance(w, float) and isinstance(g, float)]  # how far: the worst relative gap
            if numbers:
                print(f"  largest relative difference: {max(numbers)[0]:.3g} ({max(numbers)[1]}); "
                      f"keys that differ: {', '.join(sorted({k for _, k, _, _ in diffs}))}")
        else:
            print(f"{name}: identical ({len(got)} records, every key but time/*{new})")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
