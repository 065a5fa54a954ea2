"""
Writes tests/data/golden.json: the golden vectors of DA3PO's advantages, DARO's loss and the three --loss_agg
aggregations, computed in float64 by this project's own functions (the callables below, which are also what
tests/test_golden.py checks against the file). Cases are fixed by hand or drawn from a seeded generator, so the
file is the same on every machine; `--check` says whether the file on disk is what this script writes.

Run:  python -m integrations.make_golden            # (re)write tests/data/golden.json
      python -m integrations.make_golden --check    # exit 1 if the file differs from what would be written
"""
import argparse
import json
import os
import random
import sys

import torch

import common
import da3po
import daro
from integrations.golden import DEFAULT_PATH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

F64 = torch.float64

# -----------------------------------------------------------------------------------------------------------------
# The project's functions as golden-file callables: inputs (lists) -> outputs (float64 tensors)


def shaped_rewards(correct, lengths, max_new_tokens: int, overlong_buffer: int, overlong_penalty: float):
    """DAPO's reward of each completion (common.shaped_reward), as nested lists (N, G)."""
    return [[common.shaped_reward(bool(c), n, max_new_tokens, overlong_buffer, overlong_penalty)
             for c, n in zip(cs, ns)] for cs, ns in zip(correct, lengths)]


def project_advantages(inp: dict) -> dict:
    """DAPO's shaped rewards, GRPO's advantages, then DAA (da3po.daa; da3po.adaptive_lam for --adaptive_lam)."""
    correct = torch.tensor(inp["correct"], dtype=torch.bool)  # (N, G)
    if correct.shape[-1] != inp["G"]:
        raise ValueError(f"G = {inp['G']} but the groups have {correct.shape[-1]} completions")
    rewards = torch.tensor(shaped_rewards(inp["correct"], inp["lengths"], inp["max_new_tokens"], inp["overlong_buffer"],
                                          inp["overlong_penalty"]), dtype=F64)
    before = common.group_advantages(torch.tensor(inp["rewards"], dtype=F64), inp["std_norm"], inp["eps"])
    p = (correct.to(F64).mean(-1) if inp["p"] is None else torch.tensor(inp["p"], dtype=F64)).unsqueeze(-1)
    factor = da3po.adaptive_lam(p, inp["G"], inp["lam_max"]) if inp["adaptive_lam"] else inp["lam"]
    after, amplified = da3po.daa(before, correct, factor, inp["tau"], p, inp["scope"])
    return {"rewards": rewards, "advantages_before": before, "factor": (factor * torch.ones_like(p)).squeeze(-1),
            "advantages_after": after, "amplified": amplified}


def project_daro(inp: dict) -> dict:
    """Eq. (2)'s per-bin token weights (daro.bin_token_weights), w_mu (daro.bin_weights), L_mu, the model's loss
    sum_mu w_mu L_mu, and the weights' objective (daro.weight_objective) with its gradient in s = -ln w."""
    G = inp["G"]
    token_loss, mask = torch.tensor(inp["token_loss"], dtype=F64), torch.tensor(inp["mask"], dtype=F64)
    bins = torch.tensor(inp["bins"])
    neg_log_w = [torch.tensor(s, dtype=F64, requires_grad=True) for s in inp["neg_log_w"]]
    if len(neg_log_w) != G - 1:
        raise ValueError(f"G = {G} needs {G - 1} weights (mu = 1/G .. (G-1)/G), got {len(neg_log_w)}")
    bin_tokens = daro.tokens_per_bin(mask, bins, G)
    weight = daro.bin_token_weights(mask, bins, bin_tokens)
    w = daro.bin_weights(neg_log_w, inp["weighting"])  # (G+1,), detached
    bin_loss = torch.zeros(G + 1, dtype=F64).index_add_(0, bins, (token_loss * weight).sum(-1))  # L_mu
    present = bin_tokens > 0
    objective = daro.weight_objective(neg_log_w, bin_loss, present, inp["delta"], inp["literal"])
    grads = torch.autograd.grad(objective, neg_log_w, allow_unused=True) if torch.is_tensor(objective) else ()
    grad = [0.0 if g is None else g.item() for g in grads] or [0.0] * (G - 1)  # an absent bin: no gradient
    return {"token_weights": weight, "bin_tokens": bin_tokens, "present": present, "w": w, "bin_loss": bin_loss,
            "model_loss": (token_loss * weight * w[bins].unsqueeze(-1)).sum(),
            "weight_objective": float(objective.detach()) if torch.is_tensor(objective) else 0.0, "weight_grad": grad}


