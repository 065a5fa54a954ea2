"""What running a group's prompt once would save in the update: the prompt's share of the update's FLOPs, on the two
CPU demos (their own rollouts) and at the GPU recipes' lengths (docs/gpu.md). It decides whether packed micro-batches
(--pack, transformers' padding-free path, which takes no KV cache, so every row runs its prompt) give up much against
the padded path's shared prompt (one prompt forward per group, its KV cache shared by the group's rows).
Usage: python -m bench.prompt_share [--batches 3] [--threads 1]      (a minute on one core: the demos' rollouts)

FLOPs of a forward, per token at attention context c (the keys it sees, itself included), the output layer only where
a completion token is scored (the same in both layouts):  2 x (decoder weights) + 4 x layers x heads x head_dim x c.
The backward (2x) and a checkpointed recomputation (1x) scale both layouts alike, so the forward's ratio is the
update's. Per group of G rows, prompt p, completions c_i (their inputs: all tokens but the last):
  rows whole      each row runs p + c_i - 1 tokens
  prompt once     p tokens once, then each row's c_i - 1 tokens on the prompt's keys
share = 1 - FLOPs(prompt once) / FLOPs(rows whole): what sharing saves of the update."""
import argparse
import statistics

import torch

import config
import da3po
import dataset
import engine
import modeling
from bench.memory import MODELS, layer_params
from ranks import DistInfo


def shape(config) -> dict:
    """The FLOP-relevant sizes of a transformers config (the demo) in bench/memory.py's MODELS form."""
    heads = config.num_attention_heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    return dict(H=config.hidden_size, L=config.num_hidden_layers, heads=heads, kv=config.num_key_value_heads, hd=hd,
                I=config.intermediate_size, V=config.vocab_size, qkv_bias=False, qk_norm=True)


def forward_flops(m: dict, prompt: int, completions: list[int], once: bool) -> float:
    """One group's forward FLOPs (see the docstring), rows whole or its prompt once."""
    linear, attention, head = 2 * m["L"] * layer_params(m), 4 * m["L"] * m["heads"] * m["hd"], 2 * m["H"] * m["V"]
    context = lambda start, n: n * start + n * (n + 1) / 2  # noqa: E731  (sum of contexts of n tokens after start)
    total = head * sum(completions)  # the scored positions: each completion token's
    if once:
        total += linear * prompt + attention * context(0, prompt)
    for c in completions:
        n = max(c - 1, 0)
        total += (linear * n + attention * context(prompt, n)) if once else (
            linear * (prompt + n) + attention * context(0, prompt + n))
    return total


def share(m: dict, groups: list[tuple[int, list[int]]]) -> float:
    """The prompt-once saving over many groups (prompt length, completion lengths)."""
    whole = sum(forward_flops(m, p, cs, False) for p, cs in groups)
    return 1 - sum(forward_flops(m, p, cs, True) for p, cs in groups) / whole


def demo_groups(name: str, batches: int) -> tuple[dict, list, dict]:
    """A demo's groups as its first steps roll them out (the shipped model, --demo's flags): (shape, groups, cfg)."""
    cfg = config.parse_config(da3po.Config, ["--demo", name], da3po.PRESETS)
    model, tok = modeling.load_model(modeling.model_path(cfg.model))
    template = dataset.resolve_template(cfg.prompt_template, tok)
    problems = dataset.tokenize_problems(dataset.load_data(cfg.train_data, "train"), tok, template,
                                         cfg.max_prompt_length, cfg.train_data)
    rollout, groups = engine.HFRollout(model, tok, DistInfo()), []
    torch.manual_seed(0)
    per_batch = int(cfg.prompts_per_step * cfg.oversample)
    for b in range(batches):
        prompts = [x["prompt_ids"] for x in problems[b * per_batch:(b + 1) * per_batch]]
        completions = rollout.generate(prompts, cfg.max_new_tokens, n=cfg.group_size)[0]
        groups += [(len(p), [len(c) for c in completions[i * cfg.group_size:(i + 1) * cfg.group_size]])
                   for i, p in enumerate(prompts)]
    return shape(model.config), groups, cfg


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=3, help="generation batches per demo")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print("| workload | model | G | prompt tokens | completion tokens | prompt's share of the update's FLOPs "
          "(saved by running it once) |\n|---|---|---|---|---|---|")
    for name in ("arith", "reasoning"):
        m, groups, cfg = demo_groups(name, args.batches)
        prompts, completions = [p for p, _ in groups], [c for _, cs in groups for c in cs]
        print(f"| --demo {name} ({len(groups)} groups rolled out) | demo (H {m['H']}, {m['L']} layers) | "
              f"{cfg.group_size} | {statistics.mean(prompts):.1f} (mean) | {statistics.mean(completions):.1f} "
              f"(mean) | {share(m, groups):.3f} |")
    recipes = [("DA3PO/DAPO (docs/gpu.md)", "Qwen3-4B-Base", 16, (1000, 4000, 20480)),
               ("DARO (docs/gpu.md)", "Qwen2.5-Math-7B", 8, (500, 1500, 3000))]
    for recipe, model, G, lengths in recipes:
        for c in lengths:
            for prompt in (100, 300, 1100):
                print(f"| {recipe} | {model} | {G} | {prompt} | {c} (each) | "
                      f"{share(MODELS[model], [(prompt, [c] * G)]):.3f} |")


if __name__ == "__main__":
    main()
