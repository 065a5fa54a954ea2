"""Rollout throughput, the HF sampler (eng.hf_generate) vs vLLM, on the same model and prompts in one run, and what
the vLLM path costs per RL step on top of generating (weight sync + sleep/wake) as a share of the step.
Usage: python -m bench.rollout [--hidden 128 --layers 2] [--model <hf folder>] [--prompts 64 --group 8 --max_new 64]
       [--dtype float32|bfloat16] [--threads 1] [--repeats 3]
Without --model it builds an untrained model of the demo's architecture (random weights rarely emit eos, so almost
every completion runs to --max_new). Numbers are wall times on a possibly shared machine: read them, never assert them.
"""
import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, as in training

import torch  # noqa: E402

import common  # noqa: E402
import shortcuts
import modeling  # noqa: E402
import ranks  # noqa: E402
import engine as eng  # noqa: E402
import vllm_engine  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="", help="a local Hugging Face folder; '' = a fresh demo-architecture model")
parser.add_argument("--hidden", type=int, default=128)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--prompts", type=int, default=64)
parser.add_argument("--group", type=int, default=8)
parser.add_argument("--max_new", type=int, default=64)
parser.add_argument("--dtype", default="float32")
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--repeats", type=int, default=3)
args = parser.parse_args()
torch.set_num_threads(args.threads)  # before the engine: vLLM's CPU worker blocks later changes
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
why_not = vllm_engine.vllm_usable(device)
if why_not:
    sys.exit(f"vLLM cannot run here: {why_not}")

tmp = tempfile.TemporaryDirectory()
path = args.model
if not path:
    path = tmp.name
    tok = modeling.build_demo_tokenizer()
    modeling.build_demo_model(tok, args.hidden, args.layers).save_pretrained(path)
    tok.save_pretrained(path)
model, tok = modeling.load_model(path, device, args.dtype)
n_params = sum(p.numel() for p in model.parameters())
problems = [f"{a}+{7 * a + 3}" for a in range(args.prompts)]
texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
         if tok.chat_template else p for p in problems]
prompts = [ids for t in texts for ids in [tok(t, add_special_tokens=False)["input_ids"]] * args.group]  # (prompts*G)


def best_of(fn):
    """(best seconds, result of that call) over --repeats calls, after one warm-up call."""
    fn()
    runs = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        out = fn()
        runs.append((time.perf_counter() - t0, out))
    return min(runs, key=lambda r: r[0])


t0 = time.perf_counter()
engine = vllm_engine.VLLMRollout(path, tok, ranks.DistInfo(device=device), args.dtype, seed=0, cpu_kv_cache_gb=1.0,
                            max_num_seqs=len(prompts))
startup = time.perf_counter() - t0
hf_s, (hf_out, _, _) = best_of(lambda: eng.hf_generate(model, tok, prompts, args.max_new, 1.0, 1.0, len(prompts)))
vllm_s, (vllm_out, _, _) = best_of(lambda: engine.generate(prompts, args.max_new, 1.0, 1.0))
hf_tokens, vllm_tokens = sum(map(len, hf_out)), sum(map(len, vllm_out))

# One RL step's update on these completions (forward + backward + AdamW), then the vLLM-only extras around it.
opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
ids, attn, mask = common.pad_prompt_completion(prompts, vllm_out, tok.pad_token_id)


def update():
    for s in range(0, len(prompts), 64):  # micro-batches of 64 sequences
        logp, _ = shortcuts.token_logprobs(model, ids[s:s + 64].to(device), attn[s:s + 64].to(device), mask.shape[1])
        (-(logp * mask[s:s + 64].to(device)).sum() / mask.sum()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


update_s, _ = best_of(update)
sleep_s, _ = best_of(lambda: (engine.sleep(), engine.wake_up()))  # no-ops on CPU (vLLM has no sleep mode there)
engine.sleep()
sync_s, diff = best_of(lambda: (engine.sleep(), engine.sync_weights(model)["rollout/sync_diff"])[1])  # + check
step_s = vllm_s + update_s + sleep_s + sync_s

print(f"model: {path if args.model else f'demo architecture, hidden {args.hidden}, {args.layers} layers'} "
      f"({n_params / 1e6:.1f}M params, {args.dtype}) on {device.type}, {args.threads} thread(s); "
      f"{args.prompts} prompts x {args.group} = {len(prompts)} sequences, up to {args.max_new} new tokens")
print(f"{'engine':>8} | {'tokens':>7} | {'seconds':>7} | {'tokens/s':>9}")
print(f"{'HF':>8} | {hf_tokens:7d} | {hf_s:7.2f} | {hf_tokens / hf_s:9.0f}")
print(f"{'vLLM':>8} | {vllm_tokens:7d} | {vllm_s:7.2f} | {vllm_tokens / vllm_s:9.0f}   "
      f"({vllm_tokens / vllm_s / (hf_tokens / hf_s):.2f}x HF; engine start {startup:.1f}s, once)")
print(f"vLLM step: rollout {vllm_s:.3f}s + update {update_s:.3f}s + sleep/wake {sleep_s:.3f}s + sync+check "
      f"{sync_s:.3f}s = {step_s:.3f}s; overhead (sync + sleep/wake) {100 * (sync_s + sleep_s) / step_s:.1f}% of the "
      f"step (probe diff {diff:.1e})")
engine.close()
