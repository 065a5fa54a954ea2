"""
Look up when needed: the log-prob shortcuts, a room of their own beside the plain path.
common.token_logprobs computes log pi with one padded forward; at scale that costs time and memory,
so --logprob_path shortcuts (what a model of your own runs by default) computes the same numbers
with three shortcuts, each checked at start-up against each row's own forward:
  - a group's prompt once: its KV cache indexed out to the group's rows (_predicting_outputs);
  - packed rows: transformers' padding-free path, no padding positions (_packed_outputs);
  - the output layer in chunks, recomputed in the backward: no (B, T, V) logits (_chunked_logprobs).
Also here: micro-batches by a token budget, and ranks dealt as many tokens (--micro_batch_tokens).
common.py calls this file only under those flags; nothing here imports common. tests/test_pack.py,
tests/test_heads.py and tests/test_chunked_logprobs.py hold each shortcut equal to the plain path;
tests/test_shortcut_checks.py holds the start-up checks.
"""
import contextlib
import math

import torch
import torch.utils.checkpoint

from modeling import OUTSIDE_NUCLEUS, autocast, model_name, nucleus, positions, reshard
from ranks import all_reduce_max, all_reduce_sum, die, print0


# --------------------------------------------------------------------------------------------------
# Any family's output layer, so that log-probs computed a chunk of positions at a time are its
# forward's own.
def _logprobs_of_logits(logits, targets, temperature: float, with_entropy: bool,
                        top_p: float = 1.0):
    """Logits (B, t, V) -> log-probs (B, t) of the targets at this temperature, and a second
    (B, t) output:
      with_entropy   the token entropy, with its gradient
      top_p < 1      the targets' log-probs renormalised over the nucleus, without gradient (what a
                     sampler returns for what it drew from it: sample_token, vLLM)
      else           None
    """
    # softmax in float32 at least (float64 stays float64)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if temperature != 1.0:  # the sampling distribution was at this temperature (as verl does)
        logits = logits / temperature
    lse = logits.logsumexp(-1)  # (B, t)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # (B, t)
    if with_entropy:  # (differentiable: --entropy_coef's bonus)
        # H = lse - sum_v p_v logit_v, a batched dot: one (B, t, V) tensor less than p * logits
        expected_logit = logits.softmax(-1).unsqueeze(-2) @ logits.unsqueeze(-1)
        return logp, lse - expected_logit[..., 0, 0]
    if top_p < 1:
        with torch.no_grad():
            nucleus_logp = nucleus(logits.log_softmax(-1), top_p).log_softmax(-1)  # (B, t, V)
            target_logp = nucleus_logp.gather(-1, targets[..., None])[..., 0]
            return logp, target_logp.clamp(min=OUTSIDE_NUCLEUS)
    return logp, None


def _softcap(logits, cap):
    """Gemma's final logit soft-capping, as its forwards write it (cap None: none)."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _vocab_cut(logits, size):
    """Inkling's cut of its padded vocabulary (size None: none)."""
    return logits if size is None or size >= logits.shape[-1] else logits[..., :size]


# What a family's forward does after its output layer, from a survey of every ...ForCausalLM in
# transformers 5.19 (tests/test_heads.py checks each). By family, not config attribute: Granite
# divides its logits by `logits_scaling`, HyperCLOVAX multiplies them by it, MiniCPM3 divides its
# output layer's input by it (no entry: that input is recorded). Any other change is refused at
# start-up (check_chunked_logprobs).
_LOGIT_TRANSFORMS = {
    **dict.fromkeys(
        ["gemma2", "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text",
         "vaultgemma", "nanochat"],
        lambda model, x: _softcap(x, model.config.final_logit_softcapping)),
    **dict.fromkeys(
        ["gemma3n", "gemma4", "gemma4_unified"],  # multimodal: ...ForConditionalGeneration
        lambda model, x: _softcap(x, model.config.get_text_config().final_logit_softcapping)),
    "recurrent_gemma": lambda model, x: _softcap(x, model.config.logits_soft_cap),
    **dict.fromkeys(
        ["cohere", "cohere2", "cohere2_moe", "cohere_compass_text", "cohere_compass"],
        lambda model, x: x if model.logit_scale is None else x * model.logit_scale),
    **dict.fromkeys(
        ["granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared",
         "granitemoehybrid"],
        lambda model, x: x / model.config.logits_scaling),
    "hyperclovax": lambda model, x: x * model.config.logits_scaling,
    "falcon_h1": lambda model, x: x * model.model.lm_head_multiplier,
    "inkling_text": lambda model, x: _vocab_cut(x, model.config.unpadded_vocab_size),
    **dict.fromkeys(["blt", "mllama_text_model", "nemotron_h"], lambda model, x: x.float()),
}


