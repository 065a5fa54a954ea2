"""
DARO: the GRPO/DAPO loss split by difficulty bin, each bin weighted by a learnable weight.
Paper: "DARO: Difficulty-Aware Reweighting Policy Optimization", arXiv:2510.09001; DAPO (the base): arXiv:2503.14476.

One RL step: as in da3po.py (rollout, verifier, dynamic sampling, GRPO advantages), then each completion goes to the
bin mu = #correct / K of its group, and each update of the model and the weights minimises
  L(theta, w) = sum_{mu = 1/K .. (K-1)/K} [ w_mu * L_mu(theta) - ln w_mu ]                   Eq. (1)
  L_mu = (clipped token losses of bin mu, summed) / (#tokens of bin mu in the whole update)  Eq. (2)
  w_mu = exp(-s_mu), s = 0 at start; Adam (--weight_lr), no weight decay, no gradient clip   Eq. (3)
The optimum w_mu = 1 / L_mu gives every bin the same loss scale (the paper's "loss scale issue"). Bins mu = 0, 1
(zero advantage) are left out; a bin absent from an update gets no weight step. --algo: daro; the static weightings
uniform (w = 1) and var (w = sqrt(mu (1 - mu)): with the z-scored advantage a total weight mu (1 - mu), the reward
variance, as Dr. GRPO and LIPO weigh groups); the baselines dapo, grpo, dr_grpo, gspo (common.BASELINES).

Deviations (tagged [dev N]): 1) the sign of L_mu is not settled by the text available to us. At ratio 1 L_mu is minus
its bin's token-weighted mean advantage, negative when the bin's correct completions are the longer ones, and then
Eq. (1) has no minimum in w. By default the weights fit |L_mu| + delta (optimum 1 / (|L_mu| + delta), delta = 1e-3),
clamped to [w_min, w_max]; the model's gradient sum_mu w_mu grad L_mu is the same; --daro_literal fits L_mu itself.
2) The defaults run the CPU demo (docs/gpu.md: K = 8, lr 1e-6, weight lr 1e-3, 128 prompts, 2 updates, 300 steps).
3) No KL term in the GRPO preset, as in DAPO. 4) DAPO's dynamic sampling is on (not known for the paper).

Run:  python daro.py                                                    # the built-in demo, about a minute on a CPU
      python daro.py --algo var --steps 3 --out_dir /tmp/x              # a static weighting, a smoke test
      torchrun --standalone --nproc_per_node=8 daro.py --model Qwen/Qwen2.5-Math-7B ...     # docs/gpu.md
"""
import math
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from common import (BASELINES, TRAIN_SUMS, Logger, PromptStream, StepTimer, Sums, TrainConfig, UpdateGuard,
                    all_reduce_sum, check_config, cleanup_dist, die, dynamic_sampling, evaluate_and_log,
                    find_checkpoint, format_step, group_advantages, handle_stop_signals, load_checkpoint,
                    load_datasets, load_model, loss_weights, make_batch, micro_batches, model_path, old_logprobs,
                    parse_config, plan_updates, prepare_models, presets, print0, rng_state, save_checkpoint,
                    set_rng_state, setup_dist, stop_requested, stop_run, token_losses, tokenize_datasets, train_metrics)
from engine import make_rollout, rollout_correction

# -----------------------------------------------------------------------------------------------------------------
# Config: the shared knobs (common.TrainConfig) and DARO's


@dataclass
class Config(TrainConfig):
    """DARO (learnable per-difficulty loss weights) and its baselines on one code path. Defaults run the CPU demo."""
    algo: str = "daro"  # preset: daro | uniform | var | dapo | grpo | dr_grpo | gspo; explicit flags override it
    out_dir: str = "out/daro"  # config.json, metrics.jsonl, samples.jsonl, checkpoints
    wandb_project: str = "daro"  # wandb project of --report_to wandb
    weighting: str = "learned"  # w_mu: learned (DARO) | uniform (1) | var (sqrt(mu(1-mu))) | none (no bins, loss_agg)
    weight_lr: float = 1e-3  # Adam learning rate of s_mu = -ln w_mu, the weights' parameters (paper: 1e-3)
    daro_delta: float = 1e-3  # delta: the weights fit |L_mu| + delta, so w stays finite when L_mu = 0 [dev 1]
    daro_literal: bool = False  # fit the weights to L_mu itself, Eq. (1) as written (no minimum if L_mu <= 0) [dev 1]
    w_min: float = 0.1  # lower clamp of every w_mu, applied after each weight step [dev 1]
    w_max: float = 10.0  # upper clamp of every w_mu [dev 1]


