"""
DA3PO: DAPO plus Direct Advantage Amplification (DAA) of the correct responses on hard prompts.
Paper: "Learning from Hard Prompts: Difficulty-aware Advantage Amplification in Dynamic Sampling", arXiv:2608.27982.
DAPO (the base): arXiv:2503.14476.

One RL step: roll out G completions per prompt -> verify (+1/-1 plus DAPO's overlong shaping) -> dynamic sampling
(keep groups with 0 < #correct < G) -> GRPO advantages -> DAA: A <- lam * A for correct completions of groups whose
pass rate p_hat = #correct / G is below tau -> DAPO's token-level clipped loss (clip-higher), several mini-batch
updates.

Why DAA (the paper's analysis; `--theory` prints it): dynamic sampling drops all-wrong groups, which raises the
expected advantage of a surviving incorrect response on a prompt with pass rate p by alpha- = 1/(1-(1-p)^(G-1)) but
that of a correct one only by alpha+ = 1/(1-p^(G-1)); for p < 0.5 the correct ones are under-weighted (gamma < 1).

--algo presets (each paper's recipe; a flag still overrides a knob, with a note): da3po (default), dapo (lam=1),
grpo, dr_grpo, gspo; see PRESETS.

Deviations from the paper (each tagged "[dev N]" in the code):
  1) The paper's full text is not available; tau is not given there. We use tau = 0.5, the value at which the theory's
     imbalance gamma crosses 1, and a strict p_hat < tau.
  2) Learning rate, batch sizes and lengths default to the built-in CPU demo, not to the paper's GPU runs; the README
     lists the paper-scale commands.
  3) GRPO and GSPO presets use no KL term (kl_coef=0, as DAPO and GSPO do); `--kl_coef 0.04` restores DeepSeekMath's.
  4) Our extension, off by default: `--adaptive_lam` sets the factor to 1/gamma(p, G) (the paper's stated future
     work), and `--p_estimate running` estimates p from every sample of the prompt so far, not only the current G.

Run:
  python da3po.py                                                          # built-in demo, CPU or GPU, ~1 min
  python da3po.py --algo dapo --steps 3 --out_dir /tmp/x                   # a baseline, smoke test
  python da3po.py --model Qwen/Qwen3-4B-Base --train_data dapo17k.parquet --lr 1e-6 ...   # 1 GPU
  torchrun --standalone --nproc_per_node=8 da3po.py --model Qwen/Qwen3-4B-Base ...       # N GPUs
  python da3po.py --theory                                                 # the amplification factors, exact and MC
"""
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from common import (Logger, Metrics, PromptStream, StepTimer, TRAIN_SUMS, UpdateGuard, all_reduce_max, all_reduce_sum,
                    check_config, check_logprob_paths, cleanup_dist, die, dynamic_sampling, evaluate_and_log,
                    find_checkpoint, format_step, group_advantages, handle_stop_signals, load_checkpoint,
                    load_datasets, load_model, load_reference_model, loss_weights, make_batch, make_rollout,
                    micro_batch_loss, micro_batches, model_path, old_logprobs, parse_config, plan_updates, print0,
                    resolve_template, rng_state, rollout_correction, save_checkpoint, set_rng_state, setup_dist,
                    shard_model, stop_requested, tokenize_datasets, train_metrics)

# -----------------------------------------------------------------------------------------------------------------
# Config


