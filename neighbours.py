"""
DA3PO's neighbours: four other answers to how much a prompt's difficulty should weigh in the
update, each from its paper, on the same step as da3po.py (`python da3po.py --algo maxrl`).
A room of its own: a default run never calls it. docs/neighbours.md has the equations and where
each was read; docs/departures.md the choices the papers leave open.

  maxrl  MaxRL, arXiv:2602.02710, Alg. 1: A_i = (r_i - mean r) / mean r, and 0 on a group with
         no correct completion (r: correctness 0/1); the gradient of the maximum-likelihood
         objective truncated at the group size, log p weighed by the inverse pass rate.
  dgpo   DGPO (MathForge), arXiv:2601.20614: DGAE, A_i = (R_i - mean R) / MAD(R), times DQW, each
         valid group's weight B_v * softmax(-p_hat / T) over the step's valid groups (all ranks);
         the token mean spans the valid groups' tokens.
  asym   Asymmetric prompt weighting, arXiv:2602.11128, its Linear-R weighting w = 1 / rho_hat:
         A_i = (r_i - rho_hat) / rho_hat, and -1 for every completion of an all-wrong group.
  hadw   HA-DW, arXiv:2601.08521, Eqs. (7)-(16): GRPO's A_i times lam_scale exp(-sgn(A_i) d), where
         d = p_hat - C is the group's pass rate less an anchor C that follows the batches' accuracy
         (all ranks) from step to step; hard groups' correct answers weigh more, easy ones' less.

The papers' functions take (N, G) tensors, one row a group, and keep their dtype; where a weight
spans every rank they return this rank's sums and the hooks reduce them.
"""
import math

import torch

from common import Algorithm, group_advantages, loss_weights
from config import BASELINES
from ranks import all_reduce_max, all_reduce_sum, die


def check_neighbour_flags(cfg):
    """The neighbours' flags that cannot work stop here, naming the flag (exit 2)."""
    if cfg.dgpo_temp <= 0:
        die(f"--dgpo_temp must be > 0, got {cfg.dgpo_temp}")
    if cfg.hadw_scale <= 0 or cfg.hadw_window < 1 or cfg.hadw_eta < 0:
        die("--hadw_scale must be > 0, --hadw_window >= 1 and --hadw_eta >= 0, got "
            f"{cfg.hadw_scale}, {cfg.hadw_window}, {cfg.hadw_eta}")
    if cfg.hadw_anchor not in ("window", "kalman"):
        die(f"--hadw_anchor {cfg.hadw_anchor!r}: choose one of window, kalman")


# --------------------------------------------------------------------------------------------------
# The papers' functions
def maxrl_advantages(correct: torch.Tensor) -> torch.Tensor:
    """MaxRL's advantages (Alg. 1): (r - r_mean) / r_mean per group, 0 where r_mean = 0. correct:
    (N, G) floats 0/1. Example: [1, 0, 0, 0] -> [3, -1, -1, -1]; [1, 1, 1, 1] -> 0."""
    mean = correct.mean(-1, keepdim=True)  # (N, 1) the pass rate K / G
    safe = torch.where(mean > 0, mean, torch.ones_like(mean))
    return torch.where(mean > 0, (correct - mean) / safe, torch.zeros_like(correct))


def linear_r_advantages(correct: torch.Tensor) -> torch.Tensor:
    """Linear-R's advantages: w (r - rho) with w = 1 / rho per group; at rho = 0 the limit, -1 for
    each (wrong) completion. correct: (N, G) floats 0/1. Example: [1, 0, 0, 0] -> [3, -1, -1, -1];
    [0, 0, 0, 0] -> [-1, -1, -1, -1]; [1, 1, 1, 1] -> 0."""
    rho = correct.mean(-1, keepdim=True)  # (N, 1)
    safe = torch.where(rho > 0, rho, torch.ones_like(rho))
    return torch.where(rho > 0, (correct - rho) / safe, -torch.ones_like(correct))


def dgae_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """DGPO's DGAE: (R - mean R) / MAD(R) per group, MAD = mean |R - mean R|, 0 on a group of equal
    rewards; each group's |A| then sums to G. rewards: (N, G). Example: [1, -1, -1, -1] ->
    [2, -2/3, -2/3, -2/3]."""
    centred = rewards - rewards.mean(-1, keepdim=True)
    mad = centred.abs().mean(-1, keepdim=True)  # (N, 1)
    safe = torch.where(mad > 0, mad, torch.ones_like(mad))
    return torch.where(mad > 0, centred / safe, torch.zeros_like(centred))


def mixed(correct: torch.Tensor) -> torch.Tensor:
    """DGPO's valid groups (N,) bool: some but not all completions correct."""
    k = correct.sum(-1)
    return (k > 0) & (k < correct.shape[-1])


def dqw_sums(correct: torch.Tensor, temperature: float) -> torch.Tensor:
    """This rank's part of DQW's softmax (2,): [#valid groups, sum of exp(-p_hat / T) over them];
    all-reduced, they are dqw_weights' `totals`. correct: (N, G) floats 0/1."""
    valid = mixed(correct)
    terms = torch.exp(-correct.mean(-1) / temperature)[valid]
    return torch.stack([valid.sum().to(correct.dtype), terms.sum()])