def project_loss_agg(inp: dict) -> dict:
    """common.loss_weights' per-token weights for --loss_agg, and the loss they make of the token losses."""
    token_loss, mask = torch.tensor(inp["token_loss"], dtype=F64), torch.tensor(inp["mask"], dtype=F64)
    weight = common.loss_weights(mask, inp["loss_agg"], inp["max_new_tokens"])
    return {"token_weights": weight, "loss": (token_loss * weight).sum()}


PROJECT = {"advantages": project_advantages, "daro": project_daro, "loss_agg": project_loss_agg}

# -----------------------------------------------------------------------------------------------------------------
# The cases


def advantage_case(name, correct, lengths, lam=2.0, tau=0.5, p=None, scope="correct", adaptive_lam=False,
                   lam_max=4.0, std_norm=True, max_new_tokens=16, overlong_buffer=4, overlong_penalty=1.0,
                   rewards=None):
    """A case of the advantages section; `rewards` None: the shaped rewards of `correct` and `lengths`."""
    if rewards is None:
        rewards = shaped_rewards(correct, lengths, max_new_tokens, overlong_buffer, overlong_penalty)
    return {"name": name, "inputs": {
        "G": len(correct[0]), "correct": correct, "lengths": lengths, "max_new_tokens": max_new_tokens,
        "overlong_buffer": overlong_buffer, "overlong_penalty": overlong_penalty, "rewards": rewards,
        "std_norm": std_norm, "eps": 1e-6, "lam": lam, "tau": tau, "adaptive_lam": adaptive_lam, "lam_max": lam_max,
        "p": p, "scope": scope}}


def random_groups(rng: random.Random, counts: list[int], G: int, max_new_tokens: int = 16):
    """Groups with the given numbers of correct completions, in shuffled order, with lengths up to the cap."""
    correct, lengths = [], []
    for c in counts:
        row = [1] * c + [0] * (G - c)
        rng.shuffle(row)
        correct.append(row)
        lengths.append([rng.randint(1, max_new_tokens) for _ in range(G)])
    return correct, lengths


