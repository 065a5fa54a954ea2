"""--pack: a micro-batch's rows packed the way transformers packs (position_ids restarting at 0 for each sequence, no
mask, no cache: shortcuts._packed_outputs) give the padded path's loss and gradient, in float64 to harness.TOL (1e-10
of their scale; tests/harness.py derives it), on the demo model and on other families, sliding windows included; the
start-up check; nothing of transformers changed at import. The reference harness runs packed cases too
(tests/test_reference.py: harness.random_case draws --pack, and other families' cases run both ways).
Run: python -m pytest -q tests/test_pack.py"""
import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

import common
import shortcuts
import config
import da3po
from tests import harness
import modeling
from tests.conftest import ROOT


@pytest.fixture
def models(float64_model):
    model, tok = float64_model
    return model, harness.ref_model_of(model), tok.pad_token_id


def _update(model, ref_model, case, pad_id, pack: bool, every: bool = False):
    """The case's updates through the real pipeline with --pack on or off (`every`: every micro-batch packed, not
    only those where packing runs fewer positions than a group's prompt once)."""
    case = {**case, "flags": {**case["flags"], "pack": pack, "logprob_path": "shortcuts"}}
    with harness.every_micro_batch_packed(model, ref_model) if every else contextlib.nullcontext():
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
    """Packed and padded micro-batches: the same loss and gradient (float64), and both equal the reference; packed
    where it runs fewer positions (the default), and every micro-batch packed."""
    model, ref_model, pad_id = models
    fixed = dict(fixed)
    case = harness.random_case(fixed.pop("seed"), model, fixed.pop("script"), **fixed)
    padded = _update(model, ref_model, case, pad_id, False)
    for every in (False, True):
        packed = _update(model, ref_model, case, pad_id, True, every)
        loss, grad, scale = _gaps(padded, packed)
        assert loss <= harness.TOL * max(1.0, max(abs(r["loss"]) for r in padded)) and grad <= harness.TOL * scale
        assert not harness.failures(harness.compare(model, ref_model, case, packed))


def _one_group(lengths, prompt=(12, 13, 14)):
    ids, attn, _ = common.pad_prompt_completion([list(prompt)] * len(lengths),
                                                [[20 + i] * n for i, n in enumerate(lengths)], 0, min_width=2)
    return ids, attn, torch.zeros(len(lengths), dtype=torch.long)


def test_one_token_completions_keep_the_forward_count(float64_model):
    """Completions of one token (and none) leave nothing of theirs to run but their prompt: the packed forward is
    still one forward (lockstep: a rank's forward count never depends on its data), and the log-probs are the padded
    path's."""
    model, _ = float64_model
    ids, attn, groups = _one_group([1, 1, 0])
    calls = []
    handle = model.register_forward_hook(lambda *args: calls.append(1))
    try:
        T = attn.shape[1] - 3
        packed = shortcuts.token_logprobs(model, ids, attn, T, pack=True)[0]  # (rows whole: packing runs fewer)
        assert len(calls) == 1
        padded = shortcuts.token_logprobs(model, ids, attn, T, groups=groups)[0] * attn[:, 3:]
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
    attn2 = torch.cat([attn, attn])
    base = shortcuts.token_logprobs(model, ids2, attn2, 5, pack=True)[0]
    changed = ids2.clone()
    changed[1, 3:6] = 30  # row 1's completion
    changed[2:, :3] = 31  # group 1's prompt
    moved = shortcuts.token_logprobs(model, changed, attn2, 5, pack=True)[0]
    assert torch.equal(base[0], moved[0])  # its prompt and its completion as they were
    assert not torch.equal(base[2], moved[2]) and not torch.equal(base[1], moved[1])