PRESETS = presets({"daro": {**BASELINES["dapo"], "weighting": "learned"},  # DARO on the DAPO loss [dev 4]
                   "uniform": {**BASELINES["dapo"], "weighting": "uniform"},  # the bins with frozen w = 1
                   "var": {**BASELINES["dapo"], "weighting": "var"}},  # variance-based static weights
                  off={"weighting": "none"})

# -----------------------------------------------------------------------------------------------------------------
# Algorithm: difficulty bins, per-bin losses and their learnable weights


def bin_token_weights(mask: torch.Tensor, bins: torch.Tensor, G: int):
    """Per-token weights (B, T) that turn a sum of token losses into sum_mu L_mu, Eq. (2): a token in bin mu weighs
    1 / (#tokens of bin mu in the WHOLE update), counted over every micro-batch and rank before the micro-batch loop
    (as common.loss_weights does for the token mean); bins 0 and G weigh 0. A bin of one prompt weighs as much as one
    of twenty: the method, and why a sparse bin is noisy. bins: (B,) #correct of each row's group.
    Example: bins [1, 1, 3], lengths [2, 4, 5] -> 1/6, 1/6, 1/5. Returns (weights (B, T), tokens per bin (G+1,))."""
    mask = mask if mask.is_floating_point() else mask.float()  # a float64 mask stays float64
    tokens = all_reduce_sum(mask.new_zeros(G + 1).index_add_(0, bins, mask.sum(-1)))  # (G+1,)
    inside = ((bins > 0) & (bins < G)).to(mask.dtype).unsqueeze(-1)  # (B, 1)
    return mask * inside / tokens.clamp(min=1)[bins].unsqueeze(-1), tokens


def bin_weights(neg_log_w: list[torch.Tensor], weighting: str) -> torch.Tensor:
    """w_mu for mu = 0, 1/G, ..., 1, a constant (G+1,): learned exp(-s_mu), Eq. (3), or a static function of mu; 0 for
    mu = 0 and 1. `none` (the baselines' own loss, no bins) weighs every bin 1."""
    G, device = len(neg_log_w) + 1, neg_log_w[0].device
    if weighting == "none":
        return torch.ones(G + 1, device=device)
    mu = torch.arange(1, G, device=device) / G  # (G-1,)
    if weighting == "learned":
        w = torch.exp(-torch.stack(neg_log_w).detach())  # Eq. (3)
    else:
        w = torch.ones_like(mu) if weighting == "uniform" else (mu * (1 - mu)).sqrt()
    return torch.nn.functional.pad(w, (1, 1))


def weight_objective(neg_log_w: list[torch.Tensor], bin_loss: torch.Tensor, present: torch.Tensor, delta: float,
                     literal: bool) -> torch.Tensor:
    """The weights' side of Eq. (1) over the bins present in the update (absent ones are not in the graph at all):
    sum_mu w_mu L_mu + s_mu (-ln w = s), bin_loss (G+1,) a constant here; guarded: |L_mu| + delta in place of L_mu,
    so the minimum w_mu = 1 / (|L_mu| + delta) always exists [dev 1]."""
    target = bin_loss if literal else bin_loss.abs() + delta  # (G+1,)
    return sum(torch.exp(-s) * target[i] + s for i, s in enumerate(neg_log_w, 1) if present[i])  # Eq. (1), (3)


def update_weights(neg_log_w: list[torch.Tensor], weight_opt, bin_loss: torch.Tensor, present: torch.Tensor, cfg):
    """One Adam step of s = -ln w on Eq. (1), then w clamped to [w_min, w_max]. An absent bin keeps .grad None, so
    Adam skips it (with a zero gradient its momentum would still move the weight)."""
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
    """s_mu = -ln w_mu for mu = 1/G .. (G-1)/G, Eq. (3), at 0 (w = 1) or as a checkpoint saved them: one tensor per
    bin (Adam can then skip an absent one), with an Adam of their own (--weight_lr), out of the model's weight decay
    (it would pull w to 0) and gradient clipping (gradients L - 1/w would dominate the norm)."""
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


def bin_metrics(neg_log_w: list[torch.Tensor], bins: torch.Tensor, cfg: Config) -> dict:
    """The step's daro/* record, keys naming mu with three decimals (daro/w_0.125): w_mu after the step, L_mu (its
    mean over the updates in which bin mu was present; 0 if none), and n_mu, the groups trained on per bin (all
    ranks). bins (3, G+1) on this rank: the sum of L_mu over updates, the updates with bin mu, its groups."""
    G = cfg.group_size
    w = bin_weights(neg_log_w, cfg.weighting).cpu()  # (G+1,)
    counts = all_reduce_sum(bins[2])  # groups trained on, per bin, over all ranks
    record = {}
    for i in range(G + 1):
        record[f"daro/n_{i / G:.3f}"] = counts[i].item()
        if 0 < i < G:
            record[f"daro/w_{i / G:.3f}"] = w[i].item()
            record[f"daro/L_{i / G:.3f}"] = (bins[0][i] / bins[1][i].clamp(min=1)).item()
    return record

