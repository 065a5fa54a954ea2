"""The start-up checks of the log-prob shortcuts (shortcuts.check_logprob_paths): in float32 an exact shortcut is
accepted whatever the weights, a wrong one refused; a call under torch.no_grad says what is wrong.
Run: python -m pytest -q tests/test_shortcut_checks.py"""
import os

import pytest
import torch

import config
import modeling
import shortcuts
from tests import test_heads
from tests.conftest import ROOT

SEEDS = 20  # seed 0: the shipped weights; the others: each weight times 1 + 0.05 x a normal draw
DEMOS = {"arith": modeling.DEMO_MODEL, "reasoning": os.path.join(ROOT, "demo", "reasoning", "model")}


def perturbed(model, seed: int):
    """The model with each weight times 1 + 0.05 x a normal draw of `seed` (seed 0: as it is)."""
    if seed:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 0.05 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("demo", list(DEMOS))
def test_exact_shortcuts_pass_in_float32_for_any_weights(demo):
    """A group's prompt once, packed rows and the chunked output layer compute each row's own log-probs and gradient
    up to float32's rounding, which the weights and the machine's kernels move: every one of 20 weight draws passes
    (a tolerance at float32's rounding of the padded rows alone refused packing on some draws)."""
    refused = []
    cfg = config.TrainConfig(pack=True, logprob_path="shortcuts")  # --logprob_chunk 1024
    for seed in range(SEEDS):
        model = perturbed(modeling.load_model(DEMOS[demo])[0], seed).train()
        shortcuts.check_logprob_paths(model, cfg)
        if model.pack_refusal or not model.shares_prompts:
            refused.append((seed, model.pack_refusal, model.shares_prompts))
    assert not refused, refused


def test_wrong_paths_are_still_refused_in_float32(capsys):
    """The families whose layers carry a state from one packed sequence into the next, or whose cache a group's rows
    cannot share (tests/test_heads.py), are refused in float32 too (but Falcon-H1, whose packed log-probs move by
    3e-7 in float64, below float32's rounding); so is a packed forward of the demo model whose logits are off by 0.1%
    (a small error next to what a leak between sequences does)."""
    cfg = config.TrainConfig(pack=True, logprob_path="shortcuts", logprob_chunk=0)
    for family in sorted(test_heads.PACK_REFUSED - {"falcon_h1"}):
        model = test_heads.build(family, family not in test_heads.UNTIED_ONLY).float().train()
        shortcuts.check_logprob_paths(model, cfg)
        assert model.pack_refusal.startswith(("log-probs off by", "gradient off by")), (family, model.pack_refusal)
        assert model.shares_prompts == (family not in test_heads.SHARED_PROMPT_FAILS), family
    model = modeling.load_model(modeling.model_path("demo"))[0].train()
    forward = model.forward

    def slightly_off(*args, **kwargs):
        out = forward(*args, **kwargs)
        if kwargs.get("use_cache") is False and kwargs.get("attention_mask") is None:  # packed
            out.logits = out.logits * 1.001
        return out
    model.forward = slightly_off
    shortcuts.check_logprob_paths(model, cfg)
    assert model.pack_refusal.startswith("log-probs off by") and model.shares_prompts
    assert "note: --pack: Qwen3ForCausalLM runs padded (log-probs off by" in capsys.readouterr().out


def test_a_call_under_no_grad_says_so():
    """The probes of a model that trains run a backward: called under torch.no_grad() (or inference_mode) the check
    raises, naming the mistake (it once exited blaming the model's forward). A frozen model (the KL anchor) runs no
    backward and gets the same verdict either way."""
    cfg = config.TrainConfig(pack=True, logprob_path="shortcuts")
    model = modeling.load_model(modeling.model_path("demo"))[0].train()
    for context in (torch.no_grad, torch.inference_mode):
        with context(), pytest.raises(RuntimeError, match="called with gradients disabled"):
            shortcuts.check_logprob_paths(model, cfg)
    frozen = modeling.load_model(modeling.model_path("demo"))[0].requires_grad_(False).eval()
    verdicts = []
    for context in (torch.no_grad, torch.enable_grad):
        with context():
            shortcuts.check_logprob_paths(frozen, cfg)
        verdicts.append((frozen.shares_prompts, frozen.pack_refusal))
    assert verdicts == [(True, "")] * 2
