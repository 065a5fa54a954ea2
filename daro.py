"""
DARO: the GRPO/DAPO loss split by difficulty bin, each bin weighted by a learnable weight.
Paper: "DARO: Difficulty-Aware Reweighting Policy Optimization", arXiv:2510.09001.
Formulas and pitfalls: ../shared/ALGORITHMS.md (section 7, pitfalls 11-12); DAPO is arXiv:2503.14476.

One RL step: as in da3po.py (rollout, verifier, dynamic sampling, GRPO advantages), then each completion goes to the
bin mu = #correct / K of its group, and several mini-batch updates of the model and the weights minimise
  L(theta, w) = sum_{mu = 1/K .. (K-1)/K} [ w_mu * L_mu(theta) - ln w_mu ]                   Eq. (1)
  L_mu = (clipped token losses of bin mu, summed) / (#tokens of bin mu in the whole update)  Eq. (2)
  w_mu = exp(-s_mu), s = 0 at start; Adam (--weight_lr), no weight decay, no gradient clip   Eq. (3)
The optimum in w is w_mu = 1 / L_mu: every bin then carries the same loss scale (the paper's "loss scale issue").
Bins mu = 0, 1 (zero advantage) are left out; a bin absent from an update gets no weight step. Adam moves s by about
weight_lr per update: at the paper's 1e-3 a slow, bounded reweighting (ALGORITHMS.md 7.2).

The default reading [dev 1]. At ratio 1, L_mu is minus the token-weighted mean advantage of its bin: negative when the
bin's correct completions are the longer ones, and later mini-batches push it down further. Eq. (1) then has no
minimum in w, and the literal weights run to the clamp whatever the difficulty. So by default the weights fit the
detached magnitude, minimising sum_mu [w_mu (|L_mu| + delta) - ln w_mu], whose optimum 1 / (|L_mu| + delta) is the
equal loss scale for either sign (delta = 1e-3 keeps it finite at L_mu = 0), clamped to [w_min, w_max] = [0.1, 10].
The model's gradient, sum_mu w_mu grad L_mu, is the same under both readings; `--daro_literal` fits the weights to
L_mu itself: Eq. (1) as written (clamped too).

--algo presets (every knob stays overridable): daro (default); static weights uniform (w = 1) and var
(w = sqrt(mu(1 - mu))); dapo, grpo, dr_grpo (their own losses, no bins); see PRESETS. L_mu uses the z-scored GRPO
advantage, so `var` gives a bin's correct-vs-incorrect contrast the total weight mu(1 - mu), the reward variance, as
Dr. GRPO and LIPO do (ALGORITHMS.md 7.3, "relative to GRPO"); unnormalised (0.5 at mu = 1/2): Adam ignores a global
loss scale. train/loss logs sum_mu w_mu L_mu. Paper settings (7.4): K = 8, model lr 1e-6, weight lr 1e-3,
clip 0.2/0.28, 128 prompts per step, mini-batches of 64 prompts, 300 steps.

Deviations from the paper (each tagged "[dev N]" in the code):
  1) The paper's full text is not available, so the sign of L_mu is not settled there: the guarded reading above by
     default, the literal one behind `--daro_literal`; delta and the clamp range are ours.
  2) Learning rate, batch sizes and lengths default to the built-in CPU demo, not to the paper's GPU runs; the README
     lists the paper-scale commands.
  3) GRPO presets use no KL term (kl_coef=0, as DAPO does); `--kl_coef 0.04` restores DeepSeekMath's.
  4) DAPO's dynamic sampling is on (not known for the paper): it changes which prompts fill a batch, not the loss.

Run:
  python daro.py                                                           # built-in demo, CPU or GPU, ~3 min
  python daro.py --algo var --steps 3 --out_dir /tmp/x                     # a static weighting, smoke test
  python daro.py --model Qwen/Qwen2.5-Math-7B --train_data openr1.parquet --lr 1e-6 --prompts_per_step 128 ...
  torchrun --standalone --nproc_per_node=8 daro.py --model Qwen/Qwen2.5-Math-7B ...      # N GPUs
"""
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from common import (Logger, PromptStream, VLLMRollout, all_reduce_sum, check_config, cleanup_dist,
                    config_dict, die, dynamic_sampling, eval_set_names, evaluate_sets, format_eval, format_step,
                    group_advantages, guarded_step, handle_stop_signals, hf_generate, latest_checkpoint, load_data,
                    load_model, load_optimizer_state, local_state, log_samples, loss_weights, make_batch, model_path,
                    micro_batches, old_logprobs, parse_config, policy_loss, print0, resolve_rollout, resolve_template,
                    rng_state, roll_groups, rollout_copy, save_checkpoint, set_rng_state, setup_dist, shard_model,
                    split_updates, stop_requested, sync_rollout, token_logprobs, tokenize_problems)

