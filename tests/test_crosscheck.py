"""--verifier_crosscheck: a second verifier (crosscheck.py) beside ours, its disagreement counts and the file of
disagreeing completions; with a stub judge everywhere, and with Math-Verify where it is installed.
Run: python -m pytest -q tests/test_crosscheck.py"""
import json
import os
import re
import time

import pytest

import bookkeeping
import crosscheck
from tests.conftest import ScriptedEngine, run_script
from da3po import Config


def says_right(completion: str, gold: str) -> bool:
    """A stub second verifier: a completion is right iff it says so, whatever the gold answer."""
    return "right" in completion


def hangs(completion: str, gold: str) -> bool:
    """A stub that never answers on a completion that says 'hang'."""
    if "hang" in completion:
        time.sleep(60)
    return True


@pytest.fixture
def stub():
    """The trainer's checker is the says_right stub for the test, Math-Verify (or none) again after it."""
    checker = crosscheck.CrossCheck(says_right, num_workers=1)
    crosscheck.use_checker(checker)
    yield checker
    crosscheck.use_checker(None)
    checker.pool.close()


def test_counts_by_hand():
    checker = crosscheck.CrossCheck(says_right, num_workers=2)
    completions = ["\\boxed{4} right", "\\boxed{5} right", "\\boxed{4}", "\\boxed{5}", "no answer, right"]
    golds = ["4"] * 5
    ours = [True, False, True, False, False]  # what verifier.py says of the same completions
    counts, rows = checker.run(completions, golds, ours)
    # agree: 0 (both right), 3 (both wrong); ours only: 2; theirs only: 1 and 4
    assert counts == {"checked": 5, "ours_only": 1, "theirs_only": 2, "failed": 0}
    assert rows == [{"index": 1, "ours": False, "theirs": True, "extracted": "5"},
                    {"index": 2, "ours": True, "theirs": False, "extracted": "4"},
                    {"index": 4, "ours": False, "theirs": True, "extracted": None}]
    assert checker.run([], [], []) == ({"checked": 0, "ours_only": 0, "theirs_only": 0, "failed": 0}, [])
    checker.pool.close()


def test_a_judge_that_hangs_is_cut_off():
    checker = crosscheck.CrossCheck(hangs, timeout=1.0, num_workers=2)
    t = time.monotonic()
    counts, rows = checker.run(["hang", "fine", "hang"], ["1"] * 3, [True, False, True])
    assert time.monotonic() - t < 20  # two deadlines of 1 s on two workers, with slack for a shared machine
    assert counts == {"checked": 1, "ours_only": 0, "theirs_only": 1, "failed": 2}
    assert [r["index"] for r in rows] == [1]
    checker.pool.close()


def test_math_verify_judge():
    """Math-Verify itself, on pairs where the two verifiers are known to differ in each direction."""
    pytest.importorskip("math_verify")
    checker = crosscheck.CrossCheck(timeout=30.0, num_workers=2)
    completions = ["so \\boxed{2.5e6}", "\\boxed{\\emptyset}", "\\boxed{\\{1\\}}", "The answer is 7", "\\boxed{7}",
                   "\\boxed{8}"]
    golds = ["25 \\cdot 10^{5}", "\\varnothing", "1", "7", "7", "7"]
    ours = [True, True, False, False, True, False]  # verifier.py's verdicts (tests/test_verifier.py has the forms)
    counts, rows = checker.run(completions, golds, ours)
    assert counts == {"checked": 6, "ours_only": 2, "theirs_only": 2, "failed": 0}
    assert [(r["index"], r["ours"], r["theirs"]) for r in rows] == [(0, True, False), (1, True, False),
                                                                    (2, False, True), (3, False, True)]
    checker.pool.close()


# problem i's completions, chosen by hand
TEXTS = [["\\boxed{5} right", "\\boxed{7}", "\\boxed{5}", "\\boxed{7} right"],  # gold 5
         ["\\boxed{0.5} right", "\\boxed{3}", "\\boxed{1/2}", "\\boxed{3}"]]  # gold 1/2


PROBLEMS = [{"prompt": "a", "answer": "5", "level": 1, "prompt_ids": [0]},
            {"prompt": "b", "answer": "1/2", "level": 1, "prompt_ids": [1]}]


