"""The plain reference update: the loss and gradient of ONE optimizer update, computed the slow, obvious way.

Per sequence and per token, in float64, with no micro-batches, no packing, no padding and no trimming: each
sequence runs alone through the model's plain forward, and every formula is written out as the papers (and the
README's algorithm section) state it. It shares no code with the trainer's files (da3po.py, daro.py,
common.py, modeling.py, engine.py): it is what their fast, batched, split and distributed arithmetic must
agree with (tests/test_reference.py, tools/reference_sweep.py).
Run: python -m pytest -q tests/test_reference.py          (its users: tests/harness.py and the tests there)

The update (one optimizer step) is a list of Seq, every G-sized group of one prompt complete, and the flags:
  advantage  A_i = (R_i - mean_j R_j) / (std_j R_j + 1e-6), std unbiased (GRPO); R_i - mean_j R_j (Dr. GRPO)
  DAA        p_hat = #correct / G; in a group with p_hat < tau (strict): A_i <- lam * A_i for the correct
             completions with A_i > 0 (scope correct), or for every completion (scope all). --p_estimate running:
             p = (#correct / #samples of the prompt over every step so far, this one included) in place of p_hat;
             --adaptive_lam: lam = min(lam_max, (1 - p^(G-1)) / (1 - (1-p)^(G-1))), p kept inside [1e-6, 1 - 1e-6]
  rollout IS token: w_t = pi_old_t / pi_rollout_t; sequence: w_i = prod_t pi_old_t / pi_rollout_t on each token;
             truncated w <- min(w, C); or with --rollout_is_mask a token (sequence) with w outside [1/C, C] is not
             trained at all (it leaves the loss and every denominator) and the others keep w untruncated
  ratio      r_t = pi_t / pi_old_t; GSPO: s_i = exp(mean over the trained tokens of log r_t),
             r_t = sg[s_i] pi_t / sg[pi_t]
  token loss l_t = max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high)); dual clip (c > 1): for A < 0,
             l_t <- min(l_t, -A c); l_t <- w_t l_t (rollout IS); + kl_coef (pi_ref/pi - log(pi_ref/pi) - 1) (k3)
  loss       token-mean               sum_t l_t / #trained tokens of the update
             seq-mean-token-mean      sum_i (1/|o_i|) sum_t l_t / #sequences with a trained token; |o_i| its trained
                                      tokens
             seq-mean-token-sum-norm  sum_i sum_t l_t / (#sequences with a trained token * max_new_tokens)
             DARO                     sum_mu w_mu L_mu, mu = #correct / G in 1/G .. (G-1)/G (bins 0 and G are not
                                      trained), L_mu = sum of bin mu's l_t / #trained tokens of bin mu in the update;
                                      w_mu = exp(-s_mu) (learned), 1 (uniform), sqrt(mu (1 - mu)) (var)
  weights    J(s) = sum over the bins present of [exp(-s_mu) (|L_mu| + delta) + s_mu] (L_mu itself with literal),
             dJ/ds_mu = 1 - exp(-s_mu) (|L_mu| + delta); one Adam step on s, then every w clamped to [w_min, w_max]
"""
import math
from dataclasses import dataclass, field

import torch

ADV_EPS = 1e-6  # GRPO's epsilon in the advantage's denominator (verl's)


@dataclass
class Seq:
    """One completion of the update: its prompt's and its own token ids, the prompt (group) it belongs to, its reward
    and verdict, and per completion token the log-probs pi_old and (with --rollout_is) the engine's pi_rollout."""
    prompt: list[int]
    completion: list[int]
    group: int
    reward: float
    correct: bool
    old_logp: list[float]
    rollout_logp: list[float] | None = None
    prior: tuple[int, int] = (0, 0)  # the prompt's #correct and #samples in the steps before (--p_estimate running)


