"""What one run of each docs/gpu.md recipe costs, on paper: GPU-hours on H100 and H200 from first principles, and
a check of the same arithmetic against one published wall-clock (verl's synchronous DAPO run on 32 H20s).
Usage: python -m bench.replication_cost      (plain arithmetic, no torch: well under a second;
       its output is bench/results/replication_cost.txt)

One step of a synchronous, colocated run (vLLM and the trainer take turns on the same GPUs), in seconds:
  generation   sequences = prompts_per_step x G x (generation batches x oversample; 1 without dynamic sampling),
               plus the step's share of evaluation. Decode runs at the roofline of one engine: a decode step reads
               the weights (2N bytes) and the KV of every sequence in flight, and does 2N + 4 x layers x heads x
               head_dim x context FLOPs per sequence; sequences in flight = min(KV cache / (KV bytes per token x
               mean context), max_num_seqs, sequences per engine); the step takes max(bytes / bandwidth, FLOPs /
               peak) / DECODE_EFF. Prefill: 2N per prompt token (a group's prompt once: prefix caching), at MFU.
               That is the bulk. A synchronous step also waits for each engine's longest response: the tail,
               once per generation batch (tail_seconds):
                 bulk steps  = sequences per engine x mean response / batch in flight   (decode steps of the bulk)
                 alone       = max(0, max_new_tokens - bulk steps)   (the longest response's tokens after the
                               batch thins out, with that response admitted when the step starts)
                 tail        = alone x (2N + KV bytes of its context) / (TP x bandwidth) / SMALL_EFF
               SMALL_EFF: the share of the bandwidth roofline a batch-1 vLLM decode step reaches (published).
               It is zero when every response has the mean length (bulk steps >= mean) and grows with the budget.
  trainer      6N + 12 x layers x heads x head_dim x (S / 2) per trained token (LoRA: 4N, no weight gradients),
               2N + 4 x ... per token of each extra forward (pi_old, recomputed when the engine's log-probs are not
               the trainer's; the KL model when kl_coef > 0), at MFU of the GPUs' dense BF16 peak.
Every input is printed with its source. What it leaves out (say so, it all makes a real run slower): the tail's
company (other long responses, batch > 1) and TP's all-reduces at batch 1, the evaluation's own tail, weight sync,
checkpoints, the verifier, CPU offload's transfers, start-up. So the figures are floors in spirit, and the
published check says how far."""
import math

from bench.memory import MODELS as SHAPES, kv_bytes_per_token, param_count

# ---------------------------------------------------------------------------------------------------------------
# Inputs, each with its source
# ---------------------------------------------------------------------------------------------------------------
GPUS = {  # HBM bandwidth (bytes/s), memory (bytes), dense BF16 tensor FLOP/s
    "H100": dict(bw=3.35e12, mem=80e9, flops=989e12,
                 src="NVIDIA H100 datasheet (SXM): 3.35 TB/s, 80 GB, BF16 1,979 TFLOPS with sparsity = 989 dense"),
    "H200": dict(bw=4.8e12, mem=141e9, flops=989e12,
                 src="NVIDIA H200 datasheet (SXM): 4.8 TB/s, 141 GB, BF16 1,979 TFLOPS with sparsity = 989 dense"),
    "H20": dict(bw=4.0e12, mem=96e9, flops=148e12,
                src="NVIDIA H20 (China-market Hopper; no public NVIDIA datasheet): 96 GB HBM3, 4.0 TB/s, FP16/BF16 "
                    "148 TFLOPS dense, as spec listings give it (e.g. willitrunai.com/gpus/h20-96gb)")}
MODELS = dict(SHAPES)  # bench/memory.py: config.json of each on the hub
MODELS["Qwen2.5-32B"] = dict(H=5120, L=64, heads=40, kv=8, hd=128, I=27648, V=152064, tied=False, max_pos=131072,
                             qkv_bias=True, qk_norm=False)
MODEL_SRC = "config.json on huggingface.co/<org>/<model> (Qwen/Qwen3-4B-Base, Qwen/Qwen3-8B-Base, " \
            "Qwen/Qwen2.5-Math-7B, meta-llama/Llama-3.1-8B, Qwen/Qwen2.5-32B); N counted from the shapes"