# -----------------------------------------------------------------------------------------------------------------
# Config


@dataclass
class Config:
    """DARO (learnable per-difficulty loss weights) and its baselines on one code path. Defaults run the CPU demo."""
    # run
    algo: str = "daro"  # preset: daro | uniform | var | dapo | grpo | dr_grpo; explicit flags override the preset
    model: str = "demo"  # local Hugging Face folder, hub id, or 'demo' (the tiny shipped model, see demo/build.py)
    train_data: str = "arith"  # 'arith' (built-in sums) or a .jsonl/.json/.parquet file of problem/answer rows
    eval_data: str = "arith"  # same choices; 'arith' uses the held-out split
    out_dir: str = "out/daro"  # config.json, metrics.jsonl, samples.jsonl, checkpoints
    seed: int = 0  # init seed (same on every rank); sampling uses seed + rank
    steps: int = 60  # RL steps (one rollout batch each)
    device: str = ""  # '' = cuda if available, else cpu
    dtype: str = "float32"  # compute dtype: float32 | bfloat16 (weights and optimizer state stay float32)
    grad_checkpointing: bool = False  # recompute activations in backward (less memory, ~30% more compute)
    cpu_offload: bool = False  # FSDP2: keep sharded parameters and optimizer state on CPU (large models, few GPUs)
    # rollout
    prompts_per_step: int = 32  # groups trained on per step, across all ranks (train batch size in DAPO)
    group_size: int = 8  # G (K in the paper): completions per prompt; bins mu = 0, 1/G, ..., 1
    dynamic_sampling: bool = True  # DAPO: keep only groups with 0 < #correct < G, refill from fresh prompts
    oversample: float = 1.5  # prompts generated per dynamic-sampling batch, as a multiple of prompts_per_step
    max_gen_batches: int = 4  # cap on generation batches per step; at the cap, warn and train on what was kept
    max_new_tokens: int = 12  # L_max: hard limit on completion length
    max_prompt_length: int = 1024  # prompts longer than this (tokens, template included) are dropped at load
    temperature: float = 1.0  # rollout sampling temperature
    top_p: float = 1.0  # rollout nucleus sampling
    rollout_batch_size: int = 512  # sequences per generate call (memory knob)
    rollout: str = "hf"  # rollout engine: hf (transformers generate) | vllm | auto (vLLM if installed and usable)
    vllm_gpu_memory: float = 0.3  # vLLM on GPU: share of GPU memory for its weights + KV cache
    vllm_cpu_kv_gb: float = 0.5  # vLLM on CPU: KV cache size in GiB
    prompt_template: str = "auto"  # chat | plain | dapo | none | auto (none for the demo, chat if the tokenizer has one)
    answer_format: str = "auto"  # where the verifier looks: boxed | answer_line | auto
    prompt_key: str = ""  # data field holding the problem ('' = try problem, question, prompt; dots for nested)
    answer_key: str = ""  # data field holding the answer ('' = try answer, final_answer, reward_model.ground_truth)
    # reward (DAPO)
    overlong_buffer: int = 4  # L_cache: penalty ramps from 0 at L_max - L_cache tokens to -1 at L_max; 0 = off
    overlong_penalty: float = 1.0  # penalty factor of the overlong shaping
    # difficulty-aware reweighting, Eq. (1)-(3)
    weighting: str = "learned"  # w_mu: learned (DARO) | uniform (1) | var (sqrt(mu(1-mu))) | none (no bins, loss_agg)
    weight_lr: float = 1e-3  # Adam learning rate of the log-weights s_mu (paper: 1e-3)
    daro_delta: float = 1e-3  # delta: the weights fit |L_mu| + delta, so w stays finite when L_mu = 0 [dev 1]
    daro_literal: bool = False  # fit the weights to L_mu itself, Eq. (1) as written (no minimum if L_mu <= 0) [dev 1]
    w_min: float = 0.1  # lower clamp of every w_mu, applied after each weight step [dev 1]
    w_max: float = 10.0  # upper clamp of every w_mu [dev 1]
    # advantages and loss
    std_norm: bool = True  # GRPO z-score advantage; off = Dr. GRPO (mean-centred only)
    loss_agg: str = "token-mean"  # weighting none only: token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
    seq_ratio: bool = False  # GSPO: length-normalised sequence-level importance ratio
    clip_low: float = 0.2  # epsilon_low: ratio clipped below at 1 - clip_low
    clip_high: float = 0.28  # epsilon_high: ratio clipped above at 1 + clip_high (clip-higher)
    clip_ratio_c: float = 0.0  # dual clip for negative advantages (verl uses 3.0); 0 = off
    kl_coef: float = 0.0  # beta: k3 KL penalty to the initial model; 0 = none, as in DAPO [dev 3]
    # optimisation
    lr: float = 1e-4  # AdamW learning rate (paper scale: 1e-6) [dev 2]
    weight_decay: float = 0.1  # AdamW weight decay (DAPO recipe)
    warmup_steps: int = 0  # linear learning-rate warm-up over this many RL steps (not optimizer updates), as verl
    grad_clip: float = 1.0  # max global gradient norm
    updates_per_step: int = 2  # optimizer updates (mini-batches) per RL step; the step's groups are split evenly
    micro_batch_size: int = 64  # sequences per forward/backward on one rank (memory knob; does not change the math)
    # evaluation, logging, checkpoints
    eval_every: int = 10  # evaluate every N steps (also at step 0 and at the end); 0 = only at start and end
    eval_samples: int = 4  # k: completions per eval problem (avg@k, pass@k)
    eval_size: int = 0  # eval problems to use; 0 = all
    eval_temperature: float = 1.0  # eval sampling temperature
    eval_top_p: float = 1.0  # eval nucleus sampling (DAPO reports top_p 0.7)
    eval_batch_size: int = 128  # eval problems per generate call
    sample_every: int = 10  # write a few completions to samples.jsonl every N steps
    save_every: int = 0  # checkpoint every N steps (and at the end, and on SIGTERM/SIGINT); 0 = only at the end
    keep_last: int = 2  # checkpoints kept on disk (older ones are deleted)
    resume: bool = False  # continue from the latest checkpoint in out_dir
    max_bad_updates: int = 3  # stop the run after this many non-finite losses/gradients in a row (each is skipped)
    eval_only: bool = False  # evaluate --model on --eval_data and exit


