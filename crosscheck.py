"""
Look up when needed: --verifier_crosscheck, a second verifier beside ours.
Math-Verify (huggingface/Math-Verify, optional: requirements/crosscheck.txt)
judges the completions that verifier.py judged, and the pairs where the two disagree are counted and
kept for a person to read. Where they disagree one of them is wrong,
so the two rates say how often the reward may be wrong on a model's own outputs,
in each direction (docs/metrics.md: crosscheck/*).

checker = CrossCheck() # Math-Verify; CrossCheck(judge): any judge(completion, gold) -> bool counts,
rows = checker.run(completions, golds, ours) # counts: checked, ours_only (ours right,
theirs wrong), theirs_only (the reverse), failed (no verdict) # rows: the disagreements, {"index",
"ours", "theirs", "extracted" (our answer)}

common.py calls check_groups (the end of this file) in training and evaluation;
an evaluation's check prints one line (summary). Math-Verify reads plain-text answers with sympy's
parse_expr, which runs Python's eval on them: model text goes through eval there.
The judge runs in forked worker processes (verifier.py's pool), each pair under a hard deadline;
that bounds the time a completion can take, not what eval can do in that process.
The cross-check is an instrument, off by default; verifier.py itself never evaluates model text.
"""
import atexit
import math
import random
import time

import torch

import verifier
from ranks import all_gather_list, all_reduce_sum, die, print0

MATH_VERIFY_HINT = "pip install -r requirements/crosscheck.txt (Math-Verify)"


def math_verify_judge(completion: str, gold: str) -> bool:
    """Math-Verify's verdict, used as its README and TRL's accuracy reward use it: its own
    extraction from the whole completion (parse, with its default configs and timeouts), against the
    gold answer boxed."""
    from math_verify import parse, verify
    return bool(verify(parse("\\boxed{" + gold + "}"), parse(completion)))


class CrossCheck:
    """A second verifier of (completion, gold, our verdict) triples, in a worker pool of its own."""

    def __init__(self, judge=math_verify_judge, timeout: float = 15.0, num_workers: int = 0):
        if judge is math_verify_judge:
            import math_verify  # noqa: F401  (imported before the workers fork: each has it)
        # per pair; Math-Verify's own timeouts (5 s parsing, 5 s comparing) come first
        self.timeout = timeout
        # for the console line
        self.name = "Math-Verify" if judge is math_verify_judge else judge.__name__
        self.pool = verifier._Pool(num_workers or verifier._default_workers(), task=judge)
        atexit.register(self.pool.close)

    def run(self, completions: list[str], golds: list[str], ours: list[bool],
            answer_format: str = "auto") -> tuple[dict, list[dict]]:
        """Judge every (completion, gold) pair and compare with `ours`, our verdicts on the same
        pairs. Returns the counts and the disagreeing pairs (their index, both verdicts, our
        extracted answer). A pair the judge could not settle by the deadline is `failed`: neither an
        agreement nor a disagreement."""
        pairs = [(str(c), str(g)) for c, g in zip(completions, golds)]
        theirs = []  # the judge's verdicts: True, False, or None (no verdict by the deadline)
        if pairs:
            theirs = self.pool.run(pairs, self.timeout, self.pool.size, verifier._new_info())
        counts = {"checked": 0, "ours_only": 0, "theirs_only": 0, "failed": 0}
        rows = []
        for i, (mine, other) in enumerate(zip(ours, theirs)):
            if other is None:
                counts["failed"] += 1
                continue
            counts["checked"] += 1
            if bool(mine) != other:
                counts["ours_only" if mine else "theirs_only"] += 1
                extracted = verifier.extract_answer(pairs[i][0], answer_format)
                rows.append({"index": i, "ours": bool(mine), "theirs": other,
                             "extracted": extracted})
        return counts, rows


# the process's checker, made on first use (use_checker sets another)
_CHECKER: CrossCheck | None = None


def shared_checker() -> CrossCheck:
    """The checker the trainer uses: Math-Verify unless use_checker() set another."""
    global _CHECKER
    if _CHECKER is None:
        _CHECKER = CrossCheck()
    return _CHECKER


def use_checker(checker: CrossCheck | None):
    """Make `checker` the one shared_checker() returns (a test's stub judge; None: Math-Verify)."""
    global _CHECKER
    _CHECKER = checker


