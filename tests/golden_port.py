"""An independent port of the golden vectors' conventions, for tests/test_golden.py: written from
tests/data/README.md alone (its "conventions, section by section"), by someone who had not read this
project's code, in plain Python floats. It passing integrations/golden.py shows that the page is enough to
port DA3PO's advantages and DARO's loss; when a convention changes, the page and this file change together.
"""
import math


# ----------------------------------------------------------------------------------------------------------- advantages
def _shaped_reward(correct, length, max_new_tokens, overlong_buffer, overlong_penalty):
    base = 1.0 if correct else -1.0
    shaping = 0.0
    if overlong_buffer > 0 and length > max_new_tokens - overlong_buffer:
        expected_len = max_new_tokens - overlong_buffer
        shaping = max(-(length - expected_len) / overlong_buffer, -1.0) * overlong_penalty
    return base + shaping


def _group_advantages(r, G, std_norm, eps):
    mean = sum(r) / G
    centred = [x - mean for x in r]
    if not std_norm:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / (G - 1))
    return [c / (std + eps) for c in centred]


def _adaptive_factor(p, G, lam_max):
    q = min(max(p, 1e-6), 1 - 1e-6)
    return min((1 - q ** (G - 1)) / (1 - (1 - q) ** (G - 1)), lam_max)


def advantages(inputs):
    G = inputs["G"]
    correct, lengths, rewards_in = inputs["correct"], inputs["lengths"], inputs["rewards"]
    M, OB, OP = inputs["max_new_tokens"], inputs["overlong_buffer"], inputs["overlong_penalty"]
    std_norm, eps = inputs["std_norm"], inputs["eps"]
    lam, tau, adaptive, lam_max = inputs["lam"], inputs["tau"], inputs["adaptive_lam"], inputs["lam_max"]
    p_in, scope = inputs["p"], inputs["scope"]

    rewards, before, factors, after, amplified = [], [], [], [], []
    for n in range(len(correct)):
        rewards.append([_shaped_reward(c, L, M, OB, OP) for c, L in zip(correct[n], lengths[n])])
        a = _group_advantages(rewards_in[n], G, std_norm, eps)
        before.append(a)
        p = sum(1 for c in correct[n] if c) / G if p_in is None else p_in[n]
        f = _adaptive_factor(p, G, lam_max) if adaptive else lam
        factors.append(f)
        hard = p < tau
        if scope == "correct":
            amp = [bool(hard and c == 1 and x > 0) for c, x in zip(correct[n], a)]
        elif scope == "all":
            amp = [bool(hard)] * len(a)
        else:
            raise ValueError(scope)
        amplified.append(amp)
        after.append([f * x if m else x for x, m in zip(a, amp)])
    return {"rewards": rewards, "advantages_before": before, "factor": factors,
            "advantages_after": after, "amplified": amplified}


# ----------------------------------------------------------------------------------------------------------------- daro
def daro(inputs):
    G = inputs["G"]
    loss, mask, bins, s = inputs["token_loss"], inputs["mask"], inputs["bins"], inputs["neg_log_w"]
    delta, literal = inputs["delta"], inputs["literal"]
    if inputs.get("weighting", "learned") != "learned":
        return None
    B = len(mask)

    bin_tokens = [0.0] * (G + 1)
    for b in range(B):
        bin_tokens[bins[b]] += sum(mask[b])
    present = [bt > 0 for bt in bin_tokens]

    token_weights = []
    for b in range(B):
        k = bins[b]
        if 0 < k < G:
            denom = max(bin_tokens[k], 1)
            token_weights.append([m / denom for m in mask[b]])
        else:
            token_weights.append([0.0] * len(mask[b]))

    w = [0.0] * (G + 1)
    for k in range(1, G):
        w[k] = math.exp(-s[k - 1])

    bin_loss = [0.0] * (G + 1)
    model_loss = 0.0
    for b in range(B):
        row = sum(l * tw for l, tw in zip(loss[b], token_weights[b]))
        bin_loss[bins[b]] += row
        model_loss += sum(l * tw * w[bins[b]] for l, tw in zip(loss[b], token_weights[b]))

    objective = 0.0
    grad = [0.0] * (G - 1)
    for k in range(1, G):
        if not present[k]:
            continue
        sk = s[k - 1]
        target = bin_loss[k] if literal else abs(bin_loss[k]) + delta
        objective += math.exp(-sk) * target + sk
        grad[k - 1] = 1 - math.exp(-sk) * target

    return {"token_weights": token_weights, "bin_tokens": bin_tokens, "present": present, "w": w,
            "bin_loss": bin_loss, "model_loss": model_loss, "weight_objective": objective, "weight_grad": grad}


# ------------------------------------------------------------------------------------------------------------- loss_agg
def loss_agg(inputs):
    loss, mask, mode, M = inputs["token_loss"], inputs["mask"], inputs["loss_agg"], inputs["max_new_tokens"]
    row_tokens = [sum(r) for r in mask]
    num_seqs = sum(1 for rt in row_tokens if rt > 0)
    if mode == "token-mean":
        denom = max(sum(row_tokens), 1)
        tw = [[m / denom for m in r] for r in mask]
    elif mode == "seq-mean-token-mean":
        tw = [[m / (max(rt, 1) * max(num_seqs, 1)) for m in r] for r, rt in zip(mask, row_tokens)]
    elif mode == "seq-mean-token-sum-norm":
        tw = [[m / (M * max(num_seqs, 1)) for m in r] for r in mask]
    else:
        return None
    total = sum(l * w for lr, wr in zip(loss, tw) for l, w in zip(lr, wr))
    return {"token_weights": tw, "loss": total}
