"""tools/openr1_subset.py, the DARO recipe's data, on a small synthetic OpenR1-Math-220k: each rule by hand, the
documented row counts, a pinned hash, and the same bytes whatever the input's order or format.
Run: python -m pytest -q tests/test_openr1_subset.py"""
import hashlib
import json
import random

import pytest

from tests.conftest import run_script


def row(uuid, problem, answer, generations, verified, question_type="math-word-problem"):
    """One row in OpenR1-Math-220k's columns (those the rule reads, and a few it carries or ignores)."""
    return {"problem": problem, "solution": "...", "answer": answer, "problem_type": "Algebra",
            "question_type": question_type, "source": "olympiads", "uuid": uuid, "is_reasoning_complete": [True],
            "generations": generations, "correctness_math_verify": verified, "correctness_llama": None,
            "finish_reasons": None, "correctness_count": sum(verified), "messages": []}


def synthetic() -> list[dict]:
    """40 rows: 30 that pass every rule (sums, boxed), and 10 each made to fail one rule, or to pass in a way that
    needs the verifier (\\frac{1}{2} = 0.5; the second generation the checked one)."""
    rows = [row(f"ok-{i}", f"What is {i}+{i}?", str(2 * i), [f"so \\boxed{{{2 * i}}}"], [True]) for i in range(30)]
    rows += [
        row("mcq", "Pick one: (A) 1 (B) 2", "B", ["\\boxed{B}"], [True], question_type="MCQ"),  # rule 1
        row("proof", "Prove that 1 = 1.", "proof", ["done, \\boxed{proof}"], [True], question_type="proof"),  # 1
        row("empty", "What is x?", "", ["\\boxed{3}"], [True]),  # rule 2: no answer
        row("unverified", "What is 9+9?", "18", ["\\boxed{18}"], [False]),  # rule 2: Math-Verify said no
        row("disagree", "What is 8+9?", "17", ["\\boxed{71}"], [True]),  # rule 2: ours says no
        row("half", "Half of one?", "\\frac{1}{2}", ["\\boxed{0.5}"], [True]),  # passes: 0.5 = 1/2
        row("second", "What is 2+2 squared?", "16", ["\\boxed{8}", "\\boxed{16}"], [False, True]),  # passes
        row("dup-a", "What  is 1+1?", "2", ["\\boxed{2}"], [True]),  # rule 3: ok-1's problem, spaced differently
        row("dup-b", "What is 1+1?", "2", ["\\boxed{2}"], [True]),  # rule 3: again
        row("no-gen", "What is 7+7?", "14", [], []),  # rule 2: nothing to check
    ]
    return rows


# The documented counts for this input (docs/data.md): 40 read, 38 math-word-problems, 34 with a checked answer (the
# 30 sums, half, second, dup-a, dup-b), 32 after one row per problem (ok-1, dup-a and dup-b are one problem), 20
# kept by --rows 20.
COUNTS = {"read": 40, "1 math-word-problem": 38, "2 answer checked by our verifier": 34, "3 one row per problem": 32,
          "4 kept": 20}
SHA256 = "ede5bd639ff0ac4fbfa6893734dafefdf77f367c205041e2299249f2f4b4aba2"  # of the 20 rows it writes


def build(tmp_path, rows, name="rows.jsonl", *extra):
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(rows), path)
    out = tmp_path / f"{name}.out.jsonl"
    r = run_script(["-m", "tools.openr1_subset", str(path), "--rows", "20", "--out", str(out), *extra], timeout=120)
    return r, out


def test_the_rule_by_hand_and_its_documented_counts(tmp_path):
    r, out = build(tmp_path, synthetic())
    assert r.returncode == 0, r.stderr
    printed = {line.split(":")[0].strip(): line.split(":")[1].strip() for line in r.stdout.splitlines()[:-1]}
    assert printed == {rule: f"{n:,} rows" for rule, n in COUNTS.items()}
    kept = [json.loads(line) for line in open(out)]
    assert len(kept) == 20 and all(set(k) == {"problem", "answer", "uuid", "source", "problem_type"} for k in kept)
    order = sorted(["half", "second", *(f"ok-{i}" for i in range(30)), "dup-a", "dup-b"],
                   key=lambda u: hashlib.sha256(u.encode()).hexdigest())
    ones = [u for u in order if u in ("ok-1", "dup-a", "dup-b")][0]  # the problem's row that survives rule 3
    expected = [u for u in order if u not in ("ok-1", "dup-a", "dup-b") or u == ones][:20]
    assert [k["uuid"] for k in kept] == expected
    data = open(out, "rb").read()
    digest = hashlib.sha256(data).hexdigest()
    assert r.stdout.splitlines()[-1] == f"wrote {out}: 20 rows, sha256 {digest}"
    assert digest == SHA256, digest  # the rule and the output format are pinned


def test_the_same_bytes_whatever_the_order_or_format(tmp_path):
    rows = synthetic()
    random.Random(1).shuffle(rows)
    r, out = build(tmp_path, rows, "shuffled.parquet")
    assert r.returncode == 0, r.stderr
    assert hashlib.sha256(open(out, "rb").read()).hexdigest() == SHA256


@pytest.mark.parametrize("rows, extra, status, message", [
    (None, ["--rows", "33"], 1, "only 32 rows pass the rule, --rows 33 asks for more"),
    ([{"problem": "x", "answer": "1"}], [], 2, "row 1 lacks question_type, uuid, generations, correctness_math_verify"),
])
def test_bad_input_stops_in_one_line(rows, extra, status, message, tmp_path):
    r, out = build(tmp_path, synthetic() if rows is None else rows, "rows.jsonl", *extra)
    assert r.returncode == status and message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
