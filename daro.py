"""
DARO: the GRPO/DAPO loss split by difficulty bin, each bin with a learnable weight.
Paper: "DARO: Difficulty-Aware Reweighting Policy Optimization", arXiv:2510.09001.
DAPO (the base): arXiv:2503.14476.

One RL step: as in da3po.py up to GRPO's advantages; then each completion goes to the bin
mu = #correct / K of its group, and each update of the model and the weights minimises
  L(theta, w) = sum_{mu = 1/K .. (K-1)/K} [ w_mu * L_mu(theta) - ln w_mu ]                  Eq. (1)
  L_mu = (clipped token losses of bin mu, summed) / (#tokens of bin mu in the update)      Eq. (2)
  w_mu = exp(-s_mu), s = 0 at start; Adam (--weight_lr), no weight decay or gradient clip  Eq. (3)
The optimum w_mu = 1 / L_mu gives every bin the same loss scale; bins 0 and 1 (no advantage) are
left out. --algo: daro; the static uniform (w = 1) and var (w = sqrt(mu (1 - mu)), the reward
variance); the baselines dapo, grpo, dr_grpo, gspo (config.BASELINES).

Deviations [dev N]:
1) The paper does not settle the sign of L_mu: at ratio 1 it is minus its bin's mean advantage per
   token, negative when the bin's correct completions are the longer ones, and Eq. (1) then has no
   minimum in w. By default w fits |L_mu| + delta, clamped to [w_min, w_max] (the model's gradient
   is the same); --daro_literal fits L_mu.
2) The defaults run the CPU demo; docs/gpu.md has the paper's settings.
3) No KL term in the GRPO preset, as in DAPO.
4) The presets keep DAPO's dynamic sampling on (as the CPU demos were measured); the paper sets
   reweighting against resampling, so docs/gpu.md's paper runs pass --no-dynamic_sampling.

Run:
  python daro.py                                          # the reasoning demo, a minute on a CPU
  python daro.py --algo var --steps 3 --out_dir /tmp/x    # a static weighting, a smoke test
  torchrun --standalone --nproc_per_node=8 daro.py --model Qwen/Qwen2.5-Math-7B ...  # docs/gpu.md
"""
import math
from dataclasses import dataclass

import torch

import entropy_update
from bookkeeping import (Logger, PendingStep, evaluate_and_log, find_checkpoint, format_step,
                         load_checkpoint, load_policy, prepare_models, rng_state, save_checkpoint,
                         set_rng_state, step_bar)
from common import (TRAIN_SUMS, Algorithm, StepTimer, Sums, UpdateGuard, dynamic_sampling,
                    group_advantages, make_batch, micro_batches, old_logprobs, plan_updates,
                    rollout_correction, token_losses, train_metrics)
from config import BASELINES, TrainConfig, check_config, parse_config, presets
from dataset import (PromptStream, load_datasets, resolve_max_model_len, resolve_template,
                     tokenize_datasets)
from engine import make_rollout
from modeling import model_path
from ranks import (all_reduce_sum, cleanup_dist, die, end_process, handle_stop_signals, setup_dist,
                   stop_requested, stop_run)

# --------------------------------------------------------------------------------------------------
# Config: the shared knobs (common.TrainConfig) and DARO's, the presets, the checks of DARO's flags
@dataclass
class Config(TrainConfig):
    """DARO (learnable per-difficulty loss weights) and its baselines on one code path."""
    algo: str = "daro"
    """preset: daro | uniform | var | dapo | grpo | dr_grpo | gspo; explicit flags override"""
    out_dir: str = "out/daro"
    """config.json, metrics.jsonl, samples.jsonl, checkpoints"""
    wandb_project: str = "daro"
    """wandb project of --report_to wandb"""
    weighting: str = "learned"
    """w_mu: learned (DARO) | closed (1 / (|L_mu| + delta), the last update's L_mu) | uniform (1)
    | var (sqrt(mu(1-mu))) | none (no bins)"""
    weight_lr: float = 1e-3
    """Adam learning rate of s_mu = -ln w_mu (the paper: 1e-3; docs/metrics.md: how far w moves)"""
    daro_delta: float = 1e-3
    """delta: the weights fit |L_mu| + delta, so w stays finite when L_mu = 0 [dev 1]"""
    daro_literal: bool = False
    """fit w to L_mu, Eq. (1) as written (no minimum if L_mu <= 0) [dev 1]"""
    w_min: float = 0.1
    """lower clamp of every w_mu, applied after each weight step [dev 1]"""
    w_max: float = 10.0
    """upper clamp of every w_mu [dev 1]"""
    shared_weight: bool = False
    """a control: every bin weighs the fitted weights' mean (the loss scale, no reweighting)"""