def test_evaluation_counts_and_file(stub, tmp_path):
    """Eight completions: ours says 0, 2, 4, 6 are right; the stub 0, 3, 4. Disagreements: 2 and 6 (ours only),
    3 (theirs only). The rows reach crosscheck.jsonl through the Logger, with the step and the eval set."""
    import bookkeeping
    import ranks
    engine = ScriptedEngine(TEXTS)
    cfg = Config(eval_data="one", eval_samples=4, verifier_crosscheck=True, out_dir=str(tmp_path))
    out = bookkeeping.evaluate_sets(engine, engine, {"one": PROBLEMS}, cfg)
    assert out["eval/acc"] == 0.5  # ours, untouched by the cross-check
    assert out["eval/one/crosscheck/ours_only"] == out["eval/crosscheck/ours_only"] == 2 / 8
    assert out["eval/crosscheck/theirs_only"] == 1 / 8
    assert (out["eval/crosscheck/checked"], out["eval/crosscheck/failed"]) == (8, 0)
    bookkeeping.Logger(cfg, ranks.DistInfo()).log({"step": 3, **out})
    record = json.loads(open(tmp_path / "metrics.jsonl").read())
    assert "crosscheck_samples" not in record and record["eval/crosscheck/theirs_only"] == 1 / 8
    rows = [json.loads(line) for line in open(tmp_path / "crosscheck.jsonl")]
    assert [(r["step"], r["where"], r["completion"], r["ours"], r["theirs"]) for r in rows] == [
        (3, "eval/one", "\\boxed{5}", True, False), (3, "eval/one", "\\boxed{7} right", False, True),
        (3, "eval/one", "\\boxed{1/2}", True, False)]
    assert rows[0]["prompt"] == "a" and rows[0]["gold"] == "5" and rows[0]["extracted"] == "5"


def test_evaluation_prints_one_line_and_records_its_time(stub, capsys):
    """Each evaluation's cross-check prints one line (on rank 0) with both rates and its seconds, which the
    record keeps (eval/<set>/time/crosscheck_s); a training step's check records its seconds and prints none."""
    engine = ScriptedEngine(TEXTS)
    cfg = Config(eval_data="one", eval_samples=4, verifier_crosscheck=True)
    out = bookkeeping.evaluate_sets(engine, engine, {"one": PROBLEMS}, cfg)
    assert out["eval/one/time/crosscheck_s"] == out["eval/time/crosscheck_s"] >= 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("crosscheck")]
    assert len(lines) == 1
    # the counts of test_evaluation_counts_and_file: 2 of 8 ours only, 1 of 8 the stub's only
    expected = (r"crosscheck: 37\.5% disagree \(ours only 25\.0%, says_right only 12\.5%\) on 8 completions,"
                r" \d+\.\d s")
    assert re.fullmatch(expected, lines[0]), lines[0]
    groups = [{"prompt": "a", "answer": "5", "texts": TEXTS[0], "correct": [True, False, True, False]}]
    train = crosscheck.check_groups(groups, cfg, "train")
    assert train["time/crosscheck_s"] >= 0 and train["crosscheck/checked"] == 4
    assert "crosscheck" not in capsys.readouterr().out


def test_summary_line():
    scores = {"crosscheck/ours_only": 0.008, "crosscheck/theirs_only": 0.004, "crosscheck/checked": 800.0,
              "crosscheck/failed": 0.0, "time/crosscheck_s": 3.14}
    line = "crosscheck: 1.2% disagree (ours only 0.8%, Math-Verify only 0.4%) on 800 completions, 3.1 s"
    assert crosscheck.summary(scores, "Math-Verify") == line
    scores["crosscheck/failed"] = 2.0
    assert crosscheck.summary(scores, "Math-Verify") == line.replace(
        "800 completions", "800 completions (2 more without a verdict by the deadline)")


def test_off_by_default_adds_nothing():
    engine = ScriptedEngine(TEXTS)
    out = bookkeeping.evaluate_sets(engine, engine, {"one": PROBLEMS}, Config(eval_data="one", eval_samples=4))
    assert not any("crosscheck" in k for k in out)