@dataclass
class Config:
    """DA3PO (DAPO + Direct Advantage Amplification) and its baselines on one code path. Defaults run the CPU demo."""
    # run
    algo: str = "da3po"  # preset: da3po | dapo | grpo | dr_grpo | gspo; explicit flags override the preset
    model: str = "demo"  # local Hugging Face folder, hub id, or 'demo' (the tiny shipped model, see demo/build.py)
    train_data: str = "arith"  # 'arith' (built-in sums) or a .jsonl/.json/.parquet file of problem/answer rows
    eval_data: str = "arith"  # same choices, comma-separated for several sets; 'arith': 200 held-out sums
    out_dir: str = "out/da3po"  # config.json, metrics.jsonl, samples.jsonl, checkpoints
    seed: int = 0  # init seed (same on every rank); sampling uses seed + rank
    steps: int = 60  # RL steps (one rollout batch each)
    device: str = ""  # '' = cuda if available, else cpu
    dtype: str = "float32"  # compute dtype: float32 | bfloat16 (weights and optimizer state stay float32)
    grad_checkpointing: bool = False  # recompute activations in backward (less memory, ~30% more compute)
    cpu_offload: bool = False  # FSDP2: keep sharded parameters and optimizer state on CPU (large models, few GPUs)
    # rollout
    prompts_per_step: int = 32  # groups trained on per step, across all ranks (train batch size in DAPO)
    group_size: int = 8  # G: completions per prompt
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
    # Direct Advantage Amplification, Eq. (DAA)
    lam: float = 2.0  # lambda: multiplier of correct completions' advantages on hard prompts; 1 = off (DAPO)
    adaptive_lam: bool = False  # lambda(p) = 1/gamma(p, G), the theory's imbalance, capped at lam_max, in place of
    #                             the constant lam (our extension [dev 4])
    tau: float = 0.5  # hard prompt: group pass rate p_hat < tau (strict) [dev 1]
    lam_max: float = 4.0  # cap of the adaptive factor; binds for running estimates (p_hat >= 1/G keeps it <= ~1.65)
    p_estimate: str = "group"  # pass rate used by DAA: group (p_hat of the G samples) | running (per prompt, over
    #                            all epochs so far)
    daa_scope: str = "correct"  # what DAA multiplies in a hard group: correct (its correct completions with A > 0,
    #                             the paper) | all (every completion, both signs: a control, hard prompts up-weighted)
    # advantages and loss
    std_norm: bool = True  # GRPO z-score advantage; off = Dr. GRPO (mean-centred only)
    loss_agg: str = "token-mean"  # token-mean (DAPO) | seq-mean-token-mean (GRPO) | seq-mean-token-sum-norm (Dr. GRPO)
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
    theory: bool = False  # print the dynamic-sampling amplification factors (exact and Monte Carlo) and exit


# Each preset is its paper's recipe, written out for every knob that defines the algorithm; the scale (model, lr,
# batch sizes, lengths, overlong_buffer where shaping is on) comes from the flags. A flag given on the command line
# beats the preset, with a printed note (common.parse_config), so a recipe is never changed by accident.
_DAPO = {"lam": 1.0, "adaptive_lam": False, "dynamic_sampling": True, "std_norm": True, "loss_agg": "token-mean",
         "seq_ratio": False, "clip_low": 0.2, "clip_high": 0.28}  # DAPO: clip-higher, token-mean, dynamic sampling
PRESETS = {
    "da3po": {**_DAPO, "lam": 2.0, "tau": 0.5},  # DAPO + DAA with the paper's best lambda [dev 1]
    "dapo": _DAPO,
    # GRPO (DeepSeekMath, verl's recipe): z-scored advantages, per-sequence token mean, symmetric clip, no shaping,
    # no dynamic sampling; no KL [dev 3]
    "grpo": {**_DAPO, "dynamic_sampling": False, "loss_agg": "seq-mean-token-mean", "clip_high": 0.2,
             "overlong_buffer": 0},
    # Dr. GRPO: mean-centred advantages, token sums over the constant L_max
    "dr_grpo": {**_DAPO, "dynamic_sampling": False, "std_norm": False, "loss_agg": "seq-mean-token-sum-norm",
                "clip_high": 0.2, "overlong_buffer": 0},
    # GSPO: the sequence ratio, its tiny clip range, and the rollout batch split into 4 mini-batches
    "gspo": {**_DAPO, "dynamic_sampling": False, "seq_ratio": True, "loss_agg": "seq-mean-token-mean",
             "clip_low": 3e-4, "clip_high": 4e-4, "overlong_buffer": 0, "updates_per_step": 4},
}

