"""Datasets in their published schemas, pass@k, and --eval_only. Run: python -m pytest -q tests/test_data.py"""
import dataclasses
import json
import math
from fractions import Fraction

import pytest

import common
import modeling
import dataset
from da3po import Config
from tests.conftest import run_script

# A few rows per published schema; every one must load into the same {prompt, answer} records.
SCHEMAS = {
    "plain.jsonl": [{"problem": "What is 2+3?", "answer": "5"}, {"problem": "Half of 1?", "answer": "\\frac{1}{2}"}],
    "dapo17k.jsonl": [  # BytedTsinghua-SIA/DAPO-Math-17k: chat-format prompt, answer in reward_model.ground_truth
        {"data_source": "math_dapo", "ability": "MATH", "prompt": [{"role": "user", "content": "What is 2+3?"}],
         "reward_model": {"ground_truth": "5", "style": "rule-lighteval/MATH_v2"}, "extra_info": {"index": "a1"}},
        {"data_source": "math_dapo", "ability": "MATH", "prompt": [{"role": "user", "content": "Half of 1?"}],
         "reward_model": {"ground_truth": "\\frac{1}{2}", "style": "rule"}, "extra_info": {"index": "a2"}}],
    "openr1.jsonl": [  # open-r1/OpenR1-Math-220k: problem, solution, answer (+ metadata)
        {"problem": "What is 2+3?", "solution": "2+3=5, so \\boxed{5}", "answer": "5", "problem_type": "Algebra",
         "question_type": "math-word-problem", "source": "olympiads", "uuid": "u1", "is_reasoning_complete": [True]},
        {"problem": "Half of 1?", "solution": "\\boxed{\\frac{1}{2}}", "answer": "\\frac{1}{2}", "uuid": "u2"}],
    "gsm8k.jsonl": [  # openai/gsm8k: the final number follows '####'
        {"question": "What is 2+3?", "answer": "Add them: 2+3=<<2+3=5>>5\n#### 5"},
        {"question": "Half of 1?", "answer": "It is one half.\n#### \\frac{1}{2}"}],
    "math500.json": [  # HuggingFaceH4/MATH-500, as a JSON list, with levels
        {"problem": "What is 2+3?", "solution": "...", "answer": "5", "subject": "Algebra", "level": 1,
         "unique_id": "test/algebra/1.json"},
        {"problem": "Half of 1?", "solution": "...", "answer": "\\frac{1}{2}", "subject": "Algebra", "level": 2,
         "unique_id": "test/algebra/2.json"}],
    "olympiadbench.jsonl": [  # OlympiadBench: question, final_answer as a list
        {"id": 1, "question": "What is 2+3?", "final_answer": ["5"], "unit": None},
        {"id": 2, "question": "Half of 1?", "final_answer": ["\\frac{1}{2}"], "unit": None}],
}


