"""
DA3PO and DARO for verl (verl==0.9.1) in one file. Copy it into your project (or import it by path): it imports the
standard library, numpy, torch and verl, nothing else, so it works beside any `common.py` or `dataset.py` of yours.
Run verl with VERL_USE_EXTERNAL_MODULES=verl_da3po_daro (verl imports the listed modules wherever it is imported:
the trainer's process and every worker) and this file's folder on PYTHONPATH; integrations/verl_dapo_da3po.sh and
integrations/verl_daro.sh are the papers' recipes as verl commands.

Importing it registers, with verl's own registries:
  "da3po"  advantage estimator: GRPO's group advantages, then DAA (lam * A for the correct completions with A > 0
           of groups whose pass rate p_hat < tau; lam 2, tau 0.5). verl hands an estimator the scores, not the
           verifier's verdicts: a completion is correct when its score is above correct_above = -0.5, right for
           DAPO's +1/-1 with or without the overlong penalty (correct in [0, 1], wrong in [-2, -1]: a correct answer
           at the length cap scores 0 and counts as correct). For 0/1 scores register_da3po(correct_above=0.5); a
           batch of 0s and 1s that the threshold puts all on one side warns, once per process.
  "daro"   advantage estimator (GRPO's advantages; each row's bin, #correct of its group, in `returns`, which only
           a critic reads) and policy loss: sum_mu w_mu L_mu, L_mu = bin mu's clipped token losses over bin mu's
           tokens in the optimizer update (all micro-batches and data-parallel ranks), times the ranks as verl's
           own aggregation does. The weights s_mu = -ln w_mu live in each actor worker with their own Adam, step
           after each optimizer update (fit to |L_mu| + delta, clamped to [w_min, w_max]), are logged as
           actor/daro/w_0.125 ..., and are saved with verl's actor checkpoint (daro_weights.pt) and loaded on resume.
Both estimators set verl's padding aside: a uid none of whose rows has a response token gets advantage 0 (bin 0).
DARO needs what verl's policy-loss interface does not carry (the bins, per-bin token counts of the whole update, a
step after the optimizer's, state in the checkpoint): the one patch is verl's own subclassing hook,
ActorRolloutRefWorker.actor_worker_cls = DAROTrainingWorker, set on import. That worker behaves as verl's
TrainingWorker unless the actor's policy_loss.loss_mode names a DARO registration.

The formulas in section 1 are copies of the project's (common.py, da3po.py, daro.py); the project's tests hold them
equal, and equal to the golden vectors (tests/data/golden.json).
"""
import math
import os
import warnings
from functools import partial

import numpy as np
import torch
from verl.trainer.ppo import core_algos
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_name
from verl.workers import engine_workers

DARO_STATE = "daro_weights.pt"  # in the actor's checkpoint folder, beside verl's own files

# -----------------------------------------------------------------------------------------------------------------
# 1. The formulas (copies of common.py's, da3po.py's and daro.py's; shapes: N groups of G, B rows of T tokens)


