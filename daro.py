"""
DARO: the GRPO/DAPO loss split by difficulty bin, each bin weighted by a learnable weight.
Paper: "DARO: Difficulty-Aware Reweighting Policy Optimization", arXiv:2510.09001.
DAPO (the base loss): arXiv:2503.14476.

One RL step: as in da3po.py (rollout, verifier, dynamic sampling, GRPO advantages), then each completion goes to the
bin mu = #correct / K of its group, and several mini-batch updates of the model and the weights minimise
  L(theta, w) = sum_{mu = 1/K .. (K-1)/K} [ w_mu * L_mu(theta) - ln w_mu ]                   Eq. (1)
  L_mu = (clipped token losses of bin mu, summed) / (#tokens of bin mu in the whole update)  Eq. (2)
  w_mu = exp(-s_mu), s = 0 at start; Adam (--weight_lr), no weight decay, no gradient clip   Eq. (3)
The optimum in w is w_mu = 1 / L_mu: every bin then carries the same loss scale (the paper's "loss scale issue").
Bins mu = 0, 1 (zero advantage) are left out; a bin absent from an update gets no weight step. Adam moves s by about
weight_lr per update: at the paper's 1e-3 a slow, bounded reweighting (e^0.6 at most in 600 updates).

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
Dr. GRPO and LIPO do (their weights relative to GRPO's); unnormalised (0.5 at mu = 1/2): Adam ignores a global
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
  python daro.py                                                           # built-in demo, CPU or GPU, ~1 min
  python daro.py --algo var --steps 3 --out_dir /tmp/x                     # a static weighting, smoke test
  python daro.py --model Qwen/Qwen2.5-Math-7B --train_data openr1.parquet --lr 1e-6 --prompts_per_step 128 ...
  torchrun --standalone --nproc_per_node=8 daro.py --model Qwen/Qwen2.5-Math-7B ...      # N GPUs
"""
import math
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from common import (Logger, Metrics, PromptStream, StepTimer, TRAIN_SUMS, UpdateGuard, all_reduce_sum, check_config,
                    check_logprob_paths, cleanup_dist, die, dynamic_sampling, evaluate_and_log, find_checkpoint,
                    format_step, group_advantages, handle_stop_signals, load_checkpoint, load_datasets, load_model,
                    load_reference_model, loss_weights, make_batch, make_rollout, micro_batch_loss, micro_batches,
                    model_path, old_logprobs, parse_config, plan_updates, print0, resolve_template, rng_state,
                    rollout_correction, save_checkpoint, set_rng_state, setup_dist, shard_model, stop_requested,
                    tokenize_datasets, train_metrics)

# -----------------------------------------------------------------------------------------------------------------
# Config


