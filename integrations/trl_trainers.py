"""
DA3PO and DARO in TRL: GRPOTrainer subclasses (trl==1.16.0) that call this project's functions, not copies of them.

  DA3POTrainer + DA3POConfig: TRL's group advantages, then DAA (da3po.amplify: da3po.daa with lam, tau, and
    da3po.adaptive_lam / --p_estimate running / --daa_scope as in da3po.py), in float64; TRL's loss (loss_type
    "dapo": token mean, clip-higher 0.2/0.28 by default here).
  DAROTrainer + DAROConfig: TRL's group advantages and log-probs; the loss is common.policy_loss's clipped
    surrogate aggregated per difficulty bin (daro.bin_token_weights over the whole update, daro.bin_weights), and the
    learnable weights s_mu = -ln w_mu step once per optimizer update with their own Adam (daro.update_weights),
    saved in and restored from the trainer's checkpoints (algo_state.pt).
Both need `correct_func`: a function with a reward function's signature (prompts, completions, completion_ids and
the dataset's columns as keyword lists) that returns one bool per completion. DAA's p_hat and DARO's bins count
correct answers, which a shaped reward does not tell apart reliably (a correct answer at the length cap scores 0).

What TRL lacks: DAPO's dynamic sampling (drop groups whose completions are all right or all wrong, refill with new
prompts). Here every generated group is trained; DA3POConfig.mask_uniform_groups (on by default) takes the uniform
groups out of the loss and its token count, which is DAPO's filter without the refill: a step trains on fewer
groups, as da3po.py does at its --max_gen_batches cap. The refill itself needs a custom sampler (or a larger
per_device_train_batch_size). DARO's loss weighs bins 0 and G by 0 anyway.

Use: put the repository root on PYTHONPATH (this file imports common, da3po and daro from it) and see README.md.
"""
import os
from dataclasses import dataclass, field

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer

import common
import da3po
import daro

ALGO_STATE = "algo_state.pt"  # in each checkpoint-N folder, beside TRL's own files


class _CorrectAndState:
    """What both trainers add to GRPOTrainer: each completion's correctness from `correct_func`, gathered over
    processes in the order TRL gathers the rewards; and the algorithm's state in the checkpoint folder."""

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
        # which problem each completion answers, for --p_estimate running (da3po.pass_key: prompt and answer)
        self._problems = gather_object([{"prompt": str(x["prompt"]), "answer": str(x.get("answer", ""))}
                                        for x in inputs])
        return rewards_per_func

    def _groups(self, G: int):
        """The step's groups, all processes: (correct (N, G) bool, one dict per group as da3po's functions take it:
        prompt, answer, correct)."""
        correct = self._correct.view(-1, G)
        return correct, [{**p, "correct": c.tolist()} for p, c in zip(self._problems[::G], correct)]

    def _local_rows(self, n_local: int) -> slice:
        i = self.accelerator.process_index
        return slice(i * n_local, (i + 1) * n_local)  # TRL's process slice of the gathered rows

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
# DA3PO


@dataclass
class DA3POConfig(GRPOConfig):
    """GRPOConfig plus DAA's knobs (the meanings and defaults of da3po.Config's); DAPO's clip-higher by default."""
    lam: float = field(default=2.0, metadata={"help": "multiplier of correct completions' advantages on hard prompts"})
    tau: float = field(default=0.5, metadata={"help": "hard prompt: pass rate p < tau (strict)"})
    adaptive_lam: bool = field(default=False, metadata={"help": "lam(p) = 1/gamma(p, G), capped at lam_max"})
    lam_max: float = field(default=4.0, metadata={"help": "cap of the adaptive factor"})
    p_estimate: str = field(default="group", metadata={"help": "group (p_hat) | running (all samples so far)"})
    daa_scope: str = field(default="correct", metadata={"help": "correct (the paper) | all (a control)"})
    mask_uniform_groups: bool = field(default=True, metadata={"help": "DAPO's filter: all-right/all-wrong groups "
                                                                      "leave the loss and its token count"})
    epsilon_high: float | None = field(default=0.28, metadata={"help": "DAPO's clip-higher upper epsilon"})

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.tau <= 1 or self.lam <= 0 or self.lam_max < 1:
            raise ValueError(f"DA3POConfig needs 0 < tau <= 1, lam > 0, lam_max >= 1; got tau={self.tau}, "
                             f"lam={self.lam}, lam_max={self.lam_max}")
        if self.p_estimate not in ("group", "running") or self.daa_scope not in ("correct", "all"):
            raise ValueError(f"DA3POConfig: p_estimate must be group or running and daa_scope correct or all; got "
                             f"{self.p_estimate!r}, {self.daa_scope!r}")

    @property
    def group_size(self) -> int:  # the name da3po.amplify reads
        return self.num_generations


