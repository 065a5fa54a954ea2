"""Write a LoRA checkpoint's model as a plain Hugging Face folder: its adapter merged into the base weights, W + (alpha
/ r) B A, by peft. The folder loads with from_pretrained, in vLLM, and as --model (a new run, or --eval_only).

Usage: python -m tools.merge_lora out/da3po/step_000020 merged/        # the base: the adapter's own record
       python -m tools.merge_lora out/da3po/step_000020 merged/ --base Qwen/Qwen3-4B-Base   # or named here"""
import argparse
import json
import os

from modeling import model_path
from lora import ADAPTER_CONFIG
from ranks import die


def merge(checkpoint: str, out: str, base: str = ""):
    """The checkpoint's adapter on its base (`base`, else the one adapter_config.json names), merged, saved to
    `out` with the checkpoint's tokenizer, in the base's own dtype."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    config = os.path.join(checkpoint, ADAPTER_CONFIG)
    if not os.path.isfile(config):
        die(f"{checkpoint}: no {ADAPTER_CONFIG}, so no LoRA adapter to merge (a full fine-tune's checkpoint is "
            f"already a Hugging Face model folder)")
    base = model_path(base or json.load(open(config))["base_model_name_or_path"] or "")
    try:
        dtype = AutoConfig.from_pretrained(base).dtype or torch.float32  # the base's own
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)  # merged in float32
    except (OSError, ValueError) as e:
        die(f"the base model {base!r}: cannot load it ({str(e).splitlines()[0]}); name it with --base")
    merged = PeftModel.from_pretrained(model, checkpoint).merge_and_unload()
    merged.to(dtype).save_pretrained(out)
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(out)
    print(f"wrote {out}: {base} with {checkpoint}'s adapter merged in")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("checkpoint", help="a checkpoint folder of a --lora_rank run (out_dir/step_XXXXXX)")
    p.add_argument("out", help="the folder to write")
    p.add_argument("--base", default="", help="the base model (default: the one the adapter was trained on)")
    args = p.parse_args(argv)
    merge(args.checkpoint, args.out, args.base)


if __name__ == "__main__":
    main()
