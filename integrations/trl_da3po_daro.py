"""
DA3PO and DARO for TRL (trl==1.16.0): GRPOTrainer subclasses in one file. Copy this file into your project (or
import it by path): it imports the standard library, torch and TRL's stack (trl, transformers, accelerate), nothing
else, so it works beside any `common.py` or `dataset.py` of yours.

  DA3POTrainer + DA3POConfig: TRL's group advantages, then DAA (Direct Advantage Amplification: lam * A for the
    correct completions with A > 0 of groups whose pass rate p_hat < tau; or lam(p) = 1/gamma(p, G) with
    adaptive_lam), in float64 on all processes' groups at once; TRL's loss (loss_type "dapo": token mean,
    clip-higher 0.2/0.28), each update's token mean over that update's own tokens.
  DAROTrainer + DAROConfig: TRL's group advantages and log-probs; the loss is the clipped surrogate aggregated per
    difficulty bin, sum_mu w_mu L_mu, L_mu = bin mu's token losses over bin mu's tokens in the update (all
    micro-batches and processes), and the learnable weights s_mu = -ln w_mu step once per optimizer update with
    their own Adam (fit to |L_mu| + delta, clamped to [w_min, w_max]); saved in and restored from the trainer's
    checkpoints (algo_state.pt).

Both configs default to the papers' recipe shape: updates_per_generation = 2 optimizer updates per generation
batch (so that pi_old != pi on the second and clip-higher binds; TRL's own default is 1), AdamW with DAPO's weight
decay 0.1 and a constant learning rate after an optional warm-up (TRL's: no decay, linear decay to 0).

Both need `correct_func`: a function with a reward function's signature (prompts, completions, completion_ids and
the dataset's columns as keyword lists) that returns one bool per completion. DAA's p_hat and DARO's bins count
correct answers, which a shaped reward does not tell apart reliably (a correct answer at the length cap scores 0
under DAPO's overlong shaping; pass TRL's get_soft_overlong_punishment as a second reward function for it).

What TRL lacks: DAPO's dynamic sampling (drop groups whose completions are all right or all wrong, refill with new
prompts). DA3POConfig.mask_uniform_groups (on by default) takes the uniform groups out of the loss and its token
count, DAPO's filter without the refill. DARO weighs bins 0 and G by 0 anyway.

The formulas in section 1 are copies of the project's (da3po.py, daro.py, common.py); the project's tests hold
them equal, and equal to the golden vectors (tests/data/golden.json).
"""
import math
import os
from dataclasses import dataclass, field

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer

ALGO_STATE = "algo_state.pt"  # in each checkpoint-N folder, beside TRL's own files

# -----------------------------------------------------------------------------------------------------------------
# 1. The formulas (copies of da3po.py's, daro.py's and common.py's; shapes: N groups of G, B rows of T tokens)


def daa(advantages: torch.Tensor, correct: torch.Tensor, lam, tau: float, p: torch.Tensor | None = None,
        scope: str = "correct"):
    """DAA: lam * A for the correct completions with A > 0 of the groups whose pass rate p < tau (strict).
    advantages, correct: (N, G); p (N, 1), by default p_hat = #correct / G; lam: a number or (N, 1). scope "all":
    every advantage of a hard group (a control). Returns (advantages, amplified (N, G))."""
    p = correct.float().mean(-1, keepdim=True) if p is None else p
    hard = (p < tau).expand_as(advantages)
    amplified = hard if scope == "all" else hard & correct & (advantages > 0)
    return torch.where(amplified, lam * advantages, advantages), amplified


def adaptive_lam(p: torch.Tensor, G: int, lam_max: float) -> torch.Tensor:
    """The factor that undoes dynamic sampling's imbalance, capped at lam_max:
    1/gamma = (1 - p^(G-1)) / (1 - (1-p)^(G-1)), > 1 for p < 0.5. Example: G = 8, p = 1/8 -> 1.65."""
    p = p.clamp(1e-6, 1 - 1e-6)
    return ((1 - p ** (G - 1)) / (1 - (1 - p) ** (G - 1))).clamp(max=lam_max)


def pass_key(group: dict) -> str:
    """The prompt a running pass count belongs to (problem text and gold answer)."""
    return f"{group['prompt']}\x00{group['answer']}"


