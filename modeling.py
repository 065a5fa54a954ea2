"""
Look up when needed: the models. Loading (a hub id, a folder, or the demo model), FSDP2 sharding, LoRA
adapters (peft: --lora_rank), and the log-probs of completion tokens under any family's output layer: in
chunks, packed without padding (--pack), each shortcut probed at start-up.
"""
import contextlib
import os
import re

import torch
import torch.utils.checkpoint
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging as hf_logging

from ranks import DistInfo, die, is_dist, print0

hf_logging.disable_progress_bar()  # transformers' load/save bars would interleave with our one line per step


# ------------------------------------------------------------------------------------------------------------
# Loading. `--model demo` is a tiny Qwen3 with a character-level tokenizer, warm-started on the arith task by
# demo/build.py (which says why its weights are shipped), loaded as a hub model is: the demo runs real code.
DEMO_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo", "model")
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
            "(restore it from git, or rebuild it: python demo/build.py)")
    return DEMO_MODEL


def load_model(name: str, device: torch.device = torch.device("cpu"), dtype: str = "float32"):
    """A causal LM and its tokenizer (left padding) from a Hugging Face folder or hub id, dropout 0: the
    trainer runs in training mode, where dropout would make its log-probs a random draw, not the rollout's."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
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
    (no grad: entropy, nucleus log-probs or None); `groups` (B,): rows sharing a prompt run it once. With
    `pack`, on a model that packs, the forwards run without padding (_packed_outputs, or
    _packed_whole_outputs where rows run whole); both outputs are then 0 at padded positions.
    Memory: a micro-batch's logits are (B, T, V) floats, 25 GB in float32 at 2 x 20,480 x 151,936, and the
    log-softmax, entropy and backward make several. With chunk_tokens > 0, head_logits, the log-softmax and
    the entropy run on chunks of chunk_tokens tokens: peak memory grows with chunk_tokens x V; values and
    gradients are the same (tests/test_heads.py: every family, 1e-10 in float64; bench/logprob_memory.py)."""
    T = num_completion_tokens
    pack = _runs_packed(model, groups, pack)
    if pack:  # outputs (1, N, .) at the completions' N tokens, scattered back to (B, T) at the end
        where = attention_mask[:, -T:].bool()
        forward = lambda: (_packed_outputs(model, input_ids, attention_mask, T, groups)  # noqa: E731
                           if _shares_prompts(model, groups) else
                           _packed_whole_outputs(model, input_ids, attention_mask, T))
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
# Packed forwards (--pack): a micro-batch's prompts in one row, then its completions in one row on their KV
# cache, no padding. Every token carries (group, row, position); query q sees key k iff they share the
# group, k is a prompt token (row -1) or in q's row, and k's position <= q's (_sees). The attention takes
# it in its own form: sdpa as padded rows of the packed tokens, for the attention only (_attention_rows);
# eager as a dense additive (Lq, Lk) mask (CPU-sized only); flex attention as a BlockMask (scales on GPUs).
PACKED_ATTENTION = ("sdpa", "eager", "flex_attention")