# -----------------------------------------------------------------------------------------------------------------
# Training


def main(cfg: Config):
    # TRY NOT TO MODIFY: ranks, data, model, rollout engine, optimizer, resume
    dist_info = setup_dist(cfg.device)
    check_config(cfg, dist_info.world_size)  # a flag combination that cannot work stops here (exit 2)
    check_algorithm_config(cfg)
    G, device = cfg.group_size, dist_info.device
    train_set, eval_sets = load_datasets(cfg)  # a bad file fails here, in a second, before any model is loaded
    torch.manual_seed(cfg.seed)  # identical initialisation on every rank
    resume_from, base_path = find_checkpoint(cfg), model_path(cfg.model)
    model, tok = load_model(resume_from or base_path)  # on the CPU: the rollout engine takes its GPU memory first
    train_set, eval_sets = tokenize_datasets(train_set, eval_sets, tok, cfg)
    engine = make_rollout(cfg, model, tok, dist_info, resume_from or base_path)  # our sampler or vLLM
    model, ref_model = prepare_models(model, engine, base_path, cfg, dist_info)  # checked, sharded; the KL anchor
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / max(1, cfg.warmup_steps)))
    stream = PromptStream(train_set, cfg.seed)
    start_step, state = load_checkpoint(resume_from, model, opt, sched, stream, cfg.seed, dist_info)
    neg_log_w, weight_opt = init_weights(cfg, device, state)  # s_mu = -ln w_mu and their own Adam, Eq. (3)
    save = lambda step, eval_due=False, pending=None: save_checkpoint(  # noqa: E731
        cfg.out_dir, step, model, tok, opt, sched, stream,
        {**weights_state(neg_log_w, weight_opt), "eval_due": eval_due}, cfg.keep_last, pending)
    logger = Logger(cfg, dist_info, resume_step=start_step if cfg.resume else -1)
    first_eval = None  # at the start, and on resume the evaluation a stop left due
    if start_step == 0 or state.get("eval_due") or cfg.eval_only:
        first_eval = evaluate_and_log(engine, tok, eval_sets, cfg, dist_info, logger, start_step)
    handle_stop_signals()
    guard, pending = UpdateGuard(cfg.max_bad_updates), state["pending"]  # pending: a step a stop interrupted
    for step in tqdm(range(start_step + 1, 0 if cfg.eval_only else cfg.steps + 1), desc="steps", leave=False,
                     disable=not dist_info.is_main or not sys.stderr.isatty()):  # a bar in a terminal, not in logs
        timer, sums, my_groups, update_rows, first = StepTimer(), Sums(*TRAIN_SUMS), [], [], 0
        bins = torch.zeros(3, G + 1)  # per bin mu: the sum of L_mu over updates, the updates it was in, its groups
        if pending:  # the rest of a step that a stop interrupted between two updates
            (record, my_groups, update_rows, batch, first, sums.sums, bins), pending = pending["work"], None
        else:
            # 1) roll out G completions per prompt, verify and reward them; dynamic sampling keeps the mixed groups
            start = (stream.position, rng_state())
            with timer("rollout"):
                rollout = dynamic_sampling(engine, tok, stream, cfg, dist_info)
            if rollout is None:  # a stop between generation batches: this step is redone on resume, from its start
                stream.position, _ = start[0], set_rng_state(start[1])
                save(step - 1)
                return stop_run(engine, f"in step {step}'s rollout")
            kept, generated, record = rollout
            if kept:  # (a step that keeps no group is logged and skipped)
                with timer("update"):
                    # 2) this rank's groups in each update, brought to it, as one batch (common, section 7)
                    my_groups, update_rows = plan_updates(kept, cfg.updates_per_step, dist_info,
                                                          cfg.micro_batch_tokens > 0)
                    batch = make_batch(my_groups, tok.pad_token_id, device)
                    # ALGO LOGIC: 3) GRPO advantages; each completion's bin, #correct of its group (mu = bin / G)
                    batch["advantage"] = group_advantages(batch["reward"].view(-1, G), cfg.std_norm).flatten()
                    batch["bin"] = batch["correct"].view(-1, G).sum(-1).repeat_interleave(G)  # (B,)
                    if cfg.weighting != "none":  # bins 0 and G are not in Eq. (1): their tokens are not trained on
                        batch["mask"] = batch["mask"] * ((batch["bin"] > 0) & (batch["bin"] < G)).unsqueeze(-1)
                    bins[2] = torch.bincount(batch["bin"][::G].cpu(), minlength=G + 1).float()  # groups per bin
                    # 4) pi_old (the engine's log-probs if they are the trainer's, else recomputed), and with
                    #    --rollout_is the weights pi_old / pi_rollout of the engine's samples
                    batch.update(old_logprobs(model, batch, cfg, device, engine.exact_logprobs))
                    record.update(rollout_correction(batch, cfg))
        if update_rows:
            engine.sleep()  # vLLM on a GPU: its weights' and KV cache's memory go to the updates
            with timer("update"):
                # 5) optimizer updates of the model and the weights, Eq. (1)-(3)
                batch["weight"] = torch.zeros_like(batch["mask"], dtype=torch.float)  # (B, T)
                for u in range(first, len(update_rows)):
                    if u > first and stop_requested():  # a stop between updates: the checkpoint keeps the rest
                        work = (record, my_groups[:1], update_rows, batch, u, sums.sums, bins)
                        save(step - 1, pending={"step": step, "work": work})
                        return stop_run(engine, f"in step {step} before update {u}")
                    rows = update_rows[u]
                    # ALGO LOGIC: L_mu = a bin's token losses over its tokens in the whole update, Eq. (2), times w_mu
                    batch["weight"][rows], bin_tokens = bin_token_weights(batch["mask"][rows], batch["bin"][rows], G)
                    if cfg.weighting == "none":  # the baselines' own aggregation over the whole update, no bins
                        batch["weight"][rows] = loss_weights(batch["mask"][rows], cfg.loss_agg, cfg.max_new_tokens)
                    w, bin_loss = bin_weights(neg_log_w, cfg.weighting), torch.zeros(G + 1, device=device)
                    update_loss = 0.0
                    for _, mb in micro_batches(batch, rows, cfg.micro_batch_size, cfg.micro_batch_tokens):
                        token_loss = token_losses(model, ref_model, mb, cfg, device, sums)  # (B, T)
                        bin_loss += torch.zeros_like(bin_loss).index_add_(  # this micro-batch's share of each L_mu
                            0, mb["bin"], (token_loss.detach() * mb["weight"]).sum(-1))
                        loss = (token_loss * (mb["weight"] * w[mb["bin"]].unsqueeze(-1))).sum()  # Eq. (1), theta's side
                        loss.backward()
                        update_loss += loss.item()
                    if guard.step(model, opt, cfg.grad_clip, update_loss, sums, f"step {step} update {u}"):
                        bin_loss = all_reduce_sum(bin_loss)  # (G+1,) L_mu over all ranks: one weight step everywhere
                        if cfg.weighting == "learned":  # skipped, like the model's step, after a non-finite update
                            update_weights(neg_log_w, weight_opt, bin_loss, bin_tokens > 0, cfg)
                        bins[0] += torch.where(bin_tokens > 0, bin_loss, 0.0).cpu()
                        bins[1] += (bin_tokens > 0).float().cpu()
            # 6) the rollout engine takes the new weights (vLLM: streamed, then checked against the trainer's)
            with timer("sync"):
                record.update(engine.sync_weights(model))
        sched.step()  # the learning-rate schedule (warm-up) counts RL steps
        # 7) one printed line and one metrics record: sums over micro-batches and ranks, means per token or update
        record.update(train_metrics(sums.reduce(), len(update_rows), sched.get_last_lr()[0], not engine.exact_logprobs))
        record.update({"step": step, **timer.metrics()})
        record.update(bin_metrics(neg_log_w, bins, cfg))
        logger.log(record)
        ws = [record[f"daro/w_{i / G:.3f}"] for i in range(1, G)]
        logger.line(format_step(step, cfg.steps, record) + f" | w {min(ws):.2f}-{max(ws):.2f}")
        if cfg.sample_every and step % cfg.sample_every == 0 and my_groups:
            logger.samples(step, my_groups[0])
        # 8) evaluation and checkpoints; on a stop request the checkpoint at once (a due evaluation runs on resume)
        stopping, eval_due = stop_requested(), cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps
        if eval_due and not stopping:
            evaluate_and_log(engine, tok, eval_sets, cfg, dist_info, logger, step)
        if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps or stopping:
            save(step, eval_due=stopping and eval_due)
        if stopping:
            return stop_run(engine, f"at step {step}")
    if not cfg.eval_only:
        last_eval = evaluate_and_log(engine, tok, eval_sets, cfg, dist_info, logger, cfg.steps)
        if first_eval is not None and first_eval["step"] == 0:
            print0(f"eval/acc before {first_eval['eval/acc']:.3f} -> after {last_eval['eval/acc']:.3f}")
    cleanup_dist(engine)


if __name__ == "__main__":
    main(parse_config(Config, presets=PRESETS))