def test_training_sample_is_private(stub):
    """check_groups draws its sample with an RNG of its own: the global RNGs, which training uses, are
    untouched, and the same data draws the same sample."""
    import random
    import torch
    groups = [{"prompt": f"p{i}", "answer": "1", "texts": [f"\\boxed{{1}} {'right' if j % 2 else ''}"
                                                            for j in range(4)], "correct": [True] * 4}
              for i in range(5)]
    cfg = Config(verifier_crosscheck=True, crosscheck_train=6)
    random.seed(1)
    torch.manual_seed(1)
    before = (random.random(), torch.rand(1))
    random.seed(1)
    torch.manual_seed(1)
    first = crosscheck.check_groups(groups, cfg, "train", limit=6)
    after = (random.random(), torch.rand(1))
    assert before[0] == after[0] and torch.equal(before[1], after[1])
    assert first["crosscheck/checked"] == 6
    assert len(first["crosscheck_samples"]) == round(6 * first["crosscheck/ours_only"]) > 0
    again = crosscheck.check_groups(groups, cfg, "train", limit=6)
    assert again.pop("time/crosscheck_s") >= 0 and first.pop("time/crosscheck_s") >= 0
    assert again == first


def test_flags_are_checked(tmp_path):
    r = run_script(["da3po.py", "--demo", "arith", "--steps", "1", "--out_dir", str(tmp_path), "--crosscheck_train",
                    "8"])
    assert r.returncode == 2 and r.stderr.strip() == "error: --crosscheck_train 8 needs --verifier_crosscheck"
    blocker = tmp_path / "block" / "sitecustomize.py"  # Math-Verify made unimportable, as without its requirements
    blocker.parent.mkdir()
    blocker.write_text("import importlib.abc, sys\nclass B(importlib.abc.MetaPathFinder):\n"
                       "    def find_spec(self, name, path=None, target=None):\n"
                       "        if name.split('.')[0] == 'math_verify':\n            raise ImportError(name)\n"
                       "sys.meta_path.insert(0, B())\n")
    env = {**os.environ, "PYTHONPATH": str(blocker.parent)}
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "da3po.py", "--demo", "arith", "--steps", "1", "--out_dir", str(tmp_path),
                        "--verifier_crosscheck"], cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       env={**env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
    assert r.stderr.startswith("error: --verifier_crosscheck: Math-Verify is not installed: pip install -r "
                               "requirements/crosscheck.txt")


def test_run_with_math_verify_changes_no_training_number(tmp_path):
    """The real script with Math-Verify judging evaluation and 8 completions of each training step: the crosscheck
    keys are logged, and every other number is the one the same run without the cross-check logs."""
    pytest.importorskip("math_verify")
    common_flags = ["da3po.py", "--demo", "arith", "--steps", "2", "--prompts_per_step", "8", "--eval_size", "8",
                    "--eval_samples", "2"]
    records = {}
    for name, flags in [("off", []), ("on", ["--verifier_crosscheck", "--crosscheck_train", "8"])]:
        r = run_script([*common_flags, "--out_dir", str(tmp_path / name), *flags])
        assert r.returncode == 0, r.stderr[-3000:]
        records[name] = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
    on, off = records["on"], records["off"]
    assert len(on) == len(off) == 4  # eval at step 0, steps 1 and 2, eval at the end
    for a, b in zip(on, off):
        extra = {k for k in a if "crosscheck" in k}
        assert {k for k in a if not k.startswith("time/")} - extra == {k for k in b if not k.startswith("time/")}
        assert all(a[k] == b[k] for k in b if not k.startswith("time/")), a["step"]
    train = [x for x in on if "train/loss" in x]
    assert all(x["crosscheck/checked"] + x["crosscheck/failed"] == 8 for x in train)
    evals = [x for x in on if "eval/acc" in x]
    assert all(x["eval/crosscheck/checked"] + x["eval/crosscheck/failed"] == 16 for x in evals)  # 8 problems x 2
    rows = [json.loads(line) for line in open(tmp_path / "on" / "crosscheck.jsonl")] \
        if (tmp_path / "on" / "crosscheck.jsonl").exists() else []
    disagreements = sum(round((x.get("crosscheck/ours_only", 0) + x.get("crosscheck/theirs_only", 0))
                              * x.get("crosscheck/checked", 0)) for x in train)
    disagreements += sum(round((x["eval/crosscheck/ours_only"] + x["eval/crosscheck/theirs_only"])
                               * x["eval/crosscheck/checked"]) for x in evals)
    assert len(rows) == disagreements  # every disagreement is in the file, once
