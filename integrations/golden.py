"""
Golden vectors for DA3PO's advantages and DARO's loss: a checker that any codebase can run, in plain Python + json.

tests/data/golden.json (schema in tests/data/README.md) holds cases in three sections, each case
{"name", "inputs", "expected"}, every number computed in float64 by integrations/make_golden.py from this project's
functions (da3po.daa, da3po.adaptive_lam, common.group_advantages, common.loss_weights, daro.tokens_per_bin,
daro.bin_token_weights, daro.bin_weights, daro.weight_objective):
  advantages  (rewards, correctness, lengths, G, lam, tau, p estimate) -> GRPO advantages before and after DAA
  daro        (token losses, mask, bins, s = -ln w) -> per-bin losses L_mu, the model loss, the weight objective and
              its gradient
  loss_agg    (token losses, mask, --loss_agg) -> per-token weights and the loss

Give check() one callable per section you implement: it receives a case's `inputs` (lists and numbers) and returns a
dict with any of the case's `expected` keys (lists, numbers, or anything with .tolist(), e.g. a tensor), or None to
say "this case is outside what I implement" (then it is listed as skipped, not failed). Example:

    from golden import check
    report = check("tests/data/golden.json", advantages=my_advantages)
    assert not report["mismatches"], "\n".join(report["mismatches"])

Tolerance: |got - want| <= atol + rtol |want| with rtol = atol = 1e-12 by default. The values are O(1-10) and each
comes from at most ~100 float64 operations (eps 2.2e-16), so an exact float64 port lands within ~1e-14; a float32
one (eps 1.2e-7) fails, as it should. Booleans compare exactly. Run `python integrations/golden.py` for a summary.
"""
import json
import math
import os
import sys

SECTIONS = ("advantages", "daro", "loss_agg")
DEFAULT_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data",
                            "golden.json")


def load(path: str = DEFAULT_PATH) -> dict:
    with open(path) as f:
        data = json.load(f)
    missing = [s for s in SECTIONS if s not in data]
    if missing:
        raise ValueError(f"{path}: not a golden file, sections {missing} missing")
    return data


def _plain(value):
    """Tensors and arrays to nested lists (anything with .tolist()); the rest as is."""
    return value.tolist() if hasattr(value, "tolist") else value


def _compare(got, want, where: str, rtol: float, atol: float, out: list[str]) -> int:
    """Append one line per mismatch (shape, type or value) to `out`; return the number of scalars compared."""
    if isinstance(want, list):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            out.append(f"{where}: expected a list of {len(want)}, got {type(got).__name__}"
                       + (f" of {len(got)}" if isinstance(got, (list, tuple)) else ""))
            return 0
        return sum(_compare(g, w, f"{where}[{i}]", rtol, atol, out) for i, (g, w) in enumerate(zip(got, want)))
    if isinstance(want, bool):
        if not isinstance(got, (bool, int)) or bool(got) != want:
            out.append(f"{where}: expected {want}, got {got!r}")
        return 1
    if not isinstance(got, (int, float)) or isinstance(got, bool) and not isinstance(want, bool):
        out.append(f"{where}: expected a number, got {got!r}")
        return 1
    if not (math.isfinite(got) and abs(got - want) <= atol + rtol * abs(want)):
        out.append(f"{where}: expected {want!r}, got {got!r} (diff {abs(got - want):.3g})")
    return 1


def check(path: str = DEFAULT_PATH, advantages=None, daro=None, loss_agg=None, rtol: float = 1e-12,
          atol: float = 1e-12) -> dict:
    """Run each given callable on its section's cases. Returns {"cases": run, "values": scalars compared,
    "skipped": case names a callable declined (None), "mismatches": one line each (empty = all equal)}."""
    data, fns = load(path), {"advantages": advantages, "daro": daro, "loss_agg": loss_agg}
    report = {"cases": 0, "values": 0, "skipped": [], "mismatches": []}
    for section in SECTIONS:
        fn = fns[section]
        if fn is None:
            continue
        for case in data[section]:
            name = f"{section}/{case['name']}"
            got = fn(json.loads(json.dumps(case["inputs"])))  # a fresh copy: a callable cannot alter the file's
            if got is None:
                report["skipped"].append(name)
                continue
            report["cases"] += 1
            keys = [k for k in case["expected"] if k in got]
            if not keys:
                report["mismatches"].append(f"{name}: returned none of {sorted(case['expected'])}")
            for key in keys:
                report["values"] += _compare(_plain(got[key]), case["expected"][key], f"{name}.{key}", rtol, atol,
                                             report["mismatches"])
    return report


if __name__ == "__main__":
    golden = load(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_PATH)
    print(f"{golden['schema']}, {golden['dtype']}, generated by `{golden['generated_by']}`")
    for section in SECTIONS:
        print(f"  {section:10s} {len(golden[section]):2d} cases: " + ", ".join(c["name"] for c in golden[section]))