def test_pack_refusal_names_what_does_not_pack(float64_model):
    """transformers packs under flash attention and flex attention anywhere, under sdpa and eager on a CPU only (on a
    GPU they would get a dense mask per packed row); the verdict comes from the model, the config and the training
    device (the same on every rank), said once at start-up. The training device, not the parameters': under
    --cpu_offload the shards sit on the host (here: a model on the CPU) while the forwards run on the GPU."""
    model, _ = float64_model
    cpu, gpu = torch.device("cpu"), torch.device("cuda")  # (naming a device needs no GPU)
    assert shortcuts.pack_refusal(model, cpu) == ""
    for implementation in ("flash_attention_2", "flex_attention"):
        model.config._attn_implementation = implementation
        assert shortcuts.pack_refusal(model, cpu) == "" and shortcuts.pack_refusal(model, gpu) == ""
    model.config._attn_implementation = "sdpa"
    refusal = shortcuts.pack_refusal(model, gpu)
    assert "dense mask" in refusal and "on cuda" in refusal and "flash_attention_2" in refusal
    assert next(model.parameters()).device == cpu  # the parameters' device did not decide it
    assert shortcuts.pack_refusal(model.to("meta"), cpu) == ""
    model.config._attn_implementation = "paged|eager"
    assert "paged|eager" in shortcuts.pack_refusal(model, cpu)


def test_start_up_check_compares_packed_and_padded(float64_model):
    model, _ = float64_model
    shortcuts.check_logprob_paths(model, config.TrainConfig(pack=True))
    assert model.pack_refusal == ""


def test_forward_tokens_count_what_the_forwards_run(float64_model):
    """perf/pad_frac's counts: one group, a prompt of 3, completions of 5, 3 and 1 tokens (T = 5)."""
    model, _ = float64_model
    ids, attn, groups = _one_group([5, 3, 1])
    assert shortcuts.forward_tokens(model, attn, 5) == (3 * 8, 3 * 3 + 6)  # rows whole, padded
    assert shortcuts.forward_tokens(model, attn, 5, groups) == (3 + 3 * 4, 3 + 4 + 2)  # the prompt once, padded
    # packed: each row's tokens but its last, 7, 5 and 3, in rows of 7, 8, 10, 12 or 14 (first fit, longest first):
    # 21, 16, 20, 24, 28 positions: rows [7], [5, 3] of 8 hold 15 tokens in the fewest; under a kernel that reads
    # boundaries, one row of 15
    assert shortcuts.forward_tokens(model, attn, 5, pack=True) == (2 * 8, 15)
    # where the prompt could run once, packing only where it runs fewer positions: here 15 < 16, padded
    assert shortcuts.forward_tokens(model, attn, 5, groups, pack=True) == (15, 9)
    model.config._attn_implementation = "flash_attention_2"
    assert shortcuts.forward_tokens(model, attn, 5, pack=True) == (15, 15)


def test_packing_where_it_runs_fewer_positions(float64_model):
    """--pack where the padded path would run a group's prompt once: a micro-batch packs only if that runs fewer
    positions (one long completion and short ones: the padding packing saves outweighs the prompt's repeats), and
    the two forwards of the prompt once otherwise."""
    model, _ = float64_model
    calls = []
    handle = model.register_forward_hook(lambda *args: calls.append(1))
    try:
        for lengths, packs in (([9, 1, 1, 1], True), ([5, 3, 1], False)):
            ids, attn, groups = _one_group(lengths)
            T = attn.shape[1] - 3
            run, _ = shortcuts.forward_tokens(model, attn, T, groups, pack=True)
            padded = shortcuts.forward_tokens(model, attn, T, groups)[0]
            assert (run < padded) == packs and (run == padded) != packs
            calls.clear()
            logp = shortcuts.token_logprobs(model, ids, attn, T, groups=groups, pack=True)[0] * attn[:, 3:]
            assert len(calls) == (1 if packs else 2)
            assert (logp - shortcuts.token_logprobs(model, ids, attn, T)[0] * attn[:, 3:]).abs().max() <= 1e-12
    finally:
        handle.remove()


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
            logp = shortcuts.token_logprobs(model, ids, attn, 5, chunk_tokens=chunk, groups=groups, pack=pack)[0]
        finally:
            handle.remove()
        logp = logp * attn[:, -5:]
        (logp * torch.arange(1, 6)).sum().backward()
        results.append((logp, [p.grad.clone() for p in model.parameters()], len(calls)))
    (padded, grad_padded, n_padded), (packed, grad_packed, n_packed) = results
    assert n_padded == n_packed == 1
    assert (packed - padded).abs().max().item() <= 1e-12
    assert max((a - b).abs().max().item() for a, b in zip(grad_padded, grad_packed)) <= 1e-10