@dataclass
class Flags:
    """The knobs the update reads, under the scripts' flag names (defaults: the scripts')."""
    G: int = 8
    loss_agg: str = "token-mean"
    max_new_tokens: int = 12
    temperature: float = 1.0
    std_norm: bool = True
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_ratio_c: float = 0.0
    seq_ratio: bool = False
    kl_coef: float = 0.0
    rollout_is: str = "none"
    rollout_is_cap: float = 2.0
    rollout_is_mask: bool = False
    lam: float = 1.0  # DAA (da3po.py)
    tau: float = 0.5
    daa_scope: str = "correct"
    p_estimate: str = "group"
    adaptive_lam: bool = False
    lam_max: float = 4.0
    weighting: str = "none"  # DARO (daro.py): none (no bins: loss_agg) | learned | uniform | var
    daro_delta: float = 1e-3
    daro_literal: bool = False
    w_min: float = 0.1
    w_max: float = 10.0
    weight_lr: float = 1e-3


@dataclass
class Update:
    """What the reference says of one update. Lists are per sequence, inner lists per completion token."""
    advantage: list[float]
    is_weight: list[list[float]]  # w_t on the surrogate (1 without --rollout_is)
    trained: list[list[bool]]  # whether token t is in the loss at all
    coef: list[list[float]]  # the token's share of the loss: d loss / d l_t (DARO: w_mu / #tokens of its bin)
    loss: torch.Tensor  # the model's loss, a float64 scalar with its autograd graph to the model's parameters
    bin_loss: dict[int, float] = field(default_factory=dict)  # DARO: L_mu by #correct, for the bins present
    bin_tokens: dict[int, int] = field(default_factory=dict)  # DARO: trained tokens of each bin present


# -----------------------------------------------------------------------------------------------------------------
# Advantages (GRPO, Dr. GRPO) and DAA


def groups_of(seqs: list[Seq]) -> dict[int, list[int]]:
    """The indices of each group's sequences, by group id."""
    groups = {}
    for i, s in enumerate(seqs):
        groups.setdefault(s.group, []).append(i)
    return groups


def advantages(seqs: list[Seq], f: Flags) -> list[float]:
    """A_i from the group's rewards (GRPO's z-score or Dr. GRPO's centring), then DAA."""
    A = [0.0] * len(seqs)
    for members in groups_of(seqs).values():
        R = [seqs[i].reward for i in members]
        mean = math.fsum(R) / len(R)
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in R) / (len(R) - 1))  # unbiased, as torch.std
        c, n = sum(seqs[i].correct for i in members), len(members)
        if f.p_estimate == "running":
            c, n = c + seqs[members[0]].prior[0], n + seqs[members[0]].prior[1]
        p = c / n
        lam = adaptive_lam(p, f.G, f.lam_max) if f.adaptive_lam else f.lam
        for i, r in zip(members, R):
            A[i] = (r - mean) / (std + ADV_EPS) if f.std_norm else r - mean
            if p < f.tau and (f.daa_scope == "all" or (seqs[i].correct and A[i] > 0)):
                A[i] = lam * A[i]
    return A


def adaptive_lam(p: float, G: int, lam_max: float) -> float:
    """The factor that undoes dynamic sampling's tilt, 1 / gamma = alpha- / alpha+, capped at lam_max."""
    p = min(max(p, 1e-6), 1 - 1e-6)
    return min(lam_max, (1 - p ** (G - 1)) / (1 - (1 - p) ** (G - 1)))


def bin_of(seqs: list[Seq], i: int) -> int:
    """DARO's bin of sequence i: the number of correct completions in its group (mu = bin / G)."""
    return sum(s.correct for s in seqs if s.group == seqs[i].group)


# -----------------------------------------------------------------------------------------------------------------
# Rollout importance sampling, and which tokens are trained


def rollout_is(seq: Seq, f: Flags) -> tuple[list[float], list[bool]]:
    """(w_t per token, whether each token survives rejection) for one sequence."""
    L = len(seq.completion)
    if f.rollout_is == "none" or seq.rollout_logp is None:
        return [1.0] * L, [True] * L
    log_r = [seq.old_logp[t] - seq.rollout_logp[t] for t in range(L)]
    if f.rollout_is == "sequence":  # the completion's product of ratios, on each of its tokens
        log_r = [math.fsum(log_r)] * L
    w = [math.exp(x) for x in log_r]
    C = f.rollout_is_cap
    if f.rollout_is_mask:
        return w, [1 / C <= x <= C for x in w]
    return [min(x, C) for x in w], [True] * L


