"""
Look up when needed: the models. Loading (a hub id, a folder, or the demo model),
the helpers every log-prob path shares (position ids, the top_p nucleus, a model's name),
where a model keeps its decoder blocks, FSDP2's sharding and the compute dtype,
and the attention implementation. Nothing here changes another library's state at import.
"""
import os
import re

import torch
from transformers.utils import logging as hf_logging

from ranks import DistInfo, die, is_dist

# --------------------------------------------------------------------------------------------------
# Loading. `--model demo` is a tiny Qwen3 with a character-level tokenizer, warm-started on the
# reasoning demo's sums by demo/build.py (which says why its weights are shipped; the sums demo's
# is in demo/arith/model), loaded as a hub model is: the demo runs real code.
DEMO_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo", "reasoning", "model")
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
    """--model as a path or hub id; 'demo' is the reasoning demo's model (demo/reasoning/model/)."""
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


# --------------------------------------------------------------------------------------------------
# What every path that computes log-probs shares: the position ids of left-padded rows,
# the top_p nucleus the engines sample from, and a model's name for messages.
def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """position_ids from an attention mask: 0 at each row's first real token (left padding
    shifts none)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


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


def eos_ids(eos, tok) -> list[int]:
    """The ids that end a completion: a config's eos_token_id (an id, a list or None)
    and the tokenizer's."""
    if eos is None:
        eos = []
    elif not isinstance(eos, list):
        eos = [eos]
    return sorted(set(eos) | {tok.eos_token_id})


def model_name(model) -> str:
    """The model's class name (FSDP2 makes the module an instance of its subclass FSDP<name>)."""
    return next(c.__name__ for c in type(model).__mro__ if not c.__module__.startswith("torch."))


# --------------------------------------------------------------------------------------------------
# Where a causal LM keeps its decoder blocks: LoRA adapts their layers, FSDP2 shards each as a unit.
# transformers' families keep them at one of these paths: Llama, Qwen, Mistral, Gemma and most
# others; GPT-NeoX (Pythia); GPT-2, Falcon, BLOOM, GPT-J; OPT.
BLOCK_PATHS = ("model.layers", "gpt_neox.layers", "transformer.h", "model.decoder.layers")


def decoder_blocks(model) -> torch.nn.ModuleList:
    """The model's list of decoder blocks (the first of BLOCK_PATHS it has). A model that keeps
    them elsewhere stops here with one line naming its class."""
    for path in BLOCK_PATHS:
        try:
            return model.get_submodule(path)
        except AttributeError:
            continue
    die(f"{model_name(model)}: its decoder blocks are at none of {', '.join(BLOCK_PATHS)}, where "
        f"LoRA and FSDP2 (torchrun) look for them (modeling.BLOCK_PATHS)")


# --------------------------------------------------------------------------------------------------
# The models as the trainer holds them: sharded, the forward's compute dtype, the whole state
# for a save.
def shard_model(model, dist_info: DistInfo, dtype: str = "float32",
                grad_checkpointing: bool = False, cpu_offload: bool = False):
    """The model on the device in training mode (checkpointing only recomputes there; dropout is
    0), under torchrun sharded with FSDP2 (fully_shard_model)."""
    model.train()
    if grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if is_dist():
        return fully_shard_model(model, dist_info, dtype, cpu_offload)
    return model.to(dist_info.device)


def fully_shard_model(model, dist_info: DistInfo, dtype: str, cpu_offload: bool):
    """FSDP2 over every rank, a unit per block and one for the rest. Weights stay float32 (the
    optimizer's master copy), gathered in `dtype`. Gradients are SUMMED over ranks: the loss weights
    already divide by global token and sequence counts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                        fully_shard)
    # one all-gather per block: peak memory about one block
    units = list(decoder_blocks(model)) + [model]
    mesh = init_device_mesh(dist_info.device.type, (dist_info.world_size,))
    param_dtype = getattr(torch, dtype)
    # gradients are reduced in float32, or in float64 for a float64 model
    reduce_dtype = torch.promote_types(param_dtype, torch.float32)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if cpu_offload:
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    else:
        offload = OffloadPolicy()
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
    that usually follows (none follows a no-grad forward). Local (no collective); a no-op
    without FSDP."""
    if hasattr(model, "reshard"):
        model.reshard()


def autocast(dtype: str, device: torch.device):
    """The compute-dtype context of the trainer's forward passes (a no-op in float32, float64)."""
    enabled = dtype in ("bfloat16", "float16")
    return torch.autocast(device.type, getattr(torch, dtype), enabled=enabled)


def full_state_dict(model) -> dict:
    """The unsharded state dict, on CPU; under FSDP every rank must call it and rank 0 gets
    the tensors."""
    if not is_dist():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


# --------------------------------------------------------------------------------------------------
# The attention implementation the trainer runs (--attn_implementation), set before sharding.
def set_attention(model, implementation: str):
    """Set the model's attention implementation (--attn_implementation), transformers' own, before
    sharding; one it cannot use here (flash attention not installed, or on a CPU) exits 2."""
    if implementation and implementation != model.config._attn_implementation:
        try:
            model.set_attn_implementation(implementation)
        except (ImportError, ValueError, KeyError) as e:
            die(f"--attn_implementation {implementation}: transformers cannot use it here "
                f"({str(e).splitlines()[0]})")