def head_logits(model, head, hidden):
    """The logits `model`'s forward returns for `hidden` (B, t, H), the input of its output layer
    `head`: the layer (the module, so a wrapped or LoRA'd head works too), then the family's
    _LOGIT_TRANSFORMS entry."""
    transform = _LOGIT_TRANSFORMS.get(getattr(model.config, "model_type", None))
    logits = head(hidden)
    return logits if transform is None else transform(model, logits)


def _chunk_logprobs(model, head, hidden, targets, temperature: float, with_entropy: bool,
                    top_p: float):
    """head_logits and _logprobs_of_logits on a chunk of positions: hidden (B, t, H) -> (B, t)."""
    logits = head_logits(model, head, hidden)
    return _logprobs_of_logits(logits, targets, temperature, with_entropy, top_p)


@contextlib.contextmanager
def _head_forward(head, forward):
    """Inside, head(x) runs forward(x): an instance attribute shadows the class's forward
    (one already there is put back after)."""
    saved = head.__dict__.get("forward")
    head.forward = forward
    try:
        yield
    finally:
        if saved is None:
            del head.forward
        else:
            head.forward = saved


@contextlib.contextmanager
def _head_inputs_as_logits(model, head):
    """Inside, the model's forward returns its output layer's input (B, t, H) as its logits.
    The head records its input and returns an empty (B, t, 0) placeholder, on which what follows
    the head costs nothing; a forward hook run before FSDP2's own (which hooks its pre-backward on
    it) puts the input in `logits`."""
    inputs = []

    def record(hidden):
        inputs.append(hidden)
        return hidden.new_empty((*hidden.shape[:-1], 0))

    def swap(module, args, output):
        n = len(inputs)
        if n != 1:
            inputs.clear()
            raise RuntimeError(f"{model_name(model)}'s forward called its output layer "
                               f"{n} times, not once: its log-probs cannot be computed in chunks "
                               "(--logprob_chunk 0 computes them whole)")
        output.logits = inputs.pop()
        return output

    handle = model.register_forward_hook(swap, prepend=True)
    try:
        with _head_forward(head, record):
            yield
    finally:
        handle.remove()


# --------------------------------------------------------------------------------------------------
# Log-probs of completion tokens under pi or pi_old: a group's prompt runs once, the output layer
# in chunks.
def _shares_prompts(model, groups) -> bool:
    """Whether a group's prompt runs once (_predicting_outputs): the model and config decide,
    never data."""
    if groups is None or not getattr(model, "shares_prompts", True):
        return False
    # a checkpointed model drops its cache in training mode
    checkpointed = model.training and getattr(model, "is_gradient_checkpointing", False)
    return not checkpointed


def _group_rows(groups):
    """(inverse (B,): each row's group as 0..U-1, first (U,): a row of each group)."""
    inverse = torch.unique(groups, return_inverse=True)[1]
    num_groups = int(inverse.max()) + 1
    rows = torch.arange(len(groups), device=groups.device)
    first = torch.zeros(num_groups, dtype=torch.long, device=groups.device)
    first.scatter_(0, inverse, rows)
    return inverse, first


def _predicting_outputs(model, input_ids, attention_mask, T: int, groups=None):
    """The model's outputs (logits, or hidden states while the output layer is captured) at the T
    positions that predict each row's last T tokens: (B, T, .), position_ids from the attention
    mask (left padding shifts none).

    With `groups` (B,) each group's prompt runs once, its KV cache indexed out to its rows (an
    autograd op: every row's gradient flows back into the one prompt forward), and the completions
    run on it: the same values and gradients as rows run whole. A checkpointed model runs rows
    whole, as does one whose cache cannot be indexed out (model.shares_prompts).
    Lockstep: the path, and so the sharded model's forward count, depends on model and config,
    never data.
    """
    position_ids = positions(attention_mask)
    if not _shares_prompts(model, groups):
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    logits_to_keep=T + 1)
        return out.logits[:, :-1]
    assert T >= 2, "shared-prompt forwards need T >= 2 completion columns (make_batch pads to 2)"
    P = input_ids.shape[1] - T
    inverse, first = _group_rows(groups)
    # outputs (U, 1, .) at each group's last prompt position
    prompt = model(input_ids=input_ids[first, :P], attention_mask=attention_mask[first, :P],
                   position_ids=position_ids[first, :P], use_cache=True, logits_to_keep=1)
    cache = prompt.past_key_values
    # (U, ...) -> (B, ...): each row gets its prompt's keys and values
    cache.batch_select_indices(inverse)
    rest = model(input_ids=input_ids[:, P:-1], attention_mask=attention_mask[:, :-1],
                 position_ids=position_ids[:, P:-1], past_key_values=cache, use_cache=True).logits
    # (B, T, .): the last prompt position, then completion tokens 1..T-1
    return torch.cat([prompt.logits[inverse], rest], 1)


