"""End-to-end runs of the real scripts on the tiny demo model. Run: python -m pytest -q tests/test_run.py"""
import json
import math
import os

import pytest
import torch

import common
import shortcuts
import config
import modeling
import dataset
import ranks
import engine as eng
from tests.conftest import run_script
from da3po import Config


def test_demo_model_save_load_round_trip(demo_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model, tok = modeling.load_model(demo_dir, torch.device("cpu"))
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
    model, tok = modeling.load_model(demo_dir, torch.device("cpu"))
    cfg = Config(group_size=4, max_new_tokens=4, prompt_template="none", prompts_per_step=8, oversample=0.75,
                 max_gen_batches=3)
    impossible = dataset.tokenize_problems([{"prompt": f"{i}+{i}", "answer": "never", "level": 0} for i in range(50)],
                                          tok, "none", 64, "impossible")
    stream = dataset.PromptStream(impossible, seed=0)
    engine = eng.HFRollout(model, tok, ranks.DistInfo())
    groups, generated, stats = common.dynamic_sampling(engine, tok, stream, cfg, ranks.DistInfo())
    assert groups == [] and stats["train/num_gen_batches"] == 3 and stats["train/keep_rate"] == 0
    assert stream.position == 18 and len(generated) == 18  # 3 batches of 6 prompts (0.75 x 8)
    assert "dynamic sampling kept 0/8 groups after 3 generation batches" in capsys.readouterr().out


def test_da3po_two_steps_writes_metrics(demo_dir, tmp_path):
    out = tmp_path / "run"
    r = run_script(["da3po.py", "--demo", "arith", "--steps", "2", "--out_dir", str(out), "--prompts_per_step", "8",
                    "--updates_per_step", "2", "--eval_size", "16", "--eval_samples", "2", "--save_every", "1",
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
    assert cfg["steps"] == 2 and cfg["algo"] == "da3po" and cfg["lam"] == 2.0
    assert sorted(os.listdir(out / "step_000002"))[:2] == ["chat_template.jinja", "config.json"]
    assert "step    2/2 |" in r.stdout and "eval/acc before" in r.stdout
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert samples and {"step", "prompt", "answer", "completion", "reward"} <= set(samples[0])


@pytest.mark.parametrize("script", ["da3po.py", "daro.py"])
def test_steps_that_keep_no_group_are_logged_and_skipped(script, tmp_path):
    """Every answer is unreachable, so dynamic sampling keeps nothing: each step is logged with zero groups, no update
    happens, samples are not written from a stale step, and the run finishes normally."""
    data = tmp_path / "never.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+{i}", "answer": "never"}) + "\n" for i in range(40)))
    out = tmp_path / "run"
    r = run_script([script, "--demo", "arith", "--steps", "2", "--out_dir", str(out), "--train_data", str(data),
                    "--eval_data", str(data), "--prompts_per_step", "4", "--max_gen_batches", "2", "--eval_size", "8",
                    "--eval_samples", "1", "--sample_every", "1", "--prompt_template", "none"])
    assert r.returncode == 0, r.stderr[-3000:]
    train = [x for x in map(json.loads, open(out / "metrics.jsonl")) if "train/keep_rate" in x]
    assert [x["step"] for x in train] == [1, 2]
    assert all(x["train/num_groups"] == 0 and x["train/keep_rate"] == 0 and x["train/num_gen_batches"] == 2
               for x in train)
    assert not (out / "samples.jsonl").exists() or not (out / "samples.jsonl").read_text()


def test_eval_is_deterministic_for_the_same_weights(demo_dir):
    model, tok = modeling.load_model(demo_dir, torch.device("cpu"))
    cfg = Config(eval_samples=2, prompt_template="none")
    problems = dataset.tokenize_problems(dataset.load_data("arith", "eval")[:24], tok, "none", 64, "arith")
    engine = eng.HFRollout(model, tok, ranks.DistInfo())
    torch.manual_seed(1)
    a = common.evaluate(engine, tok, problems, cfg)
    torch.manual_seed(2)  # a different training RNG state must not change the score
    b = common.evaluate(engine, tok, problems, cfg)
    assert a == b