@dataclass
class Config:
    """DARO (learnable per-difficulty loss weights) and its baselines on one code path. Defaults run the CPU demo."""
    # run
    algo: str = "daro"  # preset: daro | uniform | var | dapo | grpo | dr_grpo; explicit flags override the preset
    model: str = "demo"  # local Hugging Face folder, hub id, or 'demo' (the tiny shipped model, see demo/build.py)
    train_data: str = "arith"  # 'arith' (built-in sums) or a .jsonl/.json/.parquet file of problem/answer rows
    eval_data: str = "arith"  # same choices, comma-separated for several sets; 'arith': 200 held-out sums
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
    rollout: str = "hf"  # rollout engine: hf (our sampler on the HF model) | vllm | auto (vLLM if installed and usable)
    vllm_gpu_memory: float = 0.0  # vLLM on GPU: share of GPU memory for its weights + KV cache; 0 = the most that
    #                               leaves room for what the trainer keeps there during rollouts (bench/memory.py)
    max_model_len: int = 0  # longest sequence (prompt + completion) vLLM reserves KV cache for; 0 = the longest
    #                         prompt in the data + max_new_tokens
    vllm_cpu_kv_gb: float = 0.5  # vLLM on CPU: KV cache size in GiB
    rollout_is: str = "none"  # correct the rollout/trainer mismatch (vLLM rollouts): none | token | sequence, a
    #                           truncated importance weight pi_old / pi_rollout on each token's loss (verl, TRL)
    rollout_is_cap: float = 2.0  # C: the weight is truncated at C (with rollout_is_mask: kept within [1/C, C])
    rollout_is_mask: bool = False  # reject tokens (sequences) whose weight is outside [1/C, C], out of the loss and
    #                                its denominator, instead of truncating
    prompt_template: str = "auto"  # chat | plain | dapo | none | auto (none for the demo, chat if the tokenizer
    #                                has one, else plain)
    answer_format: str = "auto"  # where the verifier looks: boxed | answer_line | auto
    prompt_key: str = ""  # data field holding the problem ('' = try problem, question, prompt; dots for nested)
    answer_key: str = ""  # data field holding the answer ('' = try answer, final_answer, reward_model.ground_truth)
    # reward (DAPO)
    overlong_buffer: int = 4  # L_cache: penalty ramps from 0 at L_max - L_cache tokens to -1 at L_max; 0 = off
    overlong_penalty: float = 1.0  # penalty factor of the overlong shaping
    # difficulty-aware reweighting, Eq. (1)-(3)
    weighting: str = "learned"  # w_mu: learned (DARO) | uniform (1) | var (sqrt(mu(1-mu))) | none (no bins, loss_agg)
    weight_lr: float = 1e-3  # Adam learning rate of s_mu = -ln w_mu, the weights' parameters (paper: 1e-3)
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
    micro_batch_tokens: int = 0  # > 0: micro-batches packed by length up to this many tokens (prompt + completion,
    #                              padding included) and ranks balanced by tokens; for long, uneven completions
    logprob_chunk: int = 1024  # tokens whose logits exist at once when computing log-probs (recomputed in the
    #                            backward); bounds memory at a large vocabulary and length; 0 = all at once
    # evaluation, logging, checkpoints
    eval_every: int = 10  # evaluate every N steps (also at step 0 and at the end); 0 = only at start and end
    eval_samples: int = 4  # k: completions per eval problem (avg@k, pass@k)
    eval_size: int = 0  # eval problems to use, spread evenly over each set (its mix of levels kept); 0 = all
    eval_temperature: float = 1.0  # eval sampling temperature
    eval_top_p: float = 1.0  # eval nucleus sampling (DAPO reports top_p 0.7)
    eval_batch_size: int = 128  # eval problems per generate call
    sample_every: int = 10  # write a few completions to samples.jsonl every N steps
    save_every: int = 0  # checkpoint every N steps (and at the end, and on SIGTERM/SIGINT); 0 = only at the end
    keep_last: int = 2  # checkpoints kept on disk (older ones are deleted)
    resume: bool = False  # continue from the latest checkpoint in out_dir
    max_bad_updates: int = 3  # stop the run after this many non-finite losses/gradients in a row (each is skipped)
    eval_only: bool = False  # evaluate --model on --eval_data and exit
    report_to: str = "none"  # also log to: none | tensorboard | wandb (optional packages: requirements-tracking.txt)
    wandb_project: str = "da3po"  # wandb project of --report_to wandb


# Each preset is its paper's recipe, written out for every knob that defines the algorithm; the scale (model, lr,
# batch sizes, lengths, overlong_buffer where shaping is on) comes from the flags. A flag given on the command line
# beats the preset, with a printed note (common.parse_config), so a recipe is never changed by accident.
_DAPO = {"weighting": "none", "dynamic_sampling": True, "std_norm": True, "loss_agg": "token-mean", "clip_low": 0.2,
         "clip_high": 0.28}  # DAPO: clip-higher, token-mean, overlong shaping, dynamic sampling [dev 4]
