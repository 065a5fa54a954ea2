"""
DA3PO: DAPO plus Direct Advantage Amplification (DAA) of the correct completions on hard prompts.
Paper: "Learning from Hard Prompts: Difficulty-aware Advantage Amplification in Dynamic Sampling",
arXiv:2608.27982; DAPO (the base): arXiv:2503.14476.

One RL step: G completions per prompt -> verifier (+1/-1, DAPO's overlong shaping)
-> dynamic sampling (keep groups with 0 < #correct < G) -> GRPO advantages
-> DAA: A <- lam * A for the correct completions (A > 0) of groups whose pass rate
   p_hat = #correct / G is below tau
-> DAPO's token-mean clipped loss (clip-higher), several updates.
Why (--theory): dropping the all-wrong groups raises the expected advantage of an incorrect
completion on a prompt of pass rate p by alpha- = 1/(1-(1-p)^(G-1)), and of a correct one by
alpha+ = 1/(1-p^(G-1)); below p = 0.5 the correct ones are under-weighted
(gamma = alpha+/alpha- < 1).
--algo: da3po, or the baselines dapo (lam 1), grpo, dr_grpo, gspo; the neighbours maxrl, dgpo, asym,
hadw (neighbours.py: other papers' difficulty weightings on the same step).

Deviations [dev N]:
1) The paper gives no tau; we use 0.5, where gamma crosses 1, and a strict p_hat < tau.
2) The defaults run the CPU demo; docs/gpu.md has the paper's settings.
3) No KL term in the GRPO and GSPO presets, as in DAPO.
4) Ours, off by default: --adaptive_lam (lam = 1/gamma, the paper's future work), --p_estimate
   running (p from every sample of the prompt so far), --daa_scope all (a control).

Run:
  python da3po.py                                         # the reasoning demo, a minute on a CPU
  python da3po.py --algo dapo --steps 3 --out_dir /tmp/x  # a baseline, a smoke test
  torchrun --standalone --nproc_per_node=8 da3po.py --model Qwen/Qwen3-4B-Base ...  # docs/gpu.md
  python da3po.py --theory                                # the amplification factors, exact and MC
"""
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
from neighbours import NEIGHBOURS, check_neighbour_flags
from neighbours import PRESETS as NEIGHBOUR_PRESETS
from ranks import (all_reduce_max, all_reduce_sum, cleanup_dist, die, end_process,
                   handle_stop_signals, setup_dist, stop_requested, stop_run)

# --------------------------------------------------------------------------------------------------
# Config: the shared knobs (common.TrainConfig) and DAA's, the presets, the checks of DAA's flags
@dataclass
class Config(TrainConfig):
    """DA3PO (DAPO + Direct Advantage Amplification) and its baselines on one code path."""
    algo: str = "da3po"
    """preset: da3po | dapo | grpo | dr_grpo | gspo | maxrl | dgpo | asym | hadw
    (docs/neighbours.md); explicit flags override the preset"""
    out_dir: str = "out/da3po"
    """config.json, metrics.jsonl, samples.jsonl, checkpoints"""
    wandb_project: str = "da3po"
    """wandb project of --report_to wandb"""
    lam: float = 2.0
    """lambda: multiplier of correct completions' advantages on hard prompts; 1 = off (DAPO)"""
    tau: float = 0.5
    """hard prompt: group pass rate p_hat < tau (strict) [dev 1]"""
    adaptive_lam: bool = False
    """lambda(p) = 1/gamma(p, G) in place of lam, capped at lam_max [dev 4]"""
    lam_max: float = 4.0
    """cap of --adaptive_lam's factor"""
    p_estimate: str = "group"
    """pass rate for DAA: group (p_hat of the G samples) | running (over all epochs) [dev 4]"""
    daa_scope: str = "correct"
    """correct (the paper: correct completions, A > 0) | all (both signs: a control) [dev 4]"""
    dgpo_temp: float = 2.0
    """--algo dgpo: T of DQW's softmax over -p_hat (MathForge's 2.0); lower: hard ones weigh more"""
    hadw_scale: float = 1.3
    """--algo hadw: lambda_scale of Phi, Eq. (16) (the best of the paper's Table 7)"""
    hadw_anchor: str = "window"
    """--algo hadw: window (App. F, Eq. (134), as the authors' code) | kalman (Eqs. (8)-(11))"""
    hadw_window: int = 10
    """--algo hadw: recent steps the anchor looks at, h of Eq. (134), m of Eqs. (9)-(10) (10 as
    the authors' script)"""
    hadw_eta: float = 1.0
    """--algo hadw --hadw_anchor kalman: eta of Eq. (11) (ours: the paper gives no value)"""
    theory: bool = False
    """print the dynamic-sampling amplification factors (exact and Monte Carlo) and exit"""


