"""Build the DARO recipe's 45k-prompt training set (docs/gpu.md) from a local copy of OpenR1-Math-220k.

The DARO paper gives the subset's size (45,000 prompts), not its rule; this rule is ours, chosen so that every kept
prompt is one our reward can score:

  1. question_type is "math-word-problem" (multiple-choice answers can be guessed; proofs have no final answer)
  2. the answer is non-empty, and at least one of the row's generations that Math-Verify judged correct
     (correctness_math_verify) has a final answer that our verifier (verifier.py) finds equal to it
  3. one row per problem text (whitespace collapsed): the one whose uuid comes first in sha256 order
  4. of those, the --rows (45,000) whose uuids come first in sha256 order, written in that order: a fixed pick that
     depends on neither the input's file order nor a random seed

It writes JSONL rows {"problem", "answer", "uuid", "source", "problem_type"} (keys sorted, UTF-8) and prints the rows
each rule keeps and the output's sha256, so two people who ran it can compare; fewer than --rows passing stops it
(exit 1) rather than writing a smaller set under the same name.

Usage (download the parquet files yourself, e.g. `huggingface-cli download open-r1/OpenR1-Math-220k --repo-type
dataset --local-dir openr1`; the "default" split's files are data/train-*.parquet):
  python -m tools.openr1_subset openr1/data/train-*.parquet --out openr1_45k.jsonl
  python -m tools.openr1_subset rows.jsonl --rows 100 --out small.jsonl      # any .parquet / .jsonl of its rows
"""
import argparse
import hashlib
import json
import os
import sys

from verifier import close_verifier_pool, verify_batch

FIELDS = ("problem", "answer", "question_type", "uuid", "generations", "correctness_math_verify")


def fail(message: str, status: int = 2):
    """One line on stderr and the exit status (2: bad input; 1: the rule keeps too few rows)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)


def read_rows(path: str) -> list[dict]:
    """The rows of one .parquet or .jsonl file of OpenR1-Math-220k; a missing column or bad line names the file."""
    if not os.path.isfile(path):
        fail(f"{path}: no such file")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq  # requirements.txt
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a corrupt or truncated file
            fail(f"{path}: not a readable parquet file ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    elif path.endswith(".jsonl"):
        rows = []
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    fail(f"{path}:{i}: not valid JSON ({e.msg})")
    else:
        fail(f"{path}: expected a .parquet or .jsonl file")
    for i, row in enumerate(rows, 1):
        missing = [k for k in FIELDS if not isinstance(row, dict) or k not in row]
        if missing:
            fail(f"{path}: row {i} lacks {', '.join(missing)} (OpenR1-Math-220k's columns)")
    return rows


def uuid_order(row: dict) -> str:
    """The fixed order rules 3 and 4 pick by: sha256 of the uuid."""
    return hashlib.sha256(str(row["uuid"]).encode()).hexdigest()


def subset(rows: list[dict], n: int) -> tuple[list[dict], dict]:
    """Rules 1-4 on `rows` -> (the kept rows, in output form and order; how many rows each rule kept)."""
    counts = {"read": len(rows)}
    rows = [r for r in rows if r["question_type"] == "math-word-problem"]
    counts["1 math-word-problem"] = len(rows)
    rows = [r for r in rows if str(r["answer"] or "").strip()]
    # rule 2: every generation Math-Verify marked correct, checked by our verifier in one batch (a worker pool)
    pairs = [(i, g) for i, r in enumerate(rows)
             for g, ok in zip(r["generations"] or [], r["correctness_math_verify"] or []) if ok]
    verdicts, _ = verify_batch([g for _, g in pairs], [str(rows[i]["answer"]) for i, _ in pairs])
    checked = {i for (i, _), ok in zip(pairs, verdicts) if ok}
    rows = [r for i, r in enumerate(rows) if i in checked]
    counts["2 answer checked by our verifier"] = len(rows)
    by_problem = {}
    for r in sorted(rows, key=uuid_order):  # rule 3: the first of a problem's rows in uuid order
        by_problem.setdefault(" ".join(str(r["problem"]).split()), r)
    rows = sorted(by_problem.values(), key=uuid_order)
    counts["3 one row per problem"] = len(rows)
    if len(rows) < n:
        fail(f"only {len(rows)} rows pass the rule, --rows {n} asks for more (add the 'extended' split's files, or "
             f"lower --rows)", status=1)
    rows = [{"problem": r["problem"], "answer": str(r["answer"]), "uuid": r["uuid"], "source": r.get("source", ""),
             "problem_type": r.get("problem_type", "")} for r in rows[:n]]
    counts["4 kept"] = len(rows)
    return rows, counts


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("inputs", nargs="+", help="OpenR1-Math-220k files (.parquet or .jsonl)")
    ap.add_argument("--out", default="openr1_45k.jsonl", help="the JSONL file to write (default: openr1_45k.jsonl)")
    ap.add_argument("--rows", type=int, default=45_000, help="rows to keep (default: 45000, the DARO paper's size)")
    args = ap.parse_args(argv)
    if args.rows < 1:
        ap.error(f"argument --rows: must be >= 1, got {args.rows}")
    rows, counts = subset([row for path in args.inputs for row in read_rows(path)], args.rows)
    close_verifier_pool()
    data = "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    with open(args.out, "wb") as f:
        f.write(data)
    for rule, count in counts.items():
        print(f"{rule:>34}: {count:,} rows")
    print(f"wrote {args.out}: {len(rows):,} rows, sha256 {hashlib.sha256(data).hexdigest()}")


if __name__ == "__main__":
    main()