def group_advantages(rewards: torch.Tensor, std_norm: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's advantages from each group's rewards (N, G): (r - mean) / (std + eps), the unbiased std as in
    verl; Dr. GRPO: std_norm=False. Example: [1, -1, -1, 1] -> [0.866, -0.866, -0.866, 0.866]."""
    centered = rewards - rewards.mean(-1, keepdim=True)
    return centered / (rewards.std(-1, keepdim=True) + eps) if std_norm else centered


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


def tokens_per_bin(mask: torch.Tensor, bins: torch.Tensor, G: int) -> torch.Tensor:
    """(G+1,) the completion tokens of each bin mu among these rows; bins (B,): #correct of each row's group."""
    mask = mask if mask.is_floating_point() else mask.float()
    return mask.new_zeros(G + 1).index_add_(0, bins, mask.sum(-1))


def bin_token_weights(mask: torch.Tensor, bins: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Eq. (2)'s per-token weights (B, T): a token of bin mu weighs 1 / (#tokens of bin mu in the whole update);
    bins 0 and G weigh 0. bins: (B,) #correct of each row's group; tokens (G+1,): tokens_per_bin over the update's
    micro-batches and ranks. Example: bins [1, 1, 3], lengths [2, 4, 5] -> 1/6, 1/6, 1/5."""
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


def update_weights(neg_log_w: list[torch.Tensor], weight_opt, bin_loss: torch.Tensor, present, settings):
    """One Adam step of s = -ln w on Eq. (1), then w clamped to [w_min, w_max]. An absent bin keeps .grad None,
    so Adam skips it. settings: daro_delta, daro_literal, w_min, w_max."""
    if not present[1:-1].any():
        return
    weight_opt.zero_grad(set_to_none=True)
    weight_objective(neg_log_w, bin_loss, present, settings.daro_delta, settings.daro_literal).backward()
    weight_opt.step()
    with torch.no_grad():
        for s in neg_log_w:
            s.clamp_(-math.log(settings.w_max), -math.log(settings.w_min))


def policy_loss(logp, old_logp, advantages, mask, clip_low: float, clip_high: float, *, clip_ratio_c: float = 0.0,
                is_weight=None):
    """Each token's loss (B, T): max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)); clip_ratio_c > 1 (dual clip):
    for A < 0 capped at -A * clip_ratio_c; is_weight (B, T): importance weights on the surrogate. advantages: (B,)
    or, as verl gives them, (B, T). Returns (token losses, counts of `mask`'s tokens clipped below and above)."""
    mask = mask.to(logp.dtype)
    ratio = torch.exp((logp - old_logp).clamp(max=20.0))
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    token_loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_low, 1 + clip_high))
    if clip_ratio_c > 1:
        token_loss = torch.where(adv < 0, torch.minimum(token_loss, -adv * clip_ratio_c), token_loss)
    if is_weight is not None:
        token_loss = token_loss * is_weight
    with torch.no_grad():
        stats = {"clip_low": (((ratio < 1 - clip_low) & (adv < 0)).float() * mask).sum(),
                 "clip_high": (((ratio > 1 + clip_high) & (adv > 0)).float() * mask).sum()}
    return token_loss, stats

# -----------------------------------------------------------------------------------------------------------------
# 2. The estimators: rows of any order, grouped by uid


def _groups(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index):
    """Each row's score and the rows of each group, verl's padding set aside. verl 0.9.1 pads a batch to a multiple
    of lcm(data-parallel size, mini-batch x n) with rows that share one uid (pad<hex>) and have no response token;
    a uid none of whose rows has a response token is such padding and joins no group (its rows carry no loss).
    Every other uid must hold G >= 2 rows. Returns (scores (bs,), order (N, G): row indices by group)."""
    scores = token_level_rewards.sum(-1)  # (bs,): verl puts a row's score on its last response token
    _, group, sizes = np.unique(np.asarray(index), return_inverse=True, return_counts=True)
    answered = (response_mask.sum(-1) > 0).cpu().numpy()  # (bs,)
    rows = np.flatnonzero(np.bincount(group, weights=answered)[group] > 0)  # the rows of groups with a response
    real_sizes = sorted(set(sizes[group[rows]].tolist()))
    if len(real_sizes) != 1 or real_sizes[0] < 2:
        raise ValueError(f"DA3PO and DARO need every uid to have the same number G >= 2 of completions (a uid "
                         f"whose rows have no response token, verl's padding, aside); got group sizes {real_sizes}. "
                         f"An agent loop that returns several outputs per session puts each under the prompt's uid")
    order = rows[np.argsort(group[rows], kind="stable")]  # the rows by group, each group's in batch order
    return scores, torch.as_tensor(order, device=scores.device).view(-1, real_sizes[0])


def _per_row(values: torch.Tensor, order: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The groups' (N, G) values back on verl's rows, on every response token: (bs, T); 0 on padding rows."""
    per_row = values.new_zeros(len(response_mask))
    return per_row.index_put_((order.flatten(),), values.flatten()).unsqueeze(-1) * response_mask


_warned_one_sided = False  # the warning below: once per process


def _warn_if_one_sided(rewards: torch.Tensor, correct: torch.Tensor, correct_above: float, register: str,
                       effect: str):
    """Warn once per process when every score is 0 or 1, both occur, and correct_above puts them all on one side:
    a 0/1 scorer (verl's default reward manager on gsm8k) under the default -0.5, where every answer is correct."""
    global _warned_one_sided
    zero_one = bool(((rewards == 0) | (rewards == 1)).all() and (rewards == 0).any() and (rewards == 1).any())
    one_side = bool(correct.all() or not correct.any())
    if _warned_one_sided or not (zero_one and one_side):
        return
    _warned_one_sided = True
    side = "correct" if correct.all() else "wrong"
    warnings.warn(f"every score is 0 or 1 and correct_above={correct_above} counts all of them {side}, so {effect}. "
                  f"For a 0/1 scorer set correct_above=0.5: {register}(correct_above=0.5) at the end of "
                  f"verl_da3po_daro.py, or {register}(your_name, correct_above=0.5) and your_name in verl's config "
                  f"(warned once per process)", stacklevel=2)


def daa_advantages(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index, lam: float = 2.0,
                   tau: float = 0.5, adaptive: bool = False, lam_max: float = 4.0, scope: str = "correct",
                   correct_above: float = -0.5, epsilon: float = 1e-6, config=None, **kwargs):
    """verl's estimator interface: (bs, T) token rewards and mask, `index` (bs,) the group (uid) of each row, in any
    order. GRPO's advantages per group (unbiased std, as verl's grpo; Dr. GRPO when config.norm_adv_by_std_in_grpo
    is false), then DAA. Returns (advantages, returns), both (bs, T)."""
    scores, order = _groups(token_level_rewards, response_mask, index)
    rewards = scores[order]  # (N, G)
    correct = rewards > correct_above
    _warn_if_one_sided(rewards, correct, correct_above, "register_da3po",
                       "DAA amplifies nothing: DA3PO is plain GRPO")
    std_norm = True if config is None else config.get("norm_adv_by_std_in_grpo", True)
    advantages = group_advantages(rewards, std_norm, epsilon)
    p = correct.to(rewards.dtype).mean(-1, keepdim=True)  # p_hat
    factor = adaptive_lam(p, rewards.shape[1], lam_max) if adaptive else lam
    advantages, _ = daa(advantages, correct, factor, tau, p, scope)
    advantages = _per_row(advantages, order, response_mask)
    return advantages, advantages


def daro_advantages(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index, correct_above: float = -0.5,
                    epsilon: float = 1e-6, config=None, **kwargs):
    """GRPO's advantages (as daa_advantages, without DAA) and, in place of returns, each row's bin: the number of
    correct completions of its group (0..G) on every response token, for the DARO policy loss."""
    scores, order = _groups(token_level_rewards, response_mask, index)
    rewards = scores[order]
    correct = rewards > correct_above
    _warn_if_one_sided(rewards, correct, correct_above, "register_daro",
                       "every row is in bin 0 or G, of weight 0: DARO's loss is 0 and the model does not train")
    std_norm = True if config is None else config.get("norm_adv_by_std_in_grpo", True)
    advantages = _per_row(group_advantages(rewards, std_norm, epsilon), order, response_mask)
    bins = correct.sum(-1, keepdim=True).expand_as(rewards).to(rewards.dtype)  # (N, G)
    return advantages, _per_row(bins, order, response_mask)


def _register_estimator(name: str, fn, knobs: dict):
    """verl's register_adv_est; the same name again with the same knobs does nothing, other knobs: an error."""
    known = core_algos.ADV_ESTIMATOR_REGISTRY.get(name)
    if known is not None and getattr(known, "knobs", None) == knobs:
        return known

    def estimator(token_level_rewards, response_mask, index, config=None, **kwargs):
        return fn(token_level_rewards, response_mask, index, config=config, **knobs)
    estimator.knobs = knobs
    return core_algos.register_adv_est(name)(estimator)  # verl raises if `name` holds another estimator


def register_da3po(name: str = "da3po", lam: float = 2.0, tau: float = 0.5, adaptive_lam: bool = False,
                   lam_max: float = 4.0, daa_scope: str = "correct", correct_above: float = -0.5):
    """Register DAA with these settings as verl's advantage estimator `name` (algorithm.adv_estimator=name)."""
    if not 0 < tau <= 1 or lam <= 0 or lam_max < 1 or daa_scope not in ("correct", "all"):
        raise ValueError(f"register_da3po needs 0 < tau <= 1, lam > 0, lam_max >= 1, daa_scope correct or all; got "
                         f"tau={tau}, lam={lam}, lam_max={lam_max}, daa_scope={daa_scope!r}")
    return _register_estimator(name, daa_advantages, {"lam": lam, "tau": tau, "adaptive": adaptive_lam,
                                                      "lam_max": lam_max, "scope": daa_scope,
                                                      "correct_above": correct_above})

# -----------------------------------------------------------------------------------------------------------------
# 3. DARO: the policy loss, the weights' state in each actor worker


class DAROSettings:
    """One DARO registration's knobs (the meanings and defaults of daro.py's flags)."""

    def __init__(self, weighting="learned", weight_lr=1e-3, daro_delta=1e-3, daro_literal=False, w_min=0.1,
                 w_max=10.0):
        if weighting not in ("learned", "uniform", "var") or not weight_lr > 0 or daro_delta < 0:
            raise ValueError(f"register_daro needs weighting learned, uniform or var, weight_lr > 0, delta >= 0; "
                             f"got {weighting!r}, {weight_lr}, {daro_delta}")
        if not 0 < w_min <= 1 <= w_max:
            raise ValueError(f"register_daro needs 0 < w_min <= 1 <= w_max, got {w_min} and {w_max}")
        self.weighting = weighting
        self.weight_lr = weight_lr
        self.daro_delta = daro_delta
        self.daro_literal = daro_literal
        self.w_min = w_min
        self.w_max = w_max

    def __eq__(self, other):
        return vars(self) == vars(other)


DARO_SETTINGS: dict[str, DAROSettings] = {}  # policy_loss.loss_mode -> its settings


class DAROWeights:
    """One actor worker's weights: s_mu = -ln w_mu (mu = 1/G .. (G-1)/G, 0 at start, float64 on the CPU, one
    tensor per bin so that Adam skips an absent one) with their own Adam, out of the model's weight decay and
    gradient clipping; the current update's tokens per bin, w_mu and this rank's share of each L_mu."""

    def __init__(self, G: int, settings: DAROSettings):
        self.G, self.settings = G, settings
        self.neg_log_w = [torch.zeros((), dtype=torch.float64, requires_grad=True) for _ in range(1, G)]
        self.opt = torch.optim.Adam(self.neg_log_w, lr=settings.weight_lr)
        self.update = None  # the current update's {"tokens", "w", "shares"} (set by begin)

    def begin(self, tokens: torch.Tensor):
        """Before an update's micro-batches: its tokens per bin over all ranks (G+1,)."""
        self.update = {"tokens": tokens, "w": bin_weights(self.neg_log_w, self.settings.weighting),
                       "shares": torch.zeros(self.G + 1, dtype=torch.float64)}

    def end(self, bin_loss: torch.Tensor) -> dict:
        """After the update's optimizer step: L_mu (all ranks), one step of s, the daro/* metrics."""
        if self.settings.weighting == "learned":
            update_weights(self.neg_log_w, self.opt, bin_loss, self.update["tokens"] > 0, self.settings)
        w = bin_weights(self.neg_log_w, self.settings.weighting)
        self.update = None
        return {**{f"daro/w_{i / self.G:.3f}": w[i].item() for i in range(1, self.G)},
                **{f"daro/L_{i / self.G:.3f}": bin_loss[i].item() for i in range(1, self.G)}}

    def state_dict(self) -> dict:  # on the CPU, where the weights live
        opt = self.opt.state_dict()
        moments = {i: {k: v.cpu() for k, v in s.items()} for i, s in opt["state"].items()}
        return {"daro_neg_log_w": torch.stack(self.neg_log_w).detach().cpu(),
                "weight_optimizer": {**opt, "state": moments}}

    def load_state_dict(self, state: dict):
        with torch.no_grad():
            for s, saved in zip(self.neg_log_w, state["daro_neg_log_w"]):
                s.copy_(saved)
        self.opt.load_state_dict(state["weight_optimizer"])


def _bins_and_mask(data):
    """A (micro- or mini-) batch's bins (B,) from DARO's estimator (in `returns`) and its response mask (B, T),
    padded as verl's ppo_loss pads them, on the CPU."""
    rows = data.select("returns", "response_mask").to_padded_tensor()
    mask = rows["response_mask"].to("cpu", torch.float64)
    return (rows["returns"].to("cpu", torch.float64) * mask).amax(-1).round().long(), mask


def _daro_micro_batch(inner, weights: DAROWeights, config, model_output, data, dp_group=None):
    """The actor's loss function on one micro-batch: its rows' Eq. (2) weights (from the update's tokens per bin)
    for the DARO policy loss, passed through the config's per-micro-batch dict (global_batch_info), then verl's
    ppo_loss, which calls the registered loss."""
    bins, mask = _bins_and_mask(data)
    eq2 = bin_token_weights(mask, bins, weights.update["tokens"])
    config.global_batch_info["daro"] = {"bins": bins, "eq2": eq2, "w": weights.update["w"],
                                        "shares": weights.update["shares"]}
    return inner(model_output=model_output, data=data, dp_group=dp_group)


def daro_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                     rollout_is_weights=None):
    """verl's policy-loss interface: this micro-batch's share of sum_mu w_mu L_mu (theta's side of Eq. 1, w_mu a
    constant) times the data-parallel ranks (verl's gradients are averaged over them, the denominators are
    global); its share of each L_mu goes to the worker's sums for the weights' step. loss_agg_mode is DARO's own:
    a token mean within each bin."""
    daro = config.global_batch_info.get("daro")
    if daro is None:
        raise RuntimeError("policy_loss.loss_mode names a DARO loss but the actor worker is not DARO's: import "
                           "verl_da3po_daro through VERL_USE_EXTERNAL_MODULES, so that every worker does")
    clip = config.clip_ratio
    low = clip if config.clip_ratio_low is None else config.clip_ratio_low
    high = clip if config.clip_ratio_high is None else config.clip_ratio_high
    token_loss, clipped = policy_loss(log_prob, old_log_prob, advantages, response_mask, low, high,
                                      clip_ratio_c=config.get("clip_ratio_c", 3.0), is_weight=rollout_is_weights)
    eq2 = daro["eq2"].to(token_loss.device, token_loss.dtype)
    bins = daro["bins"].to(token_loss.device)
    daro["shares"] += torch.zeros_like(daro["shares"]).index_add_(
        0, daro["bins"], (token_loss.detach() * eq2).sum(-1).double().cpu())
    w = daro["w"].to(token_loss.device, token_loss.dtype)
    loss = (token_loss * eq2 * w[bins].unsqueeze(-1)).sum() * config.global_batch_info.get("dp_size", 1)
    tokens = response_mask.sum().clamp(min=1)
    return loss, {"actor/pg_clipfrac": ((clipped["clip_low"] + clipped["clip_high"]) / tokens).item(),
                  "actor/ppo_kl": ((old_log_prob - log_prob) * response_mask).sum().item() / tokens.item()}


class DAROTrainingWorker(engine_workers.TrainingWorker):
    """verl's TrainingWorker (the actor's engine: forward, backward, optimizer step per mini-batch) plus, when the
    actor's loss mode is a DARO registration, the weights: each mini-batch (one optimizer update) first counts its
    tokens per bin over the data-parallel ranks, then trains, then steps the weights on L_mu summed over the
    ranks; the weights go into the actor's checkpoint folder and come back with it."""

    daro = None

    def set_loss_fn(self, loss_fn):
        config = getattr(loss_fn, "keywords", {}).get("config")  # ppo_loss with the actor's config (init_model)
        settings = DARO_SETTINGS.get(config.policy_loss.get("loss_mode")) if config is not None else None
        if settings is not None:
            self.daro = DAROWeights(config.rollout_n, settings)
            loss_fn = partial(_daro_micro_batch, loss_fn, self.daro, config)
        super().set_loss_fn(loss_fn)

    def _all_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """A float64 sum over the data-parallel ranks, on the device their collectives use, back on the CPU."""
        values = values.to(get_device_name())
        torch.distributed.all_reduce(values, group=self.engine.get_data_parallel_group())
        return values.cpu()

    def train_batch(self, data):
        if self.daro is None:
            return super().train_batch(data)
        bins, mask = _bins_and_mask(data)  # this rank's rows of the update
        self.daro.begin(self._all_ranks(tokens_per_bin(mask, bins, self.daro.G)))
        output = super().train_batch(data)
        metrics = self.daro.end(self._all_ranks(self.daro.update["shares"]))
        if output is not None:
            tu.get(output, "metrics").update(metrics)
        return output

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        out = super().save_checkpoint(local_path, hdfs_path, global_step, max_ckpt_to_keep)
        if self.daro is not None and torch.distributed.get_rank() == 0:  # the same on every rank
            torch.save(self.daro.state_dict(), os.path.join(local_path, DARO_STATE))
        return out

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        path = os.path.join(local_path, DARO_STATE) if local_path else ""
        state = None
        if self.daro is not None and os.path.exists(path):
            state = torch.load(path, weights_only=True, map_location="cpu")  # written on any device
        out = super().load_checkpoint(local_path, hdfs_path, del_local_after_load)
        if state is not None:
            self.daro.load_state_dict(state)
        return out


def register_daro(name: str = "daro", weighting: str = "learned", weight_lr: float = 1e-3, delta: float = 1e-3,
                  literal: bool = False, w_min: float = 0.1, w_max: float = 10.0, correct_above: float = -0.5):
    """Register DARO as verl's advantage estimator and policy loss `name` (algorithm.adv_estimator=name,
    actor_rollout_ref.actor.policy_loss.loss_mode=name) with these settings, and DARO's actor worker."""
    settings = DAROSettings(weighting, weight_lr, delta, literal, w_min, w_max)
    if DARO_SETTINGS.get(name, settings) != settings:
        raise ValueError(f"DARO {name!r} has already been registered with other settings")
    _register_estimator(name, daro_advantages, {"correct_above": correct_above})
    if name not in DARO_SETTINGS:
        core_algos.register_policy_loss(name)(daro_policy_loss)
    DARO_SETTINGS[name] = settings
    engine_workers.ActorRolloutRefWorker.actor_worker_cls = DAROTrainingWorker  # verl's hook for its actor class


register_da3po()  # "da3po": the paper's settings, DAPO's scores
register_daro()  # "daro": the paper's settings