OWN_PRESETS = {
    "da3po": {**BASELINES["dapo"], "lam": 2.0, "adaptive_lam": False, "tau": 0.5},  # [dev 1]
    **NEIGHBOUR_PRESETS,
}
PRESETS = presets(OWN_PRESETS, off={"lam": 1.0, "adaptive_lam": False})


def check_algorithm_config(cfg: Config):
    """DAA's flags that cannot work stop here, naming the flag (exit 2)."""
    if not 0 < cfg.tau <= 1:
        die(f"--tau must be in (0, 1], got {cfg.tau}")
    if cfg.lam <= 0:
        die(f"--lam must be > 0, got {cfg.lam}")
    if cfg.daa_scope not in ("correct", "all"):
        die(f"--daa_scope {cfg.daa_scope!r}: choose one of correct, all")
    if cfg.p_estimate not in ("group", "running"):
        die(f"--p_estimate {cfg.p_estimate!r}: choose one of group, running")
    if cfg.lam_max < 1:
        die(f"--lam_max must be >= 1, got {cfg.lam_max}")
    if cfg.algo in NEIGHBOURS:
        check_neighbour_flags(cfg)  # neighbours.py


# --------------------------------------------------------------------------------------------------
# Algorithm: Direct Advantage Amplification, and the theory behind it
def daa(advantages: torch.Tensor, correct: torch.Tensor, lam, tau: float,
        p: torch.Tensor | None = None, scope: str = "correct"):
    """DAA: lam * A for the correct completions with A > 0 of the groups whose pass rate p < tau
    (the overlong penalty can put a correct one below its group's mean). advantages, correct: (N,
    G); p (N, 1), by default p_hat = #correct / G; lam: a number or (N, 1). scope "all": every
    advantage of a hard group (a control). Advantages, not rewards: a two-level reward survives the
    z-score. No renormalisation after. Returns (advantages, amplified)."""
    p = correct.float().mean(-1, keepdim=True) if p is None else p  # (N, 1)
    hard = (p < tau).expand_as(advantages)  # (N, G) [dev 1]
    amplified = hard if scope == "all" else hard & correct & (advantages > 0)
    return torch.where(amplified, lam * advantages, advantages), amplified


def adaptive_lam(p: torch.Tensor, G: int, lam_max: float) -> torch.Tensor:
    """[dev 4] The factor that undoes the dynamic-sampling imbalance, capped at lam_max: 1/gamma =
    (1 - p^(G-1)) / (1 - (1-p)^(G-1)), > 1 for p < 0.5. Example: G = 8, p = 1/8 -> 1.65."""
    p = p.clamp(1e-6, 1 - 1e-6)
    return ((1 - p ** (G - 1)) / (1 - (1 - p) ** (G - 1))).clamp(max=lam_max)


def pass_key(group: dict) -> str:
    """The prompt a running pass count belongs to (problem text and gold answer)."""
    return f"{group['prompt']}\x00{group['answer']}"


def count_passes(counts: dict, groups: list[dict]):
    """[dev 4] Per-prompt pass counts over every group generated so far (all epochs, all ranks), for
    --p_estimate running."""
    for g in groups:
        c = counts.setdefault(pass_key(g), [0, 0])
        c[0] += sum(g["correct"])
        c[1] += len(g["correct"])


def amplify(advantage: torch.Tensor, correct: torch.Tensor, groups: list[dict], pass_counts: dict,
            cfg: Config):
    """DAA on this rank's groups with the pass-rate estimate and factor the flags ask for.
    advantage, correct: (N, G). Returns (the amplified advantages (N, G), this rank's counts (4,):
    completions, those amplified, the sum and the largest of their factors; daa_metrics turns them
    into daa/*)."""
    p = correct.to(advantage.dtype).mean(-1, keepdim=True)  # p_hat (N, 1), the advantages' dtype
    if cfg.p_estimate == "running":
        counts = [pass_counts[pass_key(g)] for g in groups]
        counts = torch.tensor(counts, dtype=p.dtype, device=p.device)  # (N, 2)
        p = counts[:, :1] / counts[:, 1:]  # #correct / #samples over every epoch so far
    factor = adaptive_lam(p, cfg.group_size, cfg.lam_max) if cfg.adaptive_lam else cfg.lam
    advantage, amplified = daa(advantage, correct, factor, cfg.tau, p, cfg.daa_scope)
    factors = (factor * torch.ones_like(p)).expand_as(advantage)  # (N, G)
    amplified = amplified & (factors != 1)  # a factor of 1 (lam = 1: DAPO, GSPO) amplifies nothing
    applied = factors[amplified]  # the factor of each amplified one
    largest = applied.max().item() if len(applied) else 0.0
    counts = [amplified.numel(), len(applied), applied.sum().item(), largest]
    return advantage, torch.tensor(counts, dtype=torch.float64)


def daa_metrics(counts: torch.Tensor) -> dict:
    """The daa/* metrics of amplify's counts (summed over ranks; the largest factor, their max)."""
    completions, num_applied, factor_sum, largest = counts.tolist()
    return {"daa/amplified_frac": num_applied / max(completions, 1.0),
            "daa/lam_mean": factor_sum / max(1.0, num_applied),  # 0: none amplified
            "daa/lam_max": largest}


