"""The entropy controls (entropy_control.py): the entropy bonus, Clip-Cov and KL-Cov (arXiv:2505.22617), each checked
in float64 against its formula written out here; the selection over the whole update, the same whatever the
micro-batch split and on 2 gloo ranks; KL-Cov a no-op on the on-policy update; short runs of both scripts' demos.
Run: python -m pytest -q tests/test_entropy_control.py"""
import json
import math

import pytest
import torch

import common
import da3po
import entropy_control as ec
import entropy_update
import neighbours
from da3po import Config
from tests.conftest import ARITH_MODEL, run_script


def update_tensors():
    """A float64 update of 8 completions x 6 tokens, with ragged lengths and rows 0 and 1 identical (same log-probs,
    same advantage: tied Cov_t): (logp, old_logp, adv (B, T) per token, mask)."""
    g = torch.Generator().manual_seed(0)
    B, T = 8, 6
    logp = -2.0 * torch.rand(B, T, generator=g, dtype=torch.float64) ** 2 * 3
    old_logp = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = 2.0 * torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    lengths = torch.tensor([6, 6, 3, 5, 1, 6, 4, 2])
    mask = (torch.arange(T) < lengths[:, None]).to(torch.float64)
    logp[1], old_logp[1], adv[1] = logp[0], old_logp[0], adv[0]
    return logp, old_logp, adv, mask


def cov_by_hand(logp, adv, mask):
    """Cov_t = (log pi_t - mean log pi)(A_t - mean A), the means over the masked tokens: written per token."""
    tokens = [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t] > 0]
    mean_logp = sum(logp[i, t].item() for i, t in tokens) / len(tokens)
    mean_adv = sum(adv[i, t].item() for i, t in tokens) / len(tokens)
    out = torch.zeros_like(logp)
    for i, t in tokens:
        out[i, t] = (logp[i, t].item() - mean_logp) * (adv[i, t].item() - mean_adv)
    return out, len(tokens)


# -----------------------------------------------------------------------------------------------------------------
# The definitions, by hand


