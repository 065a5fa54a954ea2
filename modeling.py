"""
Look up when needed: the models. Loading (a hub id, a folder, or the demo model), FSDP2 sharding, LoRA
adapters (peft: --lora_rank), and the log-probs of completion tokens under any family's output layer: in
chunks, packed without padding (--pack, the way transformers packs), each shortcut checked at start-up where
training runs. No attention code of ours, and nothing here changes another library's state at import.
"""
import contextlib
import os
import re

import torch
import torch.utils.checkpoint
from transformers.utils import logging as hf_logging

from ranks import DistInfo, all_reduce_max, all_reduce_sum, die, is_dist, print0


# ------------------------------------------------------------------------------------------------------------
# Loading. `--model demo` is a tiny Qwen3 with a character-level tokenizer, warm-started on the arith task by
# demo/build.py (which says why its weights are shipped), loaded as a hub model is: the demo runs real code.
DEMO_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo", "arith", "model")
DEMO_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|user|>", "<|assistant|>"]
DEMO_CHARS = "0123456789+-*/=()[]., ?:;!'{}\\$^_|<>abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n"
DEMO_CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
                      "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<eos>{% endif %}"
                      "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_demo_tokenizer():
    """A fast tokenizer: one token per character, plus `\\boxed{` as one token (completions stay ~6 tokens
    while ending in a real model's final-answer format, so the demo goes through the real verifier)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(DEMO_SPECIALS)}
    for c in DEMO_CHARS:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")  # isolate every character
    tok.decoder = decoders.Fuse()  # decode by concatenation, no spaces inserted
    tok.add_special_tokens(DEMO_SPECIALS)
    tok.add_tokens([AddedToken("\\boxed{", normalized=False)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                 bos_token="<bos>", unk_token="<unk>", padding_side="left")
    hf.chat_template = DEMO_CHAT_TEMPLATE
    return hf


def build_demo_model(tok, hidden: int = 128, layers: int = 2, seed: int = 0):
    """A tiny Qwen3 (0.5M parameters at hidden 128, 2 layers); head_dim 32 is one vLLM's CPU backend takes."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=4 * hidden,
                      num_hidden_layers=layers, num_attention_heads=hidden // 32,
                      num_key_value_heads=max(1, hidden // 64), head_dim=32, max_position_embeddings=512,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


def model_path(name: str) -> str:
    """--model as a path or hub id; 'demo' is the shipped demo model (demo/model/)."""
    if name != "demo":
        return name
    if not os.path.isfile(os.path.join(DEMO_MODEL, "model.safetensors")):
        die(f"the demo model is missing from {DEMO_MODEL} "
            "(restore it from git, or rebuild it: python -m demo.build)")
    return DEMO_MODEL


def load_model(name: str, device: torch.device = torch.device("cpu"), dtype: str = "float32"):
    """A causal LM and its tokenizer (left padding) from a Hugging Face folder or hub id, dropout 0: the
    trainer runs in training mode, where dropout would make its log-probs a random draw, not the rollout's."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    hf_logging.disable_progress_bar()  # transformers' load/save bars would interleave with our step lines
    try:
        tok = AutoTokenizer.from_pretrained(name)
        config = AutoConfig.from_pretrained(name)
        for key, value in vars(config).items():  # attention_dropout, hidden_dropout, resid_pdrop, ...
            if re.search(r"(dropout|pdrop)$", key) and isinstance(value, float):
                setattr(config, key, 0.0)
        model = AutoModelForCausalLM.from_pretrained(name, config=config,
                                                     dtype=getattr(torch, dtype)).to(device)
    except (OSError, ValueError) as e:  # a missing folder, an unknown hub id, or offline with no cached copy
        die(f"--model {name!r}: cannot load it ({str(e).splitlines()[0]})")
    for module in model.modules():  # dropout layers built with a hard-coded p
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    tok.padding_side = "left"
    if tok.pad_token_id is None:  # many base models ship no pad token; any id works, padding is masked out
        tok.pad_token = tok.eos_token
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


# ------------------------------------------------------------------------------------------------------------
# Any family's output layer, so that log-probs computed a chunk of positions at a time are its forward's own.
def nucleus(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Log-probs (..., V) with the tokens outside the top_p nucleus at -inf (not renormalised): those whose
    cumulative probability, from the least likely up, stays <= 1 - top_p; the most likely is always kept."""
    sorted_logp, order = logp.sort(-1)  # ascending
    drop = sorted_logp.exp().cumsum(-1) <= 1 - top_p
    drop[..., -1] = False
    return logp.scatter(-1, order, sorted_logp.masked_fill(drop, float("-inf")))


OUTSIDE_NUCLEUS = -1e4  # not -inf, so masked-out padding multiplies to 0, not NaN; mismatch_sums skips these


def _logprobs_of_logits(logits, targets, temperature: float, with_entropy: bool, top_p: float = 1.0):
    """Logits (B, t, V) -> log-probs (B, t) of the targets at this temperature, and a second (B, t) output
    (no grad): the token entropy with with_entropy, else with top_p < 1 the targets' log-probs renormalised
    over the nucleus (what a sampler returns for what it drew from it: sample_token, vLLM), else None."""
    if logits.dtype in (torch.float16, torch.bfloat16):  # softmax in float32 at least (float64 stays float64)
        logits = logits.float()
    if temperature != 1.0:  # the sampling distribution was at this temperature (as verl does)
        logits = logits / temperature
    lse = logits.logsumexp(-1)  # (B, t)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # (B, t)
    entropy_or_nucleus_logp = None
    if with_entropy:  # H = lse - sum_v p_v logit_v, a batched dot: one (B, t, V) tensor less than p * logits
        with torch.no_grad():
            entropy_or_nucleus_logp = lse - (
                logits.softmax(-1).unsqueeze(-2) @ logits.unsqueeze(-1))[..., 0, 0]
    elif top_p < 1:  # a target outside the nucleus gets OUTSIDE_NUCLEUS
        with torch.no_grad():
            nucleus_logp = nucleus(logits.log_softmax(-1), top_p).log_softmax(-1)  # (B, t, V)
            entropy_or_nucleus_logp = (nucleus_logp.gather(-1, targets[..., None])[..., 0]
                                       .clamp(min=OUTSIDE_NUCLEUS))
    return logp, entropy_or_nucleus_logp


def _softcap(logits, cap):
    """Gemma's final logit soft-capping, as its forwards write it (cap None: none)."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _vocab_cut(logits, size):
    """Inkling's cut of its padded vocabulary (size None: none)."""
    return logits if size is None or size >= logits.shape[-1] else logits[..., :size]


# What a family's forward does after its output layer, from a survey of every ...ForCausalLM in transformers
# 5.19 (tests/test_heads.py checks each). By family, not config attribute: Granite divides its logits by
# `logits_scaling`, HyperCLOVAX multiplies them by it, MiniCPM3 divides its output layer's input by it (no
# entry: that input is recorded). Any other change is refused at start-up (check_chunked_logprobs).
_LOGIT_TRANSFORMS = {
    **dict.fromkeys(["gemma2", "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text",
                     "vaultgemma", "nanochat"],
                    lambda model, x: _softcap(x, model.config.final_logit_softcapping)),
    **dict.fromkeys(["gemma3n", "gemma4", "gemma4_unified"],  # their multimodal ...ForConditionalGeneration
                    lambda model, x: _softcap(x, model.config.get_text_config().final_logit_softcapping)),
    "recurrent_gemma": lambda model, x: _softcap(x, model.config.logits_soft_cap),
    **dict.fromkeys(["cohere", "cohere2", "cohere2_moe", "cohere_compass_text", "cohere_compass"],
                    lambda model, x: x if model.logit_scale is None else x * model.logit_scale),
    **dict.fromkeys(["granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared",
                     "granitemoehybrid"], lambda model, x: x / model.config.logits_scaling),
    "hyperclovax": lambda model, x: x * model.config.logits_scaling,
    "falcon_h1": lambda model, x: x * model.model.lm_head_multiplier,
    "inkling_text": lambda model, x: _vocab_cut(x, model.config.unpadded_vocab_size),
    **dict.fromkeys(["blt", "mllama_text_model", "nemotron_h"], lambda model, x: x.float()),
}


def head_logits(model, head, hidden):
    """The logits `model`'s forward returns for `hidden` (B, t, H), the input of its output layer `head`: the
    layer (the module, so a wrapped or LoRA'd head works too), then the family's _LOGIT_TRANSFORMS entry."""
    transform = _LOGIT_TRANSFORMS.get(getattr(model.config, "model_type", None))
    logits = head(hidden)
    return logits if transform is None else transform(model, logits)


def _chunk_logprobs(model, head, hidden, targets, temperature: float, with_entropy: bool, top_p: float):
    """head_logits and _logprobs_of_logits on a chunk of positions: hidden (B, t, H) -> (B, t)."""
    return _logprobs_of_logits(head_logits(model, head, hidden), targets, temperature, with_entropy, top_p)


def _model_name(model) -> str:
    """The model's class name (FSDP2 makes the module an instance of its subclass FSDP<name>)."""
    return next(c.__name__ for c in type(model).__mro__ if not c.__module__.startswith("torch."))


@contextlib.contextmanager
def _head_forward(head, forward):
    """Inside, head(x) runs forward(x): an instance attribute shadows the class's forward (one already there
    is put back after)."""
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
    """Inside, the model's forward returns its output layer's input (B, t, H) as its logits: the head records
    its input and returns an empty (B, t, 0) placeholder, on which what follows the head costs nothing; a
    forward hook run before FSDP2's own (which hooks its pre-backward on it) puts the input in `logits`."""
    inputs = []

    def record(hidden):
        inputs.append(hidden)
        return hidden.new_empty((*hidden.shape[:-1], 0))

    def swap(module, args, output):
        n = len(inputs)
        if n != 1:
            inputs.clear()
            raise RuntimeError(f"{_model_name(model)}'s forward called its output layer {n} times, not once: "
                               "its log-probs cannot be computed in chunks "
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
# Log-probs of completion tokens under pi or pi_old: a group's prompt runs once, the output layer in chunks.
def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """position_ids from an attention mask: 0 at each row's first real token (left padding shifts none)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def _shares_prompts(model, groups) -> bool:
    """Whether a group's prompt runs once (_predicting_outputs): the model and config decide, never data."""
    return groups is not None and getattr(model, "shares_prompts", True) and not (
        model.training and getattr(model, "is_gradient_checkpointing", False))


def _group_rows(groups):
    """(inverse (B,): each row's group as 0..U-1, first (U,): a row of each group)."""
    inverse = torch.unique(groups, return_inverse=True)[1]
    first = torch.zeros(int(inverse.max()) + 1, dtype=torch.long, device=groups.device).scatter_(
        0, inverse, torch.arange(len(groups), device=groups.device))
    return inverse, first


def _predicting_outputs(model, input_ids, attention_mask, T: int, groups=None):
    """The model's outputs (logits, or hidden states while the output layer is captured) at the T positions
    that predict each row's last T tokens: (B, T, .), position_ids from the attention mask (left padding
    shifts none). With `groups` (B,) each group's prompt runs once, its KV cache indexed out to its rows (an
    autograd op: every row's gradient flows back into the one prompt forward), and the completions run on it:
    the same values and gradients as rows run whole. A checkpointed model runs rows whole (its layers drop the
    cache in training mode), as does one whose cache cannot be indexed out (model.shares_prompts).
    Lockstep: the path, and so the sharded model's forward count, depends on model and config, never data."""
    position_ids = positions(attention_mask)
    if not _shares_prompts(model, groups):
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     logits_to_keep=T + 1).logits[:, :-1]
    assert T >= 2, "shared-prompt forwards need T >= 2 completion columns (make_batch pads to 2)"
    P = input_ids.shape[1] - T
    inverse, first = _group_rows(groups)
    prompt = model(input_ids=input_ids[first, :P], attention_mask=attention_mask[first, :P],
                   position_ids=position_ids[first, :P], use_cache=True, logits_to_keep=1)  # (U, 1, .)
    cache = prompt.past_key_values
    cache.batch_select_indices(inverse)  # (U, ...) -> (B, ...): each row gets its prompt's keys and values
    rest = model(input_ids=input_ids[:, P:-1], attention_mask=attention_mask[:, :-1],
                 position_ids=position_ids[:, P:-1], past_key_values=cache, use_cache=True).logits
    return torch.cat([prompt.logits[inverse], rest], 1)  # (B, T, .): last prompt position + completion 1..T-1


def token_logprobs(model, input_ids, attention_mask, num_completion_tokens: int, temperature: float = 1.0,
                   with_entropy: bool = False, chunk_tokens: int = 0, groups=None, top_p: float = 1.0,
                   pack: bool = False):
    """log pi(token) (B, T) for the last T tokens of each row, and _logprobs_of_logits' second (B, T) output
    (no grad: entropy, nucleus log-probs or None); `groups` (B,): rows sharing a prompt run it once (padded
    rows only). With `pack`, on a model that packs (pack_refusal), one forward runs every row without padding
    (_packed_outputs) where that runs fewer positions than the padded path (_packs); both outputs are then 0
    at padded positions.
    Memory: a micro-batch's logits are (B, T, V) floats, 25 GB in float32 at 2 x 20,480 x 151,936, and the
    log-softmax, entropy and backward make several. With chunk_tokens > 0, head_logits, the log-softmax and
    the entropy run on chunks of chunk_tokens tokens: peak memory grows with chunk_tokens x V; values and
    gradients are the same (tests/test_heads.py: every family, 1e-10 in float64; bench/logprob_memory.py)."""
    T = num_completion_tokens
    pack = _packs(model, attention_mask, T, groups, pack)
    if pack:  # outputs (1, N, .) at the completions' N tokens, scattered back to (B, T) at the end
        where = attention_mask[:, -T:].bool()
        forward = lambda: _packed_outputs(model, input_ids, attention_mask, T)  # noqa: E731
        targets = input_ids[:, -T:][where][None]  # (1, N)
    else:
        forward = lambda: _predicting_outputs(model, input_ids, attention_mask, T, groups)  # noqa: E731
        targets = input_ids[:, -T:]  # (B, T)
    if chunk_tokens <= 0 or targets.numel() <= chunk_tokens:  # small enough: the whole logits at once
        logp, second = _logprobs_of_logits(forward(), targets, temperature, with_entropy, top_p)
    else:
        head = model.get_output_embeddings()
        with _head_inputs_as_logits(model, head):
            hidden = forward()  # (B, T, H) or (1, N, H)
        step = max(1, chunk_tokens // targets.shape[0])  # positions per chunk
        logps, seconds = [], []  # seconds: the chunks' entropies, or nucleus log-probs, or Nones
        for s in range(0, targets.shape[1], step):
            args = (model, head, hidden[:, s:s + step], targets[:, s:s + step], temperature, with_entropy,
                    top_p)
            if torch.is_grad_enabled():  # recompute this chunk's logits in the backward, not keep them
                logp, second = torch.utils.checkpoint.checkpoint(_chunk_logprobs, *args, use_reentrant=False)
            else:
                logp, second = _chunk_logprobs(*args)
            logps.append(logp)
            seconds.append(second)
        logp, second = torch.cat(logps, 1), torch.cat(seconds, 1) if with_entropy or top_p < 1 else None
    if not pack:
        return logp, second
    unpack = lambda x: x.new_zeros(where.shape).masked_scatter(where, x[0])  # noqa: E731
    return unpack(logp), None if second is None else unpack(second)


# ------------------------------------------------------------------------------------------------------------
# Packed forwards (--pack): transformers' own padding-free path. A micro-batch's rows, each its tokens but its
# last, go one after another with position_ids that restart at 0 for each, no attention mask and no cache:
# transformers finds the sequences in the position_ids (masking_utils.find_packed_sequence_indices) and keeps
# them apart itself, sliding windows included. Kernels that read the boundaries (flash attention's
# variable-length path, flex attention's block mask) take the micro-batch as one row. sdpa and eager are given
# a dense mask per row, so there the sequences are dealt into rows of up to twice the longest one (first fit,
# longest first), on a CPU only (pack_refusal). Each row's prompt runs in its row: a group's prompt once needs
# a KV cache, which transformers' packed path does not take; where the padded path runs it once, a micro-batch
# packs only if that runs fewer positions (_packs; docs/gpu.md: what a prompt once saves).
DENSE_MASK_ATTENTION = ("sdpa", "eager")  # transformers builds a (rows, 1, W, W) mask for packed rows


def _one_row(model) -> bool:
    """Whether the model's attention takes a packed micro-batch as one row, with no dense mask."""
    from transformers.utils.generic import is_flash_attention_requested
    return is_flash_attention_requested(model.config) or model.config._attn_implementation == "flex_attention"


def pack_refusal(model) -> str:
    """Why `model` does not run packed forwards, or '' if it does, from its attention implementation and
    device (the same on every rank): flash attention and flex attention pack anywhere; sdpa and eager on a
    CPU only, since on a GPU their masks would be dense (L x L at --micro_batch_tokens 24576)."""
    implementation = model.config._attn_implementation
    if _one_row(model):
        return ""
    if implementation not in DENSE_MASK_ATTENTION:
        return f"transformers packs no sequences under its attention implementation {implementation!r}"
    device = next(model.parameters()).device
    if device.type != "cpu":
        return (f"{implementation} would build a dense mask for packed rows on {device.type}; "
                f"--attn_implementation flash_attention_2 or flex_attention packs without one")
    return ""


def _packs(model, attention_mask, T: int, groups, pack: bool) -> bool:
    """Whether token_logprobs packs this micro-batch: asked, on a model that packs (_runs_packed), and, where
    the padded path would run a group's prompt once (_shares_prompts), only if the tokens packing runs (each
    row's but its last; its few filler positions not counted) are fewer than the positions the padded path
    runs. Summed over ranks before the choice, so that every rank takes the same path (one forward packed, two
    padded: lockstep). Example: the sums demo's prompts of 7 tokens and completions of 6: the prompt once runs
    about 60% of the tokens packing does; the reasoning demo's completions of 30-72: packing runs fewer."""
    if not _runs_packed(model, pack):
        return False
    if not _shares_prompts(model, groups):
        return True
    B, width = attention_mask.shape
    completions = attention_mask[:, width - T:].sum(-1)  # (B,)
    tokens = int(attention_mask.sum()) - int((completions > 0).sum())  # every row's tokens but its last
    padded = len(torch.unique(groups)) * (width - T) + B * (T - 1)  # _padded_tokens' count, a prompt once
    tokens, padded = all_reduce_sum(torch.tensor([tokens, padded], dtype=torch.float64)).tolist()
    return tokens < padded


def _runs_packed(model, pack: bool) -> bool:
    """Whether token_logprobs runs packed: asked, on a model that packs (the start-up verdict,
    model.pack_refusal, once check_logprob_paths has run; pack_refusal before)."""
    refusal = getattr(model, "pack_refusal", None)
    return pack and not (pack_refusal(model) if refusal is None else refusal)


def _packed_layout(model, attention_mask, T: int):
    """Where each row's tokens go in the packed input (R, W). Returns keep (B, width): the tokens a row runs,
    all but its last completion token; at (B, width): each kept token's index in the flattened input (R * W);
    used (R,): the tokens in each packed row, whose rest is filler; W. One row (W = every kept token) for a
    kernel that reads boundaries (_one_row), else rows of 1 to 2 times the longest sequence's length, the one
    with the least filler (for at most twice the padded rows' attention: bench/results/pack.md), filled first
    fit, longest first. Example: sequences of 5, 4, 3, 2 tokens under sdpa: W = 7, rows [5, 2] and [4, 3]."""
    B, width = attention_mask.shape
    device = attention_mask.device
    keep = attention_mask.bool().clone()  # (a bool mask's .bool() is the mask itself)
    lengths = attention_mask[:, width - T:].sum(-1, keepdim=True)  # (B, 1): completion tokens
    keep[:, width - T:] = torch.arange(T, device=device) < lengths - 1
    sizes = keep.sum(-1).tolist()
    order = sorted(range(B), key=lambda i: -sizes[i])  # (sorted is stable: ties keep row order)

    def first_fit(W):  # each row's first packed row with room, longest first: (its start, the rows' fill)
        used, start = [], [0] * B
        for i in order:
            r = next((r for r, n in enumerate(used) if n + sizes[i] <= W), len(used))
            used += [0] * (r == len(used))
            start[i], used[r] = r * W + used[r], used[r] + sizes[i]
        return start, used
    if _one_row(model):
        W = sum(sizes)
    else:  # of 1, 1.25, ... 2 x the longest, the width whose rows hold the fewest positions
        widths = {min(sum(sizes), max(sizes) * k // 4) for k in range(4, 9)}
        W = min(sorted(widths), key=lambda w: len(first_fit(w)[1]) * w)
    start, used = first_fit(W)
    at = torch.tensor(start, device=device)[:, None] + keep.long().cumsum(-1) - 1  # (B, width), where keep
    return keep, at, torch.tensor(used, device=device), W


def _packed_outputs(model, input_ids, attention_mask, T: int):
    """_predicting_outputs' outputs, packed: (1, N, .) at the positions that predict each row's completion
    tokens (N = their number, rows in order), from one forward of every row's tokens but its last, whatever
    the data (lockstep). Filler after a packed row's sequences is a sequence of its own (positions from 0),
    seen by none. The same values and gradients as the padded path (tests/test_pack.py)."""
    keep, at, used, W = _packed_layout(model, attention_mask, T)
    R, P = len(used), attention_mask.shape[1] - T
    ids = input_ids[keep][:1].repeat(R * W)  # filler: a token of the batch (any token would do)
    ids[at[keep]] = input_ids[keep]
    position_ids = (torch.arange(W, device=ids.device) - used[:, None]).flatten()  # the filler's: 0, 1, ...
    position_ids[at[keep]] = positions(attention_mask)[keep]
    where = at[:, P - 1:-1][attention_mask[:, P:].bool()]  # target t: the output at column P - 1 + t
    out = model(input_ids=ids.view(R, W), position_ids=position_ids.view(R, W), use_cache=False,
                logits_to_keep=where if R == 1 else 0).logits  # (1, N, .) or (R, W, .)
    return out if R == 1 else out.flatten(0, 1)[where][None]


def forward_tokens(model, attention_mask, T: int, groups=None, pack: bool = False) -> tuple[int, int]:
    """(positions token_logprobs' forwards run, those they need) for perf/pad_frac, in the layout it takes
    (_packs: under torchrun every rank must call this for every micro-batch, as token_logprobs)."""
    if _packs(model, attention_mask, T, groups, pack):
        keep, _, used, W = _packed_layout(model, attention_mask, T)
        return len(used) * W, int(keep.sum())  # the packed rows' positions, filler included
    return _padded_tokens(model, attention_mask, T, groups)


def _padded_tokens(model, attention_mask, T: int, groups=None) -> tuple[int, int]:
    """forward_tokens of the padded path: rows whole, B x width and every row's tokens but its last; a group's
    prompt once, U x prompt width + B x (T - 1) and each group's prompt plus each completion's tokens but its
    last."""
    B, width = attention_mask.shape
    completions = int((attention_mask[:, width - T:].sum(-1) - 1).clamp(min=0).sum())
    if not _shares_prompts(model, groups):
        return B * width, int(attention_mask[:, :width - T].sum()) + completions
    first = _group_rows(groups)[1]
    needed = int(attention_mask[first, :width - T].sum()) + completions
    return len(first) * (width - T) + B * (T - 1), needed


# ------------------------------------------------------------------------------------------------------------
# The models as the trainer holds them: sharded, the forward's compute dtype, the whole state for a save.
def shard_model(model, dist_info: DistInfo, dtype: str = "float32", grad_checkpointing: bool = False,
                cpu_offload: bool = False):
    """The model on the device in training mode (checkpointing only recomputes there; dropout is 0), under
    torchrun sharded with FSDP2. Weights stay float32 (the optimizer's master copy), gathered in `dtype`.
    Gradients are SUMMED over ranks: the loss weights already divide by global token and sequence counts."""
    model.train()
    if grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not is_dist():
        return model.to(dist_info.device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    mesh = init_device_mesh(dist_info.device.type, (dist_info.world_size,))
    param_dtype = getattr(torch, dtype)  # gradients are reduced in float32, or in float64 for a float64 model
    mp = MixedPrecisionPolicy(param_dtype=param_dtype,
                              reduce_dtype=torch.promote_types(param_dtype, torch.float32))
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    units = list(model.model.layers) + [model]  # one all-gather per layer: peak memory about one layer
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp, offload_policy=offload)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM collectives: gloo has no pre-multiplied sum
    return model


def full_tensor(x: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a DTensor; every rank must call this), or the tensor itself."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def reshard(model):
    """Free the gathered copy of an FSDP2 root's parameters, kept after a forward for the backward that
    usually follows (none follows a no-grad forward). Local (no collective); a no-op without FSDP."""
    if hasattr(model, "reshard"):
        model.reshard()


def autocast(dtype: str, device: torch.device):
    """The compute-dtype context of the trainer's forward passes (a no-op in float32 and float64)."""
    return torch.autocast(device.type, getattr(torch, dtype), enabled=dtype in ("bfloat16", "float16"))


def full_state_dict(model) -> dict:
    """The unsharded state dict, on CPU; under FSDP every rank must call it and rank 0 gets the tensors."""
    if not is_dist():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ------------------------------------------------------------------------------------------------------------
# LoRA (--lora_rank > 0): peft's low-rank adapters on the linear layers of the blocks, the base frozen. The
# model stays the Hugging Face model (peft swaps its layers in place), so everything above works unchanged.
# On disk an adapter is what PeftModel.save_pretrained writes (vLLM and PeftModel.from_pretrained load it).
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
_PEFT_PREFIX = "base_model.model."  # PeftModel's name for the model it wraps, in saved weight names


def is_lora(model) -> bool:
    """Whether peft's adapters are in the model (add_lora)."""
    return bool(getattr(model, "peft_config", None))


def block_linear_names(model) -> list[str]:
    """The names of the linear layers inside the model's blocks, once each (q_proj, ..., down_proj)."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.model.layers.named_modules()
                   if isinstance(module, torch.nn.Linear)})


def lora_config(model, cfg):
    """peft's LoraConfig from the --lora_* flags; a target the model's blocks do not have stops here."""
    try:
        from peft import LoraConfig
    except ImportError:
        die("--lora_rank needs peft: pip install -r requirements/lora.txt")
    available = block_linear_names(model)
    targets = [t.strip() for t in cfg.lora_target_modules.split(",") if t.strip()] or available
    missing = [t for t in targets if t not in available]
    if missing:
        die(f"--lora_target_modules: {_model_name(model)} has no linear layer named {', '.join(missing)} in "
            f"its blocks (it has {', '.join(available)})")
    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=targets,
                      lora_dropout=cfg.lora_dropout, bias="none", task_type="CAUSAL_LM",
                      base_model_name_or_path=model.config.name_or_path)


def add_lora(model, cfg):
    """The model with peft's LoRA layers swapped in (B = 0: it computes as the base until trained), only the
    adapters trainable, in float32 (the optimizer's master copy, whatever the base's dtype)."""
    config = lora_config(model, cfg)  # (says what to install if peft is missing)
    from peft import inject_adapter_in_model
    model = inject_adapter_in_model(config, model)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model


@contextlib.contextmanager
def adapter_disabled(model):
    """Inside, a LoRA model computes as its base (peft's disable_adapter): the KL reference without a second
    copy of the weights. peft also turns the adapters' requires_grad off and back on, so call it outside
    any forward whose backward is pending. A no-op on a model without adapters."""
    from_peft = [m for m in model.modules() if hasattr(m, "enable_adapters") and hasattr(m, "lora_A")]
    for module in from_peft:
        module.enable_adapters(False)
    try:
        yield
    finally:
        for module in from_peft:
            module.enable_adapters(True)


def adapter_state_dict(model, device: torch.device | None = None) -> dict:
    """The adapters' weights, whole, on the CPU, under the names peft saves them with
    (base_model.model.<layer>.lora_A.weight). Under FSDP every rank gathers each (on `device`, else where
    its shard is), in the same order: every rank gets them all."""
    from peft import get_peft_model_state_dict
    trained = {n: full_tensor(p.detach().to(device or p.device)).cpu()
               for n, p in model.named_parameters() if p.requires_grad}
    return {_PEFT_PREFIX + k: v for k, v in get_peft_model_state_dict(model, state_dict=trained).items()}


def save_adapter(model, weights: dict, path: str):
    """Write adapter_state_dict's `weights` and the adapter's config to the folder `path` (peft's format)."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(path, ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    model.peft_config["default"].save_pretrained(path)


def load_adapter(model, path: str):
    """Load a saved adapter's weights into the model's adapters, which must match it (rank, alpha, layers)."""
    import json
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    saved, ours = json.load(open(os.path.join(path, ADAPTER_CONFIG))), model.peft_config["default"]
    for key, flag in (("r", "lora_rank"), ("lora_alpha", "lora_alpha"),
                      ("target_modules", "lora_target_modules")):
        mine, theirs = getattr(ours, key), saved[key]
        if key == "target_modules":
            mine, theirs = sorted(mine), sorted(theirs)
        if mine != theirs:
            die(f"--resume: {path}'s adapter has {key} {theirs}, this run's --{flag} gives {mine}: "
                f"resume with the adapter's settings")
    weights = load_file(os.path.join(path, ADAPTER_WEIGHTS))
    weights = {k.removeprefix(_PEFT_PREFIX): v for k, v in weights.items()}
    result = set_peft_model_state_dict(model, weights)
    if result.unexpected_keys:
        die(f"--resume: {path} holds weights this adapter does not have ({result.unexpected_keys[0]}, ...)")


def merged_parameters(model, device: torch.device, dtype: torch.dtype):
    """(name, whole tensor) of the model as a plain Hugging Face model, one at a time: each adapted layer's
    weight merged, W + (alpha / r) B A, under the base's name; the adapters themselves are not yielded.
    Under FSDP every rank gathers each tensor in the same order (collectives in lockstep)."""
    modules = dict(model.named_modules())
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue  # merged into their layer's weight below
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".base_layer"):  # a peft LoRA layer's frozen base: merge its adapter in
            layer = modules[owner.removesuffix(".base_layer")]
            value = full_tensor(p.detach().to(device, torch.float32))
            if leaf == "weight":
                a = full_tensor(layer.lora_A["default"].weight.detach().to(device, torch.float32))
                b = full_tensor(layer.lora_B["default"].weight.detach().to(device, torch.float32))
                value = value + layer.scaling["default"] * (b @ a)
            yield f"{owner.removesuffix('.base_layer')}.{leaf}", value.to(dtype)
        else:
            yield name, full_tensor(p.detach().to(device, dtype))


def load_policy(resume_from: str | None, base_path: str, cfg):
    """(model, tokenizer, the folder of its full weights), on the CPU: the checkpoint's model (--resume) or
    --model's; with --lora_rank the base from --model, frozen, with LoRA adapters (the checkpoint's on
    --resume). The base is kept in the compute dtype: nothing updates it, so it needs no float32 copy."""
    if not cfg.lora_rank:
        return (*load_model(resume_from or base_path), resume_from or base_path)
    model, tok = load_model(base_path, dtype=cfg.dtype)
    model = add_lora(model, cfg)
    if resume_from:
        load_adapter(model, resume_from)
    return model, tok, base_path


# ------------------------------------------------------------------------------------------------------------
# Start-up: each shortcut of token_logprobs checked where training runs (after sharding, on the training
# device, in the training dtype under autocast, with a backward where training runs one) against the path it
# stands in for; every rank runs the same forwards (lockstep) and each verdict is all-reduced before any rank
# acts on it. Then vLLM's calibration, and the KL anchor.
def _agreed(why: str) -> str:
    """`why` ('' = passed) once every rank has passed or failed: a failure anywhere fails everywhere."""
    failed = all_reduce_max(torch.tensor(float(bool(why)))).item() > 0
    return (why or "it failed on another rank") if failed else ""


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _probe_rows(model, device):
    """The rows the checks run: two groups, prompts of 4 tokens, completions of 8, 4, 1 and 3, 2 tokens (right
    padded; no left padding, so that padded rows differ from each row alone by rounding only). Packed under
    sdpa as [11, 7, 4], [6, 5] (one row under flash attention): sequences with tokens to score follow others,
    where a forward that mixes sequences shows. Ids from the vocabulary's first 48 (a padded vocabulary's logits may
    be cut short: Inkling's). Returns (input_ids, attention_mask) (5, 12), T = 8, groups (5,)."""
    vocab = min(model.get_input_embeddings().num_embeddings, 48)
    ids = 3 + (torch.arange(60, device=device).view(5, 12) * 7 + 1) % (vocab - 3)
    ids[1:3, :4] = ids[0, :4]  # a group's prompt: the same tokens
    ids[4, :4] = ids[3, :4]
    lengths = torch.tensor([12, 8, 5, 7, 6], device=device)[:, None]  # prompt + completion
    attn = (torch.arange(12, device=device) < lengths).long()
    return ids * attn, attn, 8, torch.tensor([0, 0, 0, 1, 1], device=device)


def _gradient_sums(model) -> torch.Tensor:
    """Two numbers that a change of the gradient moves, sums of positive terms (no cancellation: they round
    to a few float32 roundings of themselves): the sum of its squares and of its absolute values, over all
    ranks (FSDP2's shards summed), in float64."""
    sums = torch.zeros(2, dtype=torch.float64, device=next(model.parameters()).device)
    for p in model.parameters():
        if p.grad is not None:
            g = (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).double()
            sums += torch.stack([(g * g).sum(), g.abs().sum()])
    return all_reduce_sum(sums.cpu())


def _probe(model, rows, dtype: str, device, alone: bool = False, **path):
    """One path of token_logprobs on the probe rows (`alone`: each row by itself, unpadded), where training
    runs: its log-probs (B, T) in float64, 0 off the completions, and _gradient_sums of sum_t t log p_t after
    a backward (None for a model that does not train); or the error it raised, as text. Every rank runs it
    (its collectives) and the gradient's all-reduce, whatever happened."""
    ids, attn, T, _ = rows
    trains = any(p.requires_grad for p in model.parameters())
    lengths = attn[:, -T:].sum(-1).tolist()
    parts = [(i, attn[i].bool(), n) for i, n in enumerate(lengths) if n > 0] if alone else [(None, None, T)]
    logp = torch.zeros(attn[:, -T:].shape, dtype=torch.float64, device=device)  # (B, T)
    try:
        for i, keep, n in parts:  # (i None: the rows together)
            part = (ids, attn) if i is None else (ids[i, keep][None], attn[i, keep][None])
            with torch.set_grad_enabled(trains), autocast(dtype, device):
                out = token_logprobs(model, *part, n, **path)[0].double() * part[1][:, -n:]
            logp[slice(None) if i is None else i, :n] = out.detach()
            if trains:
                (out * torch.arange(1, n + 1, device=device)).sum().backward()
    except Exception as e:  # any failure refuses the path (the same on every rank: same model, same rows)
        logp = _error(e)
    sums = _gradient_sums(model) if trains else None
    model.zero_grad(set_to_none=True)
    return logp, sums


def _gaps(probe, reference) -> tuple[float, float]:
    """The largest gap of two probes' log-probs, and of their gradient sums relative to the reference's."""
    logp = (probe[0] - reference[0]).abs().max().item()
    if reference[1] is None:
        return logp, 0.0
    return logp, ((probe[1] - reference[1]).abs() / reference[1].abs().clamp(min=1e-30)).max().item()


def _path_refusal(model, rows, dtype: str, device, reference, noise: tuple, **path) -> str:
    """'' if the path gives each row's own log-probs and gradient (`reference`) to within 4 x `noise` (the
    padded rows' gaps from them: the kernels' rounding from one layout to another) plus roundings of the
    compute dtype (bf16 under its autocast, else the weights' or float32): 2 at the log-probs' scale, 8 of
    the gradient's (at least float32's: families round it there, RMSNorm), else why not. Agreed across ranks.
    In bf16 a log-prob rounds to ~0.1 nat at logits of 20, so there only a gross error shows: a leak between
    sequences, a state carried across them."""
    probe = _probe(model, rows, dtype, device, **path)
    if isinstance(probe[0], str):
        return _agreed(probe[0])
    weights = next(model.parameters()).dtype
    compute = getattr(torch, dtype) if dtype in ("bfloat16", "float16") else torch.promote_types(weights,
                                                                                                  torch.float32)
    eps = torch.finfo(compute).eps
    logp, grad = _gaps(probe, reference)
    why = ""
    if not logp <= 4 * noise[0] + 2 * eps * (1 + reference[0].abs().max().item()):  # (NaN fails too)
        why = f"log-probs off by {logp:.3g}"
    elif not grad <= 4 * noise[1] + 8 * max(eps, torch.finfo(torch.float32).eps):
        why = f"gradient off by {grad:.3g} of itself"
    return _agreed(why)


@torch.no_grad()
def check_chunked_logprobs(model, dtype: str = "float32"):
    """Exit 2 (every rank) unless the model's output layer is one token_logprobs' chunks can stand in for,
    under the trainer's autocast: head_logits of the output layer's input must give back the forward's
    logits to one rounding of the compute dtype (the same elementwise operations on the same numbers; a
    missing soft-cap or scale is far more). check_logprob_paths then compares the chunks' log-probs and
    gradient with the whole logits'."""
    head = model.get_output_embeddings()
    why = "" if head is not None else "it has no output layer"
    if head is not None:
        why = _head_refusal(model, head, dtype)
    why = _agreed(why)
    if why:
        die(f"--logprob_chunk: the chunked log-probs of {_model_name(model)} would not be its own ({why}); "
            "run with --logprob_chunk 0")


def _head_refusal(model, head, dtype: str) -> str:
    """'' if head_logits of the output layer's input give back the forward's logits, else why not."""
    embeddings = model.get_input_embeddings()
    device = next(model.parameters()).device
    ids = 3 + torch.arange(8, device=device)[None] * 7 % (min(embeddings.num_embeddings, 64) - 3)  # (1, 8)
    inputs, forward = [], head.forward

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
    if ours.shape != logits.shape or not (ours - logits).abs().max().item() <= eps * scale:  # (NaN fails too)
        return "its forward changes its output layer's result in a way modeling.head_logits does not know"
    return ""


def check_logprob_paths(model, cfg, device: torch.device | None = None):
    """Start-up checks of the sharded model on `device`: each shortcut token_logprobs may take against each
    row's own forward (and the padded rows' distance from it), in cfg.dtype under autocast, with a backward
    (a model that trains): chunks of the output layer (--logprob_chunk > 0: exit 2 if off); a group's
    prompt run once (padded rows, no checkpointing: model.shares_prompts; a hybrid or recurrent cache may not
    index out); packed rows (--pack: model.pack_refusal, '' or why not, and a note). `device`: the
    parameters'."""
    device = device or next(model.parameters()).device
    rows = _probe_rows(model, device)
    alone = _probe(model, rows, cfg.dtype, device, alone=True)  # each row's own forward: what is right
    padded = _probe(model, rows, cfg.dtype, device)  # the rows whole and padded, whole logits
    why = _agreed(next((x for x in (alone[0], padded[0]) if isinstance(x, str)), ""))
    if why:
        die(f"--model: {_model_name(model)}'s forward fails on the start-up check's rows ({why})")
    noise = _gaps(padded, alone)  # the kernels' rounding from one layout to another (no left padding)
    check = lambda **path: _path_refusal(model, rows, cfg.dtype, device, alone, noise, **path)  # noqa
    if cfg.logprob_chunk > 0:
        check_chunked_logprobs(model, cfg.dtype)
        why = check(chunk_tokens=2 * len(rows[0]))  # chunks of 2 positions, the last one shorter
        if why:
            die(f"--logprob_chunk: the chunked log-probs of {_model_name(model)} would not be its own "
                f"({why}); run with --logprob_chunk 0")
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


def set_attention(model, implementation: str):
    """The model's attention implementation (--attn_implementation): transformers' own, set before sharding;
    one it cannot use here (flash attention not installed, or on a CPU) exits 2."""
    if implementation and implementation != model.config._attn_implementation:
        try:
            model.set_attn_implementation(implementation)
        except (ImportError, ValueError, KeyError) as e:
            die(f"--attn_implementation {implementation}: transformers cannot use it here "
                f"({str(e).splitlines()[0]})")


def prepare_models(model, engine, base_path: str, cfg, dist_info: DistInfo):
    """(model, ref_model), sharded and checked where they train, the rollout engine calibrated against the
    model (vLLM: the weight-sync probe's start-up gap); ref_model, the KL anchor, is the initial model even
    after a resume: with LoRA the model itself, which token_losses runs with its adapters off (the base: no
    second copy)."""
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
