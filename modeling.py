"""
Look up when needed: the models.
Loading (a hub id, a folder, or the demo model), FSDP2 sharding, LoRA adapters (peft: --lora_rank),
and the log-probs of completion tokens under any family's output layer: in chunks, packed without
padding (--pack, the way transformers packs), each shortcut checked at start-up where training
runs. No attention code of ours, and nothing here changes another library's state at import.
"""
import contextlib
import os
import re

import torch
import torch.utils.checkpoint
from transformers.utils import logging as hf_logging

from ranks import DistInfo, all_reduce_max, all_reduce_sum, die, is_dist, print0


# ------------------------------------------------------------------------------------------------------------
# Loading. `--model demo` is a tiny Qwen3 with a character-level tokenizer, warm-started on the
# arith task by demo/build.py (which says why its weights are shipped), loaded as a hub model is:
# the demo runs real code.
DEMO_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo", "arith", "model")
DEMO_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|user|>", "<|assistant|>"]
DEMO_CHARS = ("0123456789+-*/=()[]., ?:;!'{}\\$^_|<>"
              "abcdefghijklmnopqrstuvwxyz"
              "ABCDEFGHIJKLMNOPQRSTUVWXYZ\n")
DEMO_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<eos>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_demo_tokenizer():
    """The demo's fast tokenizer: one token per character, plus `\\boxed{` as one token
    (completions stay ~6 tokens while ending in a real model's final-answer format, so the demo
    goes through the real verifier)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(DEMO_SPECIALS)}
    for c in DEMO_CHARS:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # isolate every character
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()  # decode by concatenation, no spaces inserted
    tok.add_special_tokens(DEMO_SPECIALS)
    tok.add_tokens([AddedToken("\\boxed{", normalized=False)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                 bos_token="<bos>", unk_token="<unk>", padding_side="left")
    hf.chat_template = DEMO_CHAT_TEMPLATE
    return hf


def build_demo_model(tok, hidden: int = 128, layers: int = 2, seed: int = 0):
    """A tiny Qwen3 (0.5M parameters at hidden 128, 2 layers).
    head_dim 32 is one vLLM's CPU backend takes."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=max(1, hidden // 64),
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id)
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


def model_path(name: str) -> str:
    """--model as a path or hub id; 'demo' is the shipped demo model (demo/arith/model/)."""
    if name != "demo":
        return name
    if not os.path.isfile(os.path.join(DEMO_MODEL, "model.safetensors")):
        die(f"the demo model is missing from {DEMO_MODEL} "
            "(restore it from git, or rebuild it: python -m demo.build)")
    return DEMO_MODEL


def load_model(name: str, device: torch.device = torch.device("cpu"), dtype: str = "float32"):
    """(model, tokenizer): a causal LM from a Hugging Face folder or hub id, with dropout 0,
    and its tokenizer, padding on the left. The trainer runs in training mode, where dropout
    would make its log-probs a random draw, not the rollout's."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    # transformers' load/save bars would interleave with our step lines
    hf_logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(name)
        config = AutoConfig.from_pretrained(name)
        # attention_dropout, hidden_dropout, resid_pdrop, ...
        for key, value in vars(config).items():
            if re.search(r"(dropout|pdrop)$", key) and isinstance(value, float):
                setattr(config, key, 0.0)
        model = AutoModelForCausalLM.from_pretrained(name, config=config,
                                                     dtype=getattr(torch, dtype))
        model = model.to(device)
    except (OSError, ValueError) as e:
        # a missing folder, an unknown hub id, or offline with no cached copy
        die(f"--model {name!r}: cannot load it ({str(e).splitlines()[0]})")
    for module in model.modules():  # dropout layers built with a hard-coded p
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    tok.padding_side = "left"
    # many base models ship no pad token; any id works, padding is masked out
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


# ------------------------------------------------------------------------------------------------------------
# Any family's output layer, so that log-probs computed a chunk of positions at a time are its
# forward's own.
def nucleus(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Log-probs (..., V) with the tokens outside the top_p nucleus at -inf (not renormalised):
    those whose cumulative probability, from the least likely up, stays <= 1 - top_p.
    The most likely token is always kept."""
    sorted_logp, order = logp.sort(-1)  # ascending
    drop = sorted_logp.exp().cumsum(-1) <= 1 - top_p
    drop[..., -1] = False
    return logp.scatter(-1, order, sorted_logp.masked_fill(drop, float("-inf")))


