"""
DA3PO's neighbours: three other answers to how much a prompt's difficulty should weigh in the
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

The papers' functions take (N, G) tensors, one row a group, and keep their dtype; where a weight
spans every rank they return this rank's sums and the hooks reduce them.
"""
import torch

from common import Algorithm, loss_weights
from config import BASELINES
from ranks import all_reduce_max, all_reduce_sum


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


NEIGHBOURS = {"maxrl": MaxRL, "dgpo": DGPO, "asym": Asym}
# Each paper's recipe: GRPO's clip (0.2 both ways), no dynamic sampling, no overlong shaping, no KL,
# DAPO's token mean; DAA off. --updates_per_step stays the run's scale (the papers ran one).
PRESETS = {name: {**BASELINES["grpo"], "loss_agg": "token-mean", "lam": 1.0, "adaptive_lam": False}
           for name in NEIGHBOURS}