def count_passes(counts: dict, groups: list[dict]):
    """Per-prompt pass counts over every group generated so far, for p_estimate="running"."""
    for g in groups:
        c = counts.setdefault(pass_key(g), [0, 0])
        c[0] += sum(g["correct"])
        c[1] += len(g["correct"])


def amplify(advantage: torch.Tensor, correct: torch.Tensor, groups: list[dict], pass_counts: dict, args):
    """DAA on all processes' groups with the pass-rate estimate and factor `args` asks for (lam, tau,
    adaptive_lam, lam_max, p_estimate, daa_scope, group_size). advantage, correct: (N, G). Returns (the amplified
    advantages (N, G), the daa/* metrics)."""
    p = correct.to(advantage.dtype).mean(-1, keepdim=True)  # p_hat (N, 1)
    if args.p_estimate == "running":
        counts = torch.tensor([pass_counts[pass_key(g)] for g in groups], dtype=p.dtype, device=p.device)
        p = counts[:, :1] / counts[:, 1:]  # #correct / #samples over every generation so far
    factor = adaptive_lam(p, args.group_size, args.lam_max) if args.adaptive_lam else args.lam
    advantage, amplified = daa(advantage, correct, factor, args.tau, p, args.daa_scope)
    factors = (factor * torch.ones_like(p)).expand_as(advantage)  # (N, G)
    amplified = amplified & (factors != 1)  # a factor of 1 amplifies nothing
    applied = factors[amplified]
    return advantage, {"daa/amplified_frac": amplified.float().mean().item(),
                       "daa/lam_mean": applied.mean().item() if len(applied) else 0.0,
                       "daa/lam_max": applied.max().item() if len(applied) else 0.0}


def tokens_per_bin(mask: torch.Tensor, bins: torch.Tensor, G: int) -> torch.Tensor:
    """(G+1,) the completion tokens of each bin mu among these rows; bins (B,): #correct of each row's group."""
    mask = mask if mask.is_floating_point() else mask.float()
    return mask.new_zeros(G + 1).index_add_(0, bins, mask.sum(-1))


def bin_token_weights(mask: torch.Tensor, bins: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Eq. (2)'s per-token weights (B, T): a token of bin mu weighs 1 / (#tokens of bin mu in the whole update);
    bins 0 and G weigh 0. bins: (B,) #correct of each row's group; tokens (G+1,): tokens_per_bin over the update's
    micro-batches and processes. Example: bins [1, 1, 3], lengths [2, 4, 5] -> 1/6, 1/6, 1/5."""
    G = len(tokens) - 1
    inside = ((bins > 0) & (bins < G)).to(tokens.dtype).unsqueeze(-1)  # (B, 1)
    return mask * inside / tokens.clamp(min=1)[bins].unsqueeze(-1)


def bin_weights(neg_log_w: list[torch.Tensor], weighting: str) -> torch.Tensor:
    """w_mu for mu = 0, 1/G, ..., 1, a constant (G+1,): exp(-s_mu) (learned), 1 (uniform) or sqrt(mu (1 - mu))
    (var); 0 for mu = 0 and 1."""
    G, device = len(neg_log_w) + 1, neg_log_w[0].device
    mu = torch.arange(1, G, device=device, dtype=neg_log_w[0].dtype) / G
    if weighting == "learned":
        w = torch.exp(-torch.stack(neg_log_w).detach())  # Eq. (3)
    else:
        w = torch.ones_like(mu) if weighting == "uniform" else (mu * (1 - mu)).sqrt()
    return torch.nn.functional.pad(w, (1, 1))


def weight_objective(neg_log_w: list[torch.Tensor], bin_loss: torch.Tensor, present: torch.Tensor,
                     delta: float, literal: bool) -> torch.Tensor:
    """The weights' side of Eq. (1) over the bins present in the update: sum_mu w_mu (|L_mu| + delta) + s_mu
    (s = -ln w); L_mu itself when literal (no minimum in w where L_mu <= 0)."""
    target = bin_loss if literal else bin_loss.abs() + delta
    return sum(torch.exp(-s) * target[i] + s for i, s in enumerate(neg_log_w, 1) if present[i])


def update_weights(neg_log_w: list[torch.Tensor], weight_opt, bin_loss: torch.Tensor, present, args):
    """One Adam step of s = -ln w on Eq. (1), then w clamped to [w_min, w_max]. An absent bin keeps .grad None,
    so Adam skips it."""
    if not present[1:-1].any():
        return
    weight_opt.zero_grad(set_to_none=True)
    weight_objective(neg_log_w, bin_loss, present, args.daro_delta, args.daro_literal).backward()
    weight_opt.step()
    with torch.no_grad():
        for s in neg_log_w:
            s.clamp_(-math.log(args.w_max), -math.log(args.w_min))


def policy_loss(logp, old_logp, advantages, mask, clip_low: float, clip_high: float, *, seq_ratio: bool = False,
                ref_logp=None, kl_coef: float = 0.0, is_weight=None):
    """Each token's loss (B, T): max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)); seq_ratio (GSPO): every token
    shares the length-normalised sequence ratio; is_weight (B, T): importance weights on the surrogate; kl_coef > 0:
    + kl_coef * k3(pi || pi_ref). Returns (token losses, counts of `mask`'s tokens clipped below and above)."""
    mask = mask.to(logp.dtype)
    log_ratio = logp - old_logp
    if seq_ratio:
        seq = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = seq.detach() + logp - logp.detach()
    ratio = torch.exp(log_ratio.clamp(max=20.0))
    adv = advantages.unsqueeze(-1)
    token_loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_low, 1 + clip_high))
    if is_weight is not None:
        token_loss = token_loss * is_weight
    if kl_coef > 0:
        delta = ref_logp - logp
        token_loss = token_loss + kl_coef * (torch.exp(delta) - delta - 1)
    with torch.no_grad():
        stats = {"clip_low": (((ratio < 1 - clip_low) & (adv < 0)).float() * mask).sum(),
                 "clip_high": (((ratio > 1 + clip_high) & (adv > 0)).float() * mask).sum()}
    return token_loss, stats