def test_arith_splits_are_disjoint_and_graded():
    train, evals = dataset.arith_problems(seed=0)
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in evals}
    assert {p["level"] for p in evals} == {1, 2, 3, 4}
    assert all(int(p["answer"]) == sum(map(int, p["prompt"].split("+"))) for p in train[:100] + evals)


SMALL = ["--demo", "arith", "--prompts_per_step", "8", "--eval_size", "16", "--eval_samples", "2",
         "--eval_every", "0", "--sample_every", "0"]


def run_main(demo_dir, tmp_path, *flags):
    """da3po.main in this process (so tests can wrap its functions); returns the train records of metrics.jsonl."""
    import da3po
    cfg = config.parse_config(da3po.Config, ["--out_dir", str(tmp_path), *SMALL, *flags], da3po.PRESETS)
    da3po.main(cfg)
    return [r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "train/loss" in r]


def test_groups_kept_at_the_sampling_cap_are_all_trained_once(demo_dir, tmp_path, monkeypatch):
    """One generation batch of 8 prompts keeps fewer than the 8 groups asked for, with 8 updates per step: every kept
    completion must be trained exactly once, in as many updates as there are groups (none empty)."""
    import da3po
    batch_tokens, trained = [], []
    real_make_batch, real_loss = da3po.make_batch, common.policy_loss

    def make_batch(groups, pad_id, device):
        batch = real_make_batch(groups, pad_id, device)
        batch_tokens.append(batch["mask"].sum().item())
        return batch

    def policy_loss(logp, old_logp, advantages, mask, *args, **kwargs):
        trained.append(mask.sum().item())
        return real_loss(logp, old_logp, advantages, mask, *args, **kwargs)

    monkeypatch.setattr(da3po, "make_batch", make_batch)
    monkeypatch.setattr(common, "policy_loss", policy_loss)
    train = run_main(demo_dir, tmp_path, "--steps", "1", "--updates_per_step", "8", "--max_gen_batches", "1",
                     "--oversample", "1", "--micro_batch_size", "1000")
    kept = train[0]["train/num_groups"]
    assert 0 < kept < 8, "the test needs a step that stops at the cap with some groups kept"
    assert train[0]["train/num_updates"] == kept  # one update per kept group, none empty
    assert len(trained) == kept and all(t > 0 for t in trained)  # one micro-batch per update here
    assert sum(trained) == batch_tokens[0]  # every completion token of every kept group, exactly once


def test_warmup_counts_rl_steps(demo_dir, tmp_path):
    train = run_main(demo_dir, tmp_path, "--steps", "2", "--warmup_steps", "4", "--updates_per_step", "2",
                     "--no-dynamic_sampling", "--lr", "1e-4")
    # train/lr is the rate after the step's scheduler step: 2/4 and 3/4 of --lr, whatever the updates per step
    assert [r["train/lr"] for r in train] == [pytest.approx(0.5e-4), pytest.approx(0.75e-4)]


def test_gradient_checkpointing_recomputes_activations(demo_dir):
    """The trainer's model is in training mode, so a checkpointed layer runs its forward again in the backward."""
    calls = {}
    for checkpointing in (False, True):
        model, _ = modeling.load_model(demo_dir, torch.device("cpu"))
        model = modeling.shard_model(model, ranks.DistInfo(), grad_checkpointing=checkpointing)
        mlp, count = model.model.layers[0].mlp, [0]
        real_forward = mlp.forward  # counted by wrapping forward: module hooks do not fire in the recomputation

        def counted(*args, real_forward=real_forward, count=count, **kwargs):
            count[0] += 1
            return real_forward(*args, **kwargs)
        mlp.forward = counted
        ids = torch.tensor([[4, 10, 11, 12, 5, 20, 21]])
        logp, _ = shortcuts.token_logprobs(model, ids, torch.ones_like(ids), 3)
        logp.sum().backward()
        calls[checkpointing] = count[0]
    assert calls == {False: 1, True: 2}