def test_eager_packed_equals_sdpa_packed(float64_model, monkeypatch):
    """eager and sdpa read transformers' block-causal mask of the packed rows: the same log-probs. eager computes
    its softmax in float32 even on float64 (a gap of ~1e-6 that depends on the CPU's kernels: 1.2e-6 under
    ATEN_CPU_CAPABILITY=avx2); here it keeps the input's dtype, so the two agree to float64's rounding."""
    softmax = torch.nn.functional.softmax
    monkeypatch.setattr(torch.nn.functional, "softmax", lambda x, dim=None, dtype=None: softmax(x, dim=dim))
    model, _ = float64_model
    ids, attn, _ = _one_group([5, 3, 1])
    other, other_attn, _ = _one_group([2, 4], prompt=(15, 16))
    width = ids.shape[1]
    ids = torch.cat([ids, torch.nn.functional.pad(other, (width - other.shape[1], 0))])
    attn = torch.cat([attn, torch.nn.functional.pad(other_attn, (width - other.shape[1], 0))])
    sdpa = shortcuts.token_logprobs(model, ids, attn, 5, pack=True)[0]
    model.config._attn_implementation = "eager"
    eager = shortcuts.token_logprobs(model, ids, attn, 5, pack=True)[0]
    assert (sdpa - eager).abs().max().item() <= 1e-12


# -----------------------------------------------------------------------------------------------------------------
# Other families, sliding windows included: the packed path under the default flags against each row's own forward

WINDOW = 12  # longer than the start-up check's rows once were (10 tokens: a window as long passed it)


def _windowed_batch():
    """Two groups whose rows outgrow a 12-token window: prompts of 9 and 4 tokens, completions of 30, 3, 22 and 40, 1
    tokens."""
    g = torch.Generator().manual_seed(0)
    groups = [{"prompt_ids": torch.randint(10, 40, (k,), generator=g).tolist(),
               "completions": [torch.randint(10, 40, (n,), generator=g).tolist() for n in lengths],
               "reward": [0.0] * len(lengths), "correct": [False] * len(lengths)}
              for k, lengths in ((9, (30, 3, 22)), (4, (40, 1)))]
    return groups, common.make_batch(groups, 0)


def _own_logprobs(model, groups):
    """Each row's completion log-probs from its own forward: one sequence, no padding, no packing."""
    out = []
    for g in groups:
        for c in g["completions"]:
            ids = torch.tensor(g["prompt_ids"] + c)
            logits = model(input_ids=ids[None], use_cache=False).logits[0, len(g["prompt_ids"]) - 1:-1]
            out.append(logits.log_softmax(-1).gather(-1, ids[len(g["prompt_ids"]):, None])[:, 0])
    return out


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "grad_checkpointing"])
@pytest.mark.parametrize("family", harness.WINDOWED)
def test_sliding_window_families_get_each_rows_own_logprobs(family, checkpointing):
    """Mistral, Mixtral, Phi-3, StarCoder2 (their window in config.sliding_window), Qwen3-MoE and Qwen2 with their
    window on, Gemma 2: under the default flags (--pack, --logprob_chunk 1024), with and without
    --grad_checkpointing, after the start-up check, the trainer's log-probs and gradient are those of each row's own
    forward, in float64, on rows up to 44 tokens against a window of 12 (which moves them by far more: checked)."""
    model = harness.family_model(family, WINDOW)
    cfg = da3po.Config(grad_checkpointing=checkpointing)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    shortcuts.check_logprob_paths(model, cfg)
    assert model.pack_refusal == ""  # packed: no family here is refused
    groups, batch = _windowed_batch()
    rows, mb = next(common.micro_batches(batch, torch.arange(len(batch["mask"])), cfg.micro_batch_size))
    assert len(rows) == 5
    logp = common.batch_logprobs(model, mb, cfg)[0]
    weights = torch.linspace(-1, 1, logp.shape[1], dtype=logp.dtype)
    (logp * mb["mask"] * weights).sum().backward()
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    own = _own_logprobs(model, groups)
    sum((lp * weights[:len(lp)]).sum() for lp in own).backward()
    theirs = [p.grad.clone() for p in model.parameters()]
    tol = harness.FAMILY_TOL.get(family, harness.TOL)
    gap = max((logp[i, :len(lp)] - lp).abs().max().item() for i, lp in enumerate(own))
    assert gap <= tol * max(lp.abs().max().item() for lp in own), gap
    for a, b in zip(ours, theirs):
        assert (a - b).abs().max() <= tol * max(g.abs().max() for g in theirs)
    with torch.no_grad():  # the window bites: without it, the rows' own log-probs are others
        wide = _own_logprobs(harness.family_model(family, window=1000), groups)
    assert max((a - b).abs().max().item() for a, b in zip(own, wide)) > 1e-2


