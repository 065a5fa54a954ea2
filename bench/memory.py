"""Per-GPU memory arithmetic behind docs/gpu.md's recipes: why a recipe fits, or which flag to change.
Usage: python -m bench.memory [--model all|Qwen3-4B-Base|Qwen3-8B-Base|Qwen2.5-Math-7B|Llama-3.1-8B]
       [--gpus 8 --gpu_gb 79.6] [--lora_rank 32] [--markdown]   (writes bench/results/memory.md)
Full fine-tuning on 8 x 80 GB, 1 x 80 GB and 1 x 141 GB; LoRA (rank 32) on one GPU of 24, 48, 80 and 141 GB.

No GPU, no torch: plain arithmetic on the models' public config.json numbers and on what the trainer holds
(the config, the batch, the log-probs). Exact: parameter counts, sharded state, KV bytes per token. ESTIMATES
(stated margins, not measurements): activations, vLLM's activation/workspace and CUDA-graph memory, CUDA
context. The functions above main() are plain and documented so that one (vllm_share) can move into the
trainer to size --vllm_gpu_memory."""
import argparse
import os
import sys

GiB = 2**30
# config.json of each model on the hub: hidden, layers, heads, KV heads, head_dim, intermediate, vocab, tied, max pos
MODELS = {
    "Qwen3-4B-Base": dict(H=2560, L=36, heads=32, kv=8, hd=128, I=9728, V=151936, tied=True, max_pos=32768,
                          qkv_bias=False, qk_norm=True),
    "Qwen3-8B-Base": dict(H=4096, L=36, heads=32, kv=8, hd=128, I=12288, V=151936, tied=False, max_pos=32768,
                          qkv_bias=False, qk_norm=True),
    "Qwen2.5-Math-7B": dict(H=3584, L=28, heads=28, kv=4, hd=128, I=18944, V=152064, tied=False, max_pos=4096,
                            qkv_bias=True, qk_norm=False),
    "Llama-3.1-8B": dict(H=4096, L=32, heads=32, kv=8, hd=128, I=14336, V=128256, tied=False, max_pos=131072,
                         qkv_bias=False, qk_norm=False)}
# docs/gpu.md's recipes: --max_prompt_length, --max_new_tokens, --prompts_per_step / 8 GPUs, --updates_per_step,
# --group_size. G sets only the sequences per step (the update's memory is per micro-batch of --micro_batch_tokens).
DAPO = dict(name="DA3PO/DAPO/GRPO", prompt=2048, completion=20480, prompts_per_gpu=64, updates=16, G=16)
DARO = dict(name="DARO", prompt=1096, completion=3000, prompts_per_gpu=16, updates=2, G=8)
RECIPE = {"Qwen3-4B-Base": DAPO, "Qwen3-8B-Base": DAPO, "Qwen2.5-Math-7B": DARO, "Llama-3.1-8B": DARO}  # DARO's 2nd
MICRO_BATCH_TOKENS, LOGPROB_CHUNK = 24576, 1024  # --micro_batch_tokens, --logprob_chunk
# GPU totals as torch.cuda.mem_get_info reports them: an "80 GB" H100/A100 has 81,559 MiB, a 141 GB H200 143,771 MiB
MACHINES = [(8, 81559 / 1024, "8 x 80 GB"), (1, 81559 / 1024, "1 x 80 GB"), (1, 143771 / 1024, "1 x 141 GB (H200)")]
MARGIN = 0.05             # of the GPU's total, kept free in every budget below
CONTEXT = 1.5 * GiB       # estimate: the trainer's CUDA context, NCCL buffers, cuBLAS workspace (not torch tensors)
ACT_MARGIN = 1.25         # estimate: activations x 1.25 for allocator fragmentation and what the formula leaves out
TIGHT = 2 * GiB           # a plan with less than this beyond the margin is called tight (and tried last)
VLLM_TOKENS, VLLM_SEQS = 16384, 256  # vLLM's profile run: max_num_batched_tokens (LLM class, >= 70 GiB non-A100 GPU,
#                                      arg_utils.get_batch_defaults; 8192 on an A100) and VLLMRollout's max_num_seqs
VLLM_NON_TORCH = 0.5 * GiB  # estimate: attention-backend and cuBLAS workspaces vLLM adds at start-up
VLLM_GRAPHS = 1.0 * GiB     # estimate: CUDA graphs (vLLM measures and logs it; sleep does not free them)


def layer_params(m: dict) -> int:
    """Parameters of one decoder layer: q, k, v, o projections (+ q/k/v bias on Qwen2, q/k RMSNorm on Qwen3), the
    SwiGLU MLP (gate, up, down) and the two RMSNorms."""
    q, kv = m["heads"] * m["hd"], m["kv"] * m["hd"]
    attn = m["H"] * (q + 2 * kv) + q * m["H"]  # q, k, v, o
    attn += (q + 2 * kv if m["qkv_bias"] else 0) + (2 * m["hd"] if m["qk_norm"] else 0)
    return attn + 3 * m["H"] * m["I"] + 2 * m["H"]