# Each preset is its paper's recipe, written out for every knob that defines the algorithm; the scale (model, lr,
# batch sizes, lengths, overlong_buffer where shaping is on) comes from the flags. A flag given on the command line
# beats the preset, with a printed note (common.parse_config), so a recipe is never changed by accident.
_DAPO = {"weighting": "none", "dynamic_sampling": True, "std_norm": True, "loss_agg": "token-mean", "clip_low": 0.2,
         "clip_high": 0.28}  # DAPO: clip-higher, token-mean, overlong shaping, dynamic sampling [dev 4]
PRESETS = {
    "daro": {**_DAPO, "weighting": "learned"},  # DARO on top of the DAPO loss (paper: clip 0.2 / 0.28)
    "uniform": {**_DAPO, "weighting": "uniform"},  # the bins of DARO with frozen w = 1: what learning the weights adds
    "var": {**_DAPO, "weighting": "var"},  # variance-based static weights (Dr. GRPO / LIPO), ALGORITHMS.md 7.3
    "dapo": _DAPO,
    "grpo": {**_DAPO, "dynamic_sampling": False, "loss_agg": "seq-mean-token-mean", "clip_high": 0.2,
             "overlong_buffer": 0},
    "dr_grpo": {**_DAPO, "dynamic_sampling": False, "std_norm": False, "loss_agg": "seq-mean-token-sum-norm",
                "clip_high": 0.2, "overlong_buffer": 0},
}

