"""Throughput of the verifier on the peer equivalence cases. Usage: python bench/verifier.py [--rounds N]"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # pin threads before anything imports numpy/torch
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `import common`
import common as vmod  # noqa: E402


def cases_dir() -> Path:
    for parent in Path(__file__).resolve().parents:
        if (parent / "shared" / "cases").is_dir():
            return parent / "shared" / "cases"
    return Path("/work/shared/cases")


def timed(fn, n_items: int, rounds: int) -> float:
    """Verifications per second, cache cleared before every round so nothing is served from it."""
    start = time.perf_counter()
    for _ in range(rounds):
        vmod._CACHE.clear()
        fn()
    return n_items * rounds / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cases = [json.loads(line) for line in (cases_dir() / "verifier_equal_peer.jsonl").read_text().splitlines()]
    preds, golds = [c["pred"] for c in cases], [c["gold"] for c in cases]
    completions = ["Reasoning...\nThe answer is $\\boxed{" + p + "}$." for p in preds]
    # A DAPO-like step: 512 prompts x 16 completions with integer golds, about half of them correct.
    rng = random.Random(0)
    dapo_golds = [str(rng.randint(0, 10**6)) for _ in range(512) for _ in range(16)]
    dapo_comps = ["...\nAnswer: " + (g if rng.random() < 0.5 else str(int(g) + 1)) for g in dapo_golds]
    n = len(cases)
    rows = [
        ("math_equal, serial (1 worker for symbolic)", n,
         lambda: [vmod.math_equal(p, g) for p, g in zip(preds, golds)]),
        ("verify_batch, num_workers=1", n, lambda: vmod.verify_batch(completions, golds, num_workers=1)),
        ("verify_batch, num_workers=2", n, lambda: vmod.verify_batch(completions, golds, num_workers=2)),
        ("verify_batch, num_workers=4", n, lambda: vmod.verify_batch(completions, golds, num_workers=4)),
        ("verify_batch, warm cache (no clear)", n, None),
        ("verify_batch, DAPO-like 8192 ints", len(dapo_golds), lambda: vmod.verify_batch(dapo_comps, dapo_golds)),
    ]
    vmod.math_equal("x+1", "1+x")  # fork the first worker outside the timings
    print(f"cpu_count={os.cpu_count()}  peer cases={n}  rounds={args.rounds}")
    print(f"{'setting':45s} {'verif/s':>10s}")
    for name, items, fn in rows:
        if fn is None:  # cache warm: the same batch again, every pair is a cache hit
            vmod.verify_batch(completions, golds, num_workers=2)
            start = time.perf_counter()
            for _ in range(args.rounds):
                vmod.verify_batch(completions, golds, num_workers=2)
            rate = items * args.rounds / (time.perf_counter() - start)
        else:
            rate = timed(fn, items, args.rounds)
        print(f"{name:45s} {rate:10.0f}")
    vmod.close_verifier_pool()


if __name__ == "__main__":
    main()