MFU = 0.35  # model FLOPs / peak, trainer and prefill
MFU_SRC = ("ours: FSDP2 bf16 training of 4-8B models with activation checkpointing reaches 30-40% of the dense "
           "peak on Hopper (MFU counts 6N; the checkpointed recomputation, 2N more, is hardware work it does "
           "not count, so 0.35 MFU is ~0.47 of the peak in FLOPs done)")
DECODE_EFF = 0.5  # achieved / roofline, decode steps
DECODE_SRC = ("ours: a vLLM decode step also samples (B x vocab logits), schedules on the CPU and runs attention "
              "kernels below peak bandwidth; half the roofline is the middle of 0.3-0.7")
MAX_NUM_SEQS = 256  # vllm_engine.py's default (sequences decoded at once per engine)
PROMPT_MEAN = 200   # tokens, prompt with its instruction
PROMPT_SRC = "assumed (a DAPO-Math-17k or OpenR1 problem with its instruction); < 2% of a step's FLOPs either way"
KEEP = 0.5          # share of groups dynamic sampling keeps (mixed correctness)
KEEP_SRC = ("assumed; any keep rate >= 1/oversample = 1/3 gives one generation batch of 3 x prompts_per_step "
            "(verl's DAPO recipe sizes gen_batch_size = 3 x train_batch_size for the same reason); at 0.25: 2")
VLLM_FIXED = 3e9    # bytes of an engine's memory that are not weights or KV: activations, workspaces, CUDA graphs
VLLM_FIXED_SRC = "bench/memory.py's vllm_fixed: 2.4-3.6 GB for these models"


def resp_mean(max_new: int) -> tuple[int, str]:
    """The mean response length assumed for a budget of max_new tokens (the dominant unknown: no paper or run we
    could read publishes it for these recipes)."""
    if max_new <= 4096:
        return 1000, "assumed: a third of the 3,000-token budget (Qwen2.5-Math-7B under RL answers in ~0.6-1.5k)"
    return 3000, ("assumed: base models under DAPO-style RL average 1-5k tokens, growing; 3,000 over the run. No "
                  "source we could read states it for Qwen2.5-Math-7B at a long budget: SimpleRL-Zoo and Dr. GRPO "
                  "plot it (figures only; 8K and 3K budgets), verl's docs and DAPO recipe give none")


EVAL_SETS = {  # problems per set (the sets' sizes, docs/data.md's sources) and samples per problem (@k)
    "da3po": dict(aime24=(30, 32), aime25=(30, 32), aime26=(30, 32), amc23=(83, 32), minerva=(272, 8),
                  olympiad=(675, 8), math500=(500, 8)),
    "daro": dict(aime24=(30, 32), aime25=(30, 32), math500=(500, 8), gsm8k=(1319, 8), minerva=(272, 8),
                 olympiad=(675, 8)),
    "headline": dict(aime24=(30, 32), aime25=(30, 32), aime26=(30, 32), amc23=(83, 32))}

# docs/gpu.md's recipes. prompts P, G, steps, dynamic sampling (oversample 3, <= 10 batches) on or off,
# --max_prompt_length / --max_new_tokens, GPUs, LoRA, --vllm_gpu_memory (0: bench/memory.py's default), eval_every
_DAPO = dict(model="Qwen3-4B-Base", gpus=8, P=512, G=16, steps=300, ds=True, new=20480, lora=False, u=0.86,
             eval="da3po", eval_every=20, kl=0.0)
_DARO = dict(model="Qwen2.5-Math-7B", gpus=8, P=128, G=8, steps=300, ds=False, new=3000, lora=False, u=0.86,
             eval="daro", eval_every=20, kl=0.0)
