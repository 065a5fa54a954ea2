"""
The start of each update under an entropy control (entropy_control.py has the formulas and
docs/entropy.md the equations): the log-probs the covariance is taken on, the selection over the
whole update agreed by all ranks, and the cov/* metrics. A room of its own: main() calls
start_update, only with --entropy_coef or --entropy_control set.
"""
import torch

import common
import entropy_control as ec
from modeling import autocast, reshard


def start_update(model, batch: dict, rows: torch.Tensor, cfg, step: int, u: int, record: dict):
    """The start of update u of `step` (every rank, in lockstep): batch["control"][rows], 1 on the
    tokens the covariance control selects over the whole update, and the cov/* metrics of the
    step's updates so far into `record`. The covariance's log pi: pi_old before the step's first
    update (the same weights), else a no-grad pass (docs/departures.md: why, and its cost)."""
    if "control" not in batch:
        batch["control"] = torch.zeros_like(batch["mask"], dtype=torch.float)  # (B, T)
    if cfg.entropy_control == "none":  # the bonus alone selects nothing
        return
    mask = batch["mask"][rows]
    old_logp = batch["old_logp"][rows]
    logp = old_logp if u == 0 else current_logprobs(model, batch, rows, cfg)
    adv = batch["advantage"][rows].unsqueeze(-1).expand_as(old_logp)  # (b, T)
    cov, n = ec.token_covariance(logp, adv, mask)
    if cfg.entropy_control == "kl_cov":
        selected = ec.top_covariance(cov, mask, cfg.kl_cov_ratio, n)
    else:
        candidates = ec.clip_cov_candidates(cov, mask, logp, old_logp, adv, cfg.clip_cov_lb,
                                         cfg.clip_cov_ub, cfg.clip_low, cfg.clip_high)
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1_009 + u)
        selected = ec.random_share(candidates, cfg.clip_cov_ratio, n, generator)
    batch["control"][rows] = selected.float()
    # DAA's amplified rows (DAA.advantages marks them); none under DARO, a baseline or a neighbour
    amplified = batch.get("amplified", torch.zeros_like(batch["reward"], dtype=torch.bool))
    ec.add_metrics(record, cov, n, selected, amplified[rows].unsqueeze(-1) & mask.bool())


@torch.no_grad()
def current_logprobs(model, batch: dict, rows: torch.Tensor, cfg) -> torch.Tensor:
    """log pi (len(rows), T) of the update's rows under the weights the update starts from: one
    no-grad pass over the micro-batches the update will run (the same collectives on every rank)."""
    out = torch.zeros_like(batch["mask"][rows], dtype=torch.float)
    where = torch.full((len(batch["mask"]),), -1, dtype=torch.long, device=rows.device)
    where[rows] = torch.arange(len(rows), device=rows.device)  # batch row -> row of `out`
    for chunk, mb in common.micro_batches(batch, rows, cfg.micro_batch_size,
                                          cfg.micro_batch_tokens):
        with autocast(cfg.dtype, batch["mask"].device):
            logp = common.batch_logprobs(model, mb, cfg)[0]
        out[where[chunk], :logp.shape[1]] = logp.float()
    reshard(model)
    return out