def amplification_factors(p: float, G: int) -> tuple[float, float, float]:
    """(alpha+, alpha-, gamma): how dynamic sampling scales the expected advantage of a correct / an
    incorrect completion on a prompt with pass rate p, and their ratio. The other G-1 outcomes are
    Bernoulli(p); a group survives unless all G agree, and an advantage is 0 on a uniform group, so
    E[A | y, kept] = E[A | y] / P(kept | y)."""
    alpha_plus = 1.0 / (1.0 - p ** (G - 1))
    alpha_minus = 1.0 / (1.0 - (1.0 - p) ** (G - 1))
    return alpha_plus, alpha_minus, alpha_plus / alpha_minus


def monte_carlo_factors(p: float, G: int, num_groups: int = 200_000,
                        seed: int = 0) -> tuple[float, float, float]:
    """The same factors by simulation: GRPO advantages of completion 0 over random groups, averaged
    over the kept groups vs over all groups (where a dropped uniform group contributes advantage 0).
    """
    g = torch.Generator().manual_seed(seed)
    correct = torch.rand(num_groups, G, generator=g) < p  # (N, G)
    adv = group_advantages(correct.float(), std_norm=True)
    mixed = (correct.sum(-1) > 0) & (correct.sum(-1) < G)  # the groups dynamic sampling keeps
    y = correct[:, 0]

    def factor(sel):  # E[A | y, kept] / E[A | y] of completion 0
        return adv[sel & mixed, 0].mean().item() / adv[sel, 0].mean().item()
    alpha_plus = factor(y)
    alpha_minus = factor(~y)
    return alpha_plus, alpha_minus, alpha_plus / alpha_minus


def print_theory():
    print("dynamic-sampling amplification of the expected advantage "
          "(exact | Monte Carlo, 200k groups)")
    columns = f"{'alpha+':>7} {'alpha-':>7} {'gamma':>6}"
    print(f"{'G':>3} {'p':>5} | {columns} | {columns}")
    for G in (4, 8, 16):
        for p in (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9):
            exact = amplification_factors(p, G)
            mc = monte_carlo_factors(p, G)
            cells = [" ".join(f"{x:7.2f}" for x in f[:2]) + f" {f[2]:6.2f}" for f in (exact, mc)]
            print(f"{G:3d} {p:5.2f} | " + " | ".join(cells))


class DAA(Algorithm):
    """DA3PO's part of the step (the hooks: common.Algorithm). State: --p_estimate running's pass
    counts; over a step, amplify's counts over all ranks."""

    def __init__(self, cfg: Config, device: torch.device, state: dict):
        super().__init__(cfg, device, state)
        self.pass_counts = state.get("pass_counts", {})  # prompt -> [#correct, #samples]
        self.counts = torch.zeros(4, dtype=torch.float64)  # the step's amplify counts, all ranks

    def state_dict(self) -> dict:
        return {"pass_counts": self.pass_counts}

    def step_state(self) -> dict:
        return {"daa_counts": self.counts}  # the same on every rank

    def load_step_state(self, state: dict):
        self.counts = state.get("daa_counts", torch.zeros(4, dtype=torch.float64))

    def after_rollout(self, generated: list[dict]):
        if self.cfg.p_estimate == "running":  # every generated group, kept or not, on every rank
            count_passes(self.pass_counts, generated)

    def advantages(self, batch: dict, groups: list[dict]) -> torch.Tensor:
        """GRPO advantages (B,), then DAA on the correct completions of hard groups; and
        batch["amplified"] (B,), the rows whose advantage DAA scaled (read by cov/amplified)."""
        G = self.cfg.group_size
        grpo = group_advantages(batch["reward"].view(-1, G), self.cfg.std_norm)  # (N, G)
        correct = batch["correct"].view(-1, G)
        advantage, counts = amplify(grpo, correct, groups, self.pass_counts, self.cfg)
        batch["amplified"] = (advantage != grpo).flatten()
        largest = all_reduce_max(counts[3:])
        self.counts = torch.cat([all_reduce_sum(counts[:3]), largest])  # over all ranks
        return advantage.flatten()

    def end_step(self) -> dict:
        metrics = daa_metrics(self.counts)  # all zero when no group was kept
        self.counts = torch.zeros(4, dtype=torch.float64)
        return metrics

    def line(self, record: dict) -> str:
        return f" | amp {record['daa/amplified_frac']:.2f}"


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
    algo = NEIGHBOURS.get(cfg.algo, DAA)(cfg, device, state)  # the paper's part of the step (above)

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
    config = parse_config(Config, presets=PRESETS)
    if config.theory:  # the amplification factors, and exit
        print_theory()
    else:
        main(config)
        end_process()  # under torchrun: exit without the interpreter's shutdown (ranks.end_process)
