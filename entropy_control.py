"""
A room of its own, off by default: the entropy controls. An entropy bonus, and Clip-Cov and KL-Cov
from "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models" (Cui et al.,
arXiv:2505.22617), over the WHOLE update's tokens (every micro-batch, every rank), where verl picks
tokens in each micro-batch. docs/entropy.md has the equations, each default with its source, and
how verl differs; docs/departures.md has our choices.

The step reaches it through two calls: main() calls entropy_update.start_update at the start of
each update (the selection, agreed by all-reduces, stored as batch["control"]), and
common.token_losses calls apply on each micro-batch (the tokens' losses under the control).
For each token t of an update (all its micro-batches and ranks), with A_t its completion's
advantage and log pi_t its log-prob under the weights the update starts from:
  Cov_t = (log pi_t - mean log pi) * (A_t - mean A)      means over the update's N tokens
  Clip-Cov  draw max(1, floor(r N)) tokens uniformly among those with lb < Cov_t < ub that PPO's
            clip does not already cut off; their loss and gradient are zero (verl: the same)
  KL-Cov    the max(1, floor(k N)) tokens of largest Cov_t (ties at the threshold all in); every
            token's surrogate is the unclipped -A_t r_t (as the paper's equation and verl), and
            the selected ones add beta |log r_t| (the authors' code and verl; --kl_cov_penalty k3:
            beta (r_t - 1 - log r_t), an estimate of KL(pi_old || pi) with a zero gradient at r = 1)
  bonus     loss_t - entropy_coef * H_t, H_t the entropy of the token's next-token distribution
"""
import torch
import torch.distributed as dist

from ranks import all_gather_list, all_reduce_sum, die, is_dist


# --------------------------------------------------------------------------------------------------
# The papers' functions: pure functions of (B, T) tensors; the sums over ranks are all-reduces, so
# every rank calls them at the same point with its own share of the update's rows.
def token_covariance(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor):
    """Cov_t (B, T) in float64 (0 off the mask) and N, the update's tokens over all ranks.
    logp, adv, mask: (B, T), adv the completion's advantage on each of its tokens.
    Example: logp [-1, -3], adv [1, -1] -> means -2, 0 -> Cov [1, 1], N 2."""
    m = mask.to(torch.float64)
    logp = logp.to(torch.float64)
    adv = adv.to(torch.float64)
    sums = all_reduce_sum(torch.stack([(logp * m).sum(), (adv * m).sum(), m.sum()]))
    n = sums[2].clamp(min=1)
    return (logp - sums[0] / n) * (adv - sums[1] / n) * m, int(sums[2].item())


def top_covariance(cov: torch.Tensor, mask: torch.Tensor, share: float, n: int) -> torch.Tensor:
    """KL-Cov's tokens (B, T) bool: the max(1, floor(share * n)) largest Cov_t of the update over
    all ranks; every token tied with the last one is in too (identical completions of a group have
    identical Cov_t, and get the same treatment whatever rank or micro-batch holds them)."""
    mask = mask.bool()
    wanted = max(1, int(share * n))
    mine = cov[mask]
    candidates = all_gather_list(mine.topk(min(wanted, len(mine))).values.tolist())
    if not candidates:
        return torch.zeros_like(mask)
    threshold = sorted(candidates, reverse=True)[min(wanted, len(candidates)) - 1]
    return mask & (cov >= threshold)


def clip_cov_candidates(cov, mask, logp, old_logp, adv, lb: float, ub: float, clip_low: float,
                        clip_high: float) -> torch.Tensor:
    """Clip-Cov's candidates (B, T) bool: lb < Cov_t < ub, on the mask, and not already cut off by
    PPO's clip at this policy (their gradient is zero anyway; the authors' code and verl skip them).
    """
    ratio = torch.exp(logp - old_logp)
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high) > -adv * ratio
    return mask.bool() & (cov > lb) & (cov < ub) & ~clipped


def random_share(candidates: torch.Tensor, share: float, n: int,
                 generator: torch.Generator) -> torch.Tensor:
    """Clip-Cov's draw (B, T) bool: max(1, floor(share * n)) of the update's candidates over all
    ranks (all of them if fewer), uniformly without replacement. The candidates are numbered rank by
    rank, row-major, and every rank draws the same permutation from a generator seeded alike: the
    same draw whatever the micro-batch split."""
    flat = candidates.flatten().nonzero()[:, 0]  # this rank's candidates, row-major
    counts = all_gather_list([len(flat)])  # per rank, in rank order
    rank = dist.get_rank() if is_dist() else 0
    offset = sum(counts[:rank])
    wanted = min(max(1, int(share * n)), sum(counts))
    chosen = torch.randperm(sum(counts), generator=generator)[:wanted]
    mine = chosen[(chosen >= offset) & (chosen < offset + len(flat))] - offset
    selected = torch.zeros(candidates.numel(), dtype=torch.bool, device=candidates.device)
    selected[flat[mine.to(flat.device)]] = True
    return selected.view_as(candidates)


