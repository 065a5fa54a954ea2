"""Throughput of the verifier (verifier.py) on the peer equivalence cases. Usage: python bench/verifier.py [--rounds N]
Prints verifications per second per setting, and what the last verify_batch call of each setting reported."""
import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `import verifier`
import verifier as vmod  # noqa: E402


def cases_dir() -> Path:
    """The peer test cases shipped with the tests (tests/data)."""
    return Path(__file__).resolve().parents[1] / "tests" / "data"


def timed(fn, n_items: int, rounds: int, clear_cache: bool = True) -> tuple[float, dict | None]:
    """Verifications per second, cache cleared before every round unless told otherwise, and what fn returned last
    (verify_batch's info dict)."""
    start, out = time.perf_counter(), None
    for _ in range(rounds):
        if clear_cache:
            vmod._CACHE.clear()
        out = fn()
    return n_items * rounds / (time.perf_counter() - start), out


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

    def serial():  # one pair at a time; math_equal returns a bare bool, so there is no info to report
        for p, g in zip(preds, golds):
            vmod.math_equal(p, g)

    rows = [
        ("math_equal, serial (1 worker for symbolic)", n, serial),
        ("verify_batch, num_workers=1", n, lambda: vmod.verify_batch(completions, golds, num_workers=1)[1]),
        ("verify_batch, num_workers=2", n, lambda: vmod.verify_batch(completions, golds, num_workers=2)[1]),
        ("verify_batch, num_workers=4", n, lambda: vmod.verify_batch(completions, golds, num_workers=4)[1]),
        ("verify_batch, warm cache (no clear)", n, None),
        ("verify_batch, DAPO-like 8192 ints", len(dapo_golds), lambda: vmod.verify_batch(dapo_comps, dapo_golds)[1]),
    ]
    vmod.math_equal("x+1", "1+x")  # fork the first worker outside the timings
    print(f"cpu_count={os.cpu_count()}  peer cases={n}  rounds={args.rounds}")
    print(f"{'setting':45s} {'verif/s':>10s}   last call: inline / cached / symbolic / timeouts")
    for name, items, fn in rows:
        if fn is None:  # cache warm: the same batch again, every pair the workers saw is now a cache hit
            fn = lambda: vmod.verify_batch(completions, golds, num_workers=2)[1]  # noqa: E731
            fn()
            rate, info = timed(fn, items, args.rounds, clear_cache=False)
        else:
            rate, info = timed(fn, items, args.rounds)
        counts = " / ".join(str(info[k]) for k in ("inline", "cached", "symbolic", "timeouts")) if info else "-"
        print(f"{name:45s} {rate:10.0f}   {counts}")
    vmod.close_verifier_pool()


if __name__ == "__main__":
    main()