def _chunked_logprobs(model, forward, targets, chunk_tokens: int, temperature: float,
                      with_entropy: bool, top_p: float):
    """_logprobs_of_logits of forward()'s outputs, with the output layer, the log-softmax and the
    entropy run on chunks of about chunk_tokens tokens (recomputed in the backward): peak memory
    grows with chunk_tokens x V, not with the micro-batch. The same values and gradients."""
    head = model.get_output_embeddings()
    with _head_inputs_as_logits(model, head):
        hidden = forward()  # (B, T, H) or (1, N, H)
    width = max(1, chunk_tokens // targets.shape[0])  # positions per chunk
    logps = []
    seconds = []  # the chunks' entropies, or nucleus log-probs, or Nones
    for s in range(0, targets.shape[1], width):
        args = (model, head, hidden[:, s:s + width], targets[:, s:s + width], temperature,
                with_entropy, top_p)
        if torch.is_grad_enabled():
            # recompute this chunk's logits in the backward, not keep them
            logp, second = torch.utils.checkpoint.checkpoint(_chunk_logprobs, *args,
                                                             use_reentrant=False)
        else:
            logp, second = _chunk_logprobs(*args)
        logps.append(logp)
        seconds.append(second)
    logp = torch.cat(logps, 1)
    second = torch.cat(seconds, 1) if with_entropy or top_p < 1 else None
    return logp, second


def _unpack(x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Packed outputs (1, N) back to (B, T), 0 where `where` (B, T) is False."""
    return x.new_zeros(where.shape).masked_scatter(where, x[0])


def token_logprobs(model, input_ids, attention_mask, num_completion_tokens: int,
                   temperature: float = 1.0, with_entropy: bool = False, chunk_tokens: int = 0,
                   groups=None, top_p: float = 1.0, pack: bool = False):
    """log pi(token) (B, T) for the last T tokens of each row, and _logprobs_of_logits' second
    (B, T) output (the entropy, with its gradient; nucleus log-probs without; or None).

    groups (B,): rows sharing a prompt run it once (padded rows only).
    pack: on a model that packs (pack_refusal), one forward runs every row without padding
      (_packed_outputs) where that runs fewer positions than the padded path (_packs); both
      outputs are then 0 at padded positions.
    chunk_tokens > 0: the output layer runs on chunks of that many tokens (_chunked_logprobs;
      docs/gpu.md, "Memory": why; tests/test_heads.py: the same values, every family).
    """
    T = num_completion_tokens
    pack = _packs(model, attention_mask, T, groups, pack)
    if pack:
        # outputs (1, N, .) at the completions' N tokens, scattered back to (B, T) at the end
        where = attention_mask[:, -T:].bool()
        targets = input_ids[:, -T:][where][None]  # (1, N)
    else:
        targets = input_ids[:, -T:]  # (B, T)

    def forward():
        if pack:
            return _packed_outputs(model, input_ids, attention_mask, T)
        return _predicting_outputs(model, input_ids, attention_mask, T, groups)

    if chunk_tokens <= 0 or targets.numel() <= chunk_tokens:
        # small enough: the whole logits at once
        logp, second = _logprobs_of_logits(forward(), targets, temperature, with_entropy, top_p)
    else:
        logp, second = _chunked_logprobs(model, forward, targets, chunk_tokens, temperature,
                                         with_entropy, top_p)
    if not pack:
        return logp, second
    return _unpack(logp, where), None if second is None else _unpack(second, where)


# --------------------------------------------------------------------------------------------------
# Packed forwards (--pack): transformers' own padding-free path. A micro-batch's rows, each its
# tokens but its last, go one after another with position_ids that restart at 0 for each, with no
# attention mask and no cache: transformers finds the sequences in the position_ids and keeps them
# apart itself, sliding windows included. Kernels that read the boundaries (flash and flex
# attention) take the micro-batch as one row; sdpa and eager get a dense mask per row, so there the
# sequences are dealt into rows of up to twice the longest one, on a CPU only (pack_refusal).
# docs/gpu.md, "Packed micro-batches" and "A group's prompt once, or packed rows": the details.
# transformers builds a (rows, 1, W, W) mask for packed rows under these
DENSE_MASK_ATTENTION = ("sdpa", "eager")


def _one_row(model) -> bool:
    """Whether the model's attention takes a packed micro-batch as one row, with no dense mask."""
    from transformers.utils.generic import is_flash_attention_requested
    if is_flash_attention_requested(model.config):
        return True
    return model.config._attn_implementation == "flex_attention"


def pack_refusal(model, device: torch.device) -> str:
    """Why `model` does not run packed forwards on the training `device`, or '' if it does, from
    its attention implementation and that device (the same on every rank): flash attention and
    flex attention pack anywhere; sdpa and eager on a CPU only, since on a GPU their masks would
    be dense (L x L at --micro_batch_tokens 24576). The device the forwards run on, not the
    parameters': under --cpu_offload the shards sit on the host and the forwards run on the GPU."""
    implementation = model.config._attn_implementation
    if _one_row(model):
        return ""
    if implementation not in DENSE_MASK_ATTENTION:
        return (f"transformers packs no sequences under its attention implementation "
                f"{implementation!r}")
    if device.type != "cpu":
        return (f"{implementation} would build a dense mask for packed rows on {device.type}; "
                f"--attn_implementation flash_attention_2 or flex_attention packs without one")
    return ""


def _packs(model, attention_mask, T: int, groups, pack: bool) -> bool:
    """Whether token_logprobs packs this micro-batch: asked, on a model that packs (_runs_packed),
    and, where the padded path would run a group's prompt once (_shares_prompts), only if packing
    runs fewer tokens (each row's but its last; the filler not counted) than the padded path runs
    positions. The counts are summed over ranks first, so that every rank takes the same path
    (lockstep). docs/gpu.md, "A group's prompt once, or packed rows": what each demo takes."""
    if not _runs_packed(model, pack, attention_mask.device):
        return False
    if not _shares_prompts(model, groups):
        return True
    B, width = attention_mask.shape
    completions = attention_mask[:, width - T:].sum(-1)  # (B,)
    # every row's tokens but its last
    tokens = int(attention_mask.sum()) - int((completions > 0).sum())
    # _padded_tokens' count, a group's prompt once
    padded = len(torch.unique(groups)) * (width - T) + B * (T - 1)
    counts = torch.tensor([tokens, padded], dtype=torch.float64)
    tokens, padded = all_reduce_sum(counts).tolist()
    return tokens < padded


def _runs_packed(model, pack: bool, device: torch.device) -> bool:
    """Whether token_logprobs runs packed on `device` (the batch's): asked, on a model that packs
    (the start-up verdict, model.pack_refusal, once check_logprob_paths has run;
    pack_refusal before)."""
    if not pack:
        return False
    refusal = getattr(model, "pack_refusal", None)
    if refusal is None:
        refusal = pack_refusal(model, device)
    return not refusal


def _first_fit(sizes: list[int], order: list[int], W: int) -> tuple[list[int], list[int]]:
    """Sequences of `sizes` dealt, in `order`, each into the first packed row of width W with room.
    Returns (each sequence's start in the flattened rows, each row's tokens)."""
    used = []
    start = [0] * len(sizes)
    for i in order:
        r = next((r for r, n in enumerate(used) if n + sizes[i] <= W), len(used))
        if r == len(used):
            used.append(0)
        start[i] = r * W + used[r]
        used[r] += sizes[i]
    return start, used


def _packed_layout(model, attention_mask, T: int):
    """Where each row's tokens go in the packed input (R, W).

    Returns keep (B, width): the tokens a row runs, all but its last completion token;
    at (B, width): each kept token's index in the flattened input (R * W);
    used (R,): the tokens in each packed row, whose rest is filler; and W.
    One row (W = every kept token) for a kernel that reads boundaries (_one_row); else rows of 1 to
    2 times the longest sequence, the width with the fewest positions, filled first fit, longest
    first. Example: sequences of 5, 4, 3, 2 tokens under sdpa: W = 7, rows [5, 2] and [4, 3].
    """
    B, width = attention_mask.shape
    device = attention_mask.device
    keep = attention_mask.bool().clone()  # (a bool mask's .bool() is the mask itself)
    lengths = attention_mask[:, width - T:].sum(-1, keepdim=True)  # (B, 1): completion tokens
    keep[:, width - T:] = torch.arange(T, device=device) < lengths - 1
    sizes = keep.sum(-1).tolist()
    order = sorted(range(B), key=lambda i: -sizes[i])  # (sorted is stable: ties keep row order)
    if _one_row(model):
        W = sum(sizes)
    else:
        # of 1, 1.25, ... 2 x the longest, the width whose rows hold the fewest positions
        widths = {min(sum(sizes), max(sizes) * k // 4) for k in range(4, 9)}
        W = min(sorted(widths), key=lambda w: len(_first_fit(sizes, order, w)[1]) * w)
    start, used = _first_fit(sizes, order, W)
    # (B, width), where keep
    at = torch.tensor(start, device=device)[:, None] + keep.long().cumsum(-1) - 1
    return keep, at, torch.tensor(used, device=device), W


def _packed_outputs(model, input_ids, attention_mask, T: int):
    """_predicting_outputs' outputs, packed: (1, N, .) at the positions that predict each row's
    completion tokens (N = their number, rows in order), from one forward of every row's tokens but
    its last, whatever the data (lockstep). Filler after a packed row's sequences is a sequence of
    its own (positions from 0), seen by none. The same values and gradients as the padded
    path (tests/test_pack.py)."""
    keep, at, used, W = _packed_layout(model, attention_mask, T)
    R = len(used)
    P = attention_mask.shape[1] - T
    ids = input_ids[keep][:1].repeat(R * W)  # filler: a token of the batch (any token would do)
    ids[at[keep]] = input_ids[keep]
    # the filler's positions: 0, 1, ...
    position_ids = (torch.arange(W, device=ids.device) - used[:, None]).flatten()
    position_ids[at[keep]] = positions(attention_mask)[keep]
    # target t: the output at column P - 1 + t
    where = at[:, P - 1:-1][attention_mask[:, P:].bool()]
    out = model(input_ids=ids.view(R, W), position_ids=position_ids.view(R, W), use_cache=False,
                logits_to_keep=where if R == 1 else 0).logits  # (1, N, .) or (R, W, .)
    if R == 1:
        return out
    return out.flatten(0, 1)[where][None]


def forward_tokens(model, attention_mask, T: int, groups=None,
                   pack: bool = False) -> tuple[int, int]:
    """(positions token_logprobs' forwards run, those they need) for perf/pad_frac, in the layout it
    takes (_packs: under torchrun every rank must call this for every micro-batch,
    as token_logprobs)."""
    if _packs(model, attention_mask, T, groups, pack):
        keep, _, used, W = _packed_layout(model, attention_mask, T)
        return len(used) * W, int(keep.sum())  # the packed rows' positions, filler included
    return _padded_tokens(model, attention_mask, T, groups)


def _padded_tokens(model, attention_mask, T: int, groups=None) -> tuple[int, int]:
    """forward_tokens of the padded path. Rows whole: B x width, and every row's tokens but its
    last. A group's prompt once: U x prompt width + B x (T - 1), and each group's prompt plus each
    completion's tokens but its last."""
    B, width = attention_mask.shape
    completions = int((attention_mask[:, width - T:].sum(-1) - 1).clamp(min=0).sum())
    if not _shares_prompts(model, groups):
        return B * width, int(attention_mask[:, :width - T].sum()) + completions
    first = _group_rows(groups)[1]
    needed = int(attention_mask[first, :width - T].sum()) + completions
    return len(first) * (width - T) + B * (T - 1), needed


# --------------------------------------------------------------------------------------------------
# Start-up: each shortcut of token_logprobs checked where training runs (after sharding, on the
# training device, in the training dtype under autocast, with a backward where training runs one)
# against the path it stands in for; every rank runs the same forwards (lockstep) and each verdict
# is all-reduced before any rank acts on it. Then vLLM's calibration, and the KL anchor.
# docs/gpu.md, "Start-up checks": what is compared, and the tolerances.
def _agreed(why: str) -> str:
    """`why` ('' = passed) once every rank has passed or failed: a failure anywhere
    fails everywhere."""
    failed = all_reduce_max(torch.tensor(float(bool(why)))).item() > 0
    return (why or "it failed on another rank") if failed else ""


def _error(e: Exception) -> str:
    """An exception as one line: its type and its message's first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _probe_rows(model, device):
    """The rows the checks run: two groups, prompts of 4 tokens, completions of 8, 4, 1 and 3, 2
    tokens, right padded (with no left padding, padded rows differ from each row alone by rounding
    only). Packed under sdpa as [11, 7, 4], [6, 5] (one row under flash attention): sequences with
    tokens to score follow others, where a forward that mixes sequences shows. Ids come from the
    vocabulary's first 48 (a padded vocabulary's logits may be cut short: Inkling's).
    Returns (input_ids, attention_mask) (5, 12), T = 8, groups (5,).
    """
    vocab = min(model.get_input_embeddings().num_embeddings, 48)
    ids = 3 + (torch.arange(60, device=device).view(5, 12) * 7 + 1) % (vocab - 3)
    ids[1:3, :4] = ids[0, :4]  # a group's prompt: the same tokens
    ids[4, :4] = ids[3, :4]
    lengths = torch.tensor([12, 8, 5, 7, 6], device=device)[:, None]  # prompt + completion
    attn = (torch.arange(12, device=device) < lengths).long()
    groups = torch.tensor([0, 0, 0, 1, 1], device=device)
    return ids * attn, attn, 8, groups


def _gradient_sums(model) -> torch.Tensor:
    """Two numbers that a change of the gradient moves, sums of positive terms (no cancellation:
    they round to a few float32 roundings of themselves): the sum of its squares and of its
    absolute values, over all ranks (FSDP2's shards summed), in float64."""
    sums = torch.zeros(2, dtype=torch.float64, device=next(model.parameters()).device)
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        g = g.double()
        sums += torch.stack([(g * g).sum(), g.abs().sum()])
    return all_reduce_sum(sums.cpu())


def _probe(model, rows, dtype: str, device, alone: bool = False, **path):
    """One path of token_logprobs on the probe rows, where training runs (`alone`: each row by
    itself, unpadded). Every rank runs it (its collectives) and the gradient's all-reduce,
    whatever happened.

    Returns its log-probs (B, T) in float64, 0 off the completions, or the error it raised, as text;
    and _gradient_sums of sum_t t log p_t after a backward (None for a model that does not train).
    """
    ids, attn, T, _ = rows
    trains = any(p.requires_grad for p in model.parameters())
    lengths = attn[:, -T:].sum(-1).tolist()
    if alone:
        parts = [(i, attn[i].bool(), n) for i, n in enumerate(lengths) if n > 0]
    else:
        parts = [(None, None, T)]  # the rows together
    logp = torch.zeros(attn[:, -T:].shape, dtype=torch.float64, device=device)  # (B, T)
    try:
        for i, keep, n in parts:
            part = (ids, attn) if i is None else (ids[i, keep][None], attn[i, keep][None])
            with torch.set_grad_enabled(trains):
                with autocast(dtype, device):
                    out = token_logprobs(model, *part, n, **path)[0].double() * part[1][:, -n:]
                if trains:
                    (out * torch.arange(1, n + 1, device=device)).sum().backward()
            if i is None:
                logp[:, :n] = out.detach()
            else:
                logp[i, :n] = out.detach()
    except Exception as e:
        # any failure refuses the path (the same on every rank: same model, same rows)
        logp = _error(e)
    sums = _gradient_sums(model) if trains else None
    model.zero_grad(set_to_none=True)
    return logp, sums


def _gaps(probe, reference) -> tuple[float, float]:
    """The largest gap of two probes' log-probs, and of their gradient sums relative to
    the reference's."""
    logp = (probe[0] - reference[0]).abs().max().item()
    if reference[1] is None:
        return logp, 0.0
    relative = (probe[1] - reference[1]).abs() / reference[1].abs().clamp(min=1e-30)
    return logp, relative.max().item()


def _path_refusal(model, rows, dtype: str, device, reference, noise: tuple, **path) -> str:
    """'' if the path gives each row's own log-probs and gradient (`reference`) to within
    _tolerances, else why not. Agreed across ranks."""
    probe = _probe(model, rows, dtype, device, **path)
    if isinstance(probe[0], str):
        return _agreed(probe[0])
    logp, grad = _gaps(probe, reference)
    logp_tol, grad_tol = _tolerances(model, rows, dtype, reference, noise)
    why = ""
    if not logp <= logp_tol:  # (NaN fails too)
        why = f"log-probs off by {logp:.3g}"
    elif not grad <= grad_tol:
        why = f"gradient off by {grad:.3g} of itself"
    return _agreed(why)


def _tolerances(model, rows, dtype: str, reference, noise: tuple) -> tuple[float, float]:
    """How far a path's log-probs and gradient sums may sit from each row's own (`reference`):
    the sum of
      4 x `noise`  the padded rows' gaps from them (the kernels' rounding between two layouts);
      roundings    of the compute dtype (bf16 or fp16 under its autocast, else the weights',
                   float32 at least): 2 at the log-probs' scale, 8 of the gradient (float32's at
                   least: families round there, RMSNorm);
      the sums     behind them, accumulated in float32 (float64 for a float64 model): a random
                   walk of one rounding per term, at 4 standard deviations (_sums_per_forward
                   terms, twice as many for the gradient: forward and backward).
    The padded rows share most of their roundings with each row's own forward, so their gap
    alone can sit far below what another exact layout rounds to (docs/gpu.md, "Start-up checks").
    """
    if dtype in ("bfloat16", "float16"):
        compute = getattr(torch, dtype)
    else:
        compute = torch.promote_types(next(model.parameters()).dtype, torch.float32)
    eps = torch.finfo(compute).eps
    float32_eps = torch.finfo(torch.float32).eps
    sums_eps = torch.finfo(torch.promote_types(compute, torch.float32)).eps
    terms = _sums_per_forward(model, rows[0].shape[1])
    logp_scale = 1 + reference[0].abs().max().item()
    logp = 4 * noise[0] + (2 * eps + 4 * math.sqrt(terms) * sums_eps) * logp_scale
    grad = 4 * noise[1] + 8 * max(eps, float32_eps) + 4 * math.sqrt(2 * terms) * sums_eps
    return logp, grad


def _sums_per_forward(model, width: int) -> int:
    """About how many terms the sums behind one output of a forward add up: in each layer, over
    the hidden size, the MLP's inner size and the `width` positions.
    Example: the demo model (2 layers, 128 and 512 wide) on 12 positions: 2 x 652 = 1,304."""
    config = model.config.get_text_config()
    hidden = getattr(config, "hidden_size", None) or model.get_input_embeddings().embedding_dim
    inner = getattr(config, "intermediate_size", None)
    if isinstance(inner, (list, tuple)):  # one per layer (Gemma 3n)
        inner = max(inner)
    layers = getattr(config, "num_hidden_layers", None) or 1
    return layers * (hidden + (inner or 4 * hidden) + width)


# --------------------------------------------------------------------------------------------------
# The checks: the output layer in chunks on its own, then each shortcut against each row's
# own forward.
@torch.no_grad()
def check_chunked_logprobs(model, dtype: str = "float32"):
    """Exit 2 (every rank) unless the model's output layer is one token_logprobs' chunks can stand
    in for, under the trainer's autocast: head_logits of the output layer's input must give back
    the forward's logits to one rounding of the compute dtype (the same elementwise operations on
    the same numbers; a missing soft-cap or scale is far more). check_logprob_paths then compares
    the chunks' log-probs and gradient with the whole logits'."""
    head = model.get_output_embeddings()
    if head is None:
        why = "it has no output layer"
    else:
        why = _head_refusal(model, head, dtype)
    why = _agreed(why)
    if why:
        die(f"--logprob_chunk: the chunked log-probs of {model_name(model)} would not be its own "
            f"({why}); run with --logprob_chunk 0")


def _head_refusal(model, head, dtype: str) -> str:
    """'' if head_logits of the output layer's input give back the forward's logits,
    else why not."""
    embeddings = model.get_input_embeddings()
    device = next(model.parameters()).device
    vocab = min(embeddings.num_embeddings, 64)
    ids = 3 + torch.arange(8, device=device)[None] * 7 % (vocab - 3)  # (1, 8)
    inputs = []
    forward = head.forward

    def spy(hidden):
        inputs.append(hidden)
        return forward(hidden)

    try:
        with autocast(dtype, device), _head_forward(head, spy):
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits  # (1, 8, V)
            if len(inputs) != 1:
                return f"its forward called its output layer {len(inputs)} times, not once"
            ours = head_logits(model, head, inputs[0])
    except Exception as e:  # e.g. a forward that needs its output layer's result to be logits
        return _error(e)
    dtypes = (logits.dtype, ours.dtype, head.weight.dtype, getattr(torch, dtype))
    eps = max(torch.finfo(t).eps for t in dtypes)
    scale = 1.0 + logits.abs().max().item()
    unknown = ("its forward changes its output layer's result in a way modeling.head_logits "
               "does not know")
    if ours.shape != logits.shape:
        return unknown
    if not (ours - logits).abs().max().item() <= eps * scale:  # (NaN fails too)
        return unknown
    return ""


def check_logprob_paths(model, cfg, device: torch.device | None = None,
                        recorded: dict | None = None) -> dict:
    """Start-up checks of the sharded model on `device` (default: the parameters'): each shortcut
    token_logprobs may take, against each row's own forward, in cfg.dtype under autocast, with a
    backward for a model that trains. Sets what token_logprobs reads:
      --logprob_chunk > 0  chunks of the output layer: exit 2 if off
      model.shares_prompts  a group's prompt run once (padded rows, no checkpointing; a hybrid or
                            recurrent cache may not index out)
      model.pack_refusal    packed rows (--pack): '' or why not, with a note
    Returns the verdict: {"setup": what it depends on (_setup), "shares_prompts", and
    "pack_refusal" with --pack}. Given the verdict of a run's start (`recorded`, from the
    checkpoint a --resume continues) for the same setup, it takes that one and probes nothing: a
    resumed run takes the paths its start took, whatever the rounding here would now say.
    After the probes FSDP2's root is resharded: a no-grad forward leaves it gathered.
    """
    device = device or next(model.parameters()).device
    setup = _setup(model, cfg, device)
    if recorded is not None and recorded.get("setup") == setup:
        verdict = recorded
        print0(f"--resume: {model_name(model)} takes the log-prob paths the run's start chose "
               f"(not probed again): {_paths_taken(verdict)}")
    else:
        if recorded is not None:
            was = recorded.get("setup", {})
            changed = ", ".join(f"{k} {was.get(k)} -> {v}" for k, v in setup.items()
                                if was.get(k) != v)
            print0(f"note: --resume: the run's start checked {model_name(model)}'s log-prob paths "
                   f"for another setup ({changed}): checked again")
        verdict = {"setup": setup, **_decide_paths(model, cfg, device)}
        reshard(model)
    model.shares_prompts = verdict["shares_prompts"]
    if "pack_refusal" in verdict:
        model.pack_refusal = verdict["pack_refusal"]
        if model.pack_refusal:
            print0(f"note: --pack: {model_name(model)} runs padded ({model.pack_refusal})")
    if not model.shares_prompts:
        print0(f"note: {model_name(model)}'s KV cache cannot be shared by a group's rows: "
               "each row runs its prompt")
    return verdict


def _setup(model, cfg, device: torch.device) -> dict:
    """What the start-up verdicts depend on besides the weights and the kernels' rounding."""
    import transformers
    return {"model": model_name(model), "attention": model.config._attn_implementation,
            "dtype": cfg.dtype, "device": device.type, "pack": bool(getattr(cfg, "pack", False)),
            "logprob_chunk": cfg.logprob_chunk > 0,
            "checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
            "transformers": transformers.__version__}


def _paths_taken(verdict: dict) -> str:
    """A verdict in words. Example: 'a group's prompt once, packed rows'."""
    taken = ["a group's prompt once" if verdict["shares_prompts"] else "each row's prompt"]
    if "pack_refusal" in verdict:
        taken.append("padded rows" if verdict["pack_refusal"] else "packed rows")
    return ", ".join(taken)


def _decide_paths(model, cfg, device: torch.device) -> dict:
    """check_logprob_paths' probes: {"shares_prompts", and "pack_refusal" with --pack}."""
    trains = any(p.requires_grad for p in model.parameters())
    if trains and not torch.is_grad_enabled():
        # a caller's mistake (torch.no_grad, torch.inference_mode): every probe's backward would
        # fail, and the model's forward be blamed
        raise RuntimeError("check_logprob_paths was called with gradients disabled "
                           "(torch.no_grad() or torch.inference_mode()); its probes of a model "
                           "that trains run a backward: call it with gradients enabled")
    rows = _probe_rows(model, device)
    # each row's own forward: what is right
    alone = _probe(model, rows, cfg.dtype, device, alone=True)
    # the rows whole and padded, whole logits
    padded = _probe(model, rows, cfg.dtype, device)
    why = _agreed(next((x for x in (alone[0], padded[0]) if isinstance(x, str)), ""))
    if why:
        die(f"--model: {model_name(model)}'s forward fails on the start-up check's rows ({why})")
    # the kernels' rounding from one layout to another (no left padding)
    noise = _gaps(padded, alone)

    def check(**path) -> str:
        return _path_refusal(model, rows, cfg.dtype, device, alone, noise, **path)

    if cfg.logprob_chunk > 0:
        check_chunked_logprobs(model, cfg.dtype)
        why = check(chunk_tokens=2 * len(rows[0]))  # chunks of 2 positions, the last one shorter
        if why:
            die(f"--logprob_chunk: the chunked log-probs of {model_name(model)} would not be "
                f"its own ({why}); run with --logprob_chunk 0")
    verdict = {"shares_prompts": True}
    model.shares_prompts = True
    if _shares_prompts(model, rows[3]):
        verdict["shares_prompts"] = not check(groups=rows[3])
    if getattr(cfg, "pack", False):
        model.pack_refusal = ""  # (so that the probe runs packed)
        verdict["pack_refusal"] = pack_refusal(model, device) or check(pack=True)
    return verdict


# --------------------------------------------------------------------------------------------------
# Micro-batches packed by length (--micro_batch_tokens): a token budget per forward instead of a row
# count, and each rank dealt as many tokens as can be.
def token_budget_rows(batch: dict, index: torch.Tensor, size: int,
                      max_tokens: int) -> list[torch.Tensor]:
    """The rows `index` of the batch in micro-batches packed by length: rows sorted longest first,
    each micro-batch filled while its padded size (rows x (longest prompt + longest completion))
    stays within max_tokens and it has at most `size` rows; then every rank splits its largest
    micro-batches until all make as many as the busiest one (FSDP: collectives must match)."""
    P = batch["input_ids"].shape[1] - batch["mask"].shape[1]
    prompt_len = batch["attention_mask"][index, :P].sum(-1).tolist()
    completion_len = batch["attention_mask"][index, P:].sum(-1).tolist()
    order = sorted(range(len(index)), key=lambda i: -(prompt_len[i] + completion_len[i]))
    chunks = []
    width = (0, 0)  # the longest prompt and completion of the current chunk
    for i in order:
        wider = (max(width[0], prompt_len[i]), max(width[1], completion_len[i]))
        too_wide = chunks and (len(chunks[-1]) + 1) * sum(wider) > max_tokens
        if not chunks or too_wide or len(chunks[-1]) >= size:
            chunks.append([])
            wider = (prompt_len[i], completion_len[i])
        chunks[-1].append(i)
        width = wider
    # the busiest rank's number of micro-batches (0: no rank has rows)
    count = int(all_reduce_max(torch.tensor(float(len(chunks)))).item())
    assert chunks or not count, ("a rank with no rows where another has some: "
                                 "plan_updates gives every rank as many")
    while len(chunks) < count:
        k = max(range(len(chunks)), key=lambda j: len(chunks[j]))
        half = len(chunks[k]) // 2
        chunks[k:k + 1] = [chunks[k][:half], chunks[k][half:]]
    return [index[torch.tensor(c, dtype=torch.long)] for c in chunks]


def group_tokens(group: dict) -> int:
    """Tokens a group (or its _summary) puts through the trainer: its G prompt + completion rows."""
    return sum(group["prompt_len"] + n for n in group["lengths"])


def balanced_shares(part: list[int], summaries: list[dict], world: int) -> list[list[int]]:
    """The groups `part` (indices into `summaries`) dealt to `world` ranks, as many each: the
    heaviest first, each to the rank with the fewest tokens so far (sorted() is stable: every rank
    deals alike)."""
    shares = [[] for _ in range(world)]
    load = [0] * world  # tokens dealt to each rank
    per_rank = len(part) // world
    for j in sorted(part, key=lambda j: group_tokens(summaries[j]), reverse=True):
        open_ranks = [r for r in range(world) if len(shares[r]) < per_rank]
        r = min(open_ranks, key=lambda r: load[r])
        shares[r].append(j)
        load[r] += group_tokens(summaries[j])
    return shares