OWN_PRESETS = {
    "daro": {**BASELINES["dapo"], "weighting": "learned"},  # DARO on the DAPO loss [dev 4]
    "uniform": {**BASELINES["dapo"], "weighting": "uniform"},  # the bins with frozen w = 1
    "var": {**BASELINES["dapo"], "weighting": "var"},  # variance-based static weights
}
PRESETS = presets(OWN_PRESETS, off={"weighting": "none"})


def check_algorithm_config(cfg: Config):
    """DARO's flags that cannot work stop here, naming the flag (exit 2); check_config calls it."""
    if cfg.weighting not in ("learned", "closed", "uniform", "var", "none"):
        die(f"--weighting {cfg.weighting!r}: choose one of learned, closed, uniform, var, none")
    if cfg.weighting == "learned" and not cfg.weight_lr > 0:
        die(f"--weighting learned needs --weight_lr > 0 (w = 1: uniform), got {cfg.weight_lr}")
    if cfg.weighting == "closed" and cfg.daro_literal:
        die("--daro_literal does not apply to --weighting closed (it fits |L_mu| + delta)")
    if cfg.daro_delta < 0:
        die(f"--daro_delta must be >= 0 (it keeps |L_mu| + delta positive), got {cfg.daro_delta}")
    if cfg.shared_weight and cfg.weighting not in ("learned", "closed"):
        die(f"--shared_weight needs --weighting learned or closed, got {cfg.weighting}")
    if not 0 < cfg.w_min <= 1 <= cfg.w_max:
        die(f"--w_min and --w_max need 0 < w_min <= 1 <= w_max, got {cfg.w_min} and {cfg.w_max}")


# --------------------------------------------------------------------------------------------------
# Algorithm: difficulty bins, per-bin losses and their learnable weights
def tokens_per_bin(mask: torch.Tensor, bins: torch.Tensor, G: int) -> torch.Tensor:
    """(G+1,) the completion tokens of each bin mu among these rows; bins (B,): #correct of each
    row's group."""
    mask = mask if mask.is_floating_point() else mask.float()  # a float64 mask stays float64
    return mask.new_zeros(G + 1).index_add_(0, bins, mask.sum(-1))