RECIPES = [
    dict(_DAPO, cmd="da3po.py --algo da3po $SCALE ... --out_dir runs/da3po"),
    dict(_DAPO, cmd="da3po.py --algo dapo $SCALE ... --out_dir runs/dapo"),
    dict(_DAPO, cmd="da3po.py --algo da3po $SCALE --model Qwen/Qwen3-8B-Base ...", model="Qwen3-8B-Base", u=0.78),
    dict(_DAPO, cmd="da3po.py --algo grpo $SCALE ... --out_dir runs/grpo", ds=False),
    dict(_DAPO, cmd="da3po.py --algo dr_grpo $SCALE ... --out_dir runs/dr_grpo", ds=False),
    dict(_DAPO, cmd="da3po.py --algo gspo $SCALE --out_dir runs/gspo", ds=False),
    dict(_DARO, cmd="daro.py --algo daro $DARO_SCALE ... --out_dir runs/daro"),
    dict(_DARO, cmd="daro.py --algo uniform (var) $DARO_SCALE ... runs/daro_uniform (_var)"),
    dict(_DARO, cmd="daro.py --algo grpo (dr_grpo) $DARO_SCALE ... runs/daro_grpo (_dr_grpo)"),
    dict(_DARO, cmd="daro.py --algo dapo $DARO_SCALE --out_dir runs/daro_dapo", ds=True),
    dict(_DAPO, cmd="1 GPU: da3po.py --algo da3po $SCALE --prompts_per_step 64 --cpu_offload ... runs/da3po_offload",
         gpus=1, P=64, u=0.89),
    dict(_DAPO, cmd="1 GPU: da3po.py --algo da3po $SCALE --prompts_per_step 64 --out_dir runs/da3po_1gpu",
         gpus=1, P=64, u=0.61, only="H200"),
    dict(_DARO, cmd="1 GPU: daro.py --algo daro $DARO_SCALE --prompts_per_step 16 ... runs/daro_1gpu",
         gpus=1, P=16, u=0.5, only="H200"),
    dict(_DAPO, cmd="LoRA: da3po.py ... --prompts_per_step 64 $LORA ... runs/da3po_lora_24gb",
         gpus=1, P=64, lora=True, u=0.69),
    dict(_DAPO, cmd="LoRA: da3po.py ... Qwen3-8B-Base ... $LORA ... runs/da3po_8b_lora_48gb",
         model="Qwen3-8B-Base", gpus=1, P=64, lora=True, u=0.75),
    dict(_DARO, cmd="LoRA: daro.py ... --prompts_per_step 16 $LORA ... runs/daro_lora_48gb",
         gpus=1, P=16, lora=True, u=0.47),
    dict(_DARO, cmd="LoRA: daro.py ... --model meta-llama/Llama-3.1-8B ... runs/daro_llama_lora_48gb",
         model="Llama-3.1-8B", gpus=1, P=16, lora=True, u=0.46)]
OVERSAMPLE, MAX_BATCHES = 3, 10  # --oversample 3 --max_gen_batches 10 in $SCALE and $DARO_SCALE

# The published run: verl's docs/advance/fully_async.md ("Asynchronous Training on 7B Model", colocate sync, 32
# cards) and its script recipe/fully_async_policy/exp/qwen2-7B-math_32/fsdp2_colocate_64/dapo_7b_math_fsdp2_colocate.sh
VERL = dict(model="Qwen2.5-Math-7B", gpus=32, P=512, G=16, steps=400, ds=False, new=28672, lora=False, u=0.80,
            tp=4, max_num_seqs=1024, eval=None, eval_every=20, kl=0.0, gpu="H20",
            hours=3 * 24 + 17 + 5 / 60, step_s=790.10, gen_s=357.41, old_s=107.71, upd_s=313.81)
VERL_SRC = ("verl docs/advance/fully_async.md (verl.readthedocs.io/en/latest/advance/fully_async.html): H20, "
            "Qwen2.5-Math-7B, DAPO, 512 prompts x 16, 400 steps, max_response_length 28K, colocate sync on 32 "
            "cards: 3d 17h 5m (step 790.10 s = gen 357.41 + old_log_prob 107.71 + update_actor 313.81); its "
            "script: verl.trainer.main_ppo (no dynamic sampling), max_response_length 1024 x 28 = 28,672 with a "
            "4,096-token overlong buffer, vLLM TP 4 at gpu_memory_utilization 0.80, "
            "pi_old recomputed, no KL, gradient checkpointing, param and optimizer offload")