def missing() -> str:
    """Why the cross-check cannot run here ('' if it can): no Math-Verify, and no checker set."""
    if _CHECKER is not None:
        return ""
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return f"Math-Verify is not installed: {MATH_VERIFY_HINT}"
    return ""


def check_flags(cfg):
    """The cross-check's flags that cannot work stop here, naming the flag (exit 2)."""
    if cfg.crosscheck_train and not cfg.verifier_crosscheck:
        die(f"--crosscheck_train {cfg.crosscheck_train} needs --verifier_crosscheck")
    if cfg.verifier_crosscheck and missing():
        die(f"--verifier_crosscheck: {missing()}")


def summary(scores: dict, judge: str) -> str:
    """The console line of one cross-check, from check_groups' scores. Example: 'crosscheck: 1.2%
    disagree (ours only 0.8%, Math-Verify only 0.4%) on 800 completions, 3.1 s'."""
    ours = scores["crosscheck/ours_only"]
    theirs = scores["crosscheck/theirs_only"]
    line = (f"crosscheck: {ours + theirs:.1%} disagree (ours only {ours:.1%}, {judge} only "
            f"{theirs:.1%}) on {scores['crosscheck/checked']:,.0f} completions")
    if scores["crosscheck/failed"]:
        line += f" ({scores['crosscheck/failed']:,.0f} more without a verdict by the deadline)"
    return line + f", {scores['time/crosscheck_s']:.1f} s"


def check_groups(groups: list[dict], cfg, where: str, limit: int = 0, rank: int = 0) -> dict:
    """The second verifier on this rank's completions of `groups` (`limit` > 0: that many, drawn by
    an RNG of its own, so training is untouched), its disagreements with our verdicts summed over
    ranks: two collectives, on every rank whatever its data. Returns crosscheck/{ours_only,
    theirs_only} (rates per checked completion), crosscheck/{checked, failed}, time/crosscheck_s
    (this rank's seconds, the collectives included), and "crosscheck_samples": the disagreements of
    all ranks, which bookkeeping.Logger.log writes to crosscheck.jsonl. In evaluation (`where`
    "eval") rank 0 also prints the scores as one line (summary); a training step's line stays as
    it is."""
    start = time.perf_counter()
    # (group, index of a completion)
    items = [(g, i) for g in groups for i in range(len(g["texts"]))]
    if 0 < limit < len(items):  # seeded by the data: a rerun draws the same completions
        rng = random.Random(f"{cfg.seed} {rank} {groups[0]['prompt']}")
        items = rng.sample(items, limit)
    texts = [g["texts"][i] for g, i in items]
    golds = [g["answer"] for g, _ in items]
    ours = [g["correct"][i] for g, i in items]
    counts, rows = shared_checker().run(texts, golds, ours, cfg.answer_format)
    for row in rows:
        g, i = items[row.pop("index")]
        row.update(where=where, prompt=g["prompt"], gold=g["answer"], completion=g["texts"][i])
    summed = all_reduce_sum(torch.tensor(list(counts.values()), dtype=torch.float64))
    totals = dict(zip(counts, summed.tolist()))
    checked = max(totals["checked"], 1.0)
    scores = {"crosscheck/ours_only": totals["ours_only"] / checked,
              "crosscheck/theirs_only": totals["theirs_only"] / checked,
              "crosscheck/checked": totals["checked"],
              "crosscheck/failed": totals["failed"],
              "crosscheck_samples": all_gather_list(rows)}
    scores["time/crosscheck_s"] = time.perf_counter() - start
    if where == "eval":
        print0(summary(scores, shared_checker().name))
    return scores


def check_train_groups(groups: list[dict], cfg, rank: int, world: int) -> dict:
    """--crosscheck_train: check_groups on a sample of this step's completions, its share of
    --crosscheck_train on each rank."""
    return check_groups(groups, cfg, "train", math.ceil(cfg.crosscheck_train / world), rank)


def check_eval_groups(groups: list[dict], cfg, rank: int) -> dict:
    """--verifier_crosscheck in evaluation: check_groups on every completion, its scores as eval/*
    keys (the disagreements keep their name, "crosscheck_samples": bookkeeping.Logger writes them).
    """
    checks = check_groups(groups, cfg, "eval", rank=rank)
    return {key if key == "crosscheck_samples" else "eval/" + key: value
            for key, value in checks.items()}
