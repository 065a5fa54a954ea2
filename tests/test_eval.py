"""Evaluation: maj@k, each eval set with its own k (--eval_data set@k), one wording for training and evaluation.
Run: python -m pytest -q tests/test_eval.py"""
import json

import pytest

import bookkeeping
import common
import config
import modeling
import dataset
import verifier
from tests.conftest import ScriptedEngine, run_script
from da3po import PRESETS, Config


def test_majority_vote_by_hand():
    # 1/2, 0.5 and \frac12 are one answer (3 votes), 3 has 2, None never votes: the winner first appears at 0
    assert verifier.majority_vote(["1/2", "3", "0.5", "3", None, "\\frac12"]) == (0, 3)
    # spellings that only normalisation tells apart: \dfrac and \frac, a unit, a trailing period
    assert verifier.majority_vote(["7", "\\dfrac{2}{3}", "\\frac{2}{3}", "5 cm", "5."]) == (1, 2)
    # a tie (2 votes each) goes to the answer seen first, whichever order
    assert verifier.majority_vote(["4", "5", "5", "4"]) == (0, 2)
    assert verifier.majority_vote(["5", "4", "4", "5"]) == (0, 2)
    # equal only symbolically: x + 1 and 1 + x are one answer (2 votes), ahead of y's single vote
    assert verifier.majority_vote(["y", "x+1", "1+x"]) == (1, 2)
    assert verifier.majority_vote([None, None]) == (None, 0) and verifier.majority_vote([]) == (None, 0)


# problem i's completions, chosen by hand
TEXTS = [["\\boxed{5}", "\\boxed{7}", "\\boxed{7}", "no answer"],  # gold 5: 1 right; the majority (7) is wrong
         ["\\boxed{0.5}", "\\boxed{3}", "\\boxed{\\frac{1}{2}}", "\\boxed{3}"]]  # gold 1/2: 2 right; a 2-2 tie


def test_evaluate_by_hand():
    """acc, pass@j and maj@k of the two scripted problems, worked by hand. Problem 0: c = 1 of 4, majority 7 (wrong).
    Problem 1: c = 2 of 4; 0.5 and \\frac{1}{2} (2 votes) tie with 3 (2 votes), and 0.5, seen first, wins (right)."""
    problems = [{"prompt": "a", "answer": "5", "level": 1, "prompt_ids": [0]},
                {"prompt": "b", "answer": "1/2", "level": 2, "prompt_ids": [1]}]
    engine = ScriptedEngine(TEXTS)
    cfg = Config(eval_samples=4)
    out = common.evaluate(engine, engine, problems, cfg)
    assert out["eval/acc"] == pytest.approx(3 / 8)
    assert out["eval/pass@1"] == pytest.approx(3 / 8)
    assert out["eval/pass@2"] == pytest.approx(((1 - 3 / 6) + (1 - 1 / 6)) / 2)  # 1 - C(n-c, 2) / C(4, 2)
    assert out["eval/pass@4"] == 1.0
    assert out["eval/maj@4"] == 0.5  # problem 1 only
    assert (out["eval/acc_level1"], out["eval/acc_level2"]) == (0.25, 0.5)
    # the same sets through evaluate_sets with a k of their own: the scripted engine always writes 4 texts, so k
    # comes only from --eval_data here, and a set without @k keeps --eval_samples
    cfg = Config(eval_data="one@4,two", eval_samples=4)
    sets = bookkeeping.evaluate_sets(engine, engine, {"one": problems[:1], "two": problems[1:]}, cfg)
    assert sets["eval/one/maj@4"] == 0.0 and sets["eval/two/maj@4"] == 1.0 and sets["eval/maj@4"] == 0.5


@pytest.mark.parametrize("eval_data, k", [
    ("arith", [("arith", 4)]), ("a.jsonl@32,b.jsonl", [("a.jsonl", 32), ("b.jsonl", 4)]),
    ("dir/x@y.jsonl", [("dir/x@y.jsonl", 4)]),  # an '@' inside a file name is not a k
    ("AI-MO/aimo-validation-amc:train@32", [("AI-MO/aimo-validation-amc:train", 32)]),
    (" a.jsonl@8 , b.jsonl@1", [("a.jsonl", 8), ("b.jsonl", 1)])])
def test_eval_data_with_k(eval_data, k):
    assert dataset.parse_eval_data(eval_data, 4) == k


@pytest.mark.parametrize("eval_data, message", [
    ("a.jsonl@", "--eval_data 'a.jsonl@': the k after '@' must be a whole number >= 1"),
    ("a.jsonl@0", "--eval_data 'a.jsonl@0': the k after '@' must be a whole number >= 1"),
    ("a.jsonl@x", "--eval_data 'a.jsonl@x': the k after '@' must be a whole number >= 1"),
    ("a.jsonl@3.5", "--eval_data 'a.jsonl@3.5': the k after '@' must be a whole number >= 1"),
    ("a.jsonl,,b.jsonl", "--eval_data 'a.jsonl,,b.jsonl': an empty set name"),
    ("@8", "--eval_data '@8': an empty set name")])
def test_bad_eval_data_exits_2_in_one_line(eval_data, message, capsys):
    cfg = config.parse_config(Config, ["--eval_data", eval_data], PRESETS)
    with pytest.raises(SystemExit) as e:
        config.check_config(cfg, 1)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err