# A target's nucleus log-prob outside the nucleus: not -inf, so masked-out padding multiplies to 0,
# not NaN; mismatch_sums skips these.
OUTSIDE_NUCLEUS = -1e4


def _logprobs_of_logits(logits, targets, temperature: float, with_entropy: bool,
                        top_p: float = 1.0):
    """Logits (B, t, V) -> log-probs (B, t) of the targets at this temperature, and a second
    (B, t) output, without gradient:
      with_entropy   the token entropy
      top_p < 1      the targets' log-probs renormalised over the nucleus (what a sampler returns
                     for what it drew from it: sample_token, vLLM)
      else           None
    """
    # softmax in float32 at least (float64 stays float64)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if temperature != 1.0:  # the sampling distribution was at this temperature (as verl does)
        logits = logits / temperature
    lse = logits.logsumexp(-1)  # (B, t)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # (B, t)
    if with_entropy:
        # H = lse - sum_v p_v logit_v, a batched dot: one (B, t, V) tensor less than p * logits
        with torch.no_grad():
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


def _model_name(model) -> str:
    """The model's class name (FSDP2 makes the module an instance of its subclass FSDP<name>)."""
    return next(c.__name__ for c in type(model).__mro__ if not c.__module__.startswith("torch."))


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
            raise RuntimeError(f"{_model_name(model)}'s forward called its output layer "
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


# ------------------------------------------------------------------------------------------------------------
# Log-probs of completion tokens under pi or pi_old: a group's prompt runs once, the output layer
# in chunks.
def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """position_ids from an attention mask: 0 at each row's first real token (left padding shifts
    none)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


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
    (B, T) output (no grad: entropy, nucleus log-probs or None).

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


# ------------------------------------------------------------------------------------------------------------
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


def pack_refusal(model) -> str:
    """Why `model` does not run packed forwards, or '' if it does, from its attention
    implementation and device (the same on every rank): flash attention and flex attention pack
    anywhere; sdpa and eager on a CPU only, since on a GPU their masks would be dense (L x L at
    --micro_batch_tokens 24576)."""
    implementation = model.config._attn_implementation
    if _one_row(model):
        return ""
    if implementation not in DENSE_MASK_ATTENTION:
        return (f"transformers packs no sequences under its attention implementation "
                f"{implementation!r}")
    device = next(model.parameters()).device
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
    if not _runs_packed(model, pack):
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


def _runs_packed(model, pack: bool) -> bool:
    """Whether token_logprobs runs packed: asked, on a model that packs (the start-up verdict,
    model.pack_refusal, once check_logprob_paths has run; pack_refusal before)."""
    if not pack:
        return False
    refusal = getattr(model, "pack_refusal", None)
    if refusal is None:
        refusal = pack_refusal(model)
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
    its own (positions from 0), seen by none. The same values and gradients as the padded path
    (tests/test_pack.py)."""
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
    """(positions token_logprobs' forwards run, those they need) for perf/pad_frac, in the layout
    it takes (_packs: under torchrun every rank must call this for every micro-batch, as
    token_logprobs)."""
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


# ------------------------------------------------------------------------------------------------------------
# The models as the trainer holds them: sharded, the forward's compute dtype, the whole state
# for a save.
def shard_model(model, dist_info: DistInfo, dtype: str = "float32",
                grad_checkpointing: bool = False, cpu_offload: bool = False):
    """The model on the device in training mode (checkpointing only recomputes there; dropout is
    0), under torchrun sharded with FSDP2. Weights stay float32 (the optimizer's master copy),
    gathered in `dtype`. Gradients are SUMMED over ranks: the loss weights already divide by
    global token and sequence counts."""
    model.train()
    if grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not is_dist():
        return model.to(dist_info.device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                        fully_shard)
    mesh = init_device_mesh(dist_info.device.type, (dist_info.world_size,))
    param_dtype = getattr(torch, dtype)
    # gradients are reduced in float32, or in float64 for a float64 model
    reduce_dtype = torch.promote_types(param_dtype, torch.float32)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if cpu_offload:
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    else:
        offload = OffloadPolicy()
    # one all-gather per layer: peak memory about one layer
    units = list(model.model.layers) + [model]
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp, offload_policy=offload)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        # plain SUM collectives: gloo has no pre-multiplied sum
        unit.set_force_sum_reduction_for_comms(True)
    return model