def dqw_weights(correct: torch.Tensor, temperature: float, totals: torch.Tensor) -> torch.Tensor:
    """DGPO's DQW (N, 1): a valid group's weight B_v * exp(-p_hat / T) / sum_valid exp(-p_hat / T),
    the sums over every rank's valid groups (`totals`, from dqw_sums); 1 for the others (their
    advantages are 0). Harder groups weigh more; the valid weights average 1."""
    p = correct.mean(-1, keepdim=True)  # (N, 1)
    count, total = totals[0], totals[1].clamp(min=torch.finfo(totals.dtype).tiny)
    weight = count * torch.exp(-p / temperature) / total
    return torch.where(mixed(correct)[:, None], weight, torch.ones_like(weight))


def hadw_weights(advantage: torch.Tensor, correct: torch.Tensor, anchor: float,
                 scale: float) -> torch.Tensor:
    """HA-DW's Phi (N, G), Eqs. (13)-(16): diff = p_hat - C (the prior anchor), D = -sgn(A)
    sgn(diff), M = |diff|, Phi = scale exp(D M). advantage, correct: (N, G). Example: C = 1/2,
    group [1, 0, 0, 0] (A = [1.5, -.5, -.5, -.5]), scale 1: Phi = e^.25 for the correct answer and
    e^-.25 for each wrong one."""
    diff = correct.mean(-1, keepdim=True) - anchor  # (N, 1) Eq. (13)
    direction = -torch.sign(advantage) * torch.sign(diff)  # (N, G) Eq. (14)
    return scale * torch.exp(direction * diff.abs())  # Eqs. (15), (16)


def next_anchor(beliefs: list[float], observations: list[float], kind: str, eta: float) -> float:
    """HA-DW's posterior belief C_t+ from the prior C_t- = beliefs[-1] (Eq. (12)) and this batch's
    accuracy y_t = observations[-1] (Eq. (7)). kind "window" (App. F, Eq. (134)): the mean of the
    observations kept (the last h). kind "kalman" (Eqs. (8)-(11)): (1 - eta_t) C_t- + eta_t y_t,
    eta_t = eta sigma_t, sigma_t the population std of the beliefs kept (the last m). With no prior
    yet, C = y_t; with one belief, sigma_t = 1 (docs/departures.md)."""
    y = observations[-1]
    if not beliefs:
        return y
    if kind == "window":
        return sum(observations) / len(observations)  # Eq. (134)
    mean = sum(beliefs) / len(beliefs)  # Eq. (9)
    sigma = math.sqrt(sum((c - mean) ** 2 for c in beliefs) / len(beliefs))  # Eq. (10)
    eta_t = min(1.0, eta * (sigma if len(beliefs) > 1 else 1.0))  # Eq. (11), eta_t in [0, 1]
    return (1 - eta_t) * beliefs[-1] + eta_t * y  # Eq. (8)


# --------------------------------------------------------------------------------------------------
# The hooks (common.Algorithm): each neighbour's advantages, its metrics over all ranks, its line
class Neighbour(Algorithm):
    """What the neighbours share: advantages() computes them and the step's metrics (every rank at
    once, reduced there); end_step() hands the metrics over (zeros on a step that kept no group);
    a stop between two updates keeps them."""
    KEYS = ()  # the metrics' names

    def __init__(self, cfg, device: torch.device, state: dict):
        super().__init__(cfg, device, state)
        self.metrics = dict.fromkeys(self.KEYS, 0.0)

    def advantages(self, batch: dict, groups: list[dict]) -> torch.Tensor:
        G = self.cfg.group_size
        rewards = batch["reward"].view(-1, G)
        correct = batch["correct"].view(-1, G).to(rewards.dtype)  # p_hat from correctness
        advantage, self.metrics = self.group_advantages(rewards, correct, batch)
        return advantage.flatten()

    def end_step(self) -> dict:
        metrics, self.metrics = self.metrics, dict.fromkeys(self.KEYS, 0.0)
        return metrics

    def step_state(self) -> dict:
        return {"neighbour_metrics": self.metrics}  # the same on every rank

    def load_step_state(self, state: dict):
        self.metrics = state.get("neighbour_metrics", dict.fromkeys(self.KEYS, 0.0))


class MaxRL(Neighbour):
    """--algo maxrl. Metric: the mean advantage of the correct completions, 1 / p_hat - 1."""
    KEYS = ("maxrl/adv_correct_mean",)

    def group_advantages(self, rewards, correct, batch):
        advantage = maxrl_advantages(correct)
        sums = all_reduce_sum(torch.stack([advantage[correct > 0].sum(), correct.sum()]).double())
        return advantage, {self.KEYS[0]: (sums[0] / sums[1].clamp(min=1)).item()}

    def line(self, record: dict) -> str:
        return f" | A+ {record['maxrl/adv_correct_mean']:.2f}"