@pytest.mark.parametrize("name", list(SCHEMAS) + ["dapo17k.parquet"])
def test_every_schema_loads_into_the_same_records(name, tmp_path):
    path = tmp_path / name
    rows = SCHEMAS[name.replace(".parquet", ".jsonl")]
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif name.endswith(".json"):
        path.write_text(json.dumps(rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(rows), path)
    problems = dataset.load_data(str(path), "train")
    assert [(p["prompt"], p["answer"]) for p in problems] == [("What is 2+3?", "5"), ("Half of 1?", "\\frac{1}{2}")]
    assert all(p["templated"] == name.startswith("dapo17k") for p in problems)
    if name == "math500.json":
        assert [p["level"] for p in problems] == [1, 2]


def test_field_names_can_be_given_by_flag(tmp_path):
    path = tmp_path / "custom.jsonl"
    path.write_text(json.dumps({"q": "1+1", "meta": {"gold": "2"}}) + "\n")
    problems = dataset.load_data(str(path), "train", prompt_key="q", answer_key="meta.gold")
    assert problems[0]["prompt"] == "1+1" and problems[0]["answer"] == "2"


@pytest.mark.parametrize("name, content, message", [
    ("a.jsonl", '{"problem": "x", "answer": "1"}\n\n{"problem": "y"\n', "a.jsonl:3: not valid JSON"),
    ("b.jsonl", '{"problem": "x", "answer": "1"}\n{"answer": "2"}\n', "b.jsonl:2: no problem text"),
    ("c.json", '[{"problem": "x", "answer": "1"}, {"problem": "y"}]', "c.json: row 2: no answer"),
    ("d.json", '{"problem": "x"', "d.json:1: not valid JSON"),
    ("e.jsonl", '["just", "a", "list"]\n', "e.jsonl:1: expected a JSON object per row"),
    ("f.jsonl", '{"question": "x", "answer": ""}\n',
     "f.jsonl:1: no answer (looked for answer, final_answer, reward_model.ground_truth, ground_truth; row keys:"),
])
def test_malformed_files_name_the_file_and_line(name, content, message, tmp_path, capsys):
    (tmp_path / name).write_text(content)
    with pytest.raises(SystemExit) as e:
        dataset.load_data(str(tmp_path / name), "train")
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err


def test_a_field_named_by_flag_is_the_only_one_tried(tmp_path, capsys):
    """--prompt_key q on a row whose q is empty: no fallback to PROMPT_KEYS' `problem`, and the error names q."""
    path = tmp_path / "custom.jsonl"
    path.write_text(json.dumps({"q": "", "problem": "1+1", "answer": "2"}) + "\n")
    with pytest.raises(SystemExit) as e:
        dataset.load_data(str(path), "train", prompt_key="q")
    assert e.value.code == 2
    assert "custom.jsonl:1: no problem text (looked for q; row keys: answer, problem, q;" in capsys.readouterr().err


def test_templates():
    tok = modeling.build_demo_tokenizer()
    assert dataset.resolve_template("auto", tok) == "none"  # the demo model was trained on bare sums
    assert dataset.format_prompt(tok, "1+2", "none") == "<|user|>1+2<|assistant|>"
    assert dataset.format_prompt(tok, "1+2", "plain") == f"Question: 1+2\n{dataset.BOXED_INSTRUCTION}\nAnswer:"
    assert "Answer: $Answer" in dataset.format_prompt(tok, "1+2", "dapo")
    assert dataset.format_prompt(tok, "1+2", "chat").endswith(f"1+2\n{dataset.BOXED_INSTRUCTION}<|assistant|>")
    tok.chat_template = None
    assert dataset.resolve_template("auto", tok) == "plain"


def test_the_data_loader_only_reads_the_config():
    """tokenize_datasets leaves the config as it was; main() resolves --max_model_len 0 from the tokenized
    prompts (the longest prompt of any set + --max_new_tokens), and keeps a length that was given."""
    cfg = Config(prompt_template="none", max_new_tokens=7, eval_data="reasoning,arith")
    tok = modeling.build_demo_tokenizer()
    before = dataclasses.asdict(cfg)
    train, evals = dataset.tokenize_datasets(*dataset.load_datasets(cfg), tok, cfg)
    assert dataclasses.asdict(cfg) == before
    text = [dataset.format_prompt(tok, p["prompt"], "none") for ps in (train, *evals.values()) for p in ps]
    longest = max(len(tok(t, add_special_tokens=False)["input_ids"]) for t in text)
    assert dataset.resolve_max_model_len(cfg, train, evals) == longest + 7
    cfg.max_model_len = 300
    assert dataset.resolve_max_model_len(cfg, train, evals) == 300


def test_pass_at_k_is_the_unbiased_estimator():
    for n in (1, 2, 5, 8, 16, 33):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
                assert common.pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12)
    # stable for large n (C(1024, 512) overflows floats; the product form does not)
    assert common.pass_at_k(1024, 1, 512) == pytest.approx(0.5, abs=1e-12)
    assert common.pass_at_k(1024, 3, 1) == pytest.approx(3 / 1024)
    assert 0.0 < common.pass_at_k(1024, 1, 1) < common.pass_at_k(1024, 1, 1024) == 1.0


def test_eval_only_prints_avg_and_pass_at_k(demo_dir, tmp_path):
    r = run_script(["da3po.py", "--demo", "arith", "--eval_only", "--model", demo_dir, "--eval_data", "arith",
                    "--eval_samples", "8", "--eval_size", "24", "--out_dir", str(tmp_path)])
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("eval step 0"))
    for k in (1, 2, 4, 8):
        assert f"pass@{k} " in line
    record = json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert record["eval/arith/acc"] == record["eval/acc"] > 0  # the demo checkpoint solves some level-1 sums
    assert record["eval/pass@1"] == pytest.approx(record["eval/acc"])
    assert record["eval/pass@8"] >= record["eval/pass@4"] >= record["eval/pass@1"]


def test_eval_size_keeps_the_mix_of_levels():
    problems = dataset.load_data("arith", "eval")  # sorted by level, 40 each
    assert [p["level"] for p in dataset.spread(problems, 10)] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert dataset.spread(problems, 0) == problems and dataset.spread(problems, 500) == problems
    assert len({p["prompt"] for p in dataset.spread(problems, 199)}) == 199