def trained_tokens(seqs: list[Seq], f: Flags, kept: list[list[bool]]) -> list[list[bool]]:
    """A token is trained when rollout IS did not reject it and, with DARO's bins, its group is in bins 1..G-1."""
    out = []
    for i, s in enumerate(seqs):
        in_bins = f.weighting == "none" or 0 < bin_of(seqs, i) < f.G
        out.append([in_bins and k for k in kept[i]])
    return out


# -----------------------------------------------------------------------------------------------------------------
# Log-probs and token losses, one sequence at a time


def sequence_logprobs(model, seq: Seq, temperature: float) -> torch.Tensor:
    """log pi(o_t | q, o_<t) of each completion token (L,), from the model's plain forward on this sequence alone
    (no padding, positions 0..n-1): the logits at position P-1+t predict completion token t."""
    ids = torch.tensor([seq.prompt + seq.completion])
    P, L = len(seq.prompt), len(seq.completion)
    logits = model(input_ids=ids).logits[0, P - 1:P + L - 1] / temperature  # (L, V)
    return torch.log_softmax(logits, -1)[torch.arange(L), torch.tensor(seq.completion)]


def token_losses(logp: torch.Tensor, seq: Seq, A: float, w: list[float], trained: list[bool], f: Flags,
                 ref_logp: torch.Tensor | None = None) -> torch.Tensor:
    """l_t of each completion token (L,), the formulas of the module docstring."""
    old = torch.tensor(seq.old_logp, dtype=logp.dtype)
    if f.seq_ratio:  # GSPO: every token carries the sequence's ratio; its gradient is its own log-prob's
        mine = torch.tensor(trained)
        s = torch.exp((logp[mine] - old[mine]).mean()).detach() if mine.any() else logp.new_ones(())
        r = s * torch.exp(logp - logp.detach())
    else:
        r = torch.exp(logp - old)
    loss = torch.maximum(-A * r, -A * r.clamp(1 - f.clip_low, 1 + f.clip_high))
    if f.clip_ratio_c > 1 and A < 0:  # dual clip
        loss = torch.minimum(loss, torch.full_like(loss, -A * f.clip_ratio_c))
    loss = loss * torch.tensor(w, dtype=logp.dtype)
    if f.kl_coef > 0:
        d = ref_logp - logp
        loss = loss + f.kl_coef * (torch.exp(d) - d - 1)
    return loss


# -----------------------------------------------------------------------------------------------------------------
# Aggregation: each token's share of the update's loss


def bin_weight(b: int, f: Flags, s: list[float] | None) -> float:
    """w_mu of bin b (mu = b / G): exp(-s_mu) learned (s indexed by b - 1), 1 uniform, sqrt(mu (1 - mu)) var."""
    mu = b / f.G
    if f.weighting == "learned":
        return math.exp(-s[b - 1])
    return 1.0 if f.weighting == "uniform" else math.sqrt(mu * (1 - mu))


def coefficients(seqs: list[Seq], trained: list[list[bool]], f: Flags, s: list[float] | None = None):
    """coef[i][t] = d loss / d l_t for the whole update (0 for a token not trained), and DARO's tokens per bin."""
    n_tokens = sum(sum(tr) for tr in trained)
    n_seqs = sum(any(tr) for tr in trained)
    bin_tokens = {}
    if f.weighting != "none":
        for i, tr in enumerate(trained):
            if any(tr):
                bin_tokens[bin_of(seqs, i)] = bin_tokens.get(bin_of(seqs, i), 0) + sum(tr)
    coef = []
    for i, tr in enumerate(trained):
        if f.weighting != "none":
            c = bin_weight(bin_of(seqs, i), f, s) / bin_tokens[bin_of(seqs, i)] if any(tr) else 0.0
        elif f.loss_agg == "token-mean":
            c = 1 / n_tokens if n_tokens else 0.0
        elif f.loss_agg == "seq-mean-token-mean":
            c = 1 / (n_seqs * sum(tr)) if any(tr) else 0.0
        elif f.loss_agg == "seq-mean-token-sum-norm":
            c = 1 / (n_seqs * f.max_new_tokens) if n_seqs else 0.0
        else:
            raise ValueError(f.loss_agg)
        coef.append([c if t else 0.0 for t in tr])
    return coef, bin_tokens