# The synchronous tail (pinned before the tail model existed; see the module docstring)
SMALL_BATCH = dict(tok_s=75.0, model="Llama-3.1-8B", bw=1.555e12,
                   src="johnmusgrave.com/p/vllm-throughput-latency-sweep-on: vLLM, Llama-3.1-8B-Instruct bf16 on one "
                       "A100 40GB, one request at a time: about 75 tokens/s, which the post puts at ~77% of the "
                       "memory-bandwidth ceiling; A100 40GB SXM 1,555 GB/s (NVIDIA A100 datasheet). Batch 1, TP 1: "
                       "no TP all-reduces in it, so on a TP-4 engine the real per-token latency is higher")
TAIL_SRC = ("assumed: at least one response per engine reaches the run's max_response_length in every generation "
            "batch (no source gives the share at the cap; DAPO's overlong buffer, which the verl run's script "
            "enables with 4,096 tokens, exists because some responses run into it), and it is admitted when the "
            "step starts (the kindest case: it shares the full batch's decode steps as long as the bulk lasts)")
SMALL_EFF = SMALL_BATCH["tok_s"] * 2 * param_count(SHAPES[SMALL_BATCH["model"]]) / SMALL_BATCH["bw"]
PRICE = 2.79  # $ per H100 GPU-hour
PRICE_SRC = ("RunPod Secure Cloud 8 x H100 SXM, $22.32/h = $2.79 per GPU-hour (April 2026, "
             "techplained.aptechsolutions.io/runpod-vs-vast-ai; on-demand H100 SXM lists at $2.49-3.99)")


# ---------------------------------------------------------------------------------------------------------------
# The arithmetic
# ---------------------------------------------------------------------------------------------------------------
def expected_batches(P: int, keep: float, oversample: int = OVERSAMPLE, cap: int = MAX_BATCHES) -> float:
    """E[generation batches] of dynamic sampling: each batch draws oversample x P prompts, each kept with
    probability keep, until P are kept or cap batches ran. E = sum over b >= 0 of P(kept after b batches < P),
    b < cap, with the kept count Binomial(b x oversample x P, keep) (exact, in log space)."""
    def below(n, k):  # P(Binomial(n, keep) < k)
        if keep >= 1:
            return 1.0 if n < k else 0.0
        lp, lq = math.log(keep), math.log1p(-keep)
        return min(1.0, sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp
                            + (n - i) * lq) for i in range(min(k, n + 1))))
    return sum(below(b * oversample * P, P) for b in range(cap))


def decode_rate(m: dict, gpu: dict, kv_bytes: float, ctx: float, seqs: float, tp: int, max_seqs: int) -> dict:
    """Tokens per second of one engine of tp GPUs at its roofline x DECODE_EFF, and what bounds it."""
    N, kvb = param_count(m), kv_bytes_per_token(m)
    batch = max(1.0, min(kv_bytes / (kvb * ctx), max_seqs, seqs))
    read = 2 * N + batch * ctx * kvb                                       # bytes a decode step reads
    flops = batch * (2 * N + 4 * m["L"] * m["heads"] * m["hd"] * ctx)      # FLOPs a decode step does
    t_bw, t_fl = read / (tp * gpu["bw"]), flops / (tp * gpu["flops"])
    return dict(batch=batch, rate=batch / max(t_bw, t_fl) * DECODE_EFF, bound="bandwidth" if t_bw >= t_fl else
                "compute")


def tail_seconds(m: dict, gpu: dict, tp: int, cap: float, L: float, p: float, seqs: float, batch: float,
                 small_eff: float = None) -> dict:
    """The synchronous tail of one generation batch on one engine (module docstring): the longest response, cap
    tokens, shares the bulk's seqs x L / batch full-batch decode steps, then decodes the rest alone."""
    N, kvb = param_count(m), kv_bytes_per_token(m)
    alone = max(0.0, cap - seqs * L / min(batch, seqs))
    ctx = p + cap - alone / 2  # its mean context over the tokens it decodes alone
    floor = 2 * N / (tp * gpu["bw"])  # the roofline of a batch-1 step: the weights, read once
    t_tok = (2 * N + ctx * kvb) / (tp * gpu["bw"]) / (small_eff or SMALL_EFF)
    return dict(tokens=alone, t_tok=t_tok, floor=floor, s=alone * t_tok)