class DA3POTrainer(_CorrectAndState, GRPOTrainer):
    """GRPOTrainer whose advantages get DAA after TRL computed them (da3po.amplify, float64, on all processes'
    groups at once, as TRL normalises them); `last_daa` keeps the latest step's (before, after, correct) (N, G)."""

    def __init__(self, *args, correct_func=None, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, DA3POConfig):
            raise TypeError("DA3POTrainer needs args=DA3POConfig(...)")
        self._check_correct_func(correct_func)
        self.pass_counts, self.last_daa = {}, None  # prompt key -> [#correct, #samples] (--p_estimate running)

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if not self.model.training:  # evaluation reports TRL's own numbers
            return out
        G, n_local = self.num_generations, len(out["advantages"])
        before = self.accelerator.gather(out["advantages"]).view(-1, G)  # TRL's group advantages, every process
        correct, groups = self._groups(G)
        if self.args.p_estimate == "running":  # every generated group, before DAA uses the counts
            da3po.count_passes(self.pass_counts, groups)
        after, metrics = da3po.amplify(before.double(), correct, groups, self.pass_counts, self.args)
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

    def algo_state_dict(self) -> dict:
        return {"pass_counts": self.pass_counts}

    def load_algo_state(self, state: dict):
        self.pass_counts = state["pass_counts"]

# -----------------------------------------------------------------------------------------------------------------
# DARO


@dataclass
class DAROConfig(GRPOConfig):
    """GRPOConfig plus DARO's knobs (the meanings and defaults of daro.Config's); DAPO's clip-higher by default.
    One optimizer update per generation batch (steps_per_generation = gradient_accumulation_steps, TRL's default):
    L_mu's denominators are the bin's tokens in the whole update."""
    weighting: str = field(default="learned", metadata={"help": "w_mu: learned (DARO) | uniform | var"})
    weight_lr: float = field(default=1e-3, metadata={"help": "Adam learning rate of s_mu = -ln w_mu"})
    daro_delta: float = field(default=1e-3, metadata={"help": "the weights fit |L_mu| + delta"})
    daro_literal: bool = field(default=False, metadata={"help": "fit the weights to L_mu itself (Eq. 1 as written)"})
    w_min: float = field(default=0.1, metadata={"help": "lower clamp of every w_mu"})
    w_max: float = field(default=10.0, metadata={"help": "upper clamp of every w_mu"})
    epsilon_high: float | None = field(default=0.28, metadata={"help": "DAPO's clip-higher upper epsilon"})

    def __post_init__(self):
        super().__post_init__()
        if self.weighting not in ("learned", "uniform", "var"):
            raise ValueError(f"DAROConfig: weighting {self.weighting!r}: choose one of learned, uniform, var")
        if not 0 < self.w_min <= 1 <= self.w_max:
            raise ValueError(f"DAROConfig needs 0 < w_min <= 1 <= w_max, got {self.w_min} and {self.w_max}")
        if self.steps_per_generation != self.gradient_accumulation_steps:
            raise ValueError(f"DAROConfig needs steps_per_generation ({self.steps_per_generation}) = "
                             f"gradient_accumulation_steps ({self.gradient_accumulation_steps}): one update per "
                             "generation batch, whose per-bin token counts are L_mu's denominators")