def token_batch(rng: random.Random, B: int, T: int, empty_row: bool = True):
    """Token losses (signed, like a clipped surrogate's) and a right-padded mask; one row fully masked if asked."""
    lengths = [rng.randint(1, T) for _ in range(B)]
    if empty_row:
        lengths[B // 2] = 0  # a completion whose every token was masked (e.g. rejected by a rollout correction)
    mask = [[1.0 if t < n else 0.0 for t in range(T)] for n in lengths]
    token_loss = [[round(rng.uniform(-2, 2), 6) if m else 0.0 for m in row] for row in mask]
    return token_loss, mask


def daro_case(name, token_loss, mask, bins, G, neg_log_w, delta=1e-3, literal=False):
    return {"name": name, "inputs": {"G": G, "token_loss": token_loss, "mask": mask, "bins": bins,
                                     "neg_log_w": neg_log_w, "weighting": "learned", "delta": delta,
                                     "literal": literal}}


def cases() -> dict:
    rng = random.Random(29)  # a fixed seed: the file is the same on every machine
    adv = [advantage_case("hand_G4_one_correct", [[1, 0, 0, 0]], [[3, 3, 3, 3]])]  # tests/test_golden.py by hand
    correct, lengths = random_groups(rng, [0, 1, 2, 3, 4, 5, 7, 8], 8)  # every pass rate, incl. uniform groups
    adv.append(advantage_case("G8_every_pass_rate", correct, lengths))
    adv.append(advantage_case("G8_adaptive_lam", correct, lengths, adaptive_lam=True))
    adv.append(advantage_case("G8_adaptive_lam_capped", correct, lengths, adaptive_lam=True, lam_max=1.2))
    adv.append(advantage_case("G8_scope_all", correct, lengths, scope="all"))
    adv.append(advantage_case("G8_dr_grpo_no_std", correct, lengths, std_norm=False))
    running_p = [0.05, 0.3, 0.2, 0.45, 0.5, 0.55, 0.9, 0.6]  # --p_estimate running: a prompt's pass rate so far
    adv.append(advantage_case("G8_running_p_lam1.5_tau0.25", correct, lengths, lam=1.5, tau=0.25, p=running_p))
    adv.append(advantage_case("G8_running_p_adaptive", correct, lengths, adaptive_lam=True, p=running_p))
    correct, lengths = random_groups(rng, [1, 2, 3, 6, 1, 15], 16)
    adv.append(advantage_case("G16_lam3", correct, lengths, lam=3.0, max_new_tokens=24, overlong_buffer=8))
    # tau 1: a correct completion at the length cap (reward 0) sits below its group's mean: not amplified
    adv.append(advantage_case("G4_tau1_correct_below_mean", [[1, 1, 1, 0]], [[5, 5, 16, 5]], tau=1.0))
    # a correct completion at the length cap: reward 1 - 1 = 0 (not > 0), yet above its group's mean (A > 0):
    # amplified (correct and A > 0); a reading of "R_i > 0" would leave it alone. Second group: wrong ones at the
    # cap (-2) and a correct one in the buffer (0.5)
    adv.append(advantage_case("G4_correct_at_cap_amplified", [[1, 0, 0, 0], [0, 0, 1, 0]],
                              [[16, 5, 5, 5], [16, 16, 14, 3]]))
    # a correct completion exactly at its group's mean (rewards 0.25, 1, 0.75, -1: mean 0.25, exact in binary):
    # A = 0 is not > 0, so it is not amplified, though its group is hard (p 0.75 < tau 1)
    adv.append(advantage_case("G4_correct_at_zero_advantage", [[1, 1, 1, 0]], [[15, 5, 13, 5]], tau=1.0))
    # the advantages come from the rewards given, which here are not the shaped rewards of correct and lengths
    adv.append(advantage_case("G4_rewards_given", [[1, 0, 0, 0]], [[3, 3, 3, 3]],
                              rewards=[[1.0, 0.0, 0.0, -0.5]]))
    adv.append(advantage_case("G4_lam1_is_grpo", [[1, 0, 0, 1], [0, 1, 0, 0]], [[2, 15, 16, 3], [4, 4, 4, 4]],
                              lam=1.0))

    bins_hand = [1, 1, 3]  # daro.bin_token_weights' docstring: lengths 2, 4, 5 -> 1/6, 1/6, 1/5
    mask_hand = [[1.0, 1.0, 0, 0, 0], [1.0] * 4 + [0.0], [1.0] * 5]
    loss_hand = [[0.5, -0.25, 0, 0, 0], [1.0, 1.0, -1.0, 0.5, 0], [0.2, 0.2, 0.2, 0.2, 0.2]]
    dro = [daro_case("hand_G4", loss_hand, mask_hand, bins_hand, 4, [0.0, 0.0, 0.0])]
    token_loss, mask = token_batch(rng, 16, 12)
    bins = list(range(9)) + [rng.randint(0, 8) for _ in range(7)]  # every bin 0..8 present
    rng.shuffle(bins)  # bins 0 and G (no advantage) among them, weighed 0
    neg_log_w = [round(rng.uniform(-1, 1), 6) for _ in range(7)]
    dro.append(daro_case("G8_random", token_loss, mask, bins, 8, neg_log_w))
    dro.append(daro_case("G8_random_literal", token_loss, mask, bins, 8, neg_log_w, literal=True))
    dro.append(daro_case("G8_random_delta0.1", token_loss, mask, bins, 8, neg_log_w, delta=0.1))
    bins_gap = [b if b not in (2, 5) else 4 for b in bins]  # bins 2 and 5 absent: no gradient for their weights
    dro.append(daro_case("G8_absent_bins", token_loss, mask, bins_gap, 8, neg_log_w))
    # bin 6's only row has no token (fully masked): the bin is absent though a row names it
    empty = mask.index([0.0] * len(mask[0]))
    bins_empty = [6 if i == empty else (5 if b == 6 else b) for i, b in enumerate(bins)]
    dro.append(daro_case("G8_bin_of_an_empty_row", token_loss, mask, bins_empty, 8, neg_log_w))

    token_loss, mask = token_batch(rng, 6, 9)
    agg = [{"name": f"{mode}", "inputs": {"token_loss": token_loss, "mask": mask, "loss_agg": mode,
                                          "max_new_tokens": 12}}
           for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")]
    return {"advantages": adv, "daro": dro, "loss_agg": agg}


def build() -> dict:
    """The golden file's content: every case's expected outputs from the project's functions, float64."""
    golden = {"schema": "da3po-golden/1", "dtype": "float64", "generated_by": "python -m integrations.make_golden"}
    for section, section_cases in cases().items():
        for case in section_cases:
            out = PROJECT[section](case["inputs"])
            case["expected"] = {k: v.tolist() if torch.is_tensor(v) else v for k, v in out.items()}
        golden[section] = section_cases
    return golden


def dumps(golden: dict) -> str:
    return json.dumps(golden, indent=1) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from what would be written")
    parser.add_argument("--out", default=DEFAULT_PATH)
    args = parser.parse_args()
    text = dumps(build())
    if args.check:
        same = os.path.exists(args.out) and open(args.out).read() == text
        print(f"{args.out}: {'up to date' if same else 'DIFFERS from what make_golden.py writes'}")
        sys.exit(0 if same else 1)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")