def step_cost(r: dict, gpu: dict, keep: float = KEEP, resp: float = 0, mfu: float = MFU, tail: bool = True,
              small_eff: float = None) -> dict:
    """Seconds of one step of recipe r on GPUs of kind gpu, by phase, and the inputs behind them."""
    m = MODELS[r["model"]]
    N, tp = param_count(m), r.get("tp", 1)
    L = resp or resp_mean(r["new"])[0]
    p = PROMPT_MEAN
    batches = expected_batches(r["P"], keep) if r["ds"] else 1
    groups = r["P"] * (OVERSAMPLE * batches if r["ds"] else 1)
    seqs = groups * r["G"]
    if r.get("eval"):  # the evaluation's sequences, spread over the steps
        seqs += sum(n * k for n, k in EVAL_SETS[r["eval"]].values()) / r["eval_every"]
    engines = r["gpus"] / tp
    kv_bytes = tp * (r["u"] * gpu["mem"] - VLLM_FIXED) - 2 * N - (2 * 16 * N / 1e3 if r["lora"] else 0)
    dec = decode_rate(m, gpu, kv_bytes, p + L / 2, seqs / engines, tp, r.get("max_num_seqs", MAX_NUM_SEQS))
    bulk = seqs * L / (engines * dec["rate"]) + 2 * N * groups * p / (r["gpus"] * gpu["flops"] * mfu)
    n_gen = batches if r["ds"] else 1  # synchronous generation batches a step, each with its own tail
    t = tail_seconds(m, gpu, tp, r["new"], L, p, seqs / engines / n_gen, dec["batch"], small_eff)
    gen = bulk + (n_gen * t["s"] if tail else 0.0)
    S = p + L  # a trained sequence
    attn = 4 * m["L"] * m["heads"] * m["hd"] * S / 2  # forward attention FLOPs per token, mean context S / 2
    tokens = r["P"] * r["G"] * S
    train_per_token = (4 * N if r["lora"] else 6 * N) + 3 * attn
    forwards = 1 + (r["kl"] > 0)  # pi_old (vLLM's bf16 log-probs are never the trainer's) and the KL model
    flops = tokens * (train_per_token + forwards * (2 * N + attn))
    train = flops / (r["gpus"] * gpu["flops"] * mfu)
    return dict(N=N, L=L, batches=batches, seqs=seqs, kv=kv_bytes, dec=dec, bulk=bulk, tail=t, gen=gen, train=train,
                step=gen + train, flops=flops)


def run_hours(r: dict, gpu: dict, **kw) -> float:
    """GPU-hours of the whole run: steps x step seconds x GPUs."""
    return r["steps"] * step_cost(r, gpu, **kw)["step"] * r["gpus"] / 3600