# -----------------------------------------------------------------------------------------------------------------
# Algorithm: Direct Advantage Amplification and the theory behind it


def daa(advantages: torch.Tensor, correct: torch.Tensor, lam, tau: float, p: torch.Tensor | None = None,
        scope: str = "correct"):
    """DAA: multiply the (already group-normalised) positive advantages of correct completions of groups with
    p < tau by lam.

    advantages, correct: (N, G). p (N, 1) is the pass-rate estimate, by default p_hat = #correct / G of the group:
    the correctness rate, never the shaped reward (with +-1 rewards the mean reward is 2 p_hat - 1). lam is a number
    or a (N, 1) tensor of per-group factors (adaptive DAA). Only A > 0 is amplified, as the paper amplifies the
    positive advantages of correct responses: with a running p or tau > 0.5 a correct completion that the overlong
    penalty puts below its group's mean has A < 0, and multiplying it would push it down harder. scope "all" is a
    control, not the paper: every advantage of a hard group, both signs (more weight on hard prompts, no tilt toward
    their correct answers). Amplifying rewards instead would do nothing: a two-level reward is invariant under the
    z-score. No renormalisation afterwards: amplified groups stop summing to zero.
    Returns (amplified advantages (N, G), which entries were amplified (N, G) bool)."""
    p = correct.float().mean(-1, keepdim=True) if p is None else p  # (N, 1)
    hard = (p < tau).expand_as(advantages)  # (N, G) [dev 1]
    amplified = hard if scope == "all" else hard & correct & (advantages > 0)
    return torch.where(amplified, lam * advantages, advantages), amplified


def adaptive_lam(p: torch.Tensor, G: int, lam_max: float) -> torch.Tensor:
    """[dev 4] Amplification that exactly undoes the dynamic-sampling imbalance: 1/gamma = alpha-/alpha+ =
    (1 - p^(G-1)) / (1 - (1-p)^(G-1)) (> 1 for p < 0.5), capped at lam_max. Example: G=8, p=1/8 -> 1.65."""
    p = p.clamp(1e-6, 1 - 1e-6)
    return ((1 - p ** (G - 1)) / (1 - (1 - p) ** (G - 1))).clamp(max=lam_max)


def check_algorithm_config(cfg: Config):
    """DAA's flags that cannot work stop here, naming the flag (exit 2)."""
    if not 0 < cfg.tau <= 1:
        die(f"--tau must be in (0, 1], got {cfg.tau}")
    if cfg.lam <= 0:
        die(f"--lam must be > 0, got {cfg.lam}")
    if cfg.daa_scope not in ("correct", "all"):
        die(f"--daa_scope {cfg.daa_scope!r}: choose one of correct, all")
    if cfg.p_estimate not in ("group", "running") or cfg.lam_max < 1:
        die(f"--p_estimate must be group or running and --lam_max >= 1, got {cfg.p_estimate!r}, {cfg.lam_max}")


def pass_key(group: dict) -> str:
    """The prompt a running pass count belongs to (problem text and gold answer)."""
    return f"{group['prompt']}\x00{group['answer']}"


def count_passes(counts: dict, groups: list[dict]):
    """[dev 4] Running per-prompt pass counts over every group generated so far (all epochs, all ranks), for
    --p_estimate running: more samples than the current G give a less noisy p for DAA."""
    for g in groups:
        c = counts.setdefault(pass_key(g), [0, 0])
        c[0] += sum(g["correct"])
        c[1] += len(g["correct"])