def pack_refusal(model) -> str:
    """Why `model` cannot run packed forwards, or '' if it can: its attention must read a custom mask
    (PACKED_ATTENTION), on full-attention layers only (a custom mask would drop a sliding window)."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in PACKED_ATTENTION:
        return f"its attention implementation {implementation!r} takes no custom mask"
    if any(t != "full_attention" for t in getattr(model.config, "layer_types", None) or []):
        return "it has layers that are not full attention (a packed mask would drop their window)"
    return ""


def _attention_rows(q: tuple, k: tuple) -> tuple:
    """The packed queries q = (group, row, position) (Lq,) and keys k (Lk,) laid out again as R padded rows,
    one per (group, row) of the queries, for sdpa (_rows_sdpa): (q_at (R, Tq) and k_at (R, Tk), indices into
    the packed queries and keys; q_valid (R, Tq); the mask (R, 1, Tq, Tk); order: the rows' valid outputs in
    packed order). Attention then costs what padded rows cost, while the rest of the model runs packed."""
    (qg, qr, qp), (kg, kr, kp) = q, k
    span = int(max(qr.max(), kr.max())) + 3  # (group, row) -> one id: rows run from -1 (a prompt's) up
    rows, row_of = torch.unique((qg + 1) * span + qr + 1, return_inverse=True)
    g, r = rows // span - 1, rows % span - 1

    def lay_out(member):  # (R, L) bool -> each row's members in order, padded: (at (R, T), valid (R, T))
        count = member.sum(1)
        at = torch.argsort((~member).to(torch.int8), dim=1, stable=True)[:, :int(count.max())]
        return at, torch.arange(at.shape[1], device=at.device) < count[:, None]

    q_at, q_valid = lay_out(row_of[None] == torch.arange(len(rows), device=rows.device)[:, None])
    k_at, k_valid = lay_out((kg[None] == g[:, None]) & ((kr[None] == r[:, None]) | (kr[None] < 0)))
    mask = (k_valid[:, None] & (kp[k_at][:, None] <= qp[q_at][:, :, None])) | ~q_valid[:, :, None]  # (a
    return q_at, q_valid, k_at, mask[:, None], torch.argsort(q_at[q_valid])  # padded query sees all: no NaN)


def _rows_sdpa(module, query, key, value, attention_mask, packed_rows=None, **kwargs):
    """transformers' sdpa (_gqa_sdpa), unless a packed forward passes its rows (_attention_rows): then the
    packed queries, keys and values (1, heads, L, d) are laid out as padded rows, attend, and go back to
    packed order."""
    if packed_rows is None:
        return _gqa_sdpa(module, query, key, value, attention_mask, **kwargs)
    q_at, q_valid, k_at, mask, order = packed_rows
    q, k, v = (x[0][:, at].transpose(0, 1) for x, at in ((query, q_at), (key, k_at), (value, k_at)))
    out = _gqa_sdpa(module, q, k, v, mask, **kwargs)[0]  # (R, Tq, heads, d)
    return out[q_valid][order][None], None


def _gqa_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa, except on a CPU without gradients (our sampler's decode steps) for grouped-query
    attention under a mask: there transformers copies each key/value head for its query heads (repeat_kv),
    the whole KV cache at every new token, where sdpa's enable_gqa reads them in place. The output is the
    same bit for bit (tests/test_speed.py); with gradients the key/value gradients would be summed in another
    order, so training keeps transformers' path. On GPUs a mask with enable_gqa falls back to the slow math
    kernel, so they keep it too."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (groups == 1 or attention_mask is None or torch.is_grad_enabled() or query.device.type != "cpu"
            or kwargs.get("dropout", 0.0) or kwargs.get("position_bias") is not None or "cache" in kwargs):
        return _SDPA(module, query, key, value, attention_mask, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           scale=kwargs.get("scaling"), enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None  # (B, L, heads, d), as transformers returns it


# sdpa's entry in transformers' registry, wrapped: packed rows (_rows_sdpa), grouped heads in place (_gqa_sdpa)
_SDPA = ALL_ATTENTION_FUNCTIONS["sdpa"]
AttentionInterface.register("sdpa", _rows_sdpa)


def _sees(q: tuple, k: tuple) -> torch.Tensor:
    """Whether query q = (group, row, position) sees key k (the rule above), elementwise, broadcasting."""
    (qg, qr, qp), (kg, kr, kp) = q, k
    return (kg == qg) & ((kr == qr) | (kr < 0)) & (kp <= qp)


def _packed_mask(model, q: tuple, k: tuple):
    """The attention of queries q = (group, row, position), each (Lq,), on keys k (Lk,) each (see above), as
    the model's forward arguments: sdpa its rows (_attention_rows), else a mask (1, 1, Lq, Lk)."""
    implementation, device = model.config._attn_implementation, q[0].device
    if implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, h, i, j):
            return _sees(tuple(x[i] for x in q), tuple(x[j] for x in k))
        return {"attention_mask": create_block_mask(mask_mod, None, None, len(q[0]), len(k[0]), device)}
    if implementation == "sdpa":  # a 4D placeholder, which transformers passes through as it is
        return {"attention_mask": torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device),
                "packed_rows": _attention_rows(q, k)}
    allowed = _sees(tuple(x[:, None] for x in q), tuple(x[None] for x in k))[None, None]  # (1, 1, Lq, Lk)
    dtype = torch.promote_types(model.get_input_embeddings().weight.dtype, torch.float32)  # eager adds it
    return {"attention_mask": torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)}