def full_tensor(x: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a DTensor; every rank must call this),
    or the tensor itself."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def reshard(model):
    """Free the gathered copy of an FSDP2 root's parameters, kept after a forward for the backward
    that usually follows (none follows a no-grad forward). Local (no collective); a no-op without
    FSDP."""
    if hasattr(model, "reshard"):
        model.reshard()


def autocast(dtype: str, device: torch.device):
    """The compute-dtype context of the trainer's forward passes (a no-op in float32, float64)."""
    enabled = dtype in ("bfloat16", "float16")
    return torch.autocast(device.type, getattr(torch, dtype), enabled=enabled)


def full_state_dict(model) -> dict:
    """The unsharded state dict, on CPU; under FSDP every rank must call it and rank 0 gets the
    tensors."""
    if not is_dist():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


# ------------------------------------------------------------------------------------------------------------
# LoRA (--lora_rank > 0): peft's low-rank adapters on the linear layers of the blocks, the base
# frozen. The model stays the Hugging Face model (peft swaps its layers in place), so everything
# above works unchanged. On disk an adapter is what PeftModel.save_pretrained writes (vLLM and
# PeftModel.from_pretrained load it).
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# PeftModel's name for the model it wraps, in saved weight names
_PEFT_PREFIX = "base_model.model."


def is_lora(model) -> bool:
    """Whether peft's adapters are in the model (add_lora)."""
    return bool(getattr(model, "peft_config", None))


def block_linear_names(model) -> list[str]:
    """The names of the linear layers in the model's blocks, once each (q_proj, ..., down_proj)."""
    names = set()
    for name, module in model.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear):
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def lora_config(model, cfg):
    """peft's LoraConfig from the --lora_* flags; a target the model's blocks lack stops here."""
    try:
        from peft import LoraConfig
    except ImportError:
        die("--lora_rank needs peft: pip install -r requirements/lora.txt")
    available = block_linear_names(model)
    asked = [t.strip() for t in cfg.lora_target_modules.split(",") if t.strip()]
    targets = asked or available
    missing = [t for t in targets if t not in available]
    if missing:
        die(f"--lora_target_modules: {_model_name(model)} has no linear layer named "
            f"{', '.join(missing)} in its blocks (it has {', '.join(available)})")
    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=targets,
                      lora_dropout=cfg.lora_dropout, bias="none", task_type="CAUSAL_LM",
                      base_model_name_or_path=model.config.name_or_path)


def add_lora(model, cfg):
    """The model with peft's LoRA layers swapped in (B = 0: it computes as the base until
    trained), only the adapters trainable, in float32 (the optimizer's master copy, whatever the
    base's dtype)."""
    config = lora_config(model, cfg)  # (says what to install if peft is missing)
    from peft import inject_adapter_in_model
    model = inject_adapter_in_model(config, model)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model