class _StepWeights(TrainerCallback):
    """The weights' Adam step, after each optimizer step of the model (all micro-batches of the update done)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer.step_weights()


class DAROTrainer(_CorrectAndState, GRPOTrainer):
    """GRPOTrainer with DARO's loss: sum_mu w_mu L_mu (theta's side of Eq. 1), each micro-batch its share; after each
    update, one Adam step of s on the weights' side (daro.update_weights, clamped to [w_min, w_max])."""

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
            raise ValueError("DAROTrainer computes the clipped surrogate with common.policy_loss and does not "
                             f"support {[k for k, v in unsupported.items() if v]}")
        self._check_correct_func(correct_func)
        G = self.G = self.num_generations
        # s_mu, Eq. (3): w = 1 at start; float64 (seven scalars on the CPU), so that w_mu is exact in a float64 loss
        self.neg_log_w = [torch.zeros((), dtype=torch.float64, requires_grad=True) for _ in range(1, G)]
        self.weight_opt = torch.optim.Adam(self.neg_log_w, lr=a.weight_lr)  # own optimizer: no decay, no clipping
        if self.num_generations_eval not in (None, G):
            raise ValueError(f"DAROTrainer needs num_generations_eval = num_generations ({G}): the bins are 0..G")
        self.bin_loss, self.bin_tokens = torch.zeros(G + 1, dtype=torch.float64), torch.zeros(G + 1)
        self.add_callback(_StepWeights(self))

    def _generate_and_score_completions(self, inputs):
        """Each completion's bin (#correct of its group) and its Eq. (2) token weights over the whole generation
        batch, all processes (daro.bin_token_weights on the gathered masks), as per-row tensors TRL splits."""
        out = super()._generate_and_score_completions(inputs)
        G, mask = self.G, out["completion_mask"]
        correct, _ = self._groups(G)
        bins = correct.sum(-1).repeat_interleave(G)  # (all completions,)
        width = self.accelerator.gather(torch.tensor([mask.shape[1]], device=mask.device)).max().item()
        padded = torch.nn.functional.pad(mask, (0, width - mask.shape[1]))  # processes' completions differ in width
        weight, tokens = daro.bin_token_weights(self.accelerator.gather(padded).double(), bins, G)
        rows = self._local_rows(len(mask))
        out["daro_bin"], out["daro_weight"] = bins[rows], weight[rows, :mask.shape[1]]
        if self.model.training:
            self.bin_tokens = tokens.cpu()  # which bins the update has (the weights' step skips absent ones)
        return out

    def _compute_loss(self, model, inputs):
        prompt_ids, completion_ids, mask = inputs["prompt_ids"], inputs["completion_ids"], inputs["completion_mask"]
        logp, entropy, _ = self._get_per_token_logps_and_entropies(
            model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([inputs["prompt_mask"], mask], 1),
            completion_ids.size(1), compute_entropy=True)
        old_logp = inputs.get("old_per_token_logps")
        old_logp = logp.detach() if old_logp is None else old_logp  # TRL skips it when pi_old = pi (on-policy)
        is_weight = inputs.get("importance_sampling_ratio") if self.use_vllm else None
        token_loss, clipped = common.policy_loss(
            logp, old_logp, inputs["advantages"], mask, self.epsilon_low, self.epsilon_high,
            seq_ratio=self.importance_sampling_level == "sequence", ref_logp=inputs.get("ref_per_token_logps"),
            kl_coef=self.beta, is_weight=is_weight)
        loss, shares = self.daro_loss(token_loss, inputs["daro_weight"].to(token_loss.dtype), inputs["daro_bin"])
        mode = "train" if self.model.training else "eval"
        if mode == "train":  # this micro-batch's share of each L_mu, for the weights' step
            self.bin_loss += shares.cpu()
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
        w = daro.bin_weights(self.neg_log_w, self.args.weighting).to(token_loss.device, token_loss.dtype)
        shares = torch.zeros(self.G + 1, dtype=torch.float64, device=token_loss.device).index_add_(
            0, bins, (token_loss.detach() * weight).sum(-1).double())
        return (token_loss * weight * w[bins].unsqueeze(-1)).sum(), shares

    def step_weights(self):
        """After an update: L_mu summed over the update's micro-batches and the processes, one step of s (learned
        weighting only), the daro/* metrics (keys as daro.py's: daro/w_0.125, daro/L_0.125)."""
        bin_loss = self.accelerator.reduce(self.bin_loss.to(self.accelerator.device), "sum").cpu()
        present = self.bin_tokens > 0
        if self.args.weighting == "learned":
            daro.update_weights(self.neg_log_w, self.weight_opt, bin_loss, present, self.args)
        w = daro.bin_weights(self.neg_log_w, self.args.weighting)
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