def _packed_outputs(model, input_ids, attention_mask, T: int, groups):
    """_predicting_outputs' outputs, packed: (1, N, .) at the positions that predict each row's completion
    tokens (N = their number), rows in order. Two forwards, whatever the data (lockstep): the U prompts of the
    micro-batch in one row (each group's once), then its completions in one row on the prompts' KV cache (each
    row's tokens but its last; one placeholder token if there are none). The same values and gradients as the
    padded forwards (tests/test_pack.py)."""
    P, B = input_ids.shape[1] - T, input_ids.shape[0]
    device = input_ids.device
    position_ids = positions(attention_mask)
    inverse, first = _group_rows(groups)
    U = len(first)
    real = attention_mask[first, :P].bool()  # (U, P): the prompts' tokens (left padded)
    assert bool(real.any(-1).all()), "every prompt needs a token"
    p_pos = position_ids[first, :P][real]
    p = (torch.arange(U, device=device)[:, None].expand(U, P)[real], torch.full_like(p_pos, -1), p_pos)
    last = real.sum(-1).cumsum(0) - 1  # (U,): each prompt's last token in the packed row
    prompt = model(input_ids=input_ids[first, :P][real][None], **_packed_mask(model, p, p),
                   position_ids=p[2][None], use_cache=True, logits_to_keep=last)  # logits (1, U, .)
    inputs = torch.arange(T - 1, device=device)[None] < attention_mask[:, P:].sum(-1, keepdim=True) - 1
    rows = torch.arange(B, device=device)[:, None].expand(B, T - 1)[inputs]  # (B, T-1): all but the last
    c = (inverse[rows], rows, position_ids[:, P:-1][inputs])
    ids = input_ids[:, P:-1][inputs]
    if not len(ids):  # no completion has 2 tokens: a placeholder (sees itself only) keeps the forward count
        c, ids = tuple(torch.full((1,), v, device=device) for v in (-1, B, 0)), input_ids[:1, P]
    rest = model(input_ids=ids[None], **_packed_mask(model, c, tuple(map(torch.cat, zip(p, c)))),
                 position_ids=c[2][None], past_key_values=prompt.past_key_values, use_cache=True).logits
    where = torch.empty(B, T, dtype=torch.long, device=device)  # each target's output in cat(prompt, rest)
    where[:, 0] = inverse  # the first completion token: its prompt's last position
    where[:, 1:] = U + inputs.flatten().cumsum(0).view(B, T - 1) - 1
    return torch.cat([prompt.logits[0], rest[0]])[where[attention_mask[:, P:].bool()]][None]


def _runs_packed(model, groups, pack: bool) -> bool:
    """Whether token_logprobs runs packed: asked, on a model that packs (model.pack_refusal, pack_refusal)."""
    return pack and not getattr(model, "pack_refusal", pack_refusal(model))


