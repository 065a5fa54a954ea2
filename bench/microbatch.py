"""Padding and update time with fixed-size micro-batches vs micro-batches packed by length (--micro_batch_tokens), on
a workload whose completion lengths are skewed the way reasoning RL's are (most short, a few 10x longer).
Usage: python -m bench.microbatch [--rows 64] [--micro_batch_size 8] [--micro_batch_tokens 4096] [--repeats 3]

One optimizer update's forward + backward over the same rows (common.micro_batches, token_logprobs, policy_loss with
global token-mean weights, the real code path), alternating the two ways --repeats times; a Qwen3-shaped model with
hidden 256, 4 layers, a 1,000-token vocabulary, float32, on the CPU. Prints and writes a markdown table
(bench/results/microbatch.md): padded share of the tokens forwarded, tokens forwarded, median seconds, and the loss
(equal both ways up to float rounding)."""
import argparse
import os
import statistics
import sys
import time

import torch

import common
import shortcuts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--micro_batch_size", type=int, default=8)
    p.add_argument("--micro_batch_tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "microbatch.md"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, Qwen3Config
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=1000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=1024)
    model = AutoModelForCausalLM.from_config(config).train()
    g = torch.Generator().manual_seed(0)
    # completions: 90% between 16 and 64 tokens, 10% between 400 and 512; prompts of 30 to 60 tokens
    long = torch.rand(args.rows, generator=g) < 0.1
    lengths = torch.where(long, torch.randint(400, 513, (args.rows,), generator=g),
                          torch.randint(16, 65, (args.rows,), generator=g))
    prompts = [torch.randint(0, 1000, (int(n),), generator=g).tolist()
               for n in torch.randint(30, 61, (args.rows,), generator=g)]
    completions = [torch.randint(0, 1000, (int(n),), generator=g).tolist() for n in lengths]
    ids, attn, mask = common.pad_prompt_completion(prompts, completions, 0)
    batch = {"input_ids": ids, "attention_mask": attn, "mask": mask, "advantage": torch.randn(args.rows, generator=g),
             "weight": common.loss_weights(mask, "token-mean", 512)}
    with torch.no_grad():
        batch["old_logp"] = shortcuts.token_logprobs(model, ids, attn, mask.shape[1])[0]
    rows = torch.arange(args.rows)

    def update(max_tokens):
        model.zero_grad()
        t0, total, forwarded, real, count = time.perf_counter(), 0.0, 0, 0, 0
        for _, mb in common.micro_batches(batch, rows, args.micro_batch_size if not max_tokens else args.rows,
                                          max_tokens):
            logp, _ = shortcuts.token_logprobs(model, mb["input_ids"], mb["attention_mask"], mb["mask"].shape[1])
            token_loss = common.policy_loss(logp, mb["old_logp"], mb["advantage"], mb["mask"], 0.2, 0.28)[0]
            loss = (token_loss * mb["weight"]).sum()
            loss.backward()
            total += loss.item()
            forwarded += mb["attention_mask"].numel()
            real += int(mb["attention_mask"].sum())
            count += 1
        return time.perf_counter() - t0, total, 1 - real / forwarded, forwarded, count

    results = {"fixed": [], "packed": []}
    for _ in range(args.repeats):
        results["fixed"].append(update(0))
        results["packed"].append(update(args.micro_batch_tokens))
    lines = [f"One update of {args.rows} rows: completions of 16-64 tokens (90%) and 400-512 tokens (10%), prompts of "
             f"30-60; Qwen3-shaped model, hidden 256, 4 layers, vocabulary 1,000, float32, CPU, {args.threads} "
             f"thread(s); median of {args.repeats} alternating runs.", "",
             "| micro-batches | count | padded share of forwarded tokens | tokens forwarded | seconds | loss |",
             "|---|---|---|---|---|---|"]
    for name, label in (("fixed", f"fixed: {args.micro_batch_size} rows each (`--micro_batch_size "
                                  f"{args.micro_batch_size}`)"),
                        ("packed", f"packed by length: `--micro_batch_tokens {args.micro_batch_tokens}`")):
        runs = results[name]
        lines.append(f"| {label} | {runs[0][4]} | {runs[0][2]:.3f} | {runs[0][3]:,} | "
                     f"{statistics.median(r[0] for r in runs):.2f} | {runs[0][1]:+.6f} |")
    speedup = statistics.median(r[0] for r in results["fixed"]) / statistics.median(r[0] for r in results["packed"])
    command = " ".join(["python -m bench.microbatch", *sys.argv[1:]])
    lines += ["", f"Packed / fixed time: 1 / {speedup:.2f}. Command: `{command}`"]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    open(args.out, "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
