"""End-to-end runs of the real scripts on the tiny demo model. Run: python -m pytest -q tests/test_run.py"""
import json
import math
import os

import torch

import common
from conftest import DEMO_SFT_STEPS, run_script
from da3po import Config


def test_demo_model_save_load_round_trip(demo_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model, tok = common.load_model(demo_dir[0], torch.device("cpu"))
    text = "<|user|>12+345<|assistant|>\\boxed{357}<eos>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and len(ids) == 14  # one token per character, `\boxed{` is one token
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    assert tok2(text, add_special_tokens=False)["input_ids"] == ids and tok2.chat_template == tok.chat_template
    x = torch.tensor([ids])
    assert torch.equal(model(x).logits, again(x).logits)


def test_dynamic_sampling_cap_warns_instead_of_hanging(demo_dir, capsys):
    """A task the model always fails: every group is all-wrong, so nothing is kept; the cap ends the step."""
    model, tok = common.load_model(demo_dir[0], torch.device("cpu"))
    cfg = Config(group_size=4, max_new_tokens=4, prompt_template="none")
    impossible = [{"prompt": f"{i}+{i}", "answer": "never", "level": 0} for i in range(50)]
    stream = common.PromptStream(impossible, seed=0)
    gen = lambda prompts: common.hf_generate(model, tok, prompts, cfg.max_new_tokens)  # noqa: E731
    roll = lambda probs: common.roll_groups(gen, tok, probs, cfg, cfg.group_size)  # noqa: E731
    groups, stats = common.dynamic_sampling(stream, roll, num_groups=8, gen_groups=6, max_gen_batches=3)
    assert groups == [] and stats["train/num_gen_batches"] == 3 and stats["train/keep_rate"] == 0
    assert stream.position == 18
    assert "dynamic sampling kept 0/8 groups after 3 generation batches" in capsys.readouterr().out


def test_da3po_two_steps_writes_metrics(demo_dir, tmp_path):
    out = tmp_path / "run"
    r = run_script(["da3po.py", "--steps", "2", "--out_dir", str(out), "--cache_dir", demo_dir[1],
                    "--demo_sft_steps", str(DEMO_SFT_STEPS), "--prompts_per_step", "8", "--mini_batch_size", "4",
                    "--eval_size", "16", "--eval_samples", "2", "--save_every", "1",
                    "--sample_every", "1"])
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [x for x in records if "train/loss" in x]
    evals = [x for x in records if "eval/acc" in x]
    assert [x["step"] for x in train] == [1, 2] and [x["step"] for x in evals] == [0, 2]
    assert sum(x["train/num_groups"] for x in train) > 0  # the warm-started model solves some sums: updates happened
    for key in ("train/reward", "train/acc", "train/keep_rate", "train/num_gen_batches", "train/loss",
                "train/entropy", "train/clipfrac_low", "train/clipfrac_high", "train/grad_norm",
                "train/response_len", "daa/amplified_frac", "time/step_s"):
        assert all(math.isfinite(x[key]) for x in train), key
    for key in ("eval/acc", "eval/pass@1", "eval/pass@2"):
        assert 0 <= evals[-1][key] <= 1
    assert any(k.startswith("eval/acc_level") for k in evals[-1])
    cfg = json.load(open(out / "config.json"))
    assert cfg["steps"] == 2 and cfg["algo"] == "da3po" and cfg["lam"] == "2.0"
    assert sorted(os.listdir(out / "step_000002"))[:2] == ["chat_template.jinja", "config.json"]
    assert "step    2/2 |" in r.stdout and "eval/acc before" in r.stdout
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert samples and {"step", "prompt", "answer", "completion", "reward"} <= set(samples[0])


def test_eval_is_deterministic_for_the_same_weights(demo_dir):
    model, tok = common.load_model(demo_dir[0], torch.device("cpu"))
    cfg = Config(eval_samples=2, prompt_template="none")
    problems = common.load_data("arith", "eval")[:24]
    gen = lambda prompts: common.hf_generate(model, tok, prompts, cfg.max_new_tokens)  # noqa: E731
    torch.manual_seed(1)
    a = common.evaluate(gen, tok, problems, cfg)
    torch.manual_seed(2)  # a different training RNG state must not change the score
    b = common.evaluate(gen, tok, problems, cfg)
    assert a == b


def test_arith_splits_are_disjoint_and_graded():
    train, evals = common.arith_problems(seed=0)
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in evals}
    assert {p["level"] for p in evals} == {1, 2, 3, 4}
    assert all(int(p["answer"]) == sum(map(int, p["prompt"].split("+"))) for p in train[:100] + evals)