def test_checkpoint_sampling_knobs_are_ignored(demo_dir, tmp_path):
    """A model folder whose generation_config.json sets repetition_penalty=5 and top_k=2 samples exactly what an
    untouched one samples: the flags alone define the rollout distribution the trainer's log-probs assume."""
    model, tok = modeling.load_model(demo_dir, torch.device("cpu"))
    model.generation_config.do_sample = True
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.top_k = 2
    model.generation_config.min_new_tokens = 6
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    knobbed, _ = modeling.load_model(str(tmp_path), torch.device("cpu"))
    assert knobbed.generation_config.repetition_penalty == 5.0  # the checkpoint really carries the knobs
    plain, _ = modeling.load_model(demo_dir, torch.device("cpu"))
    prompts = [tok(f"{a}+{b}", add_special_tokens=False)["input_ids"] for a in range(10, 90, 7) for b in (3, 45)] * 4
    out = []
    for m in (plain, knobbed):
        torch.manual_seed(0)
        out.append(eng.HFRollout(m, tok, ranks.DistInfo()).generate(prompts, 12, temperature=1.0))
    assert out[0] == out[1]
    assert knobbed.generation_config.repetition_penalty == 5.0  # and the model's own config is left as it was


def test_dropout_is_off_in_training_mode(demo_dir, tmp_path):
    from transformers import AutoConfig
    model, tok = modeling.load_model(demo_dir, torch.device("cpu"))
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    config.attention_dropout = 0.5
    config.save_pretrained(tmp_path)
    model, _ = modeling.load_model(str(tmp_path), torch.device("cpu"))
    ids = torch.tensor([[4, 10, 11, 12, 5, 20, 21]])
    model.train()
    a, b = model(ids).logits, model(ids).logits
    model.eval()
    assert torch.equal(a, b) and torch.equal(a, model(ids).logits)


def test_overlong_prompts_are_dropped_with_a_count(demo_dir, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    rows = [{"problem": f"{a}+{a}", "answer": str(2 * a)} for a in range(1, 40)]
    rows.insert(5, {"problem": "1+" * 3000 + "1", "answer": "3001"})  # a 6,000-token problem
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = run_main(demo_dir, tmp_path / "run", "--steps", "1", "--train_data", str(data), "--max_prompt_length",
                     "64", "--no-dynamic_sampling")
    assert f"warning: {data}: dropped 1 of 40 problems whose prompt is longer than --max_prompt_length 64 tokens" \
        in capsys.readouterr().out
    assert train[0]["train/num_groups"] == 8


def test_eval_sets_with_the_same_file_name_keep_their_own_keys(demo_dir, tmp_path):
    assert dataset.eval_set_names(["a/x.jsonl", "b/x.jsonl", "arith"]) == ["a-x", "b-x", "arith"]
    assert dataset.eval_set_names(["x.jsonl", "x.jsonl"]) == ["x-0", "x-1"]
    for name, offset in (("a", 0), ("b", 1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.jsonl").write_text("".join(json.dumps({"problem": f"{a}+{offset}", "answer": str(
            a + offset)}) + "\n" for a in range(1, 9)))
    run_main(demo_dir, tmp_path / "run", "--steps", "1", "--eval_data", f"{tmp_path}/a/x.jsonl,{tmp_path}/b/x.jsonl")
    final = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "eval/acc" in r][-1]
    assert {"eval/a-x/acc", "eval/b-x/acc"} <= set(final)


def test_resume_without_a_checkpoint_says_so(demo_dir, tmp_path, capsys):
    run_main(demo_dir, tmp_path, "--steps", "1", "--resume")
    assert f"--resume: no checkpoint in {str(tmp_path)!r}; starting from step 0" in capsys.readouterr().out