# ---------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------
def inputs() -> list[str]:
    lines = ["Inputs and their sources", ""]
    for name, g in GPUS.items():
        lines.append(f"  {name}: {g['bw'] / 1e12:.2f} TB/s, {g['mem'] / 1e9:.0f} GB, {g['flops'] / 1e12:.0f} "
                     f"TFLOP/s  ({g['src']})")
    lines.append(f"  models ({MODEL_SRC}):")
    for name, m in MODELS.items():
        lines.append(f"    {name:16s} N = {param_count(m) / 1e9:6.2f}B, {m['L']} layers, {m['kv']} KV heads x "
                     f"{m['hd']}, KV {kv_bytes_per_token(m):,} B/token")
    for label, value, src in [("MFU (trainer, prefill)", MFU, MFU_SRC), ("decode efficiency", DECODE_EFF,
                              DECODE_SRC), ("keep rate", KEEP, KEEP_SRC), ("prompt mean", PROMPT_MEAN, PROMPT_SRC),
                              ("response mean, budget <= 4,096", resp_mean(3000)[0], resp_mean(3000)[1]),
                              ("response mean, budget 20,480", resp_mean(20480)[0], resp_mean(20480)[1]),
                              ("vLLM non-KV memory", f"{VLLM_FIXED / 1e9:.0f} GB", VLLM_FIXED_SRC),
                              ("max_num_seqs", MAX_NUM_SEQS, "vllm_engine.py's default"),
                              ("batch-1 decode efficiency (tail)", f"{SMALL_EFF:.2f} = {SMALL_BATCH['tok_s']:.0f} "
                               f"tokens/s x 2 x {param_count(SHAPES[SMALL_BATCH['model']]) / 1e9:.2f}B / "
                               f"{SMALL_BATCH['bw'] / 1e12:.3f} TB/s", SMALL_BATCH["src"]),
                              ("tail", "max_new_tokens of each recipe", TAIL_SRC)]:
        lines.append(f"  {label}: {value}  ({src})")
    lines.append(f"  dynamic sampling: --oversample {OVERSAMPLE} --max_gen_batches {MAX_BATCHES} (the recipes); "
                 f"E[batches] at keep {KEEP} = {expected_batches(512, KEEP):.2f}, at 0.25 = "
                 f"{expected_batches(512, 0.25):.2f}, at 0.1 = {expected_batches(512, 0.1):.2f}")
    lines.append("  evaluation: avg@k sequences of docs/gpu.md's eval sets every 20 steps (AIME 30, AMC23 83, "
                 "Minerva 272, OlympiadBench 675, MATH-500 500, GSM8K 1,319 problems)")
    return lines


def table() -> list[str]:
    lines = ["", "One run of each recipe (GPU-hours = steps x step seconds x GPUs; decode tokens/s per GPU, "
             "bound; step seconds generation + trainer, the generation's synchronous tail beside it)", "",
             "| docs/gpu.md command | model | GPUs | P x G | H100 GPU-h | H200 GPU-h | H100 step s (gen + train) "
             "| H100 tail s | H100 decode tok/s/GPU |", "|---|---|---|---|---|---|---|---|---|"]
    for r in RECIPES:
        h = {g: run_hours(r, GPUS[g]) for g in ("H100", "H200")}
        c = step_cost(r, GPUS["H100"])
        fits = r.get("only") != "H200"
        h100 = f"{h['H100']:,.0f}" if fits else "does not fit"
        step = f"{c['step']:,.0f} ({c['gen']:,.0f} + {c['train']:,.0f})" if fits else "-"
        rate = f"{c['dec']['rate'] / r.get('tp', 1):,.0f}, {c['dec']['bound']}" if fits else "-"
        tail = f"{c['gen'] - c['bulk']:,.0f}" if fits else "-"
        lines.append(f"| `{r['cmd']}` | {r['model']} | {r['gpus']} | {r['P']} x {r['G']}"
                     f"{' (DS)' if r['ds'] else ''} | {h100} | {h['H200']:,.0f} | {step} | {tail} | {rate} |")
    lines.append("(DS: dynamic sampling, 3 x P prompts a generation batch. LoRA rows: the commands as written on an "
                 "H100/H200, their --vllm_gpu_memory of that GPU.)")
    return lines