# -----------------------------------------------------------------------------------------------------------------
# 2. What both trainers add to GRPOTrainer


@dataclass
class _RecipeConfig(GRPOConfig):
    """The papers' recipe shape, both configs alike (TRL's defaults: 1 update per generation batch, no weight
    decay, linear decay to 0, epsilon_high = epsilon)."""
    updates_per_generation: int = field(default=2, metadata={"help": "optimizer updates per generation batch "
                                                                     "(sets steps_per_generation if not given)"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay (DAPO: 0.1)"})
    lr_scheduler_type: str = field(default="constant_with_warmup", metadata={
        "help": "learning-rate schedule (DAPO: constant after a linear warm-up of warmup_steps)"})
    epsilon_high: float | None = field(default=0.28, metadata={"help": "DAPO's clip-higher upper epsilon"})

    def __post_init__(self):
        # before GRPOConfig's checks: updates_per_generation updates per generation batch (TRL's
        # steps_per_generation = that many times gradient_accumulation_steps), unless the user set the batch's size
        if self.steps_per_generation is None and self.generation_batch_size is None:
            self.steps_per_generation = self.updates_per_generation * self.gradient_accumulation_steps
        super().__post_init__()
        # after them: the generation batch splits into whole updates
        if self.steps_per_generation % self.gradient_accumulation_steps:
            raise ValueError(f"{type(self).__name__}: steps_per_generation ({self.steps_per_generation}) must be a "
                             f"multiple of gradient_accumulation_steps ({self.gradient_accumulation_steps}): each "
                             "optimizer update takes whole micro-batches of one generation batch")
        self.updates_per_generation = self.steps_per_generation // self.gradient_accumulation_steps


class _Common:
    """Each completion's correctness from `correct_func`, gathered over processes in the order TRL gathers the
    rewards; the generation batch's updates (their token counts over all processes); the algorithm's state in
    the checkpoint folder."""

    def _check_correct_func(self, correct_func):
        if not callable(correct_func):
            raise ValueError(f"{type(self).__name__} needs correct_func=f(prompts, completions, completion_ids, "
                             "**columns) -> list[bool]: DAA and DARO count correct completions, not rewards")
        self.correct_func, self._correct = correct_func, None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        columns = {k: [x[k] for x in inputs] for k in inputs[0] if k not in ("prompt", "completion", "completion_ids")}
        correct = list(self.correct_func(prompts=prompts, completions=completions, completion_ids=completion_ids_list,
                                         **columns))
        if len(correct) != len(prompts):
            raise ValueError(f"correct_func returned {len(correct)} values for {len(prompts)} completions")
        local = torch.tensor([bool(c) for c in correct], device=self.accelerator.device)
        self._correct = self.accelerator.gather(local)  # (all completions,), the rows of rewards_per_func
        # which problem each completion answers, for p_estimate="running" (pass_key: prompt and answer)
        self._problems = gather_object([{"prompt": str(x["prompt"]), "answer": str(x.get("answer", ""))}
                                        for x in inputs])
        return rewards_per_func

    def _groups(self, G: int):
        """The generation batch's groups, all processes: (correct (N, G) bool, one dict per group: prompt,
        answer, correct)."""
        correct = self._correct.view(-1, G)
        return correct, [{**p, "correct": c.tolist()} for p, c in zip(self._problems[::G], correct)]

    def _local_rows(self, n_local: int) -> slice:
        i = self.accelerator.process_index
        return slice(i * n_local, (i + 1) * n_local)  # TRL's process slice of the gathered rows

    def _prepare_inputs(self, generation_batch):
        """TRL's: a new generation batch every steps_per_generation micro-batches, shuffled and cut into that many
        slices; here, when TRL has just cut one, the slices of each update get what the update needs."""
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training and self._buffered_inputs is not buffered:
            self._prepare_updates(self._buffered_inputs)
        return inputs

    def _update_slices(self, slices: list[dict]) -> list[list[dict]]:
        """The generation batch's slices grouped by optimizer update (gradient_accumulation_steps each)."""
        k = self.args.gradient_accumulation_steps
        return [slices[u:u + k] for u in range(0, len(slices), k)]

    @staticmethod
    def _loss_mask(inputs: dict) -> torch.Tensor:
        mask = inputs["completion_mask"]  # TRL's loss mask: the completion, minus tool output if any
        return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"  # the folder the Trainer just wrote
            torch.save(self.algo_state_dict(), os.path.join(self._get_output_dir(trial=trial), folder, ALGO_STATE))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)  # the Trainer's resume hook (TRL restores its own here)
        path = os.path.join(checkpoint, ALGO_STATE) if checkpoint else None
        if path and os.path.exists(path):
            self.load_algo_state(torch.load(path, weights_only=True, map_location="cpu"))  # saved on a GPU too

# -----------------------------------------------------------------------------------------------------------------
# 3. DA3PO


@dataclass
class DA3POConfig(_RecipeConfig):
    """GRPOConfig plus DAA's knobs (the meanings and defaults of da3po.py's flags) and the recipe's defaults."""
    lam: float = field(default=2.0, metadata={"help": "multiplier of correct completions' advantages on hard prompts"})
    tau: float = field(default=0.5, metadata={"help": "hard prompt: pass rate p < tau (strict)"})
    adaptive_lam: bool = field(default=False, metadata={"help": "lam(p) = 1/gamma(p, G), capped at lam_max"})
    lam_max: float = field(default=4.0, metadata={"help": "cap of the adaptive factor"})
    p_estimate: str = field(default="group", metadata={"help": "group (p_hat) | running (all samples so far)"})
    daa_scope: str = field(default="correct", metadata={"help": "correct (the paper) | all (a control)"})
    mask_uniform_groups: bool = field(default=True, metadata={"help": "DAPO's filter: all-right/all-wrong groups "
                                                                      "leave the loss and its token count"})

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.tau <= 1 or self.lam <= 0 or self.lam_max < 1:
            raise ValueError(f"DA3POConfig needs 0 < tau <= 1, lam > 0, lam_max >= 1; got tau={self.tau}, "
                             f"lam={self.lam}, lam_max={self.lam_max}")
        if self.p_estimate not in ("group", "running") or self.daa_scope not in ("correct", "all"):
            raise ValueError(f"DA3POConfig: p_estimate must be group or running and daa_scope correct or all; got "
                             f"{self.p_estimate!r}, {self.daa_scope!r}")

    @property
    def group_size(self) -> int:  # the name amplify reads
        return self.num_generations


class DA3POTrainer(_Common, GRPOTrainer):
    """GRPOTrainer whose advantages get DAA after TRL computed them (amplify, float64, on all processes' groups at
    once, as TRL normalises them); `last_daa` keeps the latest generation batch's (before, after, correct) (N, G).
    With loss_type "dapo" (token mean), each update's loss is over its own tokens (all processes)."""

    def __init__(self, *args, correct_func=None, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, DA3POConfig):
            raise TypeError("DA3POTrainer needs args=DA3POConfig(...)")
        self._check_correct_func(correct_func)
        self.pass_counts, self.last_daa = {}, None  # prompt key -> [#correct, #samples] (p_estimate running)

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if not self.model.training:  # evaluation reports TRL's own numbers
            return out
        G, n_local = self.num_generations, len(out["advantages"])
        before = self.accelerator.gather(out["advantages"]).view(-1, G)  # TRL's group advantages, every process
        correct, groups = self._groups(G)
        if self.args.p_estimate == "running":  # every generated group, before DAA uses the counts
            count_passes(self.pass_counts, groups)
        after, metrics = amplify(before.double(), correct, groups, self.pass_counts, self.args)
        self.last_daa = {"before": before, "after": after, "correct": correct}
        out["advantages"] = after.flatten()[self._local_rows(n_local)].to(out["advantages"].dtype)
        if self.args.mask_uniform_groups:  # DAPO's filter without the refill: uniform groups leave the token mean
            mixed = (correct.sum(-1) > 0) & (correct.sum(-1) < G)  # (N,), all processes' groups
            keep = mixed.repeat_interleave(G)[self._local_rows(n_local)].unsqueeze(-1)
            out["completion_mask"] = out["completion_mask"] * keep.to(out["completion_mask"].dtype)
            out["num_items_in_batch"] = self.accelerator.gather(out["completion_mask"].sum()).sum()
            metrics["daa/kept_groups_frac"] = mixed.float().mean().item()
        for key, value in metrics.items():
            self._metrics["train"][key].append(value)
        return out

    def _prepare_updates(self, slices: list[dict]):
        """loss_type "dapo": TRL divides each micro-batch's token-loss sum by the generation batch's tokens per
        update on average; here by its own update's tokens over all processes, so that each update is an exact
        token mean. TRL's normaliser is num_items_in_batch / processes * accumulation / steps_per_generation."""
        if self.loss_type != "dapo":
            return
        updates = self._update_slices(slices)
        local = torch.stack([sum(self._loss_mask(s).sum() for s in update) for update in updates])
        tokens = self.accelerator.reduce(local, reduction="sum")  # (updates,) token counts, all processes
        for update, n in zip(updates, tokens):
            for s in update:  # TRL's normaliser then is n / processes
                s["num_items_in_batch"] = n * self.args.updates_per_generation

    def algo_state_dict(self) -> dict:
        return {"pass_counts": self.pass_counts}

    def load_algo_state(self, state: dict):
        self.pass_counts = state["pass_counts"]

# -----------------------------------------------------------------------------------------------------------------
# 4. DARO


@dataclass
class DAROConfig(_RecipeConfig):
    """GRPOConfig plus DARO's knobs (the meanings and defaults of daro.py's flags) and the recipe's defaults.
    L_mu's denominators are bin mu's tokens in each optimizer update (all its micro-batches and processes)."""
    weighting: str = field(default="learned", metadata={"help": "w_mu: learned (DARO) | uniform | var"})
    weight_lr: float = field(default=1e-3, metadata={"help": "Adam learning rate of s_mu = -ln w_mu"})
    daro_delta: float = field(default=1e-3, metadata={"help": "the weights fit |L_mu| + delta"})
    daro_literal: bool = field(default=False, metadata={"help": "fit the weights to L_mu itself (Eq. 1 as written)"})
    w_min: float = field(default=0.1, metadata={"help": "lower clamp of every w_mu"})
    w_max: float = field(default=10.0, metadata={"help": "upper clamp of every w_mu"})

    def __post_init__(self):
        super().__post_init__()
        if self.weighting not in ("learned", "uniform", "var"):
            raise ValueError(f"DAROConfig: weighting {self.weighting!r}: choose one of learned, uniform, var")
        if not 0 < self.w_min <= 1 <= self.w_max:
            raise ValueError(f"DAROConfig needs 0 < w_min <= 1 <= w_max, got {self.w_min} and {self.w_max}")


class _StepWeights(TrainerCallback):
    """The weights' Adam step, after each optimizer step of the model (all micro-batches of the update done)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer.step_weights()


class DAROTrainer(_Common, GRPOTrainer):
    """GRPOTrainer with DARO's loss: sum_mu w_mu L_mu (theta's side of Eq. 1), each micro-batch its share; after each
    update, one Adam step of s on the weights' side (update_weights, clamped to [w_min, w_max])."""

    def __init__(self, *args, correct_func=None, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, DAROConfig):
            raise TypeError("DAROTrainer needs args=DAROConfig(...)")
        a = self.args
        unsupported = {"loss_type": a.loss_type not in ("dapo", "grpo", "bnpo", "dr_grpo"), "delta": a.delta,
                       "top_entropy_quantile": a.top_entropy_quantile < 1, "use_bias_correction_kl":
                       a.use_bias_correction_kl and a.beta, "off_policy_mask_threshold": a.off_policy_mask_threshold,
                       "entropy bonus": self._entropy_bonus_enabled}
        if any(unsupported.values()):  # DARO replaces TRL's aggregation; these change the token loss itself
            raise ValueError("DAROTrainer computes the clipped surrogate itself (policy_loss) and does not "
                             f"support {[k for k, v in unsupported.items() if v]}")
        self._check_correct_func(correct_func)
        G = self.G = self.num_generations
        if self.num_generations_eval not in (None, G):
            raise ValueError(f"DAROTrainer needs num_generations_eval = num_generations ({G}): the bins are 0..G")
        # s_mu, Eq. (3): w = 1 at start; float64 (G - 1 scalars on the CPU), so that w_mu is exact in a float64 loss
        self.neg_log_w = [torch.zeros((), dtype=torch.float64, requires_grad=True) for _ in range(1, G)]
        self.weight_opt = torch.optim.Adam(self.neg_log_w, lr=a.weight_lr)  # own optimizer: no decay, no clipping
        self.bin_loss = torch.zeros(G + 1, dtype=torch.float64)  # this process's share of each L_mu, this update
        self.bin_tokens = torch.zeros(G + 1, dtype=torch.float64)  # the current update's tokens per bin (all)
        self.add_callback(_StepWeights(self))

    def _generate_and_score_completions(self, inputs):
        """Each completion's bin (#correct of its group, all processes' groups), as a per-row tensor TRL splits."""
        out = super()._generate_and_score_completions(inputs)
        correct, _ = self._groups(self.G)
        bins = correct.sum(-1).repeat_interleave(self.G)  # (all completions,)
        out["daro_bin"] = bins[self._local_rows(len(out["completion_mask"]))]
        if not self.model.training:  # evaluation: the batch is its own update
            weight, _ = self._global_bin_weights([out])
            out["daro_weight"] = weight[0]
        return out

    def _global_bin_weights(self, slices: list[dict]):
        """Eq. (2)'s token weights of these slices' rows, the denominators over all processes' same slices. Returns
        (one (B, T) weight per slice, tokens per bin (G+1,))."""
        masks = [self._loss_mask(s).double() for s in slices]
        local = sum(tokens_per_bin(m, s["daro_bin"], self.G) for m, s in zip(masks, slices))
        tokens = self.accelerator.reduce(local, reduction="sum")  # (G+1,), all processes
        return [bin_token_weights(m, s["daro_bin"], tokens) for m, s in zip(masks, slices)], tokens

    def _prepare_updates(self, slices: list[dict]):
        """For each optimizer update of the generation batch: Eq. (2)'s weights of its rows, L_mu's denominators
        over the update's micro-batches and all processes."""
        for update in self._update_slices(slices):
            weights, tokens = self._global_bin_weights(update)
            for s, weight in zip(update, weights):
                s["daro_weight"], s["daro_tokens"] = weight, tokens

    def _compute_loss(self, model, inputs):
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        mask = self._loss_mask(inputs)
        logp, entropy, _ = self._get_per_token_logps_and_entropies(
            model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), completion_ids.size(1),
            compute_entropy=True)
        old_logp = inputs.get("old_per_token_logps")
        old_logp = logp.detach() if old_logp is None else old_logp  # TRL skips it when pi_old = pi (on-policy)
        is_weight = inputs.get("importance_sampling_ratio") if self.use_vllm else None
        token_loss, clipped = policy_loss(
            logp, old_logp, inputs["advantages"], mask, self.epsilon_low, self.epsilon_high,
            seq_ratio=self.importance_sampling_level == "sequence", ref_logp=inputs.get("ref_per_token_logps"),
            kl_coef=self.beta, is_weight=is_weight)
        loss, shares = self.daro_loss(token_loss, inputs["daro_weight"].to(token_loss.dtype), inputs["daro_bin"])
        mode = "train" if self.model.training else "eval"
        if mode == "train":  # this micro-batch's share of each L_mu, for the weights' step after the update
            self.bin_loss += shares.cpu()
            self.bin_tokens = inputs["daro_tokens"].cpu()
        n_tokens = self.accelerator.gather(mask.sum()).sum().clamp(min=1)
        self._metrics[mode]["entropy"].append((self.accelerator.gather((entropy * mask).sum()).sum() / n_tokens)
                                              .item())
        for side in ("low", "high"):
            self._metrics[mode][f"clip_ratio/{side}_mean"].append(
                (self.accelerator.gather(clipped[f"clip_{side}"]).sum() / n_tokens).item())
        # the processes' gradients are averaged (DDP), the weights' denominators are global: scale back to a sum
        return loss * self.accelerator.num_processes

    def daro_loss(self, token_loss: torch.Tensor, weight: torch.Tensor, bins: torch.Tensor):
        """These rows' share of sum_mu w_mu L_mu (theta's side of Eq. 1; w_mu a constant) and of each L_mu
        (detached, float64): token losses (B, T), their Eq. (2) weights (B, T), bins (B,)."""
        w = bin_weights(self.neg_log_w, self.args.weighting).to(token_loss.device, token_loss.dtype)
        shares = torch.zeros(self.G + 1, dtype=torch.float64, device=token_loss.device).index_add_(
            0, bins, (token_loss.detach() * weight).sum(-1).double())
        return (token_loss * weight * w[bins].unsqueeze(-1)).sum(), shares

    def step_weights(self):
        """After an update: L_mu summed over the update's micro-batches and the processes, one step of s (learned
        weighting only), the daro/* metrics (keys as daro.py's: daro/w_0.125, daro/L_0.125)."""
        bin_loss = self.accelerator.reduce(self.bin_loss.to(self.accelerator.device), "sum").cpu()
        present = self.bin_tokens > 0
        if self.args.weighting == "learned":
            update_weights(self.neg_log_w, self.weight_opt, bin_loss, present, self.args)
        w = bin_weights(self.neg_log_w, self.args.weighting)
        for i in range(1, self.G):
            self._metrics["train"][f"daro/w_{i / self.G:.3f}"].append(w[i].item())
            self._metrics["train"][f"daro/L_{i / self.G:.3f}"].append(bin_loss[i].item())
        self.last_bin_loss, self.bin_loss = bin_loss, torch.zeros(self.G + 1, dtype=torch.float64)

    def algo_state_dict(self) -> dict:  # on the CPU (load_state_dict moves Adam's moments to the weights' device)
        weight_opt = self.weight_opt.state_dict()
        moments = {i: {k: v.cpu() for k, v in s.items()} for i, s in weight_opt["state"].items()}
        return {"daro_neg_log_w": torch.stack(self.neg_log_w).detach().cpu(),
                "weight_optimizer": {**weight_opt, "state": moments}}

    def load_algo_state(self, state: dict):
        with torch.no_grad():
            for s, saved in zip(self.neg_log_w, state["daro_neg_log_w"]):
                s.copy_(saved)
        self.weight_opt.load_state_dict(state["weight_optimizer"])