def test_bad_eval_data_stops_the_script_before_loading(tmp_path):
    r = run_script(["daro.py", "--eval_data", "arith@4,aime24.jsonl@x", "--out_dir", str(tmp_path)], timeout=120)
    assert r.returncode == 2 and r.stdout == "" and not (tmp_path / "metrics.jsonl").exists()
    assert r.stderr.strip() == ("error: --eval_data 'aime24.jsonl@x': the k after '@' must be a whole number >= 1 "
                                "(e.g. aime24.jsonl@32)")


def test_help_shows_the_set_at_k_syntax(capsys):
    with pytest.raises(SystemExit):
        config.parse_config(Config, ["--help"], PRESETS)
    assert "aime24.jsonl@32,math500.jsonl@8" in " ".join(capsys.readouterr().out.split())


def eval_file(tmp_path):
    """Ten sums from the demo's eval set as a plain problem/answer file (another set than the built-in one)."""
    path = tmp_path / "sums.jsonl"
    rows = dataset.spread(dataset.load_data("arith", "eval"), 10)
    path.write_text("".join(json.dumps({"problem": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows))
    return str(path)


def check_per_set_keys(record: dict):
    """arith@2 and sums@8: each set's own pass@j up to its k and its maj@k, and the headline over the sets."""
    assert {"eval/arith/pass@1", "eval/arith/pass@2", "eval/arith/maj@2"} <= set(record)
    assert "eval/arith/pass@4" not in record and "eval/arith/maj@8" not in record
    assert {"eval/sums/pass@8", "eval/sums/maj@8"} <= set(record) and "eval/sums/maj@2" not in record
    assert record["eval/maj@2"] == record["eval/arith/maj@2"] and record["eval/maj@8"] == record["eval/sums/maj@8"]
    assert record["eval/acc"] == pytest.approx((record["eval/arith/acc"] + record["eval/sums/acc"]) / 2)
    for name, k in (("arith", 2), ("sums", 8)):
        assert 0 <= record[f"eval/{name}/maj@{k}"] <= record[f"eval/{name}/pass@{k}"]  # a right majority is a pass


def test_eval_only_with_a_k_per_set(demo_dir, tmp_path):
    sums = eval_file(tmp_path)
    r = run_script(["da3po.py", "--demo", "arith", "--eval_only", "--model", demo_dir, "--eval_data",
                    f"arith@2,{sums}@8", "--eval_size", "12", "--out_dir", str(tmp_path / "out")])
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [x for x in r.stdout.splitlines() if x.startswith("eval step 0")]
    assert "[arith]" in lines[0] and "pass@2 " in lines[0] and "maj@2 " in lines[0] and "pass@4" not in lines[0]
    assert "[sums]" in lines[1] and "pass@8 " in lines[1] and "maj@8 " in lines[1]
    check_per_set_keys(json.loads(open(tmp_path / "out" / "metrics.jsonl").readline()))


def test_training_logs_a_k_per_set(demo_dir, tmp_path):
    """A real (short) run: its evaluations at step 0 and at the end carry each set's own k."""
    sums = eval_file(tmp_path)
    r = run_script(["da3po.py", "--demo", "arith", "--steps", "1", "--prompts_per_step", "8", "--eval_data",
                    f"arith@2,{sums}@8", "--eval_size", "12", "--out_dir", str(tmp_path / "out")])
    assert r.returncode == 0, r.stderr[-2000:]
    records = [json.loads(x) for x in open(tmp_path / "out" / "metrics.jsonl")]
    evals = [rec for rec in records if "eval/acc" in rec]
    assert [rec["step"] for rec in evals] == [0, 1]
    for rec in evals:
        check_per_set_keys(rec)


def test_the_dapo_wording_is_the_same_for_training_and_evaluation(tmp_path):
    """The DA3PO/DAPO recipes train on DAPO-Math-17k rows (their instruction written in) and evaluate plain
    problem/answer sets with --prompt_template dapo: a model sees the same text, token for token, in both."""
    problem = "What is 2+3?"
    train = tmp_path / "dapo17k.jsonl"
    train.write_text(json.dumps({"prompt": [{"role": "user", "content": dataset.TEMPLATES["dapo"].replace("{problem}", problem)}],
                                 "reward_model": {"ground_truth": "5"}}) + "\n")
    plain = tmp_path / "aime.jsonl"
    plain.write_text(json.dumps({"problem": problem, "answer": "5"}) + "\n")
    cfg = Config(train_data=str(train), eval_data=str(plain), prompt_template="dapo")
    tok = modeling.build_demo_tokenizer()
    train_set, eval_sets = dataset.tokenize_datasets(*dataset.load_datasets(cfg), tok, cfg)
    assert train_set[0]["prompt_ids"] == eval_sets["aime"][0]["prompt_ids"]
    chat = Config(train_data=str(train), eval_data=str(plain), prompt_template="chat")  # what the recipes had
    train_set, eval_sets = dataset.tokenize_datasets(*dataset.load_datasets(chat), tok, chat)
    assert train_set[0]["prompt_ids"] != eval_sets["aime"][0]["prompt_ids"]