def check() -> list[str]:
    """The same arithmetic on verl's published synchronous run."""
    r, g = VERL, GPUS["H20"]
    c = step_cost(r, g)
    model = r["steps"] * c["step"] * r["gpus"] / 3600
    published = r["hours"] * r["gpus"]
    ratio = model / published
    lines = ["", "Check against a published wall-clock", f"  source: {VERL_SRC}",
             f"  published: {r['hours']:.2f} h x {r['gpus']} GPUs = {published:,.0f} H20 GPU-hours",
             f"  this model, same setup on H20 (mean response {c['L']:,} tokens, {resp_mean(r['new'])[1]}):",
             f"    per step: generation {c['gen']:.0f} s (published gen {r['gen_s']:.0f}), trainer {c['train']:.0f} s "
             f"(published old_log_prob + update_actor {r['old_s'] + r['upd_s']:.0f}); decode "
             f"{c['dec']['rate'] / r['tp']:,.0f} tokens/s/GPU ({c['dec']['bound']}-bound, batch "
             f"{c['dec']['batch']:.0f} per TP-{r['tp']} engine)",
             f"    generation = bulk {c['bulk']:.0f} s + tail {c['tail']['s']:.0f} s: the longest response "
             f"({r['new']:,} tokens) decodes {c['tail']['tokens']:,.0f} of them alone at\n    "
             f"{c['tail']['t_tok'] * 1e3:.2f} ms a token (roofline floor 2N / (TP x bandwidth) = "
             f"{c['tail']['floor'] * 1e3:.2f} ms, / batch-1 efficiency {SMALL_EFF:.2f}, plus its KV read)",
             f"    {model:,.0f} H20 GPU-hours: ratio model / published = {ratio:.2f} "
             f"({'within' if abs(ratio - 1) <= 0.3 else 'OUTSIDE'} +-30%)",
             "  sensitivity (ratio to the published 2,851 when one input changes):"]
    if abs(ratio - 1) > 0.3:
        lo, hi = 100.0, float(r["new"])  # the response mean at which the trainer phase takes the published time
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if step_cost(r, g, resp=mid)["train"] < r["old_s"] + r["upd_s"] else (lo, mid)
        at = step_cost(r, g, resp=lo)
        lines[-2:-1] = [lines[-2], f"    the model misses the published run by more than 30%: its trainer takes "
                        f"{c['train'] / (r['old_s'] + r['upd_s']):.2f}x the published time, its\n    generation "
                        f"(bulk + tail) {c['gen'] / r['gen_s']:.2f}x. The trainer's published time fits a response "
                        f"mean of {lo:,.0f} tokens at MFU {MFU}\n    (an inference, not an input); at that mean "
                        f"this model's generation is {at['gen']:.0f} s (tail {at['gen'] - at['bulk']:.0f} s) against "
                        f"the published\n    {r['gen_s']:.0f} s. verl publishes no mean response length for the run; "
                        f"it is the input that decides the check."]
    for label, kw in [("response mean 1,500", dict(resp=1500)), ("response mean 6,000", dict(resp=6000)),
                      ("MFU 0.25", dict(mfu=0.25)), ("MFU 0.45", dict(mfu=0.45))]:
        lines.append(f"    {label:22s} {run_hours(r, g, **kw) / published:.2f}")
    for eff in (0.3, 0.7):
        lines.append(f"    decode efficiency {eff:<4} {_with_decode_eff(eff, r, g) / published:.2f}")
    lines.append(f"    {'no tail (all the mean)':22s} {run_hours(r, g, tail=False) / published:.2f}")
    half = f"batch-1 eff. {SMALL_EFF / 2:.2f} (/2)"
    lines.append(f"    {half:22s} {run_hours(r, g, small_eff=SMALL_EFF / 2) / published:.2f}")
    return lines


def _with_decode_eff(eff: float, r: dict, g: dict) -> float:
    global DECODE_EFF
    saved, DECODE_EFF = DECODE_EFF, eff
    try:
        return run_hours(r, g)
    finally:
        DECODE_EFF = saved


# The DA3PO headline (DA3PO vs DAPO on Qwen3-4B-Base, G 16, lam 2, avg@32 on AIME and AMC), 2 seeds per arm: the
# paper runs' recipe as it stands (the scale is the claim), evaluated on AIME and AMC alone
HEADLINE = dict(_DAPO, eval="headline", arms=("da3po --lam 2", "dapo"), seeds=2)


def replication() -> list[str]:
    r = HEADLINE
    runs = len(r["arms"]) * r["seeds"]
    h = {g: runs * run_hours(r, GPUS[g]) for g in ("H100", "H200")}
    return ["", f"The DA3PO headline replicated: {len(r['arms'])} arms x {r['seeds']} seeds = {runs} runs of the "
            f"8-GPU recipe, eval AIME24/25/26 + AMC23 @32 only",
            f"  {h['H100']:,.0f} H100 GPU-hours ({h['H100'] / r['gpus'] / 24:.1f} days of one 8-GPU node), "
            f"${h['H100'] * PRICE:,.0f} at ${PRICE}/GPU-hour ({PRICE_SRC}); {h['H200']:,.0f} H200 GPU-hours"]


def main():
    print("\n".join(inputs() + table() + replication() + check()))


if __name__ == "__main__":
    main()