PRESETS = {
    "daro": {**_DAPO, "weighting": "learned"},  # DARO on top of the DAPO loss (paper: clip 0.2 / 0.28)
    "uniform": {**_DAPO, "weighting": "uniform"},  # the bins of DARO with frozen w = 1: what learning the weights adds
    "var": {**_DAPO, "weighting": "var"},  # variance-based static weights, as Dr. GRPO's and LIPO's
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
    of one prompt weighs as much as one of twenty: the method, and why a sparse bin is noisy.
    bins: (B,) #correct of each completion's group. Example: bins [1, 1, 3], lengths [2, 4, 5] -> 1/6, 1/6, 1/5.
    Returns (weights (B, T), tokens per bin (G+1,))."""
    mask = mask if mask.is_floating_point() else mask.float()  # a float64 mask stays float64
    tokens = all_reduce_sum(mask.new_zeros(G + 1).index_add_(0, bins, mask.sum(-1)))  # (G+1,)
    inside = ((bins > 0) & (bins < G)).to(mask.dtype).unsqueeze(-1)  # (B, 1)
    return mask * inside / tokens.clamp(min=1)[bins].unsqueeze(-1), tokens


def bin_weights(neg_log_w: list[torch.Tensor], weighting: str) -> torch.Tensor:
    """w_mu for mu = 0, 1/G, ..., 1 as a constant (G+1,) tensor: learned exp(-s_mu), Eq. (3), or a static function of
    mu; 0 for mu = 0 and 1. `none` (the baselines' own loss, no bins) weighs every bin 1."""
    G, device = len(neg_log_w) + 1, neg_log_w[0].device
    if weighting == "none":
        return torch.ones(G + 1, device=device)
    mu = torch.arange(1, G, device=device) / G  # (G-1,)
    if weighting == "learned":
        w = torch.exp(-torch.stack(neg_log_w).detach())  # Eq. (3)
    else:  # uniform; var on top of the z-scored advantage gives a total weight mu(1-mu), the reward variance
        w = torch.ones_like(mu) if weighting == "uniform" else (mu * (1 - mu)).sqrt()
    return torch.nn.functional.pad(w, (1, 1))


def weight_objective(neg_log_w: list[torch.Tensor], bin_loss: torch.Tensor, present: torch.Tensor, delta: float,
                     literal: bool) -> torch.Tensor:
    """The weights' side of Eq. (1) over the bins present in the update (absent ones are not in the graph at all):
    sum_mu w_mu L_mu + s_mu, as -ln w = s; bin_loss (G+1,) is a constant here. Guarded (default): |L_mu| + delta in
    place of L_mu, so the minimum w_mu = 1 / (|L_mu| + delta) always exists [dev 1]."""
    target = bin_loss if literal else bin_loss.abs() + delta  # (G+1,)
    return sum(torch.exp(-s) * target[i] + s for i, s in enumerate(neg_log_w, 1) if present[i])  # Eq. (1), (3)


def update_weights(neg_log_w: list[torch.Tensor], weight_opt, bin_loss: torch.Tensor, present: torch.Tensor, cfg):
    """One Adam step of s = -ln w on Eq. (1), then clamp w to [w_min, w_max]. An absent bin keeps .grad None, so
    Adam skips it: with a zero gradient instead, its momentum would still move the weight."""
    if not present[1:-1].any():
        return
    weight_opt.zero_grad(set_to_none=True)
    weight_objective(neg_log_w, bin_loss, present, cfg.daro_delta, cfg.daro_literal).backward()
    weight_opt.step()
    with torch.no_grad():
        for s in neg_log_w:
            s.clamp_(-math.log(cfg.w_max), -math.log(cfg.w_min))  # w = exp(-s) in [w_min, w_max] [dev 1]


def check_algorithm_config(cfg: Config):
    """DARO's flags that cannot work stop here, naming the flag (exit 2)."""
    if cfg.weighting not in ("learned", "uniform", "var", "none"):
        die(f"--weighting {cfg.weighting!r}: choose one of learned, uniform, var, none")
    if not 0 < cfg.w_min <= 1 <= cfg.w_max:
        die(f"--w_min and --w_max must satisfy 0 < w_min <= 1 <= w_max, got {cfg.w_min} and {cfg.w_max}")


def init_weights(cfg: Config, device: torch.device, state: dict):
    """s_mu = -ln w_mu for mu = 1/G .. (G-1)/G, Eq. (3), at 0 (w = 1) or as saved in a checkpoint's `state`: one
    tensor per bin, so that Adam can skip a bin absent from an update, and an Adam of their own (--weight_lr), which
    keeps them out of the model's weight decay (which would pull w to 0) and gradient clipping (their gradients
    L - 1/w would dominate the norm and shrink the model's update)."""
    neg_log_w = [torch.zeros((), device=device, requires_grad=True) for _ in range(1, cfg.group_size)]
    weight_opt = torch.optim.Adam(neg_log_w, lr=cfg.weight_lr)
    if "daro_neg_log_w" in state:  # a resumed run
        with torch.no_grad():
            for s, saved in zip(neg_log_w, state["daro_neg_log_w"]):
                s.copy_(saved)
        weight_opt.load_state_dict(state["weight_optimizer"])
    return neg_log_w, weight_opt


def weights_state(neg_log_w: list[torch.Tensor], weight_opt) -> dict:
    """What a checkpoint keeps of the weights (init_weights reads it back)."""
    return {"daro_neg_log_w": torch.stack(neg_log_w).detach().cpu(), "weight_optimizer": weight_opt.state_dict()}


def bin_metrics(neg_log_w: list[torch.Tensor], bin_sum: torch.Tensor, bin_seen: torch.Tensor,
                bin_count: torch.Tensor, cfg: Config) -> dict:
    """The step's daro/* record, keys naming mu with three decimals (daro/w_0.125): w_mu after the step, L_mu (its
    mean over the updates in which bin mu was present; 0 if none), and n_mu, the groups trained on per bin (all
    ranks). bin_sum, bin_seen, bin_count: (G+1,) on this rank's side."""
    G = cfg.group_size
    w = bin_weights(neg_log_w, cfg.weighting).cpu()  # (G+1,)
    counts = all_reduce_sum(bin_count)  # groups trained on, per bin, over all ranks
    m = {}
    for i in range(G + 1):
        m[f"daro/n_{i / G:.3f}"] = counts[i].item()
        if 0 < i < G:
            m[f"daro/w_{i / G:.3f}"] = w[i].item()
            m[f"daro/L_{i / G:.3f}"] = (bin_sum[i] / bin_seen[i].clamp(min=1)).item()
    return m

# -----------------------------------------------------------------------------------------------------------------
# Training


def main(cfg: Config):
    dist_info = setup_dist(cfg.device)
    check_config(cfg, dist_info.world_size)  # a flag combination that cannot work stops here with exit code 2
    check_algorithm_config(cfg)
    G, device = cfg.group_size, dist_info.device
    print0(f"{cfg.prompts_per_step} groups x {G} = {cfg.prompts_per_step * G} sequences per step "
           f"({cfg.prompts_per_step * G // dist_info.world_size} per rank), up to {cfg.updates_per_step} optimizer "
           f"updates per step")

    # data first (a bad file fails in a second), then the model (on the CPU), the rollout engine (before the model
    # takes any GPU memory), the sharded model, the optimizer, and a resume
    train_problems, eval_sets = load_datasets(cfg)
    torch.manual_seed(cfg.seed)  # identical initialisation on every rank
    ckpt, base = find_checkpoint(cfg), model_path(cfg.model)  # --resume: the latest checkpoint; 'demo' is shipped
    model, tok = load_model(ckpt or base)  # float32 master weights; --dtype sets the compute dtype
    cfg.prompt_template = resolve_template(cfg.prompt_template, tok)
    train_problems, eval_sets = tokenize_datasets(train_problems, eval_sets, tok, cfg)
    engine = make_rollout(cfg, model, tok, dist_info, ckpt or base)  # HF sampler or vLLM, behind one interface
    check_logprob_paths(model, cfg)  # chunked log-probs exact for this model; can a group's rows share a KV cache
    model = shard_model(model, dist_info, cfg.dtype, cfg.grad_checkpointing, cfg.cpu_offload)
    engine.calibrate(model)  # vLLM: the weight-sync probe's start-up gap, against the sharded model
    ref_model = load_reference_model(base, cfg, dist_info)  # the KL anchor; None when --kl_coef is 0
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / max(1, cfg.warmup_steps)))
    stream = PromptStream(train_problems, cfg.seed)
    start_step, state = load_checkpoint(ckpt, model, opt, sched, stream, cfg.seed, dist_info)  # fresh: seeds
    neg_log_w, weight_opt = init_weights(cfg, device, state)  # s_mu = -ln w_mu and their own Adam, Eq. (3)
    logger = Logger(cfg, dist_info, resume_step=start_step if cfg.resume else -1)
    if cfg.eval_only:
        evaluate_and_log(engine, tok, eval_sets, cfg, dist_info, logger, start_step)
        return cleanup_dist(engine)

    handle_stop_signals()
    first_eval = evaluate_and_log(engine, tok, eval_sets, cfg, dist_info, logger, 0) if start_step == 0 else None
    if state.get("eval_due"):  # a stop came where an evaluation was due
        evaluate_and_log(engine, tok, eval_sets, cfg, dist_info, logger, start_step)
    guard = UpdateGuard(cfg.max_bad_updates)  # skips a non-finite update; stops the run after several in a row
    pending = state["pending"]  # a step that a stop interrupted between two updates: it continues where it stopped
    save = lambda step, pending=None, eval_due=False: save_checkpoint(  # noqa: E731
        cfg.out_dir, step, model, tok, opt, sched, stream,
        {**weights_state(neg_log_w, weight_opt), "eval_due": eval_due}, cfg.keep_last, pending)
    for step in tqdm(range(start_step + 1, cfg.steps + 1), desc="steps", leave=False,
                     disable=not dist_info.is_main or not sys.stderr.isatty()):  # a bar in a terminal, not in logs
        timer, sums, groups, updates, batch, first = StepTimer(), Metrics(*TRAIN_SUMS), [], [], {}, 0
        bins = torch.zeros(3, G + 1)  # per bin mu: the sum of L_mu over updates, the updates it was in, its groups
        if pending:
            m, groups, updates, batch, first, sums.sums, bins, pending = *pending["work"], None
        else:
            # 1) roll out G completions per prompt, verify and reward them, keep the mixed groups (dynamic sampling)
            start = (stream.position, rng_state())
            with timer("rollout"):
                rollout = dynamic_sampling(engine, tok, stream, cfg, dist_info)
            if rollout is None:  # a stop between generation batches: the step is redone on resume, from its start
                stream.position, _ = start[0], set_rng_state(start[1])
                save(step - 1)
                print0(f"stopped in step {step}'s rollout; continue with --resume")
                return cleanup_dist(engine)
            kept, generated, m = rollout
            if kept:  # an all-filtered step (nothing kept) is logged and skipped
                with timer("update"):
                    # 2) this rank's groups of each update (ranks balanced by tokens with --micro_batch_tokens),
                    #    brought to it, and their advantages
                    groups, updates = plan_updates(kept, cfg.updates_per_step, dist_info, cfg.micro_batch_tokens > 0)
                    batch = make_batch(groups, tok.pad_token_id, device)
                    advantage = group_advantages(batch["reward"].view(-1, G), cfg.std_norm)  # (N, G)
                    # 3) the algorithm: the difficulty bin of every completion, #correct of its group (mu = bin / G)
                    batch["bin"] = batch["correct"].view(-1, G).sum(-1).repeat_interleave(G)  # (B,)
                    bins[2] = torch.bincount(batch["bin"][::G].cpu(), minlength=G + 1).float()  # groups per bin
                    batch["advantage"] = advantage.flatten()  # (B,)
                    # 4) pi_old (the engine's log-probs if they are the trainer's, else recomputed), and with
                    #    --rollout_is the weights pi_old / pi_rollout of the engine's samples
                    batch.update(old_logprobs(model, batch, cfg, device, engine.exact_logprobs))
                    m.update(rollout_correction(batch, cfg))
        if updates:
            engine.sleep()  # vLLM on a GPU: hand its weights' and KV cache's memory to the update
            with timer("update"):
                # 5) optimizer updates of the model and the weights, with global per-bin token weights, Eq. (1)-(3)
                batch["weight"] = torch.zeros_like(batch["mask"], dtype=torch.float)  # (B, T)
                for u in range(first, len(updates)):
                    if u > first and stop_requested():  # a stop between updates: checkpoint the step's rest of work
                        save(step - 1, pending={"step": step,
                                                "work": (m, groups[:1], updates, batch, u, sums.sums, bins)})
                        print0(f"stopped in step {step} before update {u}; continue with --resume")
                        return cleanup_dist(engine)
                    rows = updates[u]
                    batch["weight"][rows], bin_tokens = bin_token_weights(batch["loss_mask"][rows], batch["bin"][rows],
                                                                          G)
                    if cfg.weighting == "none":  # the baselines' own aggregation over the whole update, no bins
                        batch["weight"][rows] = loss_weights(batch["loss_mask"][rows], cfg.loss_agg,
                                                             cfg.max_new_tokens)
                    # w_mu enters the loss as a constant: the model's gradient is sum_mu w_mu grad L_mu, Eq. (1). The
                    # loss is linear in this leaf, so autograd sums each bin's weighted token losses into .grad: L_mu
                    coef = bin_weights(neg_log_w, cfg.weighting).requires_grad_()  # (G+1,)
                    coef.grad = torch.zeros_like(coef)
                    update_loss = 0.0
                    for _, mb in micro_batches(batch, rows, cfg.micro_batch_size, cfg.micro_batch_tokens):
                        mb["weight"] = mb["weight"] * coef[mb["bin"]].unsqueeze(-1)  # (B, T): w_mu / #tokens of mu
                        loss = micro_batch_loss(model, ref_model, mb, cfg, device, sums)
                        loss.backward()
                        update_loss += loss.item()
                    if guard.step(model, opt, cfg.grad_clip, update_loss, sums, f"step {step} update {u}"):
                        bin_loss = all_reduce_sum(coef.grad)  # (G+1,) L_mu over all ranks: one weight step everywhere
                        if cfg.weighting == "learned":  # skipped, like the model's step, after a non-finite update
                            update_weights(neg_log_w, weight_opt, bin_loss, bin_tokens > 0, cfg)
                        bins[0] += torch.where(bin_tokens > 0, bin_loss, 0.0).cpu()
                        bins[1] += (bin_tokens > 0).float().cpu()
            # 6) the rollout engine takes the new weights (vLLM: streamed, then checked against the trainer's)
            with timer("sync"):
                m.update(engine.sync_weights(model))
        sched.step()  # the learning-rate schedule (warm-up) counts RL steps
        # 7) one printed line and one metrics record: sums over micro-batches and ranks, means per token or update
        m.update(train_metrics(sums.reduce(), len(updates), sched.get_last_lr()[0], not engine.exact_logprobs))
        m.update({"step": step, **timer.metrics()})
        m.update(bin_metrics(neg_log_w, bins[0], bins[1], bins[2], cfg))
        logger.log(m)
        w = [m[f"daro/w_{i / G:.3f}"] for i in range(1, G)]
        logger.line(format_step(step, cfg.steps, m) + f" | w {min(w):.2f}-{max(w):.2f}")
        if cfg.sample_every and step % cfg.sample_every == 0 and groups:
            logger.samples(step, groups[0])
        # 8) evaluation and checkpoints (on SIGTERM/SIGINT: the checkpoint first, the due evaluation on resume)
        stop, eval_due = stop_requested(), cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps
        if eval_due and not stop:
            evaluate_and_log(engine, tok, eval_sets, cfg, dist_info, logger, step)
        if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps or stop:
            save(step, eval_due=stop and eval_due)
        if stop:
            print0(f"stopped at step {step}; continue with --resume")
            return cleanup_dist(engine)
    last_eval = evaluate_and_log(engine, tok, eval_sets, cfg, dist_info, logger, cfg.steps)
    if first_eval is not None:
        print0(f"eval/acc before {first_eval['eval/acc']:.3f} -> after {last_eval['eval/acc']:.3f}")
    cleanup_dist(engine)


if __name__ == "__main__":
    main(parse_config(Config, presets=PRESETS))