def amplify(advantage: torch.Tensor, correct: torch.Tensor, groups: list[dict], pass_counts: dict, cfg: Config):
    """Step 3 of the loop: DAA on this rank's groups, with the pass-rate estimate (the group's p_hat, or the running
    one) and the factor (lam, or adaptive) the flags ask for. advantage, correct: (N, G).
    Returns (the amplified advantages (N, G), the daa/* metrics over all ranks)."""
    p = correct.float().mean(-1, keepdim=True)  # p_hat (N, 1)
    if cfg.p_estimate == "running":
        counts = torch.tensor([pass_counts[pass_key(g)] for g in groups], dtype=torch.float, device=p.device)  # (N, 2)
        p = counts[:, :1] / counts[:, 1:]  # #correct / #samples over every epoch so far
    factor = adaptive_lam(p, cfg.group_size, cfg.lam_max) if cfg.adaptive_lam else cfg.lam
    advantage, amplified = daa(advantage, correct, factor, cfg.tau, p, cfg.daa_scope)
    factors = (factor * torch.ones_like(p)).expand_as(advantage)  # (N, G)
    amplified &= factors != 1  # a factor of 1 (lam = 1: DAPO, GSPO) amplifies nothing
    applied = factors[amplified]  # the factor of each amplified one
    num_applied = all_reduce_sum(torch.tensor(float(len(applied)))).item()
    return advantage, {
        "daa/amplified_frac": num_applied / all_reduce_sum(torch.tensor(float(amplified.numel()))).item(),
        "daa/lam_mean": all_reduce_sum(applied.sum()).item() / max(1.0, num_applied),  # 0 when nothing was amplified
        "daa/lam_max": all_reduce_max(applied.max() if len(applied) else p.new_zeros(())).item()}  # same device


def amplification_factors(p: float, G: int) -> tuple[float, float, float]:
    """(alpha+, alpha-, gamma): how much dynamic sampling scales the expected advantage of a correct / an incorrect
    completion on a prompt with pass rate p, and their ratio. The other G-1 outcomes are Bernoulli(p); a group survives
    unless all G agree, and an advantage is 0 on a uniform group, so E[A | y, kept] = E[A | y] / P(kept | y)."""
    alpha_plus = 1.0 / (1.0 - p ** (G - 1))
    alpha_minus = 1.0 / (1.0 - (1.0 - p) ** (G - 1))
    return alpha_plus, alpha_minus, alpha_plus / alpha_minus


def monte_carlo_factors(p: float, G: int, num_groups: int = 200_000, seed: int = 0) -> tuple[float, float, float]:
    """The same factors by simulation: GRPO advantages of completion 0 over random groups, averaged over the kept
    groups vs over all groups (where a dropped uniform group contributes advantage 0)."""
    g = torch.Generator().manual_seed(seed)
    correct = torch.rand(num_groups, G, generator=g) < p  # (N, G)
    adv = group_advantages(correct.float(), std_norm=True)
    kept = (correct.sum(-1) > 0) & (correct.sum(-1) < G)
    y = correct[:, 0]
    factor = lambda sel: adv[sel & kept, 0].mean().item() / adv[sel, 0].mean().item()  # noqa: E731
    alpha_plus, alpha_minus = factor(y), factor(~y)
    return alpha_plus, alpha_minus, alpha_plus / alpha_minus


def print_theory():
    print("dynamic-sampling amplification of the expected advantage (exact | Monte Carlo, 200k groups)")
    print(f"{'G':>3} {'p':>5} | {'alpha+':>7} {'alpha-':>7} {'gamma':>6} | {'alpha+':>7} {'alpha-':>7} {'gamma':>6}")
    for G in (4, 8, 16):
        for p in (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9):
            exact, mc = amplification_factors(p, G), monte_carlo_factors(p, G)
            print(f"{G:3d} {p:5.2f} | " + " ".join(f"{x:7.2f}" for x in exact[:2]) + f" {exact[2]:6.2f} | "
                  + " ".join(f"{x:7.2f}" for x in mc[:2]) + f" {mc[2]:6.2f}")

# -----------------------------------------------------------------------------------------------------------------
# Training


