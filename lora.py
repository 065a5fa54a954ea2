"""
Look up when needed: LoRA (--lora_rank > 0), a room of its own.
peft's low-rank adapters on the linear layers of the blocks, the base frozen.
The model stays the Hugging Face model (peft swaps its layers in place), so the step runs unchanged;
it reaches this file through the KL anchor (adapter_disabled),
the checkpoints (the adapter is what is saved) and the engines' weight sync.
On disk an adapter is what PeftModel.save_pretrained writes (vLLM and PeftModel.from_pretrained load
it), plus a record of the base it was trained on, which --resume checks.
"""
import contextlib
import hashlib
import json
import os

import torch
from transformers.pytorch_utils import Conv1D

from modeling import decoder_blocks, full_tensor, load_model, model_name
from ranks import die

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# The base an adapter was trained on (base_record), beside peft's files: adapter_config.json names
# the base only by the path it was loaded from, which differs between clones and machines.
BASE_RECORD = "base_model.json"
# PeftModel's name for the model it wraps, in saved weight names
_PEFT_PREFIX = "base_model.model."


def is_lora(model) -> bool:
    """Whether peft's adapters are in the model (add_lora)."""
    return bool(getattr(model, "peft_config", None))


def block_linear_names(model, kinds: tuple = (torch.nn.Linear, Conv1D)) -> list[str]:
    """The names of the linear layers (of `kinds`) in the model's blocks, once each (q_proj, ...,
    down_proj). GPT-2's are transformers' Conv1D, whose weight is stored (in, out)."""
    names = set()
    for name, module in decoder_blocks(model).named_modules():
        if isinstance(module, kinds):
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
        die(f"--lora_target_modules: {model_name(model)} has no linear layer named "
            f"{', '.join(missing)} in its blocks (it has {', '.join(available)})")
    # fan_in_fan_out: peft's name for weights stored (in, out), as Conv1D's are
    fan_in_fan_out = bool(set(targets) & set(block_linear_names(model, (Conv1D,))))
    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=targets,
                      lora_dropout=cfg.lora_dropout, fan_in_fan_out=fan_in_fan_out, bias="none",
                      task_type="CAUSAL_LM", base_model_name_or_path=model.config.name_or_path)


def base_record(model) -> dict:
    """What identifies a base model: the name it was loaded by, and a fingerprint of its weights.
    The fingerprint hashes each weight's name and shape and 256 of its values, strided over it,
    rounded to bfloat16 (so that a float32 and a bfloat16 load of one base agree)."""
    digest = hashlib.sha256()
    for name, weight in model.state_dict().items():
        values = weight.detach().flatten()[::max(1, weight.numel() // 256)][:256]
        digest.update(f"{name} {tuple(weight.shape)}".encode())
        digest.update(values.to(torch.bfloat16).float().cpu().numpy().tobytes())
    return {"name_or_path": model.config.name_or_path, "fingerprint": digest.hexdigest()[:16]}


def add_lora(model, cfg):
    """The model with peft's LoRA layers swapped in (B = 0: it computes as the base until
    trained), only the adapters trainable, in float32 (the optimizer's master copy, whatever the
    base's dtype). model.lora_base is the base's record (base_record), which checkpoints keep."""
    config = lora_config(model, cfg)  # (says what to install if peft is missing)
    base = base_record(model)
    from peft import inject_adapter_in_model
    model = inject_adapter_in_model(config, model)
    model.lora_base = base
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
    with open(os.path.join(path, BASE_RECORD), "w") as f:
        json.dump(model.lora_base, f, indent=1)


def load_adapter(model, path: str):
    """Load a saved adapter's weights into the model's adapters, which must match it
    (rank, alpha, layers), on the base it was trained on (the fingerprints of BASE_RECORD)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    check_base(model, path)
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


def check_base(model, path: str):
    """Stop with one line if the adapter at `path` was trained on another base than the model's:
    the fingerprints differ, whatever the names (a clone's demo folder is the same base). An
    adapter folder without a BASE_RECORD is not checked."""
    record = os.path.join(path, BASE_RECORD)
    if not os.path.isfile(record):
        return
    theirs = json.load(open(record))
    ours = model.lora_base
    if theirs["fingerprint"] != ours["fingerprint"]:
        die(f"--resume: {path}'s adapter was trained on the base {theirs['name_or_path']} (weights "
            f"{theirs['fingerprint']}), not on this run's --model {ours['name_or_path']} (weights "
            f"{ours['fingerprint']}): resume with the adapter's base as --model")


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
            delta = b @ a  # (out, in)
            if layer.fan_in_fan_out:  # a Conv1D's weight is (in, out)
                delta = delta.T
            value = value + layer.scaling["default"] * delta
        yield f"{layer_name}.{leaf}", value.to(dtype)


def load_lora_policy(resume_from: str | None, base_path: str, cfg):
    """bookkeeping.load_policy with --lora_rank: the base from --model in the compute dtype (nothing
    updates it, so it needs no float32 copy), frozen, with LoRA adapters (the checkpoint's
    on --resume)."""
    model, tok = load_model(base_path, dtype=cfg.dtype)
    model = add_lora(model, cfg)
    if resume_from:
        load_adapter(model, resume_from)
    return model, tok, base_path
