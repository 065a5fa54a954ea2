"""--pack: a micro-batch's completions in one row without padding (modeling._packed_outputs) give the padded
path's loss and gradient, in float64 to harness.TOL (1e-10 of their scale; tests/harness.py derives it).
The reference harness runs packed cases too (tests/test_reference.py: harness.random_case draws --pack).
Run: python -m pytest -q tests/test_pack.py"""
import pytest
import torch

import common
import harness
import modeling


@pytest.fixture
def models(float64_model):
    model, tok = float64_model
    return model, harness.ref_model_of(model), tok.pad_token_id


def _update(model, ref_model, case, pad_id, pack: bool):
    """The case's updates through the real pipeline with --pack on or off."""
    case = {**case, "flags": {**case["flags"], "pack": pack}}
    return harness.run_pipeline(model, ref_model if case["flags"]["kl_coef"] > 0 else None, case, pad_id)


def _gaps(padded, packed):
    """The largest absolute differences of loss and gradient over the updates, and the gradient's scale."""
    loss = max(abs(a["loss"] - b["loss"]) for a, b in zip(padded, packed))
    grad = max((a["grad"][n] - b["grad"][n]).abs().max().item() for a, b in zip(padded, packed) for n in a["grad"])
    scale = max(g.abs().max().item() for r in padded for g in r["grad"].values())
    return loss, grad, scale


# Uneven lengths, holes in the loss mask (rollout_is token --rollout_is_mask rejects tokens inside completions;
# DARO leaves bins 0 and G out), token-budget micro-batches that split groups, rows that make one micro-batch
# each, chunked log-probs, a KL anchor (a second packed model), GSPO's sequence ratio.
CASES = [dict(seed=s, script=script, **flags) for s, script, flags in [
    (1, "da3po", dict(rollout_is="token", rollout_is_mask=True, micro_batch_tokens=30, micro_batch_size=16)),
    (2, "daro", dict(rollout_is="token", rollout_is_mask=True, micro_batch_tokens=0, micro_batch_size=3)),
    (3, "da3po", dict(micro_batch_tokens=0, micro_batch_size=1, logprob_chunk=7, kl_coef=0.1)),
    (4, "daro", dict(micro_batch_tokens=45, micro_batch_size=5, seq_ratio=True, logprob_chunk=0)),
    (5, "da3po", dict(micro_batch_tokens=0, micro_batch_size=64, updates_per_step=1, kl_coef=0.1))]]


@pytest.mark.parametrize("fixed", CASES, ids=[f"{c['seed']}-{c['script']}" for c in CASES])
def test_packed_update_equals_padded(models, fixed):
    """Packed and padded micro-batches: the same loss and gradient (float64), and both equal the reference."""
    model, ref_model, pad_id = models
    fixed = dict(fixed)
    case = harness.random_case(fixed.pop("seed"), model, fixed.pop("script"), **fixed)
    padded, packed = _update(model, ref_model, case, pad_id, False), _update(model, ref_model, case, pad_id, True)
    loss, grad, scale = _gaps(padded, packed)
    assert loss <= harness.TOL * max(1.0, max(abs(r["loss"]) for r in padded)) and grad <= harness.TOL * scale
    assert not harness.failures(harness.compare(model, ref_model, case, packed))


def _one_group(lengths, prompt=(12, 13, 14)):
    ids, attn, _ = common.pad_prompt_completion([list(prompt)] * len(lengths),
                                                [[20 + i] * n for i, n in enumerate(lengths)], 0, min_width=2)
    return ids, attn, torch.zeros(len(lengths), dtype=torch.long)


def test_one_token_completions_keep_the_forward_count(float64_model):
    """Completions of one token leave the completion forward nothing to run: a placeholder token keeps the two
    forwards (lockstep: a rank's forward count never depends on its data), and the log-probs are the padded
    path's."""
    model, _ = float64_model
    ids, attn, groups = _one_group([1, 1, 0])
    calls = []
    handle = model.register_forward_hook(lambda *args: calls.append(1))
    try:
        T = attn.shape[1] - 3
        packed = modeling.token_logprobs(model, ids, attn, T, groups=groups, pack=True)[0]
        assert len(calls) == 2
        padded = modeling.token_logprobs(model, ids, attn, T, groups=groups)[0] * attn[:, 3:]
    finally:
        handle.remove()
    assert (packed - padded).abs().max().item() <= 1e-12
    assert packed[2].abs().sum() == 0  # an empty completion: nothing, not a NaN