def main(cfg: Config):
    if cfg.theory:
        return print_theory()
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
    pass_counts = state.get("pass_counts", {})  # prompt -> [#correct, #samples], for --p_estimate running
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
        cfg.out_dir, step, model, tok, opt, sched, stream, {"pass_counts": pass_counts, "eval_due": eval_due},
        cfg.keep_last, pending)
    for step in tqdm(range(start_step + 1, cfg.steps + 1), desc="steps", leave=False,
                     disable=not dist_info.is_main or not sys.stderr.isatty()):  # a bar in a terminal, not in logs
        timer, sums, groups, updates, batch, first = StepTimer(), Metrics(*TRAIN_SUMS), [], [], {}, 0
        if pending:
            m, groups, updates, batch, first, sums.sums, pending = *pending["work"], None
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
            if cfg.p_estimate == "running":
                count_passes(pass_counts, generated)  # every generated group, kept or not, on every rank
            if kept:  # an all-filtered step (nothing kept) is logged and skipped
                with timer("update"):
                    # 2) this rank's groups of each update (ranks balanced by tokens with --micro_batch_tokens),
                    #    brought to it, and their advantages
                    groups, updates = plan_updates(kept, cfg.updates_per_step, dist_info, cfg.micro_batch_tokens > 0)
                    batch = make_batch(groups, tok.pad_token_id, device)
                    advantage = group_advantages(batch["reward"].view(-1, G), cfg.std_norm)  # (N, G)
                    # 3) the algorithm: DAA on the correct completions of hard groups
                    advantage, daa_metrics = amplify(advantage, batch["correct"].view(-1, G), groups, pass_counts, cfg)
                    m.update(daa_metrics)
                    batch["advantage"] = advantage.flatten()  # (B,)
                    # 4) pi_old (the engine's log-probs if they are the trainer's, else recomputed), and with
                    #    --rollout_is the weights pi_old / pi_rollout of the engine's samples
                    batch.update(old_logprobs(model, batch, cfg, device, engine.exact_logprobs))
                    m.update(rollout_correction(batch, cfg))
        if updates:
            engine.sleep()  # vLLM on a GPU: hand its weights' and KV cache's memory to the update
            with timer("update"):
                # 5) optimizer updates, each the sum of its micro-batches' losses with global token weights
                batch["weight"] = torch.zeros_like(batch["mask"], dtype=torch.float)  # (B, T)
                for u in range(first, len(updates)):
                    if u > first and stop_requested():  # a stop between updates: checkpoint the step's rest of work
                        save(step - 1, pending={"step": step, "work": (m, groups[:1], updates, batch, u, sums.sums)})
                        print0(f"stopped in step {step} before update {u}; continue with --resume")
                        return cleanup_dist(engine)
                    rows = updates[u]
                    batch["weight"][rows] = loss_weights(batch["loss_mask"][rows], cfg.loss_agg, cfg.max_new_tokens)
                    update_loss = 0.0
                    for _, mb in micro_batches(batch, rows, cfg.micro_batch_size, cfg.micro_batch_tokens):
                        loss = micro_batch_loss(model, ref_model, mb, cfg, device, sums)
                        loss.backward()
                        update_loss += loss.item()
                    guard.step(model, opt, cfg.grad_clip, update_loss, sums, f"step {step} update {u}")
            # 6) the rollout engine takes the new weights (vLLM: streamed, then checked against the trainer's)
            with timer("sync"):
                m.update(engine.sync_weights(model))
        sched.step()  # the learning-rate schedule (warm-up) counts RL steps
        # 7) one printed line and one metrics record: sums over micro-batches and ranks, means per token or update
        m.update(train_metrics(sums.reduce(), len(updates), sched.get_last_lr()[0], not engine.exact_logprobs))
        m.update({"step": step, **timer.metrics()})
        for key in ("daa/amplified_frac", "daa/lam_mean", "daa/lam_max"):
            m.setdefault(key, 0.0)
        logger.log(m)
        logger.line(format_step(step, cfg.steps, m) + f" | amp {m['daa/amplified_frac']:.2f}")
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