def root_params(m: dict) -> int:
    """Parameters of FSDP2's root unit (shard_model: fully_shard(model) after the layers): the embedding, the
    lm_head if untied, the final norm."""
    return m["V"] * m["H"] * (1 if m["tied"] else 2) + m["H"]


def param_count(m: dict) -> int:
    """N: every decoder layer plus the root unit (a tied embedding counted once)."""
    return m["L"] * layer_params(m) + root_params(m)


def kv_bytes_per_token(m: dict, dtype_bytes: int = 2) -> int:
    """K and V of every layer: 2 x layers x KV heads x head_dim x bytes (bf16 = 2)."""
    return 2 * m["L"] * m["kv"] * m["hd"] * dtype_bytes


# The attention the recipes name (--attn_implementation): packed micro-batches (--pack) as one row, no mask
ATTENTION = "flash_attention_2"
BLOCK = 128  # flex attention's block size (torch's _DEFAULT_SPARSE_BLOCK_SIZE)


def attention_bytes(m: dict, tokens: int, kernel: str = ATTENTION) -> dict:
    """Attention's own memory for one packed micro-batch of `tokens` tokens (one row, position_ids restarting at 0
    for each sequence), beyond q, k, v and the output (in activation_bytes): `whole`, held through the whole forward
    and backward (a mask built once per forward), and `layer`, in each layer's recomputation and backward.
      flash_attention_2  its variable-length kernel takes the sequences' offsets from the position_ids: no mask;
                         it keeps the softmax's log-sum-exp, heads x tokens float32, for the backward: linear
      flex_attention     transformers builds a BlockMask: for each 128-token query block the key blocks it sees
                         (and its transpose for the backward): 4 int32 tables of (T/128)^2: quadratic in blocks,
                         16,384 times smaller than a dense mask; the log-sum-exp as flash's
      sdpa, eager        a dense (1, 1, T, T) bool mask and sdpa's bf16 additive copy (eager: float32) in each
                         layer: quadratic, why --pack sends them padded on a GPU (shortcuts.pack_refusal)"""
    lse = m["heads"] * tokens * 4
    if kernel == "flash_attention_2":
        return dict(whole=4 * (tokens + 1), layer=lse)  # (cu_seqlens: int32, at most one sequence a token)
    if kernel == "flex_attention":
        blocks = -(-tokens // BLOCK)
        return dict(whole=4 * 4 * blocks * blocks, layer=lse)
    return dict(whole=tokens * tokens, layer=2 * tokens * tokens)


def attention_lines(m: dict, recipe: dict, micro_batch_tokens: int) -> list[str]:
    """The recipe's attention memory, packed, with the kernel it assumes (and the others for comparison)."""
    T = max(micro_batch_tokens, recipe["prompt"] + recipe["completion"])
    lines = [f"  attention, packed micro-batch of {T:,} tokens in one row (--attn_implementation):"]
    for kernel in ("flash_attention_2", "flex_attention", "sdpa"):
        a = attention_bytes(m, T, kernel)
        size = lambda x: f"{x / 2**20:,.1f} MiB" if x < GiB else f"{x / GiB:,.1f} GiB"  # noqa: E731
        shape = {"flash_attention_2": "linear in tokens", "flex_attention": "128-token blocks",
                 "sdpa": "dense T x T: refused on GPUs"}[kernel]
        mark = " (the recipes')" if kernel == ATTENTION else ""
        lines.append(f"    {kernel:<18} {size(a['whole'])} per forward + {size(a['layer'])} per layer "
                     f"({(a['whole'] + a['layer']) / T:,.0f} B a token; {shape}){mark}")
    return lines


def activation_bytes(m: dict, micro_batch_tokens: int, max_len: int, chunk: int) -> dict:
    """ESTIMATE of one micro-batch's forward + backward with per-layer checkpointing (non-reentrant), bf16 compute
    under FSDP2 (the residual stream is bf16), packed rows under the recipes' attention (attention_bytes), chunked
    log-probs. A row longer than the budget gets a micro-batch of its own (shortcuts.token_budget_rows), so T = max(budget,
    longest row)."""
    H, I, L, V = m["H"], m["I"], m["L"], m["V"]
    q, kv, T = m["heads"] * m["hd"], m["kv"] * m["hd"], max(micro_batch_tokens, max_len)
    attention = attention_bytes(m, T)
    inputs = L * T * H * 2  # the input hidden state of every checkpointed layer, kept until its backward
    inputs += attention["whole"]  # ... and what the attention builds once per forward
    root = T * H * (2 + 2 + 4)  # final hidden state and its grad (bf16), the final norm's float32 input
    per_token = (2 * (q + 2 * kv) + 2 * (q + kv) + 2 * q  # q, k, v; q, k after RoPE; attention output (bf16)
                 + (6 * (q + kv) if m["qk_norm"] else 0)  # Qwen3's q/k norms: float32 input + bf16 output
                 + 2 * (4 * H + 2 * H)  # the layer's two RMSNorms: float32 input + bf16 output
                 + 4 * 2 * I  # MLP: gate, up, silu(gate), their product (bf16)
                 + 3 * 2 * I + 2 * 2 * H)  # its backward: grads of the MLP intermediates and of the hidden state
    logits = 5 * chunk * V * 4  # ~5 (chunk, V) float32 tensors, measured in bench/results/logprob_memory.md
    layer = T * per_token + attention["layer"]  # one layer's recompute + backward; the log-prob chunks run apart
    return dict(tokens=T, inputs=inputs, root=root, layer=layer, logits=logits,
                total=ACT_MARGIN * (inputs + root + max(layer, logits)))


def trainer_update_peak(m: dict, gpus: int, offload: bool, act: float) -> dict:
    """Per-GPU bytes during the optimizer updates (vLLM asleep: only its CUDA graphs stay). FSDP2 with
    MixedPrecisionPolicy(bf16, reduce float32): float32 master weights 4N/W, gradients 4N/W, AdamW moments 8N/W
    (all on the host with --cpu_offload), plus the gathered bf16 units: the root unit's params and grads (4R, kept
    unsharded through the backward) and two decoder layers (current + prefetch) with one layer's bf16 grads and
    float32 reduce-scatter input (10 P_layer)."""
    N, shard = param_count(m), 0 if offload else param_count(m) / gpus
    parts = dict(weights=4 * shard, grads=4 * shard, adam=8 * shard,
                 gathered=4 * root_params(m) + 10 * layer_params(m), activations=act, other=CONTEXT + VLLM_GRAPHS)
    return dict(parts, peak=sum(parts.values()), host=0 if not offload else 16 * N)


def gathered_for_forward(m: dict) -> int:
    """Bytes FSDP2 gathers on the GPU while a forward runs, in bf16: the root unit, gathered through the whole
    forward (2R), and two decoder layers, the current one and the prefetched next (4P)."""
    return 2 * root_params(m) + 4 * layer_params(m)


def trainer_rollout_resident(m: dict, gpus: int, offload: bool) -> float:
    """Per-GPU bytes the trainer keeps beside the awake engine: master weights + AdamW, sharded (gradients are freed
    after every update: UpdateGuard). With --cpu_offload those sit on the host, and what the GPU holds is what the
    trainer's no-grad forwards gather while vLLM is awake (pi_old, the sync probe: gathered_for_forward); after them
    the trainer reshards FSDP2's root unit (modeling.reshard), so no gathered copy stays. Without --cpu_offload the
    same passes gather the same units beside the sharded state; there they are left to the margin, as
    vllm_engine.vllm_memory_share leaves them."""
    if offload:
        return gathered_for_forward(m)
    return 12 * param_count(m) / gpus


def vllm_fixed(m: dict, tokens: int = VLLM_TOKENS) -> dict:
    """vLLM's non-KV share. vLLM 0.32 gpu_worker.determine_available_memory: KV = u x total - (the drop in free
    memory since its start-up snapshot: bf16 weights, non-torch buffers) - (the torch peak of a profile run of
    max_num_batched_tokens above what stays allocated) - its CUDA-graph estimate (on by default since 0.21)."""
    q, kv, H, I = m["heads"] * m["hd"], m["kv"] * m["hd"], m["H"], m["I"]
    act = tokens * 2 * (2 * H + 2 * q + 2 * kv + 3 * I) + 5 * VLLM_SEQS * m["V"] * 4  # layer peak + sampler
    return dict(weights=2 * param_count(m), activations=act + VLLM_NON_TORCH, graphs=VLLM_GRAPHS)


def vllm_share(total: float, free_at_start: float, rollout_resident: float, context: float = CONTEXT,
               margin: float = MARGIN) -> float:
    """The largest safe --vllm_gpu_memory u, floored to 0.01. vLLM 0.32 refuses to start unless the free memory at
    start-up is >= u x total (v1/worker/utils.request_memory); during rollouts its u x total sits beside what the
    trainer keeps resident. Both bounds keep `margin` x total free. A trainer can call it with
    torch.cuda.mem_get_info() and trainer_rollout_resident (free_at_start already excludes the CUDA context)."""
    u = min(free_at_start, total - context - rollout_resident) / total - margin
    return max(0.0, int(u * 100) / 100)


def plan(m: dict, recipe: dict, gpus: int, total: float, offload: bool, micro_batch_tokens: int) -> dict:
    """Every number of one (model, machine, flags) case, and whether it fits."""
    N, max_len, kvb = param_count(m), recipe["prompt"] + recipe["completion"], kv_bytes_per_token(m)
    act = activation_bytes(m, micro_batch_tokens, max_len, LOGPROB_CHUNK)
    upd = trainer_update_peak(m, gpus, offload, act["total"])
    resident = trainer_rollout_resident(m, gpus, offload)
    free_at_start = total - CONTEXT  # the engine is created while the trainer's model is still on the host
    u = vllm_share(total, free_at_start, resident)
    fixed = vllm_fixed(m)
    kv = u * total - sum(fixed.values())
    engine_len = min(max_len, m["max_pos"])  # --max_model_len: the longest prompt + --max_new_tokens
    start_ok = kv >= (engine_len + 16) * kvb  # one max_model_len sequence + the null block (16 tokens)
    fits = upd["peak"] <= (1 - MARGIN) * total and u > 0 and start_ok
    return dict(N=N, max_len=max_len, kvb=kvb, act=act, upd=upd, resident=resident, free_at_start=free_at_start,
                u=u, fixed=fixed, kv=kv, kv_tokens=max(0, int(kv // kvb)), engine_len=engine_len, start_ok=start_ok,
                fits=fits, offload=offload, mbt=micro_batch_tokens)


def best_plan(m: dict, recipe: dict, gpus: int, total: float) -> dict:
    """The recipe as written if it fits; else a smaller --micro_batch_tokens (not below the longest row), then
    --cpu_offload, then both; first with TIGHT to spare beyond the margin, then without. If nothing fits: the most
    relaxed of them, to show how far off it is."""
    max_len = recipe["prompt"] + recipe["completion"]
    for spare in (TIGHT, 0):
        for offload in (False, True):
            for mbt in range(MICRO_BATCH_TOKENS, max_len - 1024, -1024):
                p = plan(m, recipe, gpus, total, offload, mbt)
                if p["fits"] and p["upd"]["peak"] + spare <= (1 - MARGIN) * total:
                    return p
    return p


def report(name: str, gpus: int, total: float, label: str) -> tuple[list[str], list[str]]:
    """The block of lines for one (model, machine), and its row of the summary table."""
    m, recipe = MODELS[name], RECIPE[name]
    p, g = best_plan(m, recipe, gpus, total), lambda x: f"{x / GiB:6.1f} GiB"
    act, upd, max_len, N, f = p["act"], p["upd"], p["max_len"], p["N"], p["fixed"]
    off, usable = " (--cpu_offload: on the host)" if p["offload"] else "", (1 - MARGIN) * total
    ok_len = max_len <= m["max_pos"]
    lines = [f"{name} on {label} ({total / GiB:.1f} GiB each), {recipe['name']}: G = {recipe['G']}, "
             f"{recipe['prompts_per_gpu']} prompts = {recipe['prompts_per_gpu'] * recipe['G']} sequences per GPU "
             f"per step, "
             f"{recipe['updates']} updates",
             f"  length: prompt {recipe['prompt']} + completion {recipe['completion']} = {max_len} tokens "
             f"{'<=' if ok_len else '>'} max_position_embeddings {m['max_pos']}: " + (
                 f"ok (prompts up to {m['max_pos'] - recipe['completion']} tokens fit)" if ok_len else
                 "EXCEEDS it: vLLM stops each completion at the model's limit"),
             f"  parameters N = {N / 1e9:.2f}B (decoder layer P = {layer_params(m) / 1e6:.1f}M x {m['L']}, root unit "
             f"R = {root_params(m) / 1e9:.2f}B: embedding{'' if m['tied'] else ' + lm_head'} + final norm); KV cache "
             f"{p['kvb']:,} B/token (2 x {m['L']} layers x {m['kv']} KV heads x {m['hd']} x 2 B)",
             f"  update, per GPU (vLLM asleep), --micro_batch_tokens {p['mbt']}:",
             f"    master weights fp32 4N/W   {g(upd['weights'])}{off}",
             f"    gradients fp32 4N/W        {g(upd['grads'])}{off}",
             f"    AdamW moments fp32 8N/W    {g(upd['adam'])}{off}",
             f"    gathered bf16 4R + 10P     {g(upd['gathered'])}  (root params + grads; 2 layers + 1 layer's grads "
             f"and reduce-scatter input)",
             f"    activations (ESTIMATE)     {g(act['total'])}  (x{ACT_MARGIN} of: {act['tokens']} tokens, layer "
             f"inputs {act['inputs'] / GiB:.1f} + root {act['root'] / GiB:.1f} + max(one layer's recompute "
             f"{act['layer'] / GiB:.1f}, log-prob chunks {act['logits'] / GiB:.1f}))",
             f"    CUDA context + vLLM graphs {g(upd['other'])}  (estimate)",
             f"    trainer peak               {g(upd['peak'])}  of {usable / GiB:.1f} usable ({MARGIN:.0%} margin)"]
    if p["offload"]:
        lines.append(f"    host RAM for the offloaded state: 16N = {upd['host'] / GiB:.0f} GiB per node "
                     f"(+4N = {4 * N / GiB:.0f} GiB on rank 0 while a checkpoint is written)")
    lines += attention_lines(m, recipe, p["mbt"])
    if p["offload"]:
        kept = "weights and AdamW on the host; the bf16 root unit + 2 layers its no-grad passes gather, 2R + 4P"
    else:
        kept = f"weights + AdamW sharded, gradients freed: +{4 * N / gpus / GiB:.1f} GiB if they were kept"
    need = (p["engine_len"] + 16) * p["kvb"]
    lines += [f"  rollout, per GPU: trainer resident {g(p['resident'])}  ({kept})",
              f"    engine start: before the trainer's model is on the GPU, {p['free_at_start'] / GiB:.1f} GiB free "
              f"(vLLM 0.32's request_memory needs u x total free then); during rollouts u x total sits beside the "
              f"trainer's resident state: u = min(free, total - context - resident) / total - margin",
              f"    vLLM share u = {p['u']:.2f} ({MARGIN:.0%} margin) = {p['u'] * total / GiB:.1f} GiB: weights bf16 "
              f"2N {f['weights'] / GiB:.1f} + activations/workspace {f['activations'] / GiB:.1f} (estimate) + CUDA "
              f"graphs {f['graphs'] / GiB:.1f} (estimate) + KV {max(0, p['kv']) / GiB:.1f}",
              f"    KV {p['kv_tokens']:,} tokens = {p['kv_tokens'] // max_len} sequences of {max_len} tokens at once "
              f"(max_num_seqs {VLLM_SEQS}); start-up check, one {p['engine_len']}-token sequence (--max_model_len) "
              f"= {need / GiB:.1f} GiB: {'ok' if p['start_ok'] else 'FAILS'}"]
    hf_row = max_len * p["kvb"] * (1 + 1 / m["L"])  # DynamicCache grows by torch.cat: one layer's copy on top
    hf_free = max(0, usable - CONTEXT - p["resident"] - 2 * N)  # beside HFRollout's full bf16 copy (under FSDP)
    lines.append(f"  HF sampler (--rollout hf): 512 rows x {max_len} tokens of KV = {512 * hf_row / GiB:,.0f} GiB "
                 f"(+ its bf16 model copy {2 * N / GiB:.1f}) against {hf_free / GiB:.1f} GiB free: "
                 f"--rollout_batch_size {int(hf_free // hf_row)} would fit")
    launch = "torchrun --standalone --nproc_per_node=1 " if gpus == 1 else ""
    if gpus == 1:  # shard_model returns the plain module unless launched by torchrun
        lines.append("  one GPU: the numbers are FSDP2's (torchrun, 1 rank); a plain `python` run refuses "
                     "--cpu_offload, and without it computes under autocast from float32 weights")
    flags = [f"--vllm_gpu_memory {p['u']:.2f}"] + (["--cpu_offload"] if p["offload"] else []) + \
        ([f"--micro_batch_tokens {p['mbt']}"] if p["mbt"] != MICRO_BATCH_TOKENS else [])
    slack = usable - upd["peak"]  # what the update leaves beyond the margin: said in every verdict
    if p["fits"]:
        verdict = f"fits with {launch}{' '.join(flags)}"
        lines.append(f"  verdict: {verdict} (update peak {upd['peak'] / GiB:.1f} of {usable / GiB:.1f} GiB usable: "
                     f"{slack / GiB:.1f} GiB to spare" + (", tight" if slack < TIGHT else "") + ")")
        alt = plan(m, recipe, gpus, total, True, MICRO_BATCH_TOKENS)
        if not p["offload"] and p["mbt"] != MICRO_BATCH_TOKENS and alt["fits"]:
            lines.append(f"  or, keeping --micro_batch_tokens {MICRO_BATCH_TOKENS}: {launch}--vllm_gpu_memory "
                         f"{alt['u']:.2f} --cpu_offload (peak {alt['upd']['peak'] / GiB:.1f} GiB)")
    else:
        why = ([f"the update needs {upd['peak'] / GiB:.1f} GiB"] if upd["peak"] > usable else []) + \
            ([f"vLLM's KV {max(0, p['kv']) / GiB:.1f} GiB < {need / GiB:.1f}"] if not p["start_ok"] else [])
        verdict = f"DOES NOT FIT even with {' '.join(flags[1:])}: {'; '.join(why)}"
        lines.append(f"  verdict: {verdict}")
    row = [name, label, f"{upd['peak'] / GiB:.1f}", f"{slack / GiB:.1f}", f"{p['resident'] / GiB:.1f}",
           f"{p['u']:.2f}", f"{max(0, p['kv']) / GiB:.1f}", f"{p['kv_tokens']:,}", str(p["kv_tokens"] // max_len),
           verdict]
    return lines, row


# -----------------------------------------------------------------------------------------------------------------
# LoRA (--lora_rank r on every linear layer of the blocks), one GPU, vLLM colocated: the base is frozen and kept in
# bf16 (2N; no float32 master copy, no gradients, no AdamW), only the adapters train (float32 weights, gradients and
# AdamW moments: 16 bytes each). vLLM serves the adapter and sleeps at level 1 during the updates: its bf16 base waits
# in host memory (it never changes) and comes back on wake. Without --cpu_offload a plain `python` run (no FSDP);
# with it FSDP2 at world size 1 (torchrun), the base and adapters on the host, a layer gathered at a time.
LORA_RANK = 32  # the largest rank of the published claim's range (1-32); the adapters' memory is small at any of them
LORA_MACHINES = [(24564 / 1024, "1 x 24 GB"), (46068 / 1024, "1 x 48 GB"), (81559 / 1024, "1 x 80 GB"),
                 (143771 / 1024, "1 x 141 GB (H200)")]  # RTX 4090, L40S, H100, H200 as mem_get_info reports them
LORA_GRAPHS = 2 * VLLM_GRAPHS  # estimate: vLLM captures its CUDA graphs with and without LoRA (specialised)


def lora_params(m: dict, rank: int) -> int:
    """A: adapter parameters, rank x (in + out) for q, k, v, o, gate, up and down of every layer."""
    q, kv, H, I = m["heads"] * m["hd"], m["kv"] * m["hd"], m["H"], m["I"]
    return rank * m["L"] * ((H + q) + 2 * (H + kv) + (q + H) + 2 * (H + I) + (I + H))


def vllm_batch_tokens(total: float) -> int:
    """vLLM 0.32's max_num_batched_tokens for the LLM class: 16384 on a GPU of 70 GiB or more, else 8192."""
    return VLLM_TOKENS if total >= 70 * GiB else 8192


def lora_plan(m: dict, recipe: dict, total: float, offload: bool, micro_batch_tokens: int, rank: int) -> dict:
    """Every number of one LoRA case on one GPU, and whether it fits. Updates (vLLM asleep: its graphs stay): the
    base 2N (plain run) or FSDP2's gathered bf16 units, 2R + two layers 4P (--cpu_offload), the adapters 16A (on the
    host with --cpu_offload), activations as full fine-tuning's (the gradient still flows through every layer).
    Rollouts: the trainer keeps 2N + 12A beside vLLM (with --cpu_offload: the bf16 units its no-grad passes gather,
    gathered_for_forward), and its no-grad passes (pi_old, the probe) need one layer's activations or the log-prob
    chunks on top: vLLM's share leaves room for them."""
    N, A, max_len, kvb = param_count(m), lora_params(m, rank), recipe["prompt"] + recipe["completion"], \
        kv_bytes_per_token(m)
    act = activation_bytes(m, micro_batch_tokens, max_len, LOGPROB_CHUNK)
    base = 2 * root_params(m) + 4 * layer_params(m) if offload else 2 * N
    upd = dict(base=base, adapters=0 if offload else 16 * A, activations=act["total"], other=CONTEXT + LORA_GRAPHS)
    upd["peak"] = sum(upd.values())
    resident = gathered_for_forward(m) if offload else 2 * N + 12 * A
    passes = ACT_MARGIN * max(act["layer"], act["logits"]) / 2  # a forward alone: about half of forward + backward
    free_at_start = total - CONTEXT
    u = vllm_share(total, free_at_start, resident + passes)
    tokens = vllm_batch_tokens(total)
    fixed = {**vllm_fixed(m, tokens), "graphs": LORA_GRAPHS, "adapter slots": 2 * A}  # one adapter (max_loras 1)
    kv = u * total - sum(fixed.values())
    engine_len = min(max_len, m["max_pos"])
    start_ok = kv >= (engine_len + 16) * kvb
    fits = upd["peak"] <= (1 - MARGIN) * total and u > 0 and start_ok
    host = 2 * N + (2 * N + 16 * A if offload else 0)  # vLLM's base while asleep; the trainer's, offloaded
    return dict(N=N, A=A, max_len=max_len, kvb=kvb, act=act, upd=upd, resident=resident, passes=passes, u=u,
                fixed=fixed, kv=kv, kv_tokens=max(0, int(kv // kvb)), engine_len=engine_len, start_ok=start_ok,
                fits=fits, offload=offload, mbt=micro_batch_tokens, tokens=tokens, host=host, rank=rank)


def best_lora_plan(m: dict, recipe: dict, total: float, rank: int) -> dict:
    """As best_plan: the recipe's --micro_batch_tokens, else smaller ones (not below the longest row), then
    --cpu_offload; first with TIGHT to spare, then without; the most relaxed one if nothing fits."""
    max_len = recipe["prompt"] + recipe["completion"]
    for spare in (TIGHT, 0):
        for offload in (False, True):
            for mbt in range(MICRO_BATCH_TOKENS, max_len - 1024, -1024):
                p = lora_plan(m, recipe, total, offload, max(mbt, max_len), rank)
                if p["fits"] and p["upd"]["peak"] + spare <= (1 - MARGIN) * total:
                    return p
    return p


def lora_report(name: str, total: float, label: str, rank: int = LORA_RANK) -> tuple[list[str], list[str]]:
    """The block of lines for one LoRA (model, one GPU), and its row of the LoRA table."""
    m, recipe = MODELS[name], RECIPE[name]
    p, g = best_lora_plan(m, recipe, total, rank), lambda x: f"{x / GiB:6.1f} GiB"
    upd, usable, f = p["upd"], (1 - MARGIN) * total, p["fixed"]
    lines = [f"{name}, LoRA rank {rank} on every linear layer of the blocks, on {label} ({total / GiB:.1f} GiB), "
             f"{recipe['name']}: {recipe['prompts_per_gpu']} prompts per step, {recipe['prompt']} + "
             f"{recipe['completion']} tokens",
             f"  parameters: base N = {p['N'] / 1e9:.2f}B, frozen, bf16; adapters A = {p['A'] / 1e6:.1f}M "
             f"({p['A'] / p['N']:.2%} of N), float32",
             f"  update (vLLM asleep at level 1), --micro_batch_tokens {p['mbt']}"
             + (" (--cpu_offload: FSDP2 at world size 1)" if p["offload"] else " (a plain python run)") + ":",
             ("    gathered bf16 2R + 4P       " if p["offload"] else "    base bf16 2N                ")
             + f"{g(upd['base'])}",
             f"    adapters + grads + AdamW 16A {g(upd['adapters'])}" + ("  (on the host)" if p["offload"] else ""),
             f"    activations (ESTIMATE)      {g(upd['activations'])}  (as full fine-tuning's: "
             f"{p['act']['tokens']} tokens)",
             f"    CUDA context + vLLM graphs  {g(upd['other'])}  (estimate; graphs with and without LoRA)",
             f"    trainer peak                {g(upd['peak'])}  of {usable / GiB:.1f} usable ({MARGIN:.0%} margin)",
             f"  rollout: trainer resident {g(p['resident'])} ("
             + ("all on the host; the bf16 root unit + 2 layers its passes gather, 2R + 4P" if p["offload"]
                else "base 2N + adapters and AdamW 12A") + f") + its no-grad passes {g(p['passes'])} "
             f"(estimate: pi_old and the probe run while vLLM is awake)",
             f"    vLLM share u = {p['u']:.2f} = {p['u'] * total / GiB:.1f} GiB: base bf16 2N {f['weights'] / GiB:.1f} "
             f"+ adapter slots {f['adapter slots'] / GiB:.2f} + activations/workspace {f['activations'] / GiB:.1f} "
             f"({p['tokens']} batched tokens) + graphs {f['graphs'] / GiB:.1f} + KV {max(0, p['kv']) / GiB:.1f}",
             f"    KV {p['kv_tokens']:,} tokens = {p['kv_tokens'] // p['max_len']} sequences of {p['max_len']} "
             f"tokens at once; start-up check, one {p['engine_len']}-token sequence = "
             f"{(p['engine_len'] + 16) * p['kvb'] / GiB:.1f} GiB: {'ok' if p['start_ok'] else 'FAILS'}",
             f"  host RAM: {p['host'] / GiB:.0f} GiB (vLLM's sleeping base 2N"
             + (" + the offloaded base and adapters" if p["offload"] else "") + ")"]
    lines += attention_lines(m, recipe, p["mbt"])
    launch = "torchrun --standalone --nproc_per_node=1" if p["offload"] else "python"
    flags = [f"--lora_rank {rank}", f"--vllm_gpu_memory {p['u']:.2f}"] + \
        (["--cpu_offload"] if p["offload"] else []) + \
        ([f"--micro_batch_tokens {p['mbt']}"] if p["mbt"] != MICRO_BATCH_TOKENS else [])
    slack = usable - upd["peak"]
    if p["fits"]:
        verdict = f"fits: {launch}, {' '.join(flags)}"
        lines.append(f"  verdict: {verdict} (update peak {upd['peak'] / GiB:.1f} of {usable / GiB:.1f} GiB usable: "
                     f"{slack / GiB:.1f} GiB to spare" + (", tight" if slack < TIGHT else "") + ")")
    else:
        why = ([f"the update needs {upd['peak'] / GiB:.1f} GiB"] if upd["peak"] > usable else []) + \
            ([f"vLLM's KV {max(0, p['kv']) / GiB:.1f} GiB < one sequence's "
              f"{(p['engine_len'] + 16) * p['kvb'] / GiB:.1f}"] if not p["start_ok"] else [])
        verdict = f"DOES NOT FIT even with {' '.join(flags[2:]) or 'the recipe as written'}: {'; '.join(why)}"
        lines.append(f"  verdict: {verdict}")
    row = [name, label, f"{p['A'] / 1e6:.0f}M", f"{upd['peak'] / GiB:.1f}", f"{slack / GiB:.1f}",
           f"{p['u']:.2f}", f"{max(0, p['kv']) / GiB:.1f}", str(p["kv_tokens"] // p["max_len"]), verdict]
    return lines, row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="all", choices=["all", *MODELS], help="one model, or all")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs (FSDP ranks); with --gpu_gb: one machine (default 8)")
    ap.add_argument("--gpu_gb", type=float, default=0.0,
                    help="GiB per GPU as torch.cuda.mem_get_info reports it (default: 8x80, 1x80, 1x141 GB)")
    ap.add_argument("--lora_rank", type=int, default=LORA_RANK,
                    help=f"the LoRA rows' rank, one GPU each (default {LORA_RANK}; 0: no LoRA rows)")
    ap.add_argument("--markdown", action="store_true", help="also write bench/results/memory.md")
    args = ap.parse_args()
    if args.gpus < 0 or args.gpu_gb < 0 or args.lora_rank < 0:
        ap.error("--gpus, --gpu_gb and --lora_rank must be positive")
    machines, lora_machines = MACHINES, LORA_MACHINES
    if args.gpus or args.gpu_gb:
        gpus, gb = args.gpus or 8, args.gpu_gb or 81559 / 1024
        machines = [(gpus, gb, f"{gpus} x {gb:g} GiB")]
        lora_machines = [(gb, f"1 x {gb:g} GiB")] if args.gpu_gb else []
    names = MODELS if args.model == "all" else [args.model]
    out = [report(name, gpus, gb * GiB, label) for name in names for gpus, gb, label in machines]
    lora = [lora_report(name, gb * GiB, label, args.lora_rank) for name in names for gb, label in lora_machines
            if args.lora_rank]
    text, rows = "\n\n".join("\n".join(lines) for lines, _ in out + lora), [row for _, row in out]
    print(text)
    if args.markdown:
        head = ["model", "machine", "update peak GiB", "spare GiB", "rollout resident GiB", "u", "KV GiB",
                "KV tokens", "full-length seqs", "verdict"]
        table = ["| " + " | ".join(r) + " |" for r in [head, ["---"] * len(head), *rows]]
        head = ["model", "machine", "adapters", "update peak GiB", "spare GiB", "u", "KV GiB", "full-length seqs",
                "verdict"]
        lora_table = ["| " + " | ".join(r) + " |" for r in [head, ["---"] * len(head), *(r for _, r in lora)]]
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "memory.md")
        with open(path, "w") as fh:
            fh.write(f"Per-GPU memory of docs/gpu.md's recipes (`python -m bench.memory {' '.join(sys.argv[1:])}`): "
                     f"arithmetic, "
                     f"not a measurement; activations, vLLM's workspace, CUDA graphs and context are estimates with "
                     f"the margins stated in the script. G = {DAPO['G']} (DA3PO/DAPO/GRPO) and {DARO['G']} (DARO), "
                     f"spare = usable ({1 - MARGIN:.0%} of the GPU) - update peak, --logprob_chunk {LOGPROB_CHUNK}, "
                     f"bf16 compute, "
                     f"gradient checkpointing, FSDP2, vLLM colocated with sleep level 2.\n\n"
                     + "\n".join(table) + "\n\n"
                     + (f"LoRA of rank {args.lora_rank} on every linear layer of the blocks, one GPU (the recipes' "
                        f"prompts per step / 8), vLLM colocated serving the adapter, sleep level 1; Llama-3.1-8B "
                        f"with DARO's recipe (its paper's second model):\n\n" + "\n".join(lora_table) + "\n\n"
                        if lora else "") + "```\n" + text + "\n```\n")
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