def test_packed_attention_keeps_sequences_apart(float64_model):
    """A completion's log-probs do not move when another row's tokens, or another group's prompt, change."""
    model, _ = float64_model
    ids, attn, groups = _one_group([5, 3])
    other, _, _ = _one_group([5, 3], prompt=(15, 16, 17))
    ids2 = torch.cat([ids, other])  # two groups, the second with another prompt
    attn2, groups2 = torch.cat([attn, attn]), torch.tensor([0, 0, 1, 1])
    base = modeling.token_logprobs(model, ids2, attn2, 5, groups=groups2, pack=True)[0]
    changed = ids2.clone()
    changed[1, 3:6] = 30  # row 1's completion
    changed[2:, :3] = 31  # group 1's prompt
    moved = modeling.token_logprobs(model, changed, attn2, 5, groups=groups2, pack=True)[0]
    assert torch.equal(base[0], moved[0])  # its prompt and its completion as they were
    assert not torch.equal(base[2], moved[2]) and not torch.equal(base[1], moved[1])


def test_pack_refusal_names_what_does_not_pack(float64_model):
    """Packing needs an attention that takes a custom mask on full-attention layers; else the padded path runs,
    decided from the model and config (the same on every rank), said once at start-up."""
    model, _ = float64_model
    assert modeling.pack_refusal(model) == ""
    model.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in modeling.pack_refusal(model)
    model.config._attn_implementation = "sdpa"
    model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
    assert "full attention" in modeling.pack_refusal(model)


def test_start_up_check_compares_packed_and_padded(float64_model):
    model, _ = float64_model
    modeling.check_logprob_paths(model, common.TrainConfig(pack=True))
    assert model.pack_refusal == ""


def test_forward_tokens_count_what_the_forwards_run(float64_model):
    """perf/pad_frac's counts: one group, a prompt of 3, completions of 5, 3 and 1 tokens (T = 5)."""
    model, _ = float64_model
    ids, attn, groups = _one_group([5, 3, 1])
    assert modeling.forward_tokens(model, attn, 5) == (3 * 8, 3 * 3 + 6)  # rows whole, padded
    assert modeling.forward_tokens(model, attn, 5, groups) == (3 + 3 * 4, 3 + 4 + 2)  # the prompt once, padded
    assert modeling.forward_tokens(model, attn, 5, groups, pack=True) == (9, 9)  # packed: no padding
    assert modeling.forward_tokens(model, attn, 5, pack=True) == (3 * 3 + 6, 3 * 3 + 6)  # packed rows whole


@pytest.mark.parametrize("chunk", [0, 4])
def test_rows_whole_packed_equal_padded(float64_model, chunk):
    """A checkpointed model (its layers drop the KV cache in training) runs rows whole: packed, in one forward,
    the same log-probs and gradient as padded, the last prompt position predicting each first token."""
    model, _ = float64_model
    ids, attn, _ = _one_group([5, 3, 1, 0])
    other, other_attn, _ = _one_group([2, 4], prompt=(15, 16))
    width = ids.shape[1]
    ids = torch.cat([ids, torch.nn.functional.pad(other, (width - other.shape[1], 0))])  # left pad the prompt
    attn = torch.cat([attn, torch.nn.functional.pad(other_attn, (width - other.shape[1], 0))])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    groups, results = torch.tensor([0, 0, 0, 0, 1, 1]), []
    for pack in (False, True):
        model.zero_grad()
        calls = []
        handle = model.register_forward_hook(lambda *args: calls.append(1))
        try:
            logp = modeling.token_logprobs(model, ids, attn, 5, chunk_tokens=chunk, groups=groups, pack=pack)[0]
        finally:
            handle.remove()
        logp = logp * attn[:, -5:]
        (logp * torch.arange(1, 6)).sum().backward()
        results.append((logp, [p.grad.clone() for p in model.parameters()], len(calls)))
    (padded, grad_padded, n_padded), (packed, grad_packed, n_packed) = results
    assert n_padded == n_packed == 1
    assert (packed - padded).abs().max().item() <= 1e-12
    assert max((a - b).abs().max().item() for a, b in zip(grad_padded, grad_packed)) <= 1e-10


def test_eager_packed_mask_equals_sdpa_rows(float64_model):
    """eager reads a dense additive mask, sdpa the rows layout (_attention_rows): the same log-probs."""
    model, _ = float64_model
    ids, attn, _ = _one_group([5, 3, 1])
    other, other_attn, _ = _one_group([2, 4], prompt=(15, 16))
    width = ids.shape[1]
    ids = torch.cat([ids, torch.nn.functional.pad(other, (width - other.shape[1], 0))])
    attn = torch.cat([attn, torch.nn.functional.pad(other_attn, (width - other.shape[1], 0))])
    groups = torch.tensor([0, 0, 0, 1, 1])
    sdpa = modeling.token_logprobs(model, ids, attn, 5, groups=groups, pack=True)[0]
    model.config._attn_implementation = "eager"
    eager = modeling.token_logprobs(model, ids, attn, 5, groups=groups, pack=True)[0]
    assert (sdpa - eager).abs().max().item() <= 1e-6  # eager's softmax runs in float32, even on float64
