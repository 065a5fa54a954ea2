"""
DA3PO in verl (verl==0.9.1): DAA as a registered advantage estimator, calling this project's functions
(common.group_advantages, da3po.daa, da3po.adaptive_lam), not copies of them.

Importing this module registers "da3po" (lam 2, tau 0.5, the paper's scope) with verl's register_adv_est;
register_da3po(name, ...) registers other settings under other names. verl computes advantages in its driver
process, so the driver must import this module: run verl with VERL_USE_EXTERNAL_MODULES=integrations.verl_da3po
(verl imports the listed modules when it is imported) and the repository root on PYTHONPATH, and set
algorithm.adv_estimator=da3po. The rest of DA3PO is verl's own: DAPO's loss is verl's "vanilla" policy loss with
loss_agg_mode=token-mean and clip_ratio_high=0.28 (tests/test_verl.py checks it against common.policy_loss), and
DAPO's dynamic sampling is verl's algorithm.filter_groups (the DAPO recipe).

Correctness: verl hands an estimator the rewards (token_level_rewards), not the verifier's verdicts, so a completion
counts as correct when its score is above `correct_above` (0 by default: a 0/1 or +1/-1 verifier score). With DAPO's
overlong penalty (+1/-1 plus a penalty down to -1) a correct answer at the length cap scores 0: pass
correct_above=-0.5 there. --p_estimate running is not offered: verl gives an estimator each batch's uids, not which
prompt they are, so a prompt's earlier samples cannot be found.
DARO is not offered for verl 0.9.1 without patching it: docs/integrations.md says what it would take.
"""
import numpy as np
import torch
from verl.trainer.ppo import core_algos

import common
import da3po


def daa_advantages(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index, lam: float = 2.0,
                   tau: float = 0.5, adaptive_lam: bool = False, lam_max: float = 4.0, scope: str = "correct",
                   correct_above: float = 0.0, epsilon: float = 1e-6, config=None, **kwargs):
    """verl's estimator interface: (bs, T) token rewards and mask, `index` (bs,) the group (uid) of each row, in any
    order. GRPO's advantages per group (unbiased std, as verl's grpo; Dr. GRPO when
    config.norm_adv_by_std_in_grpo is false), then DAA. Returns (advantages, returns), both (bs, T)."""
    scores = token_level_rewards.sum(-1)  # (bs,)
    _, group, sizes = np.unique(np.asarray(index), return_inverse=True, return_counts=True)
    if len(set(sizes.tolist())) != 1 or sizes[0] < 2:
        raise ValueError(f"DA3PO needs every uid to have the same number G >= 2 of completions; got group sizes "
                         f"{sorted(set(sizes.tolist()))}")
    G = int(sizes[0])
    order = torch.as_tensor(np.argsort(group, kind="stable"), device=scores.device).view(-1, G)  # rows of each group
    rewards = scores[order]  # (N, G)
    correct = rewards > correct_above
    std_norm = True if config is None else config.get("norm_adv_by_std_in_grpo", True)
    advantages = common.group_advantages(rewards, std_norm, epsilon)
    p = correct.to(rewards.dtype).mean(-1, keepdim=True)  # p_hat
    factor = da3po.adaptive_lam(p, G, lam_max) if adaptive_lam else lam
    advantages, _ = da3po.daa(advantages, correct, factor, tau, p, scope)
    per_row = torch.empty_like(scores).index_put_((order.flatten(),), advantages.flatten())
    advantages = per_row.unsqueeze(-1) * response_mask
    return advantages, advantages


def register_da3po(name: str = "da3po", lam: float = 2.0, tau: float = 0.5, adaptive_lam: bool = False,
                   lam_max: float = 4.0, daa_scope: str = "correct", correct_above: float = 0.0):
    """Register DAA with these settings as verl's advantage estimator `name` (algorithm.adv_estimator=name).
    Registering the same name again with the same settings does nothing; with other settings it is an error."""
    if not 0 < tau <= 1 or lam <= 0 or lam_max < 1 or daa_scope not in ("correct", "all"):
        raise ValueError(f"register_da3po needs 0 < tau <= 1, lam > 0, lam_max >= 1, daa_scope correct or all; got "
                         f"tau={tau}, lam={lam}, lam_max={lam_max}, daa_scope={daa_scope!r}")
    knobs = {"lam": lam, "tau": tau, "adaptive_lam": adaptive_lam, "lam_max": lam_max, "scope": daa_scope,
             "correct_above": correct_above}
    known = core_algos.ADV_ESTIMATOR_REGISTRY.get(name)
    if known is not None and getattr(known, "da3po_knobs", None) == knobs:
        return known

    def estimator(token_level_rewards, response_mask, index, config=None, **kwargs):
        return daa_advantages(token_level_rewards, response_mask, index, config=config, **knobs)
    estimator.da3po_knobs = knobs
    return core_algos.register_adv_est(name)(estimator)  # verl raises if `name` holds another estimator


register_da3po()  # "da3po": the paper's settings