@contextlib.contextmanager
def adapter_disabled(model):
    """Inside, a LoRA model computes as its base (peft's disable_adapter): the KL reference without
    a second copy of the weights. peft also turns the adapters' requires_grad off and back on, so
    call it outside any forward whose backward is pending. A no-op on a model without adapters."""
    from_peft = [m for m in model.modules()
                 if hasattr(m, "enable_adapters") and hasattr(m, "lora_A")]
    for module in from_peft:
        module.enable_adapters(False)
    try:
        yield
    finally:
        for module in from_peft:
            module.enable_adapters(True)


def adapter_state_dict(model, device: torch.device | None = None) -> dict:
    """The adapters' weights, whole, on the CPU, under the names peft saves them with
    (base_model.model.<layer>.lora_A.weight). Under FSDP every rank gathers each (on `device`,
    else where its shard is), in the same order: every rank gets them all."""
    from peft import get_peft_model_state_dict
    trained = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            trained[name] = full_tensor(p.detach().to(device or p.device)).cpu()
    adapters = get_peft_model_state_dict(model, state_dict=trained)
    return {_PEFT_PREFIX + k: v for k, v in adapters.items()}


def save_adapter(model, weights: dict, path: str):
    """Write adapter_state_dict's `weights` and the adapter's config to the folder `path`
    (peft's format)."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    contiguous = {k: v.contiguous() for k, v in weights.items()}
    save_file(contiguous, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    model.peft_config["default"].save_pretrained(path)


def load_adapter(model, path: str):
    """Load a saved adapter's weights into the model's adapters, which must match it
    (rank, alpha, layers)."""
    import json
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    saved = json.load(open(os.path.join(path, ADAPTER_CONFIG)))
    ours = model.peft_config["default"]
    flags = (("r", "lora_rank"), ("lora_alpha", "lora_alpha"),
             ("target_modules", "lora_target_modules"))
    for key, flag in flags:
        mine = getattr(ours, key)
        theirs = saved[key]
        if key == "target_modules":
            mine = sorted(mine)
            theirs = sorted(theirs)
        if mine != theirs:
            die(f"--resume: {path}'s adapter has {key} {theirs}, this run's --{flag} gives "
                f"{mine}: resume with the adapter's settings")
    weights = load_file(os.path.join(path, ADAPTER_WEIGHTS))
    weights = {k.removeprefix(_PEFT_PREFIX): v for k, v in weights.items()}
    result = set_peft_model_state_dict(model, weights)
    if result.unexpected_keys:
        die(f"--resume: {path} holds weights this adapter does not have "
            f"({result.unexpected_keys[0]}, ...)")


def merged_parameters(model, device: torch.device, dtype: torch.dtype):
    """(name, whole tensor) of the model as a plain Hugging Face model, one at a time: each
    adapted layer's weight merged, W + (alpha / r) B A, under the base's name; the adapters
    themselves are not yielded. Under FSDP every rank gathers each tensor in the same order
    (collectives in lockstep)."""
    modules = dict(model.named_modules())
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue  # merged into their layer's weight below
        owner, _, leaf = name.rpartition(".")
        if not owner.endswith(".base_layer"):
            yield name, full_tensor(p.detach().to(device, dtype))
            continue
        # a peft LoRA layer's frozen base: merge its adapter in
        layer_name = owner.removesuffix(".base_layer")
        layer = modules[layer_name]
        value = full_tensor(p.detach().to(device, torch.float32))
        if leaf == "weight":
            a = full_tensor(layer.lora_A["default"].weight.detach().to(device, torch.float32))
            b = full_tensor(layer.lora_B["default"].weight.detach().to(device, torch.float32))
            value = value + layer.scaling["default"] * (b @ a)
        yield f"{layer_name}.{leaf}", value.to(dtype)


def load_policy(resume_from: str | None, base_path: str, cfg):
    """(model, tokenizer, the folder of its full weights), on the CPU: the checkpoint's model
    (--resume) or --model's; with --lora_rank the base from --model, frozen, with LoRA adapters
    (the checkpoint's on --resume). The base is kept in the compute dtype: nothing updates it, so
    it needs no float32 copy."""
    if not cfg.lora_rank:
        path = resume_from or base_path
        model, tok = load_model(path)
        return model, tok, path
    model, tok = load_model(base_path, dtype=cfg.dtype)
    model = add_lora(model, cfg)
    if resume_from:
        load_adapter(model, resume_from)
    return model, tok, base_path


# ------------------------------------------------------------------------------------------------------------
# Start-up: each shortcut of token_logprobs checked where training runs (after sharding, on the
# training device, in the training dtype under autocast, with a backward where training runs one)
# against the path it stands in for; every rank runs the same forwards (lockstep) and each verdict
# is all-reduced before any rank acts on it. Then vLLM's calibration, and the KL anchor.
# docs/gpu.md, "Start-up checks": what is compared, and the tolerances.
def _agreed(why: str) -> str:
    """`why` ('' = passed) once every rank has passed or failed: a failure anywhere fails
    everywhere."""
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

    Returns its log-probs (B, T) in float64, 0 off the completions, or the error it raised, as
    text; and _gradient_sums of sum_t t log p_t after a backward (None for a model that does not
    train).
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
            with torch.set_grad_enabled(trains), autocast(dtype, device):
                out = token_logprobs(model, *part, n, **path)[0].double() * part[1][:, -n:]
            if i is None:
                logp[:, :n] = out.detach()
            else:
                logp[i, :n] = out.detach()
            if trains:
                (out * torch.arange(1, n + 1, device=device)).sum().backward()
    except Exception as e:
        # any failure refuses the path (the same on every rank: same model, same rows)
        logp = _error(e)
    sums = _gradient_sums(model) if trains else None
    model.zero_grad(set_to_none=True)
    return logp, sums


def _gaps(probe, reference) -> tuple[float, float]:
    """The largest gap of two probes' log-probs, and of their gradient sums relative to the
    reference's."""
    logp = (probe[0] - reference[0]).abs().max().item()
    if reference[1] is None:
        return logp, 0.0
    relative = (probe[1] - reference[1]).abs() / reference[1].abs().clamp(min=1e-30)
    return logp, relative.max().item()


def _path_refusal(model, rows, dtype: str, device, reference, noise: tuple, **path) -> str:
    """'' if the path gives each row's own log-probs and gradient (`reference`) to within 4 x
    `noise` (the padded rows' gaps from them) plus a few roundings of the compute dtype, else why
    not (docs/gpu.md, "Start-up checks": the tolerance). Agreed across ranks."""
    probe = _probe(model, rows, dtype, device, **path)
    if isinstance(probe[0], str):
        return _agreed(probe[0])
    # the compute dtype: bf16 or fp16 under its autocast, else the weights' (float32 at least)
    if dtype in ("bfloat16", "float16"):
        compute = getattr(torch, dtype)
    else:
        compute = torch.promote_types(next(model.parameters()).dtype, torch.float32)
    eps = torch.finfo(compute).eps
    logp, grad = _gaps(probe, reference)
    logp_scale = 1 + reference[0].abs().max().item()
    # the gradient at least at float32's rounding: families round it there (RMSNorm)
    grad_eps = max(eps, torch.finfo(torch.float32).eps)
    why = ""
    if not logp <= 4 * noise[0] + 2 * eps * logp_scale:  # (NaN fails too)
        why = f"log-probs off by {logp:.3g}"
    elif not grad <= 4 * noise[1] + 8 * grad_eps:
        why = f"gradient off by {grad:.3g} of itself"
    return _agreed(why)


# ------------------------------------------------------------------------------------------------------------
# The checks: the output layer in chunks on its own, then each shortcut against each row's own forward.
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
        die(f"--logprob_chunk: the chunked log-probs of {_model_name(model)} would not be its own "
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


def check_logprob_paths(model, cfg, device: torch.device | None = None):
    """Start-up checks of the sharded model on `device` (default: the parameters'): each shortcut
    token_logprobs may take, against each row's own forward, in cfg.dtype under autocast, with a
    backward for a model that trains. Sets what token_logprobs reads:
      --logprob_chunk > 0  chunks of the output layer: exit 2 if off
      model.shares_prompts  a group's prompt run once (padded rows, no checkpointing; a hybrid or
                            recurrent cache may not index out)
      model.pack_refusal    packed rows (--pack): '' or why not, with a note
    """
    device = device or next(model.parameters()).device
    rows = _probe_rows(model, device)
    # each row's own forward: what is right
    alone = _probe(model, rows, cfg.dtype, device, alone=True)
    # the rows whole and padded, whole logits
    padded = _probe(model, rows, cfg.dtype, device)
    why = _agreed(next((x for x in (alone[0], padded[0]) if isinstance(x, str)), ""))
    if why:
        die(f"--model: {_model_name(model)}'s forward fails on the start-up check's rows ({why})")
    # the kernels' rounding from one layout to another (no left padding)
    noise = _gaps(padded, alone)

    def check(**path) -> str:
        return _path_refusal(model, rows, cfg.dtype, device, alone, noise, **path)

    if cfg.logprob_chunk > 0:
        check_chunked_logprobs(model, cfg.dtype)
        why = check(chunk_tokens=2 * len(rows[0]))  # chunks of 2 positions, the last one shorter
        if why:
            die(f"--logprob_chunk: the chunked log-probs of {_model_name(model)} would not be "
                f"its own ({why}); run with --logprob_chunk 0")
    model.shares_prompts = True
    if _shares_prompts(model, rows[3]):
        model.shares_prompts = not check(groups=rows[3])
    if getattr(cfg, "pack", False):
        model.pack_refusal = ""  # (so that the probe runs packed)
        model.pack_refusal = pack_refusal(model) or check(pack=True)
        if model.pack_refusal:
            print0(f"note: --pack: {_model_name(model)} runs padded ({model.pack_refusal})")
    if not model.shares_prompts:
        print0(f"note: {_model_name(model)}'s KV cache cannot be shared by a group's rows: "
               "each row runs its prompt")


# ------------------------------------------------------------------------------------------------------------
# Preparing the models for training: attention, sharding, the start-up checks, the KL anchor.
def set_attention(model, implementation: str):
    """Set the model's attention implementation (--attn_implementation), transformers' own, before
    sharding; one it cannot use here (flash attention not installed, or on a CPU) exits 2."""
    if implementation and implementation != model.config._attn_implementation:
        try:
            model.set_attn_implementation(implementation)
        except (ImportError, ValueError, KeyError) as e:
            die(f"--attn_implementation {implementation}: transformers cannot use it here "
                f"({str(e).splitlines()[0]})")


def prepare_models(model, engine, base_path: str, cfg, dist_info: DistInfo):
    """(model, ref_model), sharded and checked where they train, and the rollout engine calibrated
    against the model (vLLM: the weight-sync probe's start-up gap). ref_model, the KL anchor, is
    the initial model even after a resume: with LoRA the model itself, which token_losses runs
    with its adapters off (the base: no second copy); None without KL."""
    set_attention(model, cfg.attn_implementation)
    model = shard_model(model, dist_info, cfg.dtype, cfg.grad_checkpointing, cfg.cpu_offload)
    check_logprob_paths(model, cfg, dist_info.device)
    engine.calibrate(model)
    if cfg.kl_coef <= 0:
        return model, None
    if is_lora(model):
        return model, model
    ref_model = load_model(base_path)[0].requires_grad_(False)
    set_attention(ref_model, cfg.attn_implementation)
    ref_model = shard_model(ref_model, dist_info, cfg.dtype, cpu_offload=cfg.cpu_offload).eval()
    check_logprob_paths(ref_model, cfg, dist_info.device)
    return model, ref_model