def test_a_flash_style_kernel_gets_one_row_and_no_mask(monkeypatch):
    """The GPU path on a CPU: under flash attention transformers hands the attention no mask at all, and our packed
    micro-batch comes as one row whose position_ids restart at 0 for each sequence (flash's variable-length kernel
    takes its sequence boundaries from them). A stand-in for flash_attention_2 that records what it gets and attends
    within each sequence, window included, gives the padded path's log-probs."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    seen = []

    def varlen(module, query, key, value, attention_mask, position_ids=None, sliding_window=None, **kwargs):
        seen.append((attention_mask, tuple(query.shape[:1]), position_ids))
        starts = (position_ids[0] == 0).nonzero()[:, 0].tolist() + [query.shape[2]]
        out = []
        for a, b in zip(starts, starts[1:]):
            i, j = torch.arange(b - a)[:, None], torch.arange(b - a)[None]
            mask = (j <= i) & ((i - j < sliding_window) if sliding_window else True)  # (within one sequence)
            out.append(sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                              mask[None, None], **kwargs)[0])
        return torch.cat(out, 1), None
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", varlen)
    model = harness.family_model("mistral", WINDOW)
    groups, batch = _windowed_batch()
    T = batch["mask"].shape[1]
    padded = shortcuts.token_logprobs(model, batch["input_ids"], batch["attention_mask"], T)[0] * batch["mask"]
    model.config._attn_implementation = "flash_attention_2"
    packed = shortcuts.token_logprobs(model, batch["input_ids"], batch["attention_mask"], T, pack=True)[0]
    assert seen and all(mask is None and rows == (1,) for mask, rows, _ in seen)
    starts = (seen[0][2][0] == 0).sum().item()
    assert starts == 5  # five sequences in the one row
    assert (packed - padded).abs().max().item() <= harness.TOL * padded.abs().max().item()


IMPORTS = """
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
registries = (ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS)
before = [(dict(r._global_mapping), dict(r._local_mapping)) for r in registries]
import common, da3po, daro, engine, modeling
after = [(dict(r._global_mapping), dict(r._local_mapping)) for r in registries]
print("same" if before == after else f"changed: {before} -> {after}")
"""


def test_importing_the_project_leaves_transformers_attention_as_it_was():
    """No change to another library's state at import: transformers' attention and mask registries hold the same
    functions under the same names after importing every project module (in a fresh interpreter)."""
    r = subprocess.run([sys.executable, "-c", IMPORTS], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "same", r.stdout + r.stderr[-2000:]


DIST_CHECKS = r"""
import json
import torch
from torch.distributed.tensor import DTensor
import bookkeeping, config, engine, modeling, ranks
d = ranks.setup_dist("cpu")
torch.manual_seed(0)
# --pack, --logprob_chunk 1024 by default; a KL anchor; the shortcuts checked
cfg = config.TrainConfig(dtype="bfloat16", kl_coef=0.1, logprob_path="shortcuts")
seen, load_model = [], modeling.load_model