# -----------------------------------------------------------------------------------------------------------------
# Algorithm: difficulty bins, per-bin losses and their learnable weights


def bin_token_weights(mask: torch.Tensor, bins: torch.Tensor, G: int):
    """Per-token weights (B, T) that turn a sum of token losses into sum_mu L_mu, Eq. (2): a token in bin mu weighs
    1 / (#tokens of bin mu in the WHOLE update), counted over every micro-batch and rank before the micro-batch loop
    (as common.loss_weights does for token-mean), so the split never matters; bins 0 and G (mu = 0, 1) weigh 0. A bin
    of one prompt weighs as much as one of twenty: the method, and why a sparse bin is noisy (pitfall 12).
    bins: (B,) #correct of each completion's group. Example: bins [1, 1, 3], lengths [2, 4, 5] -> 1/6, 1/6, 1/5.
    Returns (weights (B, T), tokens per bin (G+1,))."""
    mask = mask if mask.is_floating_point() else mask.float()  # a float64 mask stays float64
    tokens = all_reduce_sum(mask.new_zeros(G + 1).index_add_(0, bins, mask.sum(-1)))  # (G+1,)
    inside = ((bins > 0) & (bins < G)).to(mask.dtype).unsqueeze(-1)  # (B, 1)
    return mask * inside / tokens.clamp(min=1)[bins].unsqueeze(-1), tokens


def bin_weights(log_w: list[torch.Tensor], weighting: str) -> torch.Tensor:
    """w_mu for mu = 0, 1/G, ..., 1 as a constant (G+1,) tensor: learned exp(-s_mu), Eq. (3), or a static function of
    mu; 0 for mu = 0 and 1. `none` (the baselines' own loss, no bins) weighs every bin 1."""
    G, device = len(log_w) + 1, log_w[0].device
    if weighting == "none":
        return torch.ones(G + 1, device=device)
    mu = torch.arange(1, G, device=device) / G  # (G-1,)
    if weighting == "learned":
        w = torch.exp(-torch.stack(log_w).detach())  # Eq. (3)
    else:  # uniform; var on top of the z-scored advantage gives a total weight mu(1-mu) (ALGORITHMS.md 7.3)
        w = torch.ones_like(mu) if weighting == "uniform" else (mu * (1 - mu)).sqrt()
    return torch.nn.functional.pad(w, (1, 1))


def weight_objective(log_w: list[torch.Tensor], bin_loss: torch.Tensor, present: torch.Tensor, delta: float,
                     literal: bool) -> torch.Tensor:
    """The weights' side of Eq. (1) over the bins present in the update (absent ones are not in the graph at all):
    sum_mu w_mu L_mu + s_mu, as -ln w = s; bin_loss (G+1,) is a constant here. Guarded (default): |L_mu| + delta in
    place of L_mu, so the minimum w_mu = 1 / (|L_mu| + delta) always exists [dev 1]."""
    target = bin_loss if literal else bin_loss.abs() + delta  # (G+1,)
    return sum(torch.exp(-s) * target[i] + s for i, s in enumerate(log_w, 1) if present[i])  # Eq. (1), (3)