def test_covariance_hand_worked():
    """logp [[-1, -3], [-2, pad]], A per row [1, -1]: N = 3, means -2 and 1/3, so Cov = [[2/3, -2/3], [0, 0]]."""
    logp = torch.tensor([[-1.0, -3.0], [-2.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    cov, n = ec.token_covariance(logp, adv, mask)
    assert n == 3
    assert torch.allclose(cov, torch.tensor([[2 / 3, -2 / 3], [0.0, 0.0]], dtype=torch.float64), atol=1e-15)
    logp, _, adv, mask = update_tensors()
    expected, n_expected = cov_by_hand(logp, adv, mask)
    cov, n = ec.token_covariance(logp, adv, mask)
    assert n == n_expected and torch.allclose(cov, expected, atol=1e-13)


def test_kl_cov_selects_the_largest_covariances_ties_included():
    """KL-Cov: the max(1, floor(k N)) tokens of largest Cov_t; a token tied with the last is in too."""
    cov = torch.tensor([[3.0, 1.0, 5.0], [3.0, -2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    two = ec.top_covariance(cov, mask, 0.4, 5)  # floor(0.4 * 5) = 2: 5 and 3, and the other 3 (a tie)
    assert two.tolist() == [[True, False, True], [True, False, False]]
    one = ec.top_covariance(cov, mask, 0.01, 5)  # max(1, 0): the largest alone
    assert one.tolist() == [[False, False, True], [False, False, False]]
    logp, _, adv, mask = update_tensors()
    cov, n = ec.token_covariance(logp, adv, mask)
    k = 0.2
    ranked = sorted((cov[i, t].item() for i in range(8) for t in range(6) if mask[i, t]), reverse=True)
    threshold = ranked[max(1, int(k * n)) - 1]
    expected = [[bool(mask[i, t]) and cov[i, t].item() >= threshold for t in range(6)] for i in range(8)]
    assert ec.top_covariance(cov, mask, k, n).tolist() == expected
    assert torch.equal(ec.top_covariance(cov, mask, k, n)[0], ec.top_covariance(cov, mask, k, n)[1])  # the twins


def test_clip_cov_candidates_and_draw():
    """Clip-Cov's candidates: lb < Cov_t < ub, on the mask, not already clipped by PPO (r > 1 + eps_high with A > 0,
    r < 1 - eps_low with A < 0); the draw: max(1, floor(r N)) of them, all when fewer."""
    cov = torch.tensor([[2.0, 0.5, 6.0, 3.0], [4.0, 1.5, 2.5, 2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    adv = torch.tensor([[1.0] * 4, [-1.0] * 4], dtype=torch.float64)
    ratio = torch.tensor([[1.0, 1.0, 1.0, 1.5], [1.0, 0.5, 1.1, 1.0]], dtype=torch.float64)  # (0,3) and (1,1) clipped
    old_logp = torch.zeros(2, 4, dtype=torch.float64)
    candidates = ec.clip_cov_candidates(cov, mask, ratio.log(), old_logp, adv, 1.0, 5.0, 0.2, 0.28)
    assert candidates.tolist() == [[True, False, False, False], [True, False, True, False]]
    drawn = ec.random_share(candidates, 0.3, 7, torch.Generator().manual_seed(0))  # floor(0.3 * 7) = 2 of the 3
    assert drawn.sum() == 2 and not (drawn & ~candidates).any()
    assert torch.equal(ec.random_share(candidates, 1.0, 7, torch.Generator().manual_seed(0)), candidates)
    counts = torch.zeros(2, 4)
    for seed in range(300):  # uniform: each candidate drawn about 2/3 of the time
        counts += ec.random_share(candidates, 0.3, 7, torch.Generator().manual_seed(seed)).float()
    # 300 draws with p = 2/3: sd 8.2, so +-5 sd is +-41
    assert (counts[candidates] - 200).abs().max() < 41


def test_control_losses_hand_worked():
    """One token with r = 1.5, A = 1 (clip-higher clips it at 1.28), one with r = 1, A = -1. Clip-Cov on the first:
    its loss 0. KL-Cov on the first: -A r = -1.5 (no clip) + beta |log 1.5|; the second: -A r = 1. The bonus
    subtracts coef * H."""
    old_logp = torch.zeros(1, 2, dtype=torch.float64)
    logp = torch.tensor([[math.log(1.5), 0.0]], dtype=torch.float64)
    mb = {"old_logp": old_logp, "advantage": torch.tensor([1.0], dtype=torch.float64),
          "mask": torch.ones(1, 2), "control": torch.tensor([[1.0, 0.0]])}
    mb2 = {**mb, "advantage": torch.tensor([-1.0], dtype=torch.float64)}
    cfg = Config(entropy_control="clip_cov")
    token_loss, _ = common.policy_loss(logp, old_logp, mb["advantage"], mb["mask"], 0.2, 0.28)
    assert torch.allclose(token_loss, torch.tensor([[-1.28, -1.0]], dtype=torch.float64))
    entropy = torch.tensor([[0.5, 2.0]], dtype=torch.float64)
    assert ec.apply(token_loss, logp, entropy, mb, cfg).tolist() == [[0.0, -1.0]]
    cfg = Config(entropy_control="kl_cov", kl_cov_coef=0.5)
    out = ec.apply(token_loss, logp, entropy, mb, cfg)
    assert torch.allclose(out, torch.tensor([[-1.5 + 0.5 * math.log(1.5), -1.0]], dtype=torch.float64), atol=1e-15)
    cfg = Config(entropy_control="kl_cov", kl_cov_coef=0.5, kl_cov_penalty="k3")
    out = ec.apply(token_loss, logp, entropy, mb, cfg)
    assert torch.allclose(out, torch.tensor([[-1.5 + 0.5 * (0.5 - math.log(1.5)), -1.0]], dtype=torch.float64))
    token_loss2, _ = common.policy_loss(logp, old_logp, mb2["advantage"], mb["mask"], 0.2, 0.28)
    out = ec.apply(token_loss2, logp, entropy, mb2, Config(entropy_control="kl_cov", kl_cov_coef=0.5))
    assert torch.allclose(out, torch.tensor([[1.5 + 0.5 * math.log(1.5), 1.0]], dtype=torch.float64))
    out = ec.apply(token_loss, logp, entropy, {**mb, "control": torch.zeros(1, 2)}, Config(entropy_coef=0.1))
    assert torch.allclose(out, torch.tensor([[-1.28 - 0.05, -1.0 - 0.2]], dtype=torch.float64))


@pytest.mark.parametrize("penalty", ["abs", "k3"])
def test_kl_cov_is_a_no_op_on_policy(penalty):
    """pi == pi_old (the step's first update): KL-Cov's loss and gradient are the plain surrogate's on every token,
    selected or not; off policy (r = 1.2 on a selected token) the penalty's gradient is not zero."""
    logp0, _, adv, mask = update_tensors()
    selected = ec.top_covariance(*ec.token_covariance(logp0, adv, mask)[:1], mask, 0.3, int(mask.sum()))
    for shift, should_differ in ((0.0, False), (math.log(1.2), True)):
        old_logp = logp0 - shift
        grads = []
        for control in ("none", "kl_cov"):
            logp = logp0.clone().requires_grad_(True)
            mb = {"old_logp": old_logp, "advantage": adv[:, 0], "mask": mask, "control": selected.double()}
            cfg = Config(entropy_control=control, kl_cov_penalty=penalty, clip_low=10.0, clip_high=10.0)
            token_loss, _ = common.policy_loss(logp, old_logp, adv[:, 0], mask, 10.0, 10.0)  # no clip: -A r
            (ec.apply(token_loss, logp, None, mb, cfg) * mask).sum().backward()
            grads.append(logp.grad)
        assert torch.equal(grads[0], grads[1]) != should_differ


def test_entropy_bonus_gradient(float64_model):
    """token_logprobs' entropy keeps its gradient: H = -sum_v p_v log p_v from the model's logits, written out here;
    the bonus's gradient is -coef dH/dtheta."""
    model, tok = float64_model
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    attn = torch.ones_like(ids)
    _, entropy = common.token_logprobs(model, ids, attn, 2, with_entropy=True)
    logits = model(input_ids=ids).logits[:, -3:-1]  # the positions predicting the last 2 tokens
    p = logits.softmax(-1)
    expected = -(p * p.log()).sum(-1)
    assert torch.allclose(entropy, expected, atol=1e-12)
    params = [q for q in model.parameters() if q.requires_grad]
    g1 = torch.autograd.grad(entropy.sum(), params, allow_unused=True)
    g2 = torch.autograd.grad(expected.sum(), params, allow_unused=True)
    assert all((a is None and b is None) or torch.allclose(a, b, atol=1e-10) for a, b in zip(g1, g2))
    assert any(a is not None and a.abs().max() > 0 for a in g1)


# -----------------------------------------------------------------------------------------------------------------
# The whole update: any micro-batch split, two ranks


def model_batch(model, tok, G=4, groups=3, seed=0):
    """An update of `groups` groups on the float64 demo model: log-probs 0.3 off pi_old, GRPO advantages with one
    group's correct completions amplified x2 and marked (as DAA does)."""
    from tests.conftest import off_policy_batch
    g = torch.Generator().manual_seed(seed)
    batch = off_policy_batch(model, tok, G * groups, g)
    batch["reward"] = torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0])[:G * groups]
    grpo = common.group_advantages(batch["reward"].view(-1, G)).flatten()
    adv = grpo.clone()
    adv[:G] = torch.where(batch["reward"][:G] > 0, 2 * adv[:G], adv[:G])
    batch["advantage"] = adv.double()
    batch["amplified"] = adv != grpo  # as DAA.advantages marks them
    batch["reward"] = batch["reward"].float()
    return batch


def test_amplified_tokens_are_daas_only(float64_model):
    """cov/amplified counts the tokens of the rows DAA.advantages marks as amplified (batch["amplified"]): under
    DA3PO, the amplified group's correct tokens; under a neighbour (MaxRL here), whose advantages differ from GRPO's
    on every row but which marks none, no token."""
    model, tok = float64_model
    counts = {}
    for algo in ("da3po", "maxrl"):
        batch = model_batch(model, tok)
        batch["correct"] = batch["reward"] > 0
        del batch["amplified"]  # model_batch's mark: the hook writes its own, and a neighbour none
        cfg = Config(algo=algo, entropy_control="kl_cov", kl_cov_ratio=0.05, group_size=4)
        if algo == "da3po":  # the hook amplifies what model_batch amplified by hand, and marks those rows
            advantage = da3po.DAA(cfg, torch.device("cpu"), {}).advantages(batch, [{}] * 3)
            assert torch.allclose(advantage.double(), batch["advantage"], rtol=1e-6)
            assert batch["amplified"].tolist() == [True] + [False] * 11
        else:
            batch["advantage"] = neighbours.maxrl_advantages((batch["reward"] > 0).double().view(-1, 4)).flatten()
        record = {}
        entropy_update.start_update(model, batch, torch.arange(12), cfg, 1, 0, record)
        counts[algo] = record["cov/amplified"]
    expected = batch["mask"][0].sum().item()  # group 0's correct completion
    assert counts["maxrl"] == 0
    assert counts["da3po"] == expected > 0


@pytest.mark.parametrize("control", ["kl_cov", "clip_cov"])
def test_selection_equal_whatever_the_micro_batch_split(float64_model, control):
    """start_update's no-grad pass (update 1: the current policy) in micro-batches of 1, 5 or 12 rows: the same
    selection and the same cov/* metrics; update 0 takes pi_old's log-probs, as the definition on them does."""
    model, tok = float64_model
    outs = []
    for size in (1, 5, 12):
        batch = model_batch(model, tok)
        batch["old_logp"] = batch["old_logp"] + 0.0
        cfg = Config(entropy_control=control, micro_batch_size=size, kl_cov_ratio=0.05, clip_cov_ratio=0.05,
                     clip_cov_lb=0.01, group_size=4)
        record = {}
        entropy_update.start_update(model, batch, torch.arange(12), cfg, 1, 1, record)
        outs.append((batch["control"], record))
    for control_mask, record in outs[1:]:
        assert torch.equal(control_mask, outs[0][0])
        assert record.keys() == outs[0][1].keys()
        assert all(math.isclose(record[k], outs[0][1][k], rel_tol=1e-12, abs_tol=1e-15) for k in record)
    assert outs[0][1]["cov/selected"] >= 1 and outs[0][1]["cov/amplified"] > 0
    # update 0: pi_old's log-probs, the formula on them
    batch = model_batch(model, tok)
    cfg = Config(entropy_control="kl_cov", kl_cov_ratio=0.05, group_size=4)
    entropy_update.start_update(model, batch, torch.arange(12), cfg, 1, 0, {})
    adv = batch["advantage"][:, None].expand_as(batch["old_logp"])
    cov, n = cov_by_hand(batch["old_logp"], adv, batch["mask"])
    expected = ec.top_covariance(cov, batch["mask"], 0.05, n)
    assert torch.equal(batch["control"].bool(), expected)


def test_selection_on_two_gloo_ranks_equals_one_process(tmp_path):
    """torchrun, 2 gloo ranks, each its stride of the rows: Cov_t, N, KL-Cov's tokens and Clip-Cov's candidates equal
    the whole update's in one process; Clip-Cov draws as many tokens (which ones depends on the layout: the draw is
    uniform over the candidates numbered rank by rank)."""
    one = tmp_path / "one.pt"
    two = tmp_path / "two.pt"
    r = run_script(["-m", "tests.dist_entropy", str(one)])
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "tests.dist_entropy",
                    str(two)])
    assert r.returncode == 0, r.stderr[-3000:]
    whole = torch.load(f"{one}.0")
    parts = [torch.load(f"{two}.{rank}") for rank in (0, 1)]
    assert parts[0]["n"] == parts[1]["n"] == whole["n"]
    for part in parts:
        rows = part["rows"]
        assert torch.allclose(part["cov"], whole["cov"][rows], rtol=1e-13, atol=1e-14)
        for key in ("top", "candidates", "many"):
            assert torch.equal(part[key], whole[key][rows]), key
    assert whole["top"].sum() >= 2 and whole["candidates"].sum() > whole["few"].sum() >= 1
    assert sum(int(p["few"].sum()) for p in parts) == int(whole["few"].sum())


# -----------------------------------------------------------------------------------------------------------------
# The scripts


@pytest.mark.parametrize("script,demo,flags", [
    ("da3po.py", "reasoning", ["--entropy_control", "kl_cov", "--entropy_coef", "0.001"]),
    ("da3po.py", "reasoning", ["--entropy_control", "clip_cov", "--clip_cov_lb", "0.1"]),
    ("da3po.py", "arith", ["--entropy_control", "kl_cov", "--kl_cov_penalty", "k3"]),
    ("da3po.py", "arith", ["--entropy_control", "clip_cov", "--clip_cov_lb", "0.1", "--entropy_coef", "0.001"]),
    ("daro.py", "arith", ["--entropy_control", "kl_cov"]),
])
def test_three_steps_with_each_control(tmp_path, script, demo, flags):
    """3 steps of each control in both demos (and DARO): finite losses, and the cov/* metrics of the selection."""
    out = tmp_path / "run"
    r = run_script([script, "--demo", demo, "--steps", "3", "--eval_every", "0", "--eval_size", "8",
                    "--eval_samples", "1", "--out_dir", str(out), *flags])
    assert r.returncode == 0, r.stderr[-3000:]
    train = [x for x in map(json.loads, open(out / "metrics.jsonl")) if "train/loss" in x]
    assert [x["step"] for x in train] == [1, 2, 3]
    trained = [x for x in train if x["train/num_updates"] > 0]
    assert trained and all(math.isfinite(x["train/loss"]) for x in train)
    for x in trained:
        assert x["cov/tokens"] > 0 and x["cov/selected"] >= 1 and 0 < x["cov/selected_frac"] < 1
        assert math.isfinite(x["cov/logp_adv"]) and math.isfinite(x["cov/selected_mean"])
    if script == "da3po.py" and demo == "reasoning":
        assert any(x["cov/amplified"] > 0 for x in trained)
    config = json.load(open(out / "config.json"))
    assert config["entropy_control"] == flags[1]


def test_bad_flags_stop_naming_the_flag(tmp_path):
    r = run_script(["da3po.py", "--entropy_control", "klcov", "--out_dir", str(tmp_path / "a")])
    assert r.returncode == 2 and "--entropy_control 'klcov'" in r.stdout + r.stderr
    r = run_script(["da3po.py", "--entropy_coef", "-0.1", "--out_dir", str(tmp_path / "b")])
    assert r.returncode == 2 and "--entropy_coef" in r.stdout + r.stderr
    for flags, name in (({"clip_cov_lb": 5.0, "clip_cov_ub": 1.0}, "--clip_cov_lb"), ({"kl_cov_ratio": 2.0},
                                                                                      "--kl_cov_ratio")):
        with pytest.raises(SystemExit) as stop:
            ec.check_flags(Config(entropy_control="kl_cov", **flags))
        assert stop.value.code == 2


@pytest.mark.parametrize("clip_ratio_c", [0.0, 3.0])
def test_surrogates_equal_policy_loss(clip_ratio_c):
    """KL-Cov's own clipped surrogate (entropy_control.surrogates) is common.policy_loss's, dual clip and rollout
    weights included: swapping it for the unclipped one leaves nothing else behind."""
    logp, old_logp, adv, mask = update_tensors()
    weight = torch.rand(8, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.5
    cfg = Config(clip_ratio_c=clip_ratio_c)
    clipped, unclipped = ec.surrogates(logp, old_logp, adv[:, 0], cfg, weight)
    expected, _ = common.policy_loss(logp, old_logp, adv[:, 0], mask, 0.2, 0.28, clip_ratio_c=clip_ratio_c,
                                     is_weight=weight)
    assert torch.equal(clipped, expected)
    assert torch.allclose(unclipped, -adv * torch.exp(logp - old_logp) * weight, atol=1e-13)