def watched(model):
    # each forward the start-up checks run, as the model sees it; packed, wrong on rank 1 only
    real_forward = model.forward

    def forward(*args, **kwargs):
        out = real_forward(*args, **kwargs)
        packed = kwargs.get("attention_mask") is None and kwargs.get("use_cache") is False
        seen.append(dict(sharded=type(model).__name__.startswith("FSDP"), grad=torch.is_grad_enabled(),
                         autocast=torch.is_autocast_enabled("cpu"), packed=packed, backward=False))
        if out.logits.requires_grad:
            record = seen[-1]
            out.logits.register_hook(lambda g: record.update(backward=True))
        if packed and d.rank == 1:
            out.logits = out.logits * 1.5
        return out
    model.forward = forward
    return model


ARITH_MODEL = config.ARITH_MODEL
# the KL anchor prepare_models loads (bookkeeping's own name for the function)
bookkeeping.load_model = lambda *a, **k: (watched(load_model(*a, **k)[0]), None)
model, tok = load_model(ARITH_MODEL)
rollout = engine.HFRollout(watched(model), tok, d, cfg.dtype)
model, ref_model = bookkeeping.prepare_models(model, rollout, ARITH_MODEL, cfg, d)
# FSDP2 swaps a gathered unit's parameters for plain tensors; a sharded one's are DTensors
gathered = [sum(not isinstance(p, DTensor) for p in m.parameters()) for m in (model, ref_model)]
with open(f"{out}/rank{{d.rank}}.json", "w") as f:  # (one file each: the ranks' prints would interleave)
    json.dump(dict(rank=d.rank, seen=seen, pack_refusal=model.pack_refusal, ref_refusal=ref_model.pack_refusal,
                   gathered=gathered), f)
ranks.cleanup_dist()
ranks.end_process()
"""


def test_start_up_checks_run_where_training_runs_and_agree(tmp_path):
    """Under torchrun (2 gloo ranks, FSDP2): every forward of prepare_models' checks runs on the sharded models,
    under the bfloat16 autocast of --dtype bfloat16, the trained model's with gradients and a backward through them.
    A packed path that is wrong on rank 1 only is refused on both ranks: for the KL anchor (no gradient: only rank 1
    sees its log-probs off) rank 0 says it failed on another rank. The verdict is all-reduced before any rank acts on
    it, so the ranks' forward paths, and their collectives, stay the same. After the checks no parameter of either
    model stays gathered (the KL anchor's no-grad forwards would leave its root unit so until the first step)."""
    script = tmp_path / "checks.py"
    script.write_text(DIST_CHECKS.format(out=tmp_path))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    results = {rank: json.load(open(tmp_path / f"rank{rank}.json")) for rank in (0, 1)}
    assert sorted(results) == [0, 1]
    for x in results.values():
        assert x["seen"] and all(s["sharded"] and s["autocast"] for s in x["seen"]), x["seen"]
        assert any(s["grad"] and s["backward"] for s in x["seen"]) and any(s["packed"] for s in x["seen"])
        assert x["pack_refusal"]  # (its gradient, all-reduced, is off on both ranks)
        assert x["gathered"] == [0, 0], x["gathered"]  # (policy, KL anchor)
    assert results[0]["ref_refusal"] == "it failed on another rank"
    assert results[1]["ref_refusal"].startswith("log-probs off by")
    assert r.stdout.count("note: --pack:") == 2  # rank 0's line, for each model


@pytest.mark.parametrize("implementation", ["flash_attention_2", "no_such_attention"])
def test_an_attention_transformers_cannot_use_here_exits_2(float64_model, implementation, capsys):
    """--attn_implementation: one transformers cannot use on this machine (flash attention without its package or a
    GPU, an unknown name) stops the run with one line naming the flag, before anything trains."""
    model, _ = float64_model
    with pytest.raises(SystemExit) as exit_info:
        modeling.set_attention(model, implementation)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: --attn_implementation {implementation}: transformers cannot use it here")
    assert model.config._attn_implementation == "sdpa"
