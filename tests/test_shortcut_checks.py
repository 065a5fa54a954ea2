"""The start-up checks of the log-prob shortcuts (shortcuts.check_logprob_paths): in float32 an exact shortcut is
accepted whatever the weights, a wrong one refused; a run decides once, and a resumed run takes the verdicts its
start recorded in the checkpoint; a call under torch.no_grad says what is wrong.
Run: python -m pytest -q tests/test_shortcut_checks.py"""
import json
import os
import signal

import pytest
import torch

import bookkeeping
import common
import config
import da3po
import modeling
import ranks
import shortcuts
from tests import test_heads
from tests.conftest import ROOT

SEEDS = 20  # seed 0: the shipped weights; the others: each weight times 1 + 0.05 x a normal draw
DEMOS = {"arith": os.path.join(ROOT, "demo", "arith", "model"), "reasoning": modeling.DEMO_MODEL}


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


def test_a_recorded_verdict_is_taken_without_probing(capsys):
    """Given the verdict a run's start recorded, for the same setup, the check runs no forward and takes it, whatever
    probing would say now; for another setup (here the attention implementation) it probes again and says why."""
    cfg = config.TrainConfig(pack=True, logprob_path="shortcuts")
    model = modeling.load_model(modeling.model_path("demo"))[0].train()
    verdict = shortcuts.check_logprob_paths(model, cfg)
    assert verdict["pack_refusal"] == "" and verdict["shares_prompts"]
    assert json.loads(json.dumps(verdict)) == verdict  # (it goes into a JSON file)
    recorded = {**verdict, "pack_refusal": "as recorded", "shares_prompts": False}
    forwards = []
    model.register_forward_hook(lambda *args: forwards.append(1))
    capsys.readouterr()
    assert shortcuts.check_logprob_paths(model, cfg, recorded=recorded) == recorded
    assert not forwards and model.pack_refusal == "as recorded" and not model.shares_prompts
    said = capsys.readouterr().out
    assert "takes the log-prob paths the run's start chose (not probed again)" in said
    assert "note: --pack: Qwen3ForCausalLM runs padded (as recorded)" in said
    model.config._attn_implementation = "eager"
    again = shortcuts.check_logprob_paths(model, cfg, recorded=recorded)
    assert forwards and again["pack_refusal"] == "" and again["setup"]["attention"] == "eager"
    assert "for another setup (attention sdpa -> eager): checked again" in capsys.readouterr().out


SMALL = ["--demo", "arith", "--prompts_per_step", "8", "--updates_per_step", "2", "--eval_size", "16",
         "--eval_samples", "2", "--logprob_path", "shortcuts", "--steps", "3", "--eval_every", "2"]


def records(path):
    """metrics.jsonl without wall-clock fields (the only thing allowed to differ between runs)."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")} for line in open(path)]


def test_a_resumed_run_takes_the_paths_its_start_chose(tmp_path, monkeypatch, capsys):
    """--logprob_path shortcuts: a run stopped in step 2 and resumed on a machine whose rounding would now refuse a
    group's prompt once and packed rows (the check's refusal forced) takes the paths its start chose, recorded in
    out_dir and in the checkpoint, and its metrics.jsonl equals the uninterrupted run's."""
    def run(out, *flags):
        da3po.main(config.parse_config(da3po.Config, ["--out_dir", str(out), *SMALL, *flags], da3po.PRESETS))

    run(tmp_path / "straight")
    straight = records(tmp_path / "straight" / "metrics.jsonl")
    out = tmp_path / "stopped"
    real_step, calls = common.UpdateGuard.step, [0]

    def step(self, *args, **kwargs):  # a stop request at the run's 3rd update, step 2's first
        calls[0] += 1
        if calls[0] == 3:
            ranks._stop_signal = signal.SIGTERM
        return real_step(self, *args, **kwargs)
    with monkeypatch.context() as m:
        m.setattr(common.UpdateGuard, "step", step)
        run(out)
    ranks._stop_signal = None
    chosen = json.load(open(out / bookkeeping.PATHS_FILE))
    assert chosen["policy"]["pack_refusal"] == "" and chosen["policy"]["shares_prompts"]
    assert json.load(open(out / "step_000002" / bookkeeping.PATHS_FILE)) == chosen
    capsys.readouterr()
    def refusal(*args, **path):  # as the rounding of another machine might say (the chunks pass)
        return "" if "chunk_tokens" in path else "gradient off by 1.81e-06 of itself"
    monkeypatch.setattr(shortcuts, "_path_refusal", refusal)
    run(out, "--resume")
    said = capsys.readouterr().out
    assert "takes the log-prob paths the run's start chose" in said and "note: --pack" not in said
    assert records(out / "metrics.jsonl") == straight
