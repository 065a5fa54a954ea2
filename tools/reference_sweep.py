"""The reference harness's long sweep: many random update batches and flag combinations through the real pipeline,
each compared with the plain reference update (tests/reference.py, tests/harness.py), in float64, in one process.
Usage: python -m tools.reference_sweep [--seeds 500] [--start 0] [--script da3po|daro] [--tol 1e-10]
                                      [--family demo|llama|mistral|...]   (tests/harness.py FAMILIES)

Prints one line per failing case (its seed, flags and the checks over the tolerance), then a table: per flag
combination (harness.describe) the cases run and passed and the worst error of the loss, the gradient and the
per-token weights carried by the micro-batches. Exit status 1 if any case failed. About 1 s a case on one core.
A failing seed reruns alone with --start SEED --seeds 1; tests/test_reference.py runs a fixed list of seeds in CI."""
import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402

import modeling  # noqa: E402
from tests import harness  # noqa: E402
from tests.conftest import ARITH_MODEL, float64_norms  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=500, help="how many cases")
    p.add_argument("--start", type=int, default=0, help="the first seed")
    p.add_argument("--script", default=None, choices=["da3po", "daro"], help="only this script's cases")
    p.add_argument("--tol", type=float, default=0.0,
                   help="relative tolerance of every check (default: harness.TOL, or the family's FAMILY_TOL)")
    p.add_argument("--family", default="demo", choices=["demo", *harness.FAMILIES],
                   help="the demo model, or a tiny random model of another family (float64 norms)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    args.tol = args.tol or harness.FAMILY_TOL.get(args.family, harness.TOL)
    if args.family == "demo":
        float64_norms()  # the whole model in float64 (the exactness the tolerance assumes)
        model, tok = modeling.load_model(ARITH_MODEL)
        model, pad_id = model.double(), tok.pad_token_id
    else:
        model, pad_id = harness.family_model(args.family), 0
    ref_model = harness.ref_model_of(model)
    table, failed, start = {}, 0, time.time()
    for seed in range(args.start, args.start + args.seeds):
        case, errors = harness.check_case(model, ref_model, pad_id, seed, args.script)
        key, bad = harness.describe(case), harness.failures(errors, args.tol)
        row = table.setdefault(key, {"cases": 0, "passed": 0, "loss": 0.0, "grad": 0.0, "carried": 0.0})
        row["cases"] += 1
        row["passed"] += not bad
        for k in ("loss", "grad", "carried"):
            row[k] = max(row[k], errors[k])
        if bad:
            failed += 1
            print(f"FAIL seed {seed}: {key}: " + ", ".join(f"{k} {v:.2e}" for k, v in bad.items()), flush=True)
    print(f"\n{'flags':<68} {'cases':>5} {'passed':>6} {'loss':>8} {'grad':>8} {'carried':>8}")
    for key in sorted(table):
        r = table[key]
        print(f"{key:<68} {r['cases']:>5} {r['passed']:>6} {r['loss']:>8.1e} {r['grad']:>8.1e} {r['carried']:>8.1e}")
    n = args.seeds
    print(f"\n{n - failed} of {n} cases passed (tolerance {args.tol:g}); {time.time() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
