"""GPU figures for a lent GPU machine, in about 5 minutes: FSDP2 training-update throughput (tokens/s) and model FLOPs
utilisation in bf16 for a ~0.5B Qwen-style model built from a config (no download), the peak memory of a log-prob
pass with the whole logits and with --logprob_chunk's chunks, and HF rollout tokens/s.
Usage:  torchrun --standalone --nproc_per_node=1 bench/gpu.py            # the FSDP2 path on one GPU (or N)
        python bench/gpu.py --tiny --device cpu                           # a smoke test of the script on a CPU
Peak FLOPs for MFU: --peak_tflops (default 989, H100/H200 dense bf16)."""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--device", default="")
p.add_argument("--tiny", action="store_true", help="a 2-layer model and short sequences (smoke test)")
p.add_argument("--micro_batch", type=int, default=8)
p.add_argument("--prompt_len", type=int, default=256)
p.add_argument("--completion_len", type=int, default=1024)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--peak_tflops", type=float, default=989.0)
p.add_argument("--logprob_len", type=int, default=8192, help="completion tokens of the log-prob memory pass")
p.add_argument("--logprob_chunk", type=int, default=1024)
args = p.parse_args()

d = common.setup_dist(args.device)
from transformers import AutoModelForCausalLM, Qwen3Config  # noqa: E402

# Qwen2.5-0.5B-like shape (494M parameters with its 152k vocabulary), or a tiny one for the smoke test
size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, vocab_size=1000) if args.tiny else dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    head_dim=64, vocab_size=151936)
torch.manual_seed(0)
config = Qwen3Config(**size, max_position_embeddings=4096, tie_word_embeddings=True)
model = AutoModelForCausalLM.from_config(config).to(d.device)
n_params = sum(p.numel() for p in model.parameters())
dtype = "bfloat16" if d.device.type == "cuda" else "float32"
engine = common.HFRollout(model, None, d, dtype)  # under FSDP: an unsharded copy, as --rollout hf keeps
model = common.shard_model(model, d, dtype, grad_checkpointing=not args.tiny)
opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
P, T, B = (16, 32, 4) if args.tiny else (args.prompt_len, args.completion_len, args.micro_batch)
sync = torch.cuda.synchronize if d.device.type == "cuda" else (lambda: None)
if d.device.type == "cuda":
    torch.cuda.reset_peak_memory_stats()

# one optimizer update per step on B sequences of P prompt + T completion tokens (the real loss path)
ids = torch.randint(0, size["vocab_size"], (B, P + T), device=d.device)
attn = torch.ones_like(ids)
mask = torch.ones(B, T, device=d.device)
adv = torch.randn(B, device=d.device)
times = []
for step in range(args.steps + 1):  # the first step warms up (allocator, kernels) and is not timed
    sync()
    t0 = time.time()
    with torch.autocast(d.device.type, torch.bfloat16, enabled=dtype == "bfloat16"):
        logp, _ = common.token_logprobs(model, ids, attn, T, chunk_tokens=args.logprob_chunk)
    weights = common.loss_weights(mask, "token-mean", T)
    loss, _ = common.policy_loss(logp, logp.detach(), adv, weights, 0.2, 0.28)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    if step:
        times.append(time.time() - t0)
step_s = sorted(times)[len(times) // 2]
tokens = B * (P + T) * d.world_size
# 6 N flops per token for forward + backward, plus the recomputed forward under activation checkpointing (8 N)
flops_per_token = (6 if args.tiny else 8) * n_params
mfu = tokens * flops_per_token / step_s / (args.peak_tflops * 1e12 * d.world_size)
common.print0(f"model {n_params / 1e6:.0f}M params, {d.world_size} rank(s), {dtype}, micro-batch {B} x {P}+{T} tokens")
common.print0(f"update: {step_s:.3f} s/step, {tokens / step_s:,.0f} tokens/s, MFU {100 * mfu:.1f}% "
              f"(of {args.peak_tflops:.0f} TFLOPS/GPU)")
if d.device.type == "cuda":
    common.print0(f"peak memory: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")

# memory of a log-prob pass (old log-probs: no grad) over B sequences of --logprob_len tokens, whole vs chunked
L = 64 if args.tiny else args.logprob_len
long_ids = torch.randint(0, size["vocab_size"], (B, P + L), device=d.device)
for chunk in (0, 64 if args.tiny else args.logprob_chunk):  # the smoke test exercises the chunked path too
    if d.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    try:
        with torch.no_grad(), torch.autocast(d.device.type, torch.bfloat16, enabled=dtype == "bfloat16"):
            common.token_logprobs(model, long_ids, torch.ones_like(long_ids), L, chunk_tokens=chunk)
        peak = f"{(torch.cuda.max_memory_allocated() - base) / 2**30:.1f} GiB" if d.device.type == "cuda" else "n/a"
    except torch.OutOfMemoryError:
        peak = "out of memory"
    common.print0(f"log-prob pass, {B} x {P}+{L} tokens, {'whole logits' if chunk == 0 else f'chunks of {chunk}'}: "
                  f"peak {peak}")

# generation: common.hf_generate on the unsharded copy (what --rollout hf uses), 64 prompts x 256 new tokens
engine.sync_weights(model)
gen_model = engine.model
prompts = [torch.randint(0, size["vocab_size"], (P,)).tolist() for _ in range(8 if args.tiny else 64)]


class Tok:  # the minimum hf_generate needs from a tokenizer; an end id outside the vocabulary is never sampled,
    pad_token_id, eos_token_id = 0, size["vocab_size"]  # so every sequence gets exactly `new` tokens


new = 16 if args.tiny else 256
gen_model.generation_config.eos_token_id = Tok.eos_token_id
sync()
t0 = time.time()
completions, _, _ = common.hf_generate(gen_model, Tok(), prompts, new, temperature=1.0)
sync()
gen_s = time.time() - t0
common.print0(f"HF sampler: {len(prompts)} x {new} tokens in {gen_s:.1f} s = "
              f"{sum(map(len, completions)) / gen_s:,.0f} tokens/s")
common.cleanup_dist()