def update_weights(log_w: list[torch.Tensor], weight_opt, bin_loss: torch.Tensor, present: torch.Tensor, cfg):
    """One Adam step of the log-weights on Eq. (1), then clamp w to [w_min, w_max]. An absent bin keeps .grad None, so
    Adam skips it: with a zero gradient instead, its momentum would still move the weight (ALGORITHMS.md pitfall 11)."""
    if not present[1:-1].any():
        return
    weight_opt.zero_grad(set_to_none=True)
    weight_objective(log_w, bin_loss, present, cfg.daro_delta, cfg.daro_literal).backward()
    weight_opt.step()
    with torch.no_grad():
        for s in log_w:
            s.clamp_(-math.log(cfg.w_max), -math.log(cfg.w_min))  # w = exp(-s) in [w_min, w_max] [dev 1]

# -----------------------------------------------------------------------------------------------------------------
# Training


def main(cfg: Config):
    d = setup_dist(cfg.device)
    G, world = cfg.group_size, d.world_size
    check_config(cfg, world)  # a flag combination that cannot work stops here with exit code 2
    if cfg.weighting not in ("learned", "uniform", "var", "none"):
        die(f"--weighting {cfg.weighting!r}: choose one of learned, uniform, var, none")
    if not 0 < cfg.w_min <= 1 <= cfg.w_max:
        die(f"--w_min and --w_max must satisfy 0 < w_min <= 1 <= w_max, got {cfg.w_min} and {cfg.w_max}")
    gen_groups = math.ceil(cfg.prompts_per_step * (cfg.oversample if cfg.dynamic_sampling else 1) / world) * world
    print0(f"{cfg.prompts_per_step} groups x {G} = {cfg.prompts_per_step * G} sequences per step "
           f"({cfg.prompts_per_step * G // world} per rank), {cfg.updates_per_step} optimizer updates per step")

    # data first (a bad file fails in a second), then model, optimizer
    train_problems = load_data(cfg.train_data, "train", cfg.prompt_key, cfg.answer_key)
    specs = cfg.eval_data.split(",")
    eval_sets = {name: load_data(spec, "eval", cfg.prompt_key, cfg.answer_key)[:cfg.eval_size or None]
                 for name, spec in zip(eval_set_names(specs), specs)}
    torch.manual_seed(cfg.seed)  # identical initialisation on every rank
    ckpt = latest_checkpoint(cfg.out_dir) if cfg.resume else None
    if cfg.resume and not ckpt:
        print0(f"--resume: no checkpoint in {cfg.out_dir!r}; starting from step 0")
    base = model_path(cfg.model)  # 'demo': the shipped demo model
    model, tok = load_model(ckpt or base, d.device)  # float32 master weights; --dtype sets the compute dtype
    cfg.prompt_template = resolve_template(cfg.prompt_template, tok)
    train_problems = tokenize_problems(train_problems, tok, cfg.prompt_template, cfg.max_prompt_length, cfg.train_data)
    eval_sets = {name: tokenize_problems(problems, tok, cfg.prompt_template, cfg.max_prompt_length, spec)
                 for (name, problems), spec in zip(eval_sets.items(), specs)}
    stream = PromptStream(train_problems, cfg.seed)
    policy = rollout_copy(model, d, cfg.dtype)  # what generates: the model itself, or a full copy per rank under FSDP
    model = shard_model(model, d, cfg.dtype, cfg.grad_checkpointing, cfg.cpu_offload)
    ref_model = shard_model(load_model(base, d.device)[0].requires_grad_(False), d, cfg.dtype).eval() \
        if cfg.kl_coef > 0 else None  # the KL anchor is the initial model, also after a resume
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / max(1, cfg.warmup_steps)))
    engine = None
    if resolve_rollout(cfg.rollout, d.device) == "vllm":  # before the sampling seed: vLLM reseeds torch's RNG
        engine = VLLMRollout(ckpt or base, tok, d, cfg.dtype, cfg.seed, gpu_memory_utilization=cfg.vllm_gpu_memory,
                             cpu_kv_cache_gb=cfg.vllm_cpu_kv_gb)
        print0(f"rollout: vLLM, probe log-prob diff at start {engine.check_sync(model):.1e}")
    amp = lambda: torch.autocast(d.device.type, getattr(torch, cfg.dtype), enabled=cfg.dtype != "float32")  # noqa: E731
    # s_mu for mu = 1/G .. (G-1)/G, Eq. (3): one tensor per bin, so that Adam can skip a bin absent from an update;
    # their own optimizer keeps them out of the model's weight decay and gradient clipping (ALGORITHMS.md pitfall 11)
    log_w = [torch.zeros((), device=d.device, requires_grad=True) for _ in range(1, G)]
    weight_opt = torch.optim.Adam(log_w, lr=cfg.weight_lr)

    def generate(prompts, temperature=cfg.temperature, top_p=cfg.top_p):
        if engine is not None:  # also returns vLLM's sampling log-probs (logged as rollout/logprob_diff)
            return engine.generate(prompts, cfg.max_new_tokens, temperature, top_p)
        return hf_generate(policy, tok, prompts, cfg.max_new_tokens, temperature, top_p, cfg.rollout_batch_size)

    def run_eval(step):
        gen = lambda prompts: generate(prompts, cfg.eval_temperature, cfg.eval_top_p)  # noqa: E731
        metrics = {"step": step, **evaluate_sets(gen, tok, eval_sets, cfg, d.rank, world)}
        logger.log(metrics)
        for line in format_eval(step, metrics, list(eval_sets)):
            logger.line(line)
        return metrics

    def save(step):
        save_checkpoint(cfg.out_dir, step, model, policy, tok, {
            "optimizer": local_state(opt.state_dict()), "scheduler": sched.state_dict(), "rng": rng_state(),
            "data_position": stream.position, "step": step, "daro_log_w": torch.stack(log_w).detach().cpu(),
            "weight_optimizer": weight_opt.state_dict()}, keep=cfg.keep_last)

    start_step = 0
    if ckpt:
        state = torch.load(os.path.join(ckpt, f"trainer_rank{d.rank}.pt"), weights_only=False)
        load_optimizer_state(opt, state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        with torch.no_grad():
            for s, saved in zip(log_w, state["daro_log_w"]):
                s.copy_(saved)
        weight_opt.load_state_dict(state["weight_optimizer"])
        stream.position, start_step = state["data_position"], state["step"]
        set_rng_state(state["rng"])
        print0(f"resumed from {ckpt} (step {start_step})")
    else:
        torch.manual_seed(cfg.seed + d.rank)  # sampling differs per rank
    logger = Logger(cfg.out_dir, d.is_main, resume_step=start_step if cfg.resume else -1)
    if d.is_main:
        print0("config: " + " ".join(f"{k}={v}" for k, v in config_dict(cfg, world).items()))
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(config_dict(cfg, world), f, indent=1)
    if cfg.eval_only:
        run_eval(start_step)
        return cleanup_dist(engine)

    handle_stop_signals()
    first_eval = run_eval(0) if start_step == 0 else None
    bad_updates = 0
    for step in tqdm(range(start_step + 1, cfg.steps + 1), desc="steps", leave=False,
                     disable=not d.is_main or not sys.stderr.isatty()):  # a bar in a terminal, not in log files
        t0 = time.time()
        # 1) roll out G completions per prompt, verify, and keep mixed groups (dynamic sampling)
        roll = lambda problems: roll_groups(generate, tok, problems, cfg, G)  # noqa: E731
        groups, m = dynamic_sampling(stream, roll, cfg.prompts_per_step, gen_groups,
                                     cfg.max_gen_batches if cfg.dynamic_sampling else 1, d.rank, world,
                                     cfg.dynamic_sampling)
        m["time/rollout_s"], t1 = time.time() - t0, time.time()
        # 2) GRPO advantages, and the difficulty bin of every completion: #correct of its group (mu = bin / G)
        sums = {"loss": 0.0, "entropy": 0.0, "clip_low": 0.0, "clip_high": 0.0, "grad_norm": 0.0, "tokens": 0.0,
                "skipped": 0.0, "logprob_diff": 0.0}
        bin_sum, bin_seen = torch.zeros(G + 1), torch.zeros(G + 1)  # L_mu summed over updates; updates with bin mu
        if groups:  # an all-filtered step (nothing kept) is logged and skipped
            if engine is not None:
                engine.sleep()  # GPU: hand vLLM's weights and KV cache memory to the update (no-op on CPU)
            batch = make_batch(groups, tok.pad_token_id)
            adv = group_advantages(batch["reward"].view(-1, G), cfg.std_norm)  # (N, G)
            batch["bin"] = batch["correct"].view(-1, G).sum(-1).repeat_interleave(G)  # (B,)
            batch["advantage"] = adv.flatten()  # (B,)
            batch = {k: v.to(d.device) for k, v in batch.items()}
            updates = split_updates(len(groups), cfg.updates_per_step, G)  # row indices per update, none empty
            m["train/num_updates"] = len(updates)
            # 3) old log-probs from the trainer, before any update. The first mini-batch is trained before the weights
            #    move, so its old log-probs are the current ones (logp.detach() below): only later mini-batches need a pass
            batch["old_logp"] = old_logprobs(model, batch, torch.arange(len(updates[0]), len(batch["mask"])),
                                             cfg.micro_batch_size, cfg.temperature, amp)  # (B, T)
            # 4) optimizer updates over mini-batches; each sums micro-batch losses with global per-bin token weights
            batch["weight"] = torch.zeros_like(batch["mask"], dtype=torch.float)  # (B, T)
            for u, rows in enumerate(updates):
                batch["weight"][rows], bin_tokens = bin_token_weights(batch["mask"][rows], batch["bin"][rows], G)
                if cfg.weighting == "none":  # the baselines' own aggregation over the whole update, no bins
                    batch["weight"][rows] = loss_weights(batch["mask"][rows], cfg.loss_agg, cfg.max_new_tokens)
                # w_mu enters the loss as a constant: the model's gradient is sum_mu w_mu grad L_mu, Eq. (1). The loss
                # is linear in this leaf, so autograd sums each bin's weighted token losses into .grad: L_mu, Eq. (2)
                coef = bin_weights(log_w, cfg.weighting).requires_grad_()  # (G+1,)
                coef.grad = torch.zeros_like(coef)
                opt.zero_grad(set_to_none=True)
                update_loss = 0.0
                for _, mb in micro_batches(batch, rows, cfg.micro_batch_size):
                    T = mb["mask"].shape[1]
                    with amp():
                        logp, entropy = token_logprobs(model, mb["input_ids"], mb["attention_mask"], T,
                                                       cfg.temperature, with_entropy=True)
                        ref_logp = None
                        if ref_model is not None:
                            with torch.no_grad():
                                ref_logp = token_logprobs(ref_model, mb["input_ids"], mb["attention_mask"], T,
                                                          cfg.temperature)[0]
                    old_logp = logp.detach() if u == 0 else mb["old_logp"]
                    if "sampling_logp" in mb:  # the rollout engine vs the trainer, same weights (logged only)
                        sums["logprob_diff"] += ((old_logp - mb["sampling_logp"]).abs() * mb["mask"]).sum().item()
                    weight = mb["weight"] * coef[mb["bin"]].unsqueeze(-1)  # (B, T): w_mu / #tokens of bin mu
                    loss, stats = policy_loss(logp, old_logp, mb["advantage"], weight, cfg.clip_low,
                                              cfg.clip_high, cfg.clip_ratio_c, cfg.seq_ratio, ref_logp, cfg.kl_coef)
                    loss.backward()
                    update_loss += loss.item()
                    sums["entropy"] += (entropy * mb["mask"]).sum().item()
                    sums["clip_low"] += stats["clip_low"].item()
                    sums["clip_high"] += stats["clip_high"].item()
                    sums["tokens"] += mb["mask"].sum().item()
                stepped, grad_norm = guarded_step(model, opt, cfg.grad_clip, update_loss)  # NaN/inf: skipped
                if stepped:
                    sums["loss"] += update_loss
                    sums["grad_norm"] += grad_norm / world  # the same global norm on every rank
                    bad_updates = 0
                    bin_loss = all_reduce_sum(coef.grad)  # (G+1,) L_mu, all ranks: the same weight step on each rank
                    if cfg.weighting == "learned":  # skipped, like the model's step, after a non-finite update
                        update_weights(log_w, weight_opt, bin_loss, bin_tokens > 0, cfg)
                    bin_sum += torch.where(bin_tokens > 0, bin_loss, 0.0).cpu()
                    bin_seen += (bin_tokens > 0).float().cpu()
                else:
                    sums["skipped"] += 1.0 / world
                    bad_updates += 1
                    print0(f"warning: step {step} update {u}: non-finite loss or gradient; update skipped")
                    if bad_updates >= cfg.max_bad_updates:
                        print0(f"error: {bad_updates} non-finite updates in a row (--max_bad_updates); stopping. "
                               f"Try a lower --lr, --dtype float32, or check the data.")
                        raise SystemExit(1)
            m["time/update_s"], t2 = time.time() - t1, time.time()
            if engine is not None:  # stream the weights into vLLM, reset its prefix cache, check them (raises)
                m["rollout/sync_diff"] = engine.sync_weights(model)
            else:
                sync_rollout(model, policy)  # the next rollout, eval or checkpoint sees the new weights
            m["time/sync_s"] = time.time() - t2
        sched.step()  # the learning-rate schedule (warm-up) counts RL steps
        # 5) one printed line and one metrics record; metrics are sums over micro-batches and ranks
        totals = {k: all_reduce_sum(torch.tensor(v)).item() for k, v in sums.items()}
        m.setdefault("train/num_updates", 0)
        tokens, done = max(totals["tokens"], 1.0), max(m["train/num_updates"] - totals["skipped"], 1.0)
        m.update({"step": step, "train/loss": totals["loss"] / done, "train/entropy": totals["entropy"] / tokens,
                  "train/clipfrac_low": totals["clip_low"] / tokens, "train/clipfrac_high": totals["clip_high"] / tokens,
                  "train/grad_norm": totals["grad_norm"] / done, "train/skipped_updates": totals["skipped"],
                  "train/lr": sched.get_last_lr()[0],
                  "time/step_s": time.time() - t0})
        w = bin_weights(log_w, cfg.weighting).cpu()  # (G+1,)
        counts = torch.bincount(batch["bin"][::G].cpu(), minlength=G + 1) if groups else torch.zeros(G + 1)
        counts = all_reduce_sum(counts.float())  # groups trained on, per bin, over all ranks
        for i in range(G + 1):  # keys name mu with three decimals: daro/w_0.125
            m[f"daro/n_{i / G:.3f}"] = counts[i].item()
            if 0 < i < G:  # L_mu: mean over the updates in which bin mu was present (0 if none)
                m[f"daro/w_{i / G:.3f}"] = w[i].item()
                m[f"daro/L_{i / G:.3f}"] = (bin_sum[i] / bin_seen[i].clamp(min=1)).item()
        if engine is not None:
            m["rollout/logprob_diff"] = totals["logprob_diff"] / tokens
        logger.log(m)
        logger.line(format_step(step, cfg.steps, m) + f" | w {w[1:G].min():.2f}-{w[1:G].max():.2f}")
        if cfg.sample_every and step % cfg.sample_every == 0 and groups:
            log_samples(logger, step, groups[0])
        # 6) evaluation and checkpoints (also on SIGTERM/SIGINT, then a clean exit)
        stop = stop_requested()
        if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps and not stop:
            run_eval(step)
        if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps or stop:
            save(step)
        if stop:
            print0(f"stopped at step {step}; continue with --resume")
            return cleanup_dist(engine)
    last_eval = run_eval(cfg.steps)
    if first_eval is not None:
        print0(f"eval/acc before {first_eval['eval/acc']:.3f} -> after {last_eval['eval/acc']:.3f}")
    cleanup_dist(engine)


if __name__ == "__main__":
    main(parse_config(Config, presets=PRESETS))