def forward_tokens(model, attention_mask, T: int, groups=None, pack: bool = False) -> tuple[int, int]:
    """(positions token_logprobs' forwards run, those a forward needs: each completion's tokens but its last,
    and each row's prompt, or each group's once where rows share it): rows whole, B x width; a group's
    prompt once, then the completions padded, U x prompt width + B x (T - 1); packed, the tokens needed."""
    B, width = attention_mask.shape
    completions = int((attention_mask[:, width - T:].sum(-1) - 1).clamp(min=0).sum())
    if not _shares_prompts(model, groups):
        needed = int(attention_mask[:, :width - T].sum()) + completions
        return (needed if _runs_packed(model, groups, pack) else B * width), needed
    first = _group_rows(groups)[1]
    needed = int(attention_mask[first, :width - T].sum()) + completions
    if _runs_packed(model, groups, pack):
        return needed + (completions == 0), needed  # (a placeholder when no completion has 2 tokens)
    return len(first) * (width - T) + B * (T - 1), needed


def _packed_whole_outputs(model, input_ids, attention_mask, T: int):
    """_packed_outputs where rows run whole (no groups, a checkpointed model, or one that cannot share its
    cache: _shares_prompts): each row's tokens but its last, all rows in one row, one forward."""
    B, width = input_ids.shape
    P = width - T
    position_ids = positions(attention_mask)
    keep = attention_mask.bool().clone()  # (a bool mask's .bool() is the mask itself)
    keep[:, P:] = torch.arange(T, device=keep.device) < attention_mask[:, P:].sum(-1, keepdim=True) - 1
    rows = torch.arange(B, device=keep.device)[:, None].expand(B, width)[keep]
    t = (rows, rows, position_ids[keep])  # a row is its own group: it sees its own earlier tokens only
    where = (keep.flatten().cumsum(0).view(B, width) - 1)[:, P - 1:-1]  # target t: column P - 1 + t's output
    return model(input_ids=input_ids[keep][None], **_packed_mask(model, t, t),
                 position_ids=t[2][None], logits_to_keep=where[attention_mask[:, P:].bool()]).logits


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
        die("--lora_rank needs peft: pip install -r requirements-lora.txt")
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
# Start-up: token_logprobs' shortcuts checked on the unsharded model, then FSDP2, calibration; the KL anchor.
@torch.no_grad()
def check_chunked_logprobs(model, dtype: str = "float32"):
    """Exit 2 unless token_logprobs' chunks compute what the model's forward does, under the trainer's
    autocast (the same on every rank): head_logits of the output layer's input must give back the forward's
    logits to one rounding of the compute dtype (the same elementwise operations on the same numbers; a
    missing soft-cap or scale is far more), and chunks of one position must run and match their log-probs to
    1e-3 of the logits' scale (a log-softmax over a large vocabulary rounds to a few 1e-4 in float32)."""
    head = model.get_output_embeddings()

    def refuse(why: str):
        die(f"--logprob_chunk: the chunked log-probs of {_model_name(model)} would not be its own ({why}); "
            "run with --logprob_chunk 0")

    if head is None:
        refuse("it has no output layer")
    embeddings = model.get_input_embeddings()
    ids = (3 + torch.arange(8, device=embeddings.weight.device)[None] * 7
           % (min(embeddings.num_embeddings, 64) - 3))
    attn, inputs, forward = torch.ones_like(ids), [], head.forward  # ids (1, 8): 4 prompt + 4 completion

    def spy(hidden):
        inputs.append(hidden)
        return forward(hidden)

    with autocast(dtype, ids.device):
        with _head_forward(head, spy):
            logits = model(input_ids=ids, attention_mask=attn).logits  # (1, 8, V)
        if len(inputs) != 1:
            refuse(f"its forward called its output layer {len(inputs)} times, not once")
        ours = head_logits(model, head, inputs[0])
        try:
            logp = token_logprobs(model, ids, attn, 4, 1.0, False, chunk_tokens=1)[0]  # chunks of 1 position
        except Exception as e:  # e.g. a forward that needs its output layer's result to be logits
            refuse(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    dtypes = (logits.dtype, ours.dtype, head.weight.dtype, getattr(torch, dtype))
    eps = max(torch.finfo(t).eps for t in dtypes)
    scale = 1.0 + logits.abs().max().item()
    if ours.shape != logits.shape or not (ours - logits).abs().max().item() <= eps * scale:  # (NaN fails too)
        refuse("its forward changes its output layer's result in a way modeling.head_logits does not know")
    gap = (logp - _logprobs_of_logits(logits[:, 3:7], ids[:, 4:], 1.0, False)[0]).abs().max().item()
    if not gap <= max(1e-3, 8 * eps) * scale:
        refuse(f"chunked log-probs off by {gap:.3g}")


@torch.no_grad()
def check_logprob_paths(model, cfg):
    """On the unsharded CPU model (a failure costs no collective); model.shares_prompts: whether two rows with
    one prompt agree whole and sharing its KV cache (a hybrid or recurrent cache may not index out)."""
    if cfg.logprob_chunk > 0:
        check_chunked_logprobs(model, cfg.dtype)
    ids = 3 + torch.arange(12).view(2, 6) % 5  # (2, 6): a shared prompt of 3 tokens, then 3 different each
    ids[:, :3] = ids[0, :3]
    attn, groups = torch.ones_like(ids), torch.zeros(2, dtype=torch.long)
    was_training = model.training
    model.eval()
    try:
        whole = token_logprobs(model, ids, attn, 3)[0]
        model.shares_prompts = True
        shared = token_logprobs(model, ids, attn, 3, groups=groups)[0]
        model.shares_prompts = bool(torch.allclose(shared, whole, rtol=1e-4, atol=1e-4))
    except (RuntimeError, AttributeError, TypeError, ValueError, IndexError):
        model.shares_prompts = False  # the cache cannot be indexed out
    if getattr(cfg, "pack", False):
        model.pack_refusal = pack_refusal(model)  # then packed as it would run: compared with padded
        model.pack_refusal = model.pack_refusal or _check_packed(model)
        if model.pack_refusal:
            print0(f"note: --pack: {_model_name(model)} runs padded ({model.pack_refusal})")
    model.train(was_training)
    if not model.shares_prompts:
        print0(f"note: {_model_name(model)}'s KV cache cannot be shared by a group's rows: "
               "each row runs its prompt")


def _check_packed(model) -> str:
    """'' if packed log-probs (both paths) agree with padded ones on two groups of uneven prompts and
    completions, else why not (a family whose forward does not take a custom mask as it should)."""
    ids = 3 + torch.arange(30).view(3, 10) % 7  # (3, 10): prompts of 4, 4, 2 tokens; completions of 5, 2, 6
    attn = torch.ones_like(ids)
    attn[2, :2] = 0
    attn[0, 9] = attn[1, 6:] = 0
    ids[1, :4] = ids[0, :4]
    groups = torch.tensor([0, 0, 1])
    try:
        padded = token_logprobs(model, ids, attn, 6, groups=groups)[0] * attn[:, 4:]
        gap = max((token_logprobs(model, ids, attn, 6, groups=g, pack=True)[0] - padded).abs().max().item()
                  for g in (groups, None))  # a group's prompt once, and rows whole (a checkpointed model)
    except (RuntimeError, AttributeError, TypeError, ValueError, IndexError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return "" if gap <= 1e-4 else f"packed log-probs off by {gap:.3g}"


def prepare_models(model, engine, base_path: str, cfg, dist_info: DistInfo):
    """(model, ref_model), checked and sharded, the rollout engine calibrated against the model (vLLM: the
    weight-sync probe's start-up gap); ref_model, the KL anchor, is the initial model even after a resume:
    with LoRA the model itself, which token_losses runs with its adapters off (the base: no second copy)."""
    check_logprob_paths(model, cfg)
    model = shard_model(model, dist_info, cfg.dtype, cfg.grad_checkpointing, cfg.cpu_offload)
    engine.calibrate(model)
    if cfg.kl_coef <= 0:
        return model, None
    if is_lora(model):
        return model, model
    ref_model = load_model(base_path)[0].requires_grad_(False)
    check_logprob_paths(ref_model, cfg)
    return model, shard_model(ref_model, dist_info, cfg.dtype, cpu_offload=cfg.cpu_offload).eval()
