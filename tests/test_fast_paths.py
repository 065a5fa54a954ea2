"""The speed work keeps the math: our sampler against transformers' generate and its top-p filter, one prompt forward
per group with its KV cache shared by the group's rows, the rollout's own log-probs used as pi_old, the verifier's
integer fast path. Run: python -m pytest -q tests/test_fast_paths.py"""
import json

import pytest
import torch

import common
import shortcuts
import config
import modeling
import dataset
import engine as eng
import da3po
import verifier
from tests.conftest import ARITH_MODEL


@pytest.fixture(scope="module")
def model_tok(demo_dir):
    return modeling.load_model(demo_dir, torch.device("cpu"))


def arith_prompts(tok, n=12):
    problems = dataset.tokenize_problems(dataset.load_data("arith", "eval"), tok, "none", 64, "arith")
    return [p["prompt_ids"] for p in dataset.spread(problems, n)]


def test_greedy_sampling_equals_transformers_generate(model_tok):
    model, tok = model_tok
    prompts = arith_prompts(tok)
    ids, attn, _ = common.pad_prompt_completion(prompts, [[]] * len(prompts), tok.pad_token_id)
    out = model.generate(input_ids=ids[:, :-1], attention_mask=attn[:, :-1], do_sample=False, max_new_tokens=12,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    reference = []
    for row in out[:, ids.shape[1] - 1:].tolist():
        cut = next((j for j, t in enumerate(row) if t == tok.eos_token_id), None)
        reference.append(row if cut is None else row[:cut + 1])
    ours, truncated, _ = eng.hf_generate(model, tok, prompts, 12, temperature=0.0)
    assert ours == reference and truncated == [c[-1] != tok.eos_token_id for c in reference]
    # n samples per prompt with one shared prefill: greedy gives n copies of the same completion
    ours3, _, _ = eng.hf_generate(model, tok, prompts, 12, temperature=0.0, n=3)
    assert ours3 == [c for c in reference for _ in range(3)]


def test_top_p_filter_equals_transformers_warper():
    from transformers.generation.logits_process import TopPLogitsWarper
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 3
    for top_p in (0.3, 0.7, 0.95):
        warped = TopPLogitsWarper(top_p)(None, logits.clone())
        # sample_token's filter: the tokens it may draw are those the warper keeps
        kept = []
        for _ in range(200):
            token, _ = eng.sample_token(logits, 1.0, top_p)
            kept.append(token)
        drawn = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, torch.stack(kept, 1), True)
        assert not (drawn & torch.isinf(warped)).any(), top_p  # never outside the nucleus
        assert (drawn == ~torch.isinf(warped)).float().mean() > 0.95  # and nearly every nucleus token is drawn


def test_sampled_frequencies_follow_softmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 6, generator=g).expand(40_000, 6)
    torch.manual_seed(0)
    tokens, logp = eng.sample_token(logits, 0.7, 1.0)
    expected = (logits[0] / 0.7).softmax(-1)
    freq = torch.bincount(tokens, minlength=6) / len(tokens)
    assert (freq - expected).abs().max() < 0.01  # 4 standard errors at most
    assert torch.allclose(logp, (logits / 0.7).log_softmax(-1).gather(1, tokens[:, None])[:, 0])


def test_decode_attention_reads_grouped_heads_in_place_with_the_same_samples(model_tok, monkeypatch):
    """engine._rollout_sdpa: in our sampler on a CPU (no gradients), grouped-query attention under a mask (the demo
    model: 4 query heads on 2 key/value heads) runs sdpa's enable_gqa instead of copying the heads (transformers'
    repeat_kv). Sampled completions and their log-probs equal transformers' path bit for bit, on prompts of
    different lengths (left padding: a mask at every step). The sampler switches the model to it and back: after,
    the model runs transformers' sdpa, which copies the heads, and transformers' own sdpa entry is untouched."""
    import transformers.integrations.sdpa_attention as hf_sdpa
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    model, tok = model_tok
    prompts = arith_prompts(tok)
    assert len(set(map(len, prompts))) > 1 and model.config.num_key_value_heads < model.config.num_attention_heads
    copies, real_repeat_kv = [], hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda x, n: copies.append(n) or real_repeat_kv(x, n))

    def sample():
        torch.manual_seed(0)
        return eng.hf_generate(model, tok, prompts, 12, n=4)
    in_place = sample()
    assert copies == [] and model.config._attn_implementation == "sdpa"
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is hf_sdpa.sdpa_attention_forward
    with monkeypatch.context() as m:  # transformers' sdpa as it is
        m.setattr(eng, "_rollout_sdpa", hf_sdpa.sdpa_attention_forward)
        copied = sample()
    assert copies and copied == in_place  # completions, truncation flags and log-probs, exactly
    copies.clear()
    ids, attn, _ = common.pad_prompt_completion(prompts, [[]] * len(prompts), tok.pad_token_id)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=attn)  # outside the sampler: the heads are copied as before
    assert copies