class Asym(Neighbour):
    """--algo asym (Linear-R). Metric: the share of groups with no correct completion, which this
    weighting trains (-1 each) and the others leave out."""
    KEYS = ("asym/all_wrong_frac",)

    def group_advantages(self, rewards, correct, batch):
        wrong = (correct.sum(-1) == 0).sum().to(correct.dtype)
        sums = all_reduce_sum(torch.stack([wrong, correct.new_tensor(len(correct))]).double())
        return linear_r_advantages(correct), {self.KEYS[0]: (sums[0] / sums[1].clamp(min=1)).item()}

    def line(self, record: dict) -> str:
        return f" | all-wrong {record['asym/all_wrong_frac']:.2f}"


class DGPO(Neighbour):
    """--algo dgpo: DGAE on the rewards, DQW over the step's valid groups of all ranks, the token
    mean over the valid groups' tokens. Metrics: the largest and smallest valid weight."""
    KEYS = ("dgpo/weight_max", "dgpo/weight_min")

    def group_advantages(self, rewards, correct, batch):
        totals = all_reduce_sum(dqw_sums(correct.double(), self.cfg.dgpo_temp))
        weight = dqw_weights(correct.double(), self.cfg.dgpo_temp, totals)  # (N, 1) float64
        valid = mixed(correct)
        batch["valid"] = valid.repeat_interleave(correct.shape[-1])  # (B,) the batch contract
        w = weight[valid, 0]
        mine = torch.stack([w.max(), -w.min()]) if len(w) else correct.new_full((2,), -torch.inf)
        high, low = all_reduce_max(mine.double()).tolist()
        metrics = {"dgpo/weight_max": max(high, 0.0), "dgpo/weight_min": max(-low, 0.0)}
        return dgae_advantages(rewards) * weight.to(rewards.dtype), metrics

    def start_update(self, batch: dict, rows: torch.Tensor) -> torch.Tensor:
        """The loss over the update's tokens of valid groups (MathForge rescales its token mean to
        them): an all-correct or all-wrong group's tokens leave the denominator."""
        mask = batch["mask"][rows] * batch["valid"][rows, None]
        return loss_weights(mask, self.cfg.loss_agg, self.cfg.max_new_tokens)

    def line(self, record: dict) -> str:
        return f" | w {record['dgpo/weight_min']:.2f}-{record['dgpo/weight_max']:.2f}"


class HADW(Neighbour):
    """--algo hadw: GRPO's advantages times HA-DW's Phi. State: the anchor's history (the last
    --hadw_window batch accuracies and beliefs), the same on every rank, kept by checkpoints.
    Metrics: the prior anchor C_t- the step's weights used, and the step's accuracy y_t."""
    KEYS = ("hadw/anchor", "hadw/batch_acc")

    def __init__(self, cfg, device: torch.device, state: dict):
        super().__init__(cfg, device, state)
        self.observations = list(state.get("hadw_observations", []))  # y of recent steps
        self.beliefs = list(state.get("hadw_beliefs", []))  # C+ of recent steps

    def state_dict(self) -> dict:
        return {"hadw_observations": self.observations, "hadw_beliefs": self.beliefs}

    def group_advantages(self, rewards, correct, batch):
        # Eq. (7): y_t = K_t / B_t over the step's completions, all ranks
        counts = torch.stack([correct.sum(), correct.new_tensor(correct.numel())]).double()
        total = all_reduce_sum(counts)  # [K_t, B_t]
        y = (total[0] / total[1]).item()
        window = self.cfg.hadw_window
        self.observations = (self.observations + [y])[-window:]
        prior = self.beliefs[-1] if self.beliefs else y  # Eq. (12): C_t- = C_(t-1)+
        belief = next_anchor(self.beliefs, self.observations, self.cfg.hadw_anchor,
                             self.cfg.hadw_eta)
        self.beliefs = (self.beliefs + [belief])[-window:]
        advantage = group_advantages(rewards, self.cfg.std_norm)  # (N, G) GRPO's A_hat
        weight = hadw_weights(advantage, correct, prior, self.cfg.hadw_scale)
        return advantage * weight, {"hadw/anchor": prior, "hadw/batch_acc": y}

    def line(self, record: dict) -> str:
        return f" | C {record['hadw/anchor']:.2f}"


NEIGHBOURS = {"maxrl": MaxRL, "dgpo": DGPO, "asym": Asym, "hadw": HADW}
# Each paper's recipe: GRPO's clip (0.2 both ways), no dynamic sampling, no overlong shaping, no KL,
# DAPO's token mean; DAA off. --updates_per_step stays the run's scale (the papers ran one).
PRESETS = {name: {**BASELINES["grpo"], "loss_agg": "token-mean", "lam": 1.0, "adaptive_lam": False}
           for name in NEIGHBOURS}
# HA-DW on GRPO keeps GRPO's per-sequence mean (its Eq. (25), the authors' script)
PRESETS["hadw"]["loss_agg"] = "seq-mean-token-mean"