def kl_cov_penalty(logp: torch.Tensor, old_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """KL-Cov's per-token penalty (B, T): abs |log r| (the authors' code, verl) or k3 r - 1 - log r
    (Schulman's estimator of KL(pi_old || pi) on pi_old's samples), r = pi / pi_old."""
    log_ratio = logp - old_logp
    if kind == "abs":
        return log_ratio.abs()
    return torch.exp(log_ratio) - 1 - log_ratio


def surrogates(logp, old_logp, advantages, cfg, is_weight=None):
    """common.policy_loss's clipped surrogate per token (B, T) (clip-higher, the dual clip, the
    rollout correction's weight), and the unclipped -A r with the same weight: KL-Cov swaps the
    first for the second (a test holds the first equal to policy_loss's)."""
    ratio = torch.exp((logp - old_logp).clamp(max=20.0))
    adv = advantages.unsqueeze(-1)  # (B, 1)
    clipped = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high))
    if cfg.clip_ratio_c > 1:
        clipped = torch.where(adv < 0, torch.minimum(clipped, -adv * cfg.clip_ratio_c), clipped)
    weight = 1.0 if is_weight is None else is_weight
    return clipped * weight, -adv * ratio * weight


def apply(token_loss, logp, entropy, mb: dict, cfg) -> torch.Tensor:
    """common.token_losses' call on each micro-batch: its token losses (B, T) under the controls,
    from common.policy_loss's and the selection start_update made (mb["control"]). Clip-Cov zeroes
    the selected tokens; KL-Cov swaps the clipped surrogate for the unclipped one on every token and
    adds beta * penalty on the selected ones; the bonus subtracts entropy_coef * H_t (entropy
    (B, T) with its gradient)."""
    selected = mb["control"].to(token_loss.dtype)
    if cfg.entropy_control == "clip_cov":
        token_loss = token_loss * (1 - selected)
    elif cfg.entropy_control == "kl_cov":
        clipped, unclipped = surrogates(logp, mb["old_logp"], mb["advantage"], cfg,
                                        mb.get("is_weight"))
        penalty = kl_cov_penalty(logp, mb["old_logp"], cfg.kl_cov_penalty)
        token_loss = token_loss - clipped + unclipped + cfg.kl_cov_coef * penalty * selected
    if cfg.entropy_coef:
        token_loss = token_loss - cfg.entropy_coef * entropy
    return token_loss


# --------------------------------------------------------------------------------------------------
# The start of each update: the log-probs, the selection over the whole update, the metrics.
def check_flags(cfg):
    """The controls' flags that cannot work stop here, naming the flag (exit 2). The choices and
    lower bounds are config.check_config's; these need the pair or an upper bound."""
    if cfg.entropy_control == "kl_cov" and cfg.seq_ratio:
        die("--entropy_control kl_cov is per token: it cannot run with --seq_ratio (GSPO)")
    if cfg.clip_cov_lb >= cfg.clip_cov_ub:
        die(f"--clip_cov_lb {cfg.clip_cov_lb} must be below --clip_cov_ub {cfg.clip_cov_ub}")
    for name in ("clip_cov_ratio", "kl_cov_ratio"):
        if not 0 < getattr(cfg, name) <= 1:
            die(f"--{name} must be in (0, 1] (a share of the update's tokens), got "
                f"{getattr(cfg, name)}")


def add_metrics(record: dict, cov: torch.Tensor, n: int, selected: torch.Tensor,
                amplified: torch.Tensor):
    """The cov/* metrics of one update added to the step's (token-weighted over its updates):
      cov/logp_adv        Cov(log pi, A) over the tokens: the mean of Cov_t
      cov/selected        tokens the control selected; cov/selected_frac their share
      cov/selected_mean   the mean Cov_t of the selected tokens
      cov/amplified       tokens of DAA's amplified completions; cov/amplified_mean their mean Cov_t
    """
    sums = torch.stack([cov.sum(), (cov * selected).sum(), selected.sum().double(),
                        (cov * amplified).sum(), amplified.sum().double()])
    cov_sum, sel_cov, num_sel, amp_cov, num_amp = all_reduce_sum(sums).tolist()

    def running(key: str, count_key: str, total: float, count: float):
        """The step's mean over its updates so far, weighted by each update's count."""
        before = record.get(count_key, 0.0)
        mean = (record.get(key, 0.0) * before + total) / max(before + count, 1.0)
        record[key] = mean
        record[count_key] = before + count
    running("cov/logp_adv", "cov/tokens", cov_sum, n)
    running("cov/selected_mean", "cov/selected", sel_cov, num_sel)
    running("cov/amplified_mean", "cov/amplified", amp_cov, num_amp)
    record["cov/selected_frac"] = record["cov/selected"] / max(record["cov/tokens"], 1.0)