def test_rollout_logprobs_are_the_trainers(model_tok):
    """HF rollouts in float32 return log-probs that the trainer then uses as pi_old without a pass of its own: they
    must equal what token_logprobs computes on the same completions."""
    model, tok = model_tok
    prompts = arith_prompts(tok)
    torch.manual_seed(0)
    completions, _, logps = eng.hf_generate(model, tok, prompts, 12, temperature=0.8, n=4)
    rows = [p for p in prompts for _ in range(4)]
    ids, attn, mask = common.pad_prompt_completion(rows, completions, tok.pad_token_id)
    with torch.no_grad():
        trainer, _ = shortcuts.token_logprobs(model, ids, attn, mask.shape[1], 0.8)
    rollout = torch.tensor([lp + [0.0] * (mask.shape[1] - len(lp)) for lp in logps])
    gap = (trainer - rollout).abs() * mask  # float32: the KV cache's incremental attention vs the whole sequence
    assert gap.max() < 1e-4 and gap.sum() / mask.sum() < 2e-6, (gap.max(), gap.sum() / mask.sum())


def test_shared_prompt_logprobs_equal_the_rows_run_whole(model_tok):
    """token_logprobs with `groups` runs each prompt once and shares its KV cache with the group's rows: the same
    values and gradients. In float64, where transformers' RMSNorm still computes in float32, hence 1e-6 relative."""
    model, tok = model_tok
    model = type(model).from_pretrained(ARITH_MODEL).double().train()
    g = torch.Generator().manual_seed(0)
    groups = [{"prompt_ids": torch.randint(10, 40, (int(k),), generator=g).tolist(),
               "completions": [torch.randint(10, 40, (int(m),), generator=g).tolist()
                               for m in torch.randint(1, 9, (5,), generator=g)],
               "reward": [0.0] * 5, "correct": [False] * 5} for k in (3, 6, 8, 5)]
    batch = common.make_batch(groups, tok.pad_token_id)
    T = batch["mask"].shape[1]
    out = []
    for shared in (None, batch["group"]):
        for chunk in (0, 9):
            model.zero_grad()
            logp, entropy = shortcuts.token_logprobs(model, batch["input_ids"], batch["attention_mask"], T, 0.9, True,
                                                  chunk, shared)
            (logp * batch["mask"] * torch.linspace(-1, 1, T)).sum().backward()
            out.append((logp.detach() * batch["mask"], entropy * batch["mask"],
                        [p.grad.clone() for p in model.parameters()]))
    for logp, entropy, grads in out[1:]:
        assert torch.allclose(logp, out[0][0], atol=1e-9) and torch.allclose(entropy, out[0][1], atol=1e-9)
        for a, b in zip(grads, out[0][2]):
            assert (a - b).abs().max() <= 1e-6 * a.abs().max()


def test_first_update_rows_take_their_current_logprobs(model_tok, tmp_path):
    """Rows whose old log-probs are not known in advance (bf16, where the rollout's are not the trainer's) take the
    current ones: with one update per step every ratio is exactly 1, so nothing is clipped."""
    flags = ["--demo", "arith", "--steps", "2", "--out_dir", str(tmp_path), "--prompts_per_step", "8",
             "--eval_size", "10", "--eval_samples", "2", "--updates_per_step", "1",
             "--dtype", "bfloat16", "--clip_low", "0.0", "--clip_high", "0.0"]
    cfg = config.parse_config(da3po.Config, flags, da3po.PRESETS)
    da3po.main(cfg)
    train = [r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "train/loss" in r]
    assert train and all(r["train/clipfrac_low"] == 0 and r["train/clipfrac_high"] == 0 for r in train)
    assert all(r["time/verify_s"] >= 0 and r["time/verify_s"] <= r["time/rollout_s"] for r in train)


def test_integer_fast_path_agrees_with_the_full_check():
    values = ["0", "-0", "007", "7", "-7", "12", "0012", "123456789012345678901234567890", "1" * 40]
    for a in values:
        for b in values:
            verifier._CACHE.clear()
            key, quick = verifier._quick_check(a, b)  # the path the fast one skips
            assert quick is None or quick == verifier.math_equal(a, b), (a, b)
            assert verifier.math_equal(a, b) == (int(a) == int(b)), (a, b)