# -----------------------------------------------------------------------------------------------------------------
# The update


def update(model, seqs: list[Seq], f: Flags, ref_model=None, s: list[float] | None = None) -> Update:
    """The reference of one update on `model` (float64): its loss with its graph, every token's share, and DARO's
    per-bin losses L_mu (s: DARO's learned s_mu = -ln w_mu, mu = 1/G .. (G-1)/G)."""
    A = advantages(seqs, f)
    weights, kept = zip(*[rollout_is(seq, f) for seq in seqs])
    trained = trained_tokens(seqs, f, list(kept))
    coef, bin_tokens = coefficients(seqs, trained, f, s)
    loss, bin_loss = torch.zeros((), dtype=torch.float64), {}
    for i, seq in enumerate(seqs):
        if not any(trained[i]):  # nothing of it is trained: it adds no term (and needs no forward)
            continue
        logp = sequence_logprobs(model, seq, f.temperature)
        ref_logp = None
        if f.kl_coef > 0:
            with torch.no_grad():
                ref_logp = sequence_logprobs(ref_model, seq, f.temperature)
        l_t = token_losses(logp, seq, A[i], weights[i], trained[i], f, ref_logp)
        for t in range(len(seq.completion)):
            if trained[i][t]:
                loss = loss + coef[i][t] * l_t[t]
                if f.weighting != "none":  # L_mu: the bin's token losses over its tokens, without w_mu
                    b = bin_of(seqs, i)
                    bin_loss[b] = bin_loss.get(b, 0.0) + l_t[t].item() / bin_tokens[b]
    return Update(A, [list(w) for w in weights], trained, coef, loss, bin_loss, bin_tokens)


def gradient(model, result: Update) -> dict[str, torch.Tensor]:
    """d loss / d theta of every trainable parameter, by name (zeros where the loss does not reach)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not result.loss.requires_grad:  # no token trained: the loss is the constant 0
        return {n: torch.zeros_like(p) for n, p in named}
    grads = torch.autograd.grad(result.loss, [p for _, p in named], allow_unused=True)
    return {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(named, grads)}


# -----------------------------------------------------------------------------------------------------------------
# DARO's weights: their objective, its gradient, and their optimizer


def weight_objective(bin_loss: dict[int, float], s: list[float], f: Flags) -> tuple[float, dict[int, float]]:
    """J(s) over the bins present (1..G-1) and dJ/ds_mu, in closed form."""
    J, grad = 0.0, {}
    for b, L in bin_loss.items():
        if 0 < b < f.G:
            target = L if f.daro_literal else abs(L) + f.daro_delta
            J += math.exp(-s[b - 1]) * target + s[b - 1]
            grad[b] = 1 - math.exp(-s[b - 1]) * target
    return J, grad


class Adam:
    """Adam on scalars, written out (Kingma and Ba, Alg. 1; PyTorch's defaults): a parameter absent from a step keeps
    its moments and its own step count. After each step with a gradient every s is clamped so that w = exp(-s) stays
    in [w_min, w_max]."""

    def __init__(self, s: list[float], f: Flags, betas=(0.9, 0.999), eps=1e-8):
        self.s, self.f, self.betas, self.eps = list(s), f, betas, eps
        self.m, self.v, self.k = [0.0] * len(s), [0.0] * len(s), [0] * len(s)

    def step(self, grad: dict[int, float]):
        """grad: dJ/ds by bin (1..G-1); s[b - 1] is bin b's."""
        if not grad:
            return
        b1, b2 = self.betas
        for b, g in grad.items():
            j = b - 1
            self.k[j] += 1
            self.m[j] = b1 * self.m[j] + (1 - b1) * g
            self.v[j] = b2 * self.v[j] + (1 - b2) * g * g
            m_hat, v_hat = self.m[j] / (1 - b1 ** self.k[j]), self.v[j] / (1 - b2 ** self.k[j])
            self.s[j] -= self.f.weight_lr * m_hat / (math.sqrt(v_hat) + self.eps)
        lo, hi = -math.log(self.f.w_max), -math.log(self.f.w_min)
        self.s = [min(max(x, lo), hi) for x in self.s]