def bin_token_weights(mask: torch.Tensor, bins: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per-token weights (B, T) that turn a sum of token losses into sum_mu L_mu, Eq. (2): a token
    of bin mu weighs 1 / (#tokens of bin mu in the WHOLE update); bins 0 and G weigh 0, and a bin of
    one prompt weighs as much as one of twenty. tokens (G+1,): tokens_per_bin over the update's
    micro-batches and ranks. Example: bins [1, 1, 3], lengths [2, 4, 5] -> 1/6, 1/6, 1/5."""
    G = len(tokens) - 1
    inside = ((bins > 0) & (bins < G)).to(tokens.dtype).unsqueeze(-1)  # (B, 1)
    return mask * inside / tokens.clamp(min=1)[bins].unsqueeze(-1)


def bin_weights(neg_log_w: list[torch.Tensor], weighting: str,
                shared: bool = False) -> torch.Tensor:
    """w_mu for mu = 0, 1/G, ..., 1, a constant (G+1,): exp(-s_mu), Eq. (3) (learned, or set by the
    closed form), or a static function of mu; 0 for mu = 0 and 1; `none` (no bins) weighs every bin
    1. shared: every bin mu = 1/G .. (G-1)/G weighs the mean of those weights (the global
    loss-scale control)."""
    G = len(neg_log_w) + 1
    device = neg_log_w[0].device
    if weighting == "none":
        return torch.ones(G + 1, device=device)
    mu = torch.arange(1, G, device=device) / G  # (G-1,)
    if weighting in ("learned", "closed"):
        w = torch.exp(-torch.stack(neg_log_w).detach())  # Eq. (3)
    else:
        w = torch.ones_like(mu) if weighting == "uniform" else (mu * (1 - mu)).sqrt()
    if shared:
        w = w.mean().expand(G - 1)
    return torch.nn.functional.pad(w, (1, 1))


def weight_objective(neg_log_w: list[torch.Tensor], bin_loss: torch.Tensor, present: torch.Tensor,
                     delta: float, literal: bool) -> torch.Tensor:
    """The weights' side of Eq. (1) over the bins present in the update: sum_mu w_mu L_mu + s_mu (s
    = -ln w), with |L_mu| + delta in place of L_mu, so that the minimum w_mu = 1 / (|L_mu| + delta)
    exists [dev 1]."""
    target = bin_loss if literal else bin_loss.abs() + delta  # (G+1,)
    return sum(torch.exp(-s) * target[i] + s  # Eq. (1), (3)
               for i, s in enumerate(neg_log_w, 1) if present[i])


def update_weights(neg_log_w: list[torch.Tensor], weight_opt, bin_loss: torch.Tensor,
                   present: torch.Tensor, cfg):
    """One Adam step of s = -ln w on Eq. (1), then w clamped to [w_min, w_max]. An absent bin keeps
    .grad None, so Adam skips it (with a zero gradient its momentum would still move the weight)."""
    if not present[1:-1].any():
        return
    weight_opt.zero_grad(set_to_none=True)
    weight_objective(neg_log_w, bin_loss, present, cfg.daro_delta, cfg.daro_literal).backward()
    weight_opt.step()
    with torch.no_grad():
        for s in neg_log_w:  # w = exp(-s) in [w_min, w_max] [dev 1]
            s.clamp_(-math.log(cfg.w_max), -math.log(cfg.w_min))


def closed_form_weights(neg_log_w: list[torch.Tensor], bin_loss: torch.Tensor,
                        present: torch.Tensor, cfg):
    """The minimum of Eq. (1) in w, set directly: s_mu = ln(|L_mu| + delta), i.e. w_mu = 1 / (|L_mu|
    + delta), clamped to [w_min, w_max], for each bin present in the update; an absent bin keeps
    its weight."""
    low = -math.log(cfg.w_max)  # s = -ln w: w_max is the lowest s
    high = -math.log(cfg.w_min)
    with torch.no_grad():
        for i, s in enumerate(neg_log_w, 1):
            if present[i]:  # |L_mu| + delta = 0 (delta 0): ln 0 = -inf, clamped: w_max
                s.copy_((bin_loss[i].abs() + cfg.daro_delta).log().clamp(low, high))


class DARO(Algorithm):
    """DARO's part of the step (the hooks: common.Algorithm). Its state: s_mu = -ln w_mu for
    mu = 1/G .. (G-1)/G, 0 at start, one tensor per bin (Adam skips an absent one), with an Adam of
    their own, apart from the model's weight decay and gradient clipping (docs/departures.md);
    --weighting closed sets s_mu itself. `bins` (3, G+1), per bin over the step's updates, the same
    on every rank: L_mu summed, updates, groups. start_update sets the update's own: its tokens per
    bin (bin_tokens), w_mu (w) and this rank's share of each L_mu (bin_loss), summed by loss()."""

    def __init__(self, cfg: Config, device: torch.device, state: dict):
        super().__init__(cfg, device, state)
        self.G = cfg.group_size
        self.neg_log_w = [torch.zeros((), device=device, requires_grad=True)
                          for _ in range(self.G - 1)]  # s_mu, mu = 1/G .. (G-1)/G
        self.weight_opt = torch.optim.Adam(self.neg_log_w, lr=cfg.weight_lr)  # Eq. (3)
        if "daro_neg_log_w" in state:  # a resumed run
            self.load_state_dict(state)
        self.bins = torch.zeros(3, self.G + 1)

    def state_dict(self) -> dict:
        """s_mu and their Adam, on the device they train on (a checkpoint loads onto the CPU)."""
        return {"daro_neg_log_w": torch.stack(self.neg_log_w).detach(),
                "weight_optimizer": self.weight_opt.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict):
        """The weights and their Adam, as state_dict() saved them."""
        for s, saved in zip(self.neg_log_w, state["daro_neg_log_w"]):
            s.copy_(saved)
        self.weight_opt.load_state_dict(state["weight_optimizer"])

    def step_state(self) -> dict:
        return {"bins": self.bins}  # on the CPU, the same on every rank

    def load_step_state(self, state: dict):
        self.bins = state["bins"]

    def advantages(self, batch: dict, groups: list[dict]) -> torch.Tensor:
        """GRPO advantages (B,), and batch["bin"] (B,): the #correct of each completion's group,
        its bin mu = bin / G."""
        G = self.G
        advantage = group_advantages(batch["reward"].view(-1, G), self.cfg.std_norm)  # (N, G)
        batch["bin"] = batch["correct"].view(-1, G).sum(-1).repeat_interleave(G)  # (B,)
        if self.cfg.weighting != "none":  # bins 0 and G are not in Eq. (1): not trained
            batch["mask"] = batch["mask"] * ((batch["bin"] > 0) & (batch["bin"] < G)).unsqueeze(-1)
        per_bin = torch.bincount(batch["bin"][::G].cpu(), minlength=G + 1).float()  # this rank's
        self.bins[2] = all_reduce_sum(per_bin)  # all ranks' groups per bin, the same on every rank
        return advantage.flatten()

    def start_update(self, batch: dict, rows: torch.Tensor) -> torch.Tensor:
        """Each token's weight in its bin's L_mu, Eq. (2), or a baseline's aggregation (no bins);
        the update's w_mu, and its L_mu to be summed from zero by loss()."""
        mask = batch["mask"][rows]
        bins = batch["bin"][rows]
        self.bin_tokens = all_reduce_sum(tokens_per_bin(mask, bins, self.G))  # all ranks'
        weight = bin_token_weights(mask, bins, self.bin_tokens)
        if self.cfg.weighting == "none":  # the baselines' own aggregation over the whole update
            weight = super().start_update(batch, rows)
        self.w = bin_weights(self.neg_log_w, self.cfg.weighting, self.cfg.shared_weight)  # (G+1,)
        self.bin_loss = torch.zeros(self.G + 1, device=self.device)  # this rank's part of L_mu
        return weight

    def loss(self, token_loss: torch.Tensor, mb: dict) -> torch.Tensor:
        """A micro-batch's share of each L_mu (for the weights' step), and its part of Eq. (1) on
        theta's side."""
        row_loss = (token_loss.detach() * mb["weight"]).sum(-1)  # (B,)
        self.bin_loss += torch.zeros_like(self.bin_loss).index_add_(0, mb["bin"], row_loss)
        w_row = self.w[mb["bin"]].unsqueeze(-1)  # (B, 1)
        return (token_loss * (mb["weight"] * w_row)).sum()

    def after_update(self):
        """After each applied update: L_mu over all ranks, then a weight step on each bin present
        (or the closed form)."""
        bin_loss = all_reduce_sum(self.bin_loss)  # (G+1,)
        present = self.bin_tokens > 0  # the bins in this update
        if self.cfg.weighting == "learned":
            update_weights(self.neg_log_w, self.weight_opt, bin_loss, present, self.cfg)
        elif self.cfg.weighting == "closed":  # the next update's w: this one's L_mu
            closed_form_weights(self.neg_log_w, bin_loss, present, self.cfg)
        self.bins[0] += torch.where(present, bin_loss, 0.0).cpu()
        self.bins[1] += present.float().cpu()

    def end_step(self) -> dict:
        """The step's daro/* record (daro/w_0.125: mu to three decimals): w_mu after the step, L_mu
        (mean over the updates with bin mu, else 0), n_mu (groups trained on, all ranks); the next
        step's `bins` start at zero."""
        G = self.G
        bins, self.bins = self.bins, torch.zeros(3, G + 1)  # the next step's
        w = bin_weights(self.neg_log_w, self.cfg.weighting, self.cfg.shared_weight).cpu()
        metrics = {}
        for i in range(G + 1):
            metrics[f"daro/n_{i / G:.3f}"] = bins[2][i].item()  # groups trained on, all ranks
            if 0 < i < G:
                metrics[f"daro/w_{i / G:.3f}"] = w[i].item()
                metrics[f"daro/L_{i / G:.3f}"] = (bins[0][i] / bins[1][i].clamp(min=1)).item()
        return metrics

    def line(self, record: dict) -> str:
        ws = [record[f"daro/w_{i / self.G:.3f}"] for i in range(1, self.G)]
        return f" | w {min(ws):.2f}-{max(ws):.2f}"

# --------------------------------------------------------------------------------------------------
# Training
def main(cfg: Config):
    # TRY NOT TO MODIFY: ranks, data, model, rollout engine, optimizer, resume
    dist_info = setup_dist(cfg.device)
    device = dist_info.device
    # a flag that cannot work, or a bad file, stops here, before any model is loaded
    check_config(cfg, dist_info.world_size, check_algorithm_config)
    train_set, eval_sets = load_datasets(cfg)
    torch.manual_seed(cfg.seed)  # identical initialisation on every rank
    resume_from = find_checkpoint(cfg)  # --resume: the latest checkpoint, else None
    base_path = model_path(cfg.model)
    # on the CPU (the engine takes its GPU memory first); --lora_rank: adapters on the base
    model, tok, weights_path = load_policy(resume_from, base_path, cfg)
    cfg.prompt_template = resolve_template(cfg.prompt_template, tok)  # auto: by the tokenizer
    train_set, eval_sets = tokenize_datasets(train_set, eval_sets, tok, cfg)
    cfg.max_model_len = resolve_max_model_len(cfg, train_set, eval_sets)  # 0: from the prompts
    engine = make_rollout(cfg, model, tok, dist_info, weights_path)  # our sampler or vLLM
    # checked, sharded; ref_model: the KL anchor
    model, ref_model = prepare_models(model, engine, base_path, cfg, dist_info)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                            fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up over --warmup_steps RL steps
        opt, lambda i: min(1.0, (i + 1) / max(1, cfg.warmup_steps)))
    stream = PromptStream(train_set, cfg.seed)
    start_step, state = load_checkpoint(resume_from, model, opt, sched, stream, cfg.seed,
                                        dist_info)
    algo = DARO(cfg, device, state)  # the paper's part of the step (above)

    def save(step: int, eval_due: bool = False, pending: PendingStep | None = None):
        """A checkpoint after `step`, the last step done (`pending`: the rest of the next one)."""
        algo_state = {**algo.state_dict(), "eval_due": eval_due}
        save_checkpoint(cfg.out_dir, step, model, tok, opt, sched, stream, algo_state,
                        cfg.keep_last, pending)
    logger = Logger(cfg, dist_info, start_step if resume_from else -1)
    # the evaluation at the start: of a fresh run, or the one a stop left due
    start_eval = None
    fresh = start_step == 0 and not resume_from
    if fresh or state.get("eval_due") or cfg.eval_only:
        start_eval = evaluate_and_log(engine, tok, eval_sets, cfg, dist_info, logger, start_step)
    handle_stop_signals()
    guard = UpdateGuard(cfg.max_bad_updates)
    pending = state["pending"]  # the rest of a step a stop interrupted between two updates, if any
    for step in step_bar(start_step, cfg, dist_info):
        timer = StepTimer()
        sums = Sums(*TRAIN_SUMS)
        my_groups = []  # (a step that keeps no group is logged, not trained)
        update_rows = []
        next_update = 0
        if pending is None:
            # 1) rollout: G completions per prompt, rewarded; dynamic sampling keeps mixed groups
            position = stream.position
            rng = rng_state()
            with timer("rollout"):
                rollout = dynamic_sampling(engine, tok, stream, cfg, dist_info)
            if rollout is None:  # a stop between generation batches: the step is redone on resume
                stream.position = position
                set_rng_state(rng)
                save(step - 1)
                return stop_run(engine, f"in step {step}'s rollout")
            kept_summaries, generated, record = rollout
            algo.after_rollout(generated)
            if kept_summaries:
                with timer("update"):
                    # 2) this rank's groups of each update, brought to it, as one batch
                    balance = cfg.micro_batch_tokens > 0  # packed: each rank as many tokens
                    my_groups, update_rows = plan_updates(
                        kept_summaries, cfg.updates_per_step, dist_info, balance)
                    batch = make_batch(my_groups, tok.pad_token_id, device)
                    # ALGO LOGIC: 3) the advantages, the paper's way
                    batch["advantage"] = algo.advantages(batch, my_groups)  # (B,)
                    # 4) pi_old (the engine's log-probs if they are the trainer's, else recomputed);
                    #    --rollout_is: the weights pi_old / pi_rollout of the engine's samples
                    batch.update(old_logprobs(model, batch, cfg, device, engine, my_groups))
                    if cfg.rollout_is != "none":
                        record.update(rollout_correction(batch, cfg))
        else:  # resumed mid-step: the updates left (split anew if the number of ranks changed)
            record, my_groups, update_rows, batch, next_update = pending.resume(sums, algo)
            pending = None
        if update_rows:
            engine.sleep()  # vLLM on a GPU: its weights' and KV cache's memory go to the updates
            with timer("update"):
                # 5) optimizer updates, each the sum of its micro-batches' losses
                batch["weight"] = torch.zeros_like(batch["mask"], dtype=torch.float)  # (B, T)
                for u in range(next_update, len(update_rows)):
                    if u > next_update and stop_requested():  # keep the updates left
                        rest = PendingStep(step, record, my_groups[:1], update_rows, batch, u,
                                           sums.values, algo.step_state())
                        save(step - 1, pending=rest)
                        return stop_run(engine, f"in step {step} before update {u}")
                    rows = update_rows[u]
                    # ALGO LOGIC: the token losses' weights and sum, the paper's way
                    batch["weight"][rows] = algo.start_update(batch, rows)
                    if cfg.entropy_coef or cfg.entropy_control != "none":  # entropy_update.py
                        entropy_update.start_update(model, batch, rows, cfg, step, u, record)
                    update_loss = 0.0
                    for _, mb in micro_batches(batch, rows, cfg.micro_batch_size,
                                               cfg.micro_batch_tokens):
                        token_loss = token_losses(model, ref_model, mb, cfg, device, sums)  # (B, T)
                        loss = algo.loss(token_loss, mb)
                        loss.backward()
                        update_loss += loss.item()
                    if guard.step(model, opt, cfg.grad_clip, update_loss, sums,
                                  f"step {step} update {u}"):
                        algo.after_update()
            # 6) the rollout engine takes the new weights (vLLM: streamed, then checked by a probe)
            with timer("sync"):
                record.update(engine.sync_weights(model))
        sched.step()  # the learning-rate schedule (warm-up) counts RL steps
        # 7) a printed line and a metrics record: sums over micro-batches and ranks, then means
        lr = sched.get_last_lr()[0]
        mismatch = not engine.exact_logprobs  # the engine's log-probs are not pi_old: log the gap
        record.update(train_metrics(sums.reduce(), len(update_rows), lr, mismatch))
        record.update({"step": step, **timer.metrics()})
        record.update(algo.end_step())
        logger.log(record)
        logger.line(format_step(step, cfg.steps, record) + algo.line(record))
        logger.samples(step, my_groups)  # every --sample_every steps
        # 8) eval and checkpoints; a stop request checkpoints at once (a due eval runs on resume)
        stopping = stop_requested()  # (every rank: an all-reduce)
        eval_due = step == cfg.steps or (cfg.eval_every > 0 and step % cfg.eval_every == 0)
        if eval_due and not stopping:
            evaluate_and_log(engine, tok, eval_sets, cfg, dist_info, logger, step,
                             before=start_eval)
        save_due = cfg.save_every > 0 and step % cfg.save_every == 0
        if save_due or step == cfg.steps or stopping:
            save(step, eval_due=stopping and eval_due)
        if stopping:
            return stop_run(engine, f"at step {step}")
    cleanup_dist(engine)


if __name__ == "__main__":
    main(parse_config(Config, presets=PRESETS))
    end_process()  # under torchrun: exit without the interpreter's shutdown (ranks.end_process)
