"""Formulas against hand-worked values. Run: python -m pytest -q tests/test_algorithms.py"""
import math
import os
import subprocess
import sys

import pytest
import torch

import common
import shortcuts
import modeling
import ranks
import da3po
from tests.conftest import ROOT, accumulate, off_policy_batch, weighted_loss
from da3po import amplification_factors, daa, monte_carlo_factors


def test_grpo_advantages_hand_worked():
    # [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) = 0.5774 -> +-0.866
    adv = common.group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), eps=0.0)
    assert torch.allclose(adv, torch.tensor([[0.8660, -0.8660, -0.8660, 0.8660]]), atol=1e-4)
    # +-1 rewards, one correct of 4: mean -0.5, unbiased std 1 -> [1.5, -0.5, -0.5, -0.5]
    adv = common.group_advantages(torch.tensor([[1.0, -1.0, -1.0, -1.0]]), eps=0.0)
    assert torch.allclose(adv, torch.tensor([[1.5, -0.5, -0.5, -0.5]]))
    # a uniform group gets zero advantage, not NaN
    assert torch.equal(common.group_advantages(torch.tensor([[1.0, 1.0, 1.0]])), torch.zeros(1, 3))
    # Dr. GRPO: mean-centred only
    adv = common.group_advantages(torch.tensor([[1.0, -1.0, -1.0, -1.0]]), std_norm=False)
    assert torch.allclose(adv, torch.tensor([[1.5, -0.5, -0.5, -0.5]]))
    adv = common.group_advantages(torch.tensor([[2.0, 0.0]]), std_norm=False)
    assert torch.allclose(adv, torch.tensor([[1.0, -1.0]]))


def test_two_level_rewards_give_the_same_advantages():
    # why DAA must act on advantages: scaling a two-level reward changes nothing after the z-score
    correct = torch.tensor([[1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    a = common.group_advantages(correct)
    b = common.group_advantages(2 * correct - 1)
    c = common.group_advantages(2.0 * correct)
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(a, c, atol=1e-5)


def test_daa_touches_only_correct_completions_of_hard_groups():
    correct = torch.tensor([[1, 0, 0, 0],    # p_hat 0.25 < 0.5: correct one amplified
                            [1, 1, 0, 0],    # p_hat 0.5 == tau: NOT amplified (strict <)
                            [1, 1, 1, 0],    # easy group: untouched
                            [0, 0, 0, 0]], dtype=torch.bool)  # no correct completion: nothing to amplify
    adv = torch.arange(1, 17, dtype=torch.float).view(4, 4)  # all positive here; the sign: the next test
    out, amplified = daa(adv, correct, lam=2.0, tau=0.5)
    expected_mask = torch.zeros(4, 4, dtype=torch.bool)
    expected_mask[0, 0] = True
    assert torch.equal(amplified, expected_mask)
    assert out[0, 0] == 2.0 * adv[0, 0]
    assert torch.equal(out[~expected_mask], adv[~expected_mask])
    # tau above 0.5 includes the p_hat = 0.5 group (only its correct completions with A > 0); lam = 1 is the identity
    out, amplified = daa(adv, correct, lam=3.0, tau=0.6)
    assert amplified[1].tolist() == [True, True, False, False] and out[1, 1] == 3.0 * adv[1, 1]
    assert torch.equal(daa(adv, correct, lam=1.0, tau=0.5)[0], adv)


def test_daa_never_amplifies_a_negative_advantage():
    """The paper amplifies the positive advantages of correct responses. With a running pass-rate estimate (or
    tau > 0.5) a correct completion that the overlong penalty pushes below its group's mean has A < 0: it stays as it
    is. The control scope 'all' multiplies every advantage of a hard group, both signs."""
    correct = torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    rewards = torch.tensor([[1.0, -0.95, -1, -1, -1, -1, -1, -1]])  # the 2nd correct one hit the overlong ramp
    adv = common.group_advantages(rewards, std_norm=True)
    assert adv[0, 0] > 0 and adv[0, 1] < 0  # correct, and below the group's mean
    running_p = torch.tensor([[0.1]])  # e.g. --p_estimate running: hard, whatever this group's p_hat
    out, amplified = daa(adv, correct, lam=2.0, tau=0.5, p=running_p)
    assert amplified[0].tolist() == [True] + [False] * 7
    assert out[0, 0] == 2 * adv[0, 0] and out[0, 1] == adv[0, 1]  # the negative one is not pushed down harder
    out, amplified = daa(adv, correct, lam=2.0, tau=0.5, p=running_p, scope="all")
    assert amplified.all() and torch.equal(out, 2 * adv)
    out, amplified = daa(adv, correct, lam=2.0, tau=0.5, p=torch.tensor([[0.6]]), scope="all")  # easy: untouched
    assert not amplified.any() and torch.equal(out, adv)


def test_amplify_reports_what_it_amplified():
    """daa/* metrics: the share of completions whose advantage changed and the factor applied; none when lam = 1."""
    correct = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)  # p_hat 0.25, 0.5, 0.75
    adv = common.group_advantages(correct.float(), std_norm=True)
    groups = [{"prompt": str(i), "answer": "1"} for i in range(3)]
    cfg = da3po.Config(group_size=4, lam=2.0, tau=0.6)
    out, counts = da3po.amplify(adv, correct, groups, {}, cfg)
    assert counts.tolist() == [12, 3, 6.0, 2.0]  # completions, amplified, their factors' sum and largest
    m = da3po.daa_metrics(counts)
    assert m == {"daa/amplified_frac": 3 / 12, "daa/lam_mean": 2.0, "daa/lam_max": 2.0}
    assert out[0, 0] == 2 * adv[0, 0] and out[1, 1] == 2 * adv[1, 1] and torch.equal(out[2], adv[2])
    out, counts = da3po.amplify(adv, correct, groups, {}, da3po.Config(group_size=4, lam=1.0, tau=0.6))
    m = da3po.daa_metrics(counts)
    assert torch.equal(out, adv) and m == {"daa/amplified_frac": 0.0, "daa/lam_mean": 0.0, "daa/lam_max": 0.0}
    out, counts = da3po.amplify(adv, correct, groups, {}, da3po.Config(group_size=4, adaptive_lam=True, tau=0.6))
    m = da3po.daa_metrics(counts)
    expected = da3po.adaptive_lam(torch.tensor([0.25, 0.5]), 4, 4.0)  # 1/gamma: > 1 at 0.25, exactly 1 at 0.5
    assert expected[1] == 1.0 and m["daa/lam_max"] == pytest.approx(expected[0].item())
    assert m["daa/amplified_frac"] == 1 / 12  # the p_hat = 0.5 group's factor is 1: nothing amplified there
    # the symmetric control: both hard groups (p_hat 0.25, 0.5 < tau) whole, both signs
    out, counts = da3po.amplify(adv, correct, groups, {}, da3po.Config(group_size=4, lam=2.0, tau=0.6, daa_scope="all"))
    m = da3po.daa_metrics(counts)
    assert torch.equal(out[:2], 2 * adv[:2]) and torch.equal(out[2], adv[2]) and m["daa/amplified_frac"] == 8 / 12


def test_amplification_factors_match_the_paper_numbers():
    for G, p, expected in [(8, 0.1, (1.00, 1.92, 0.52)), (16, 0.1, (1.00, 1.26, 0.79))]:
        got = amplification_factors(p, G)
        assert [round(x, 2) for x in got] == list(expected)
        mc = monte_carlo_factors(p, G, num_groups=100_000)
        assert all(abs(a - b) < 0.05 for a, b in zip(got, mc)), (got, mc)
    assert amplification_factors(0.5, 8)[2] == pytest.approx(1.0)
    assert amplification_factors(0.3, 8)[2] < 1 < amplification_factors(0.7, 8)[2]


def test_theory_flag_prints_the_table_and_trains_nothing(tmp_path):
    """`python da3po.py --theory`: the exact and Monte Carlo factors for G in 4, 8, 16, and no run folder."""
    out = subprocess.run([sys.executable, "da3po.py", "--theory", "--out_dir", str(tmp_path / "run")], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.split()[0] in ("4", "8", "16")]
    assert len(rows) == 21 and not (tmp_path / "run").exists()
    row = next(r for r in rows if r[:2] == ["8", "0.10"])  # G, p | exact alpha+ alpha- gamma | Monte Carlo
    assert row[3:6] == ["1.00", "1.92", "0.52"] and abs(float(row[9]) - 0.52) < 0.05


def test_policy_loss_equals_the_formula_on_a_toy_batch():
    # 2 sequences x 3 tokens; the last token of sequence 2 is padding
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -1.5, -3.0]])
    old = torch.tensor([[-1.1, -0.2, -2.0], [-0.6, -1.4, -9.0]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    weights = common.loss_weights(mask, "token-mean", max_new_tokens=3)
    loss, stats = weighted_loss(logp, old, adv, weights, clip_low=0.2, clip_high=0.28)
    expected = 0.0
    for i in range(2):
        for t in range(3):
            if mask[i, t]:
                r = math.exp(logp[i, t] - old[i, t])
                expected += max(-adv[i] * r, -adv[i] * min(max(r, 0.8), 1.28)) / 5
    assert loss.item() == pytest.approx(float(expected), rel=1e-6)
    # ratios: e^0.1 (ok), e^-0.3=0.74 (A>0, below: not clipped), 1, e^0.4=1.49 (A<0, above: not clipped), e^-0.1
    assert stats["clip_low"].item() == 0 and stats["clip_high"].item() == 0
    # seq-mean-token-mean and Dr. GRPO's constant normaliser
    w = common.loss_weights(mask, "seq-mean-token-mean", 3)
    assert torch.allclose(w, torch.tensor([[1 / 6, 1 / 6, 1 / 6], [1 / 4, 1 / 4, 0.0]]))
    w = common.loss_weights(mask, "seq-mean-token-sum-norm", 10)
    assert torch.allclose(w, mask / 20)


def test_policy_loss_clipping_and_gspo_ratio():
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-0.5, 0.0]])  # token 0 ratio e^0.5 = 1.65 > 1.28
    w = torch.tensor([[0.5, 0.5]])
    loss, stats = weighted_loss(logp, old, torch.tensor([1.0]), w, 0.2, 0.28)
    assert stats["clip_high"].item() == 1
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] == pytest.approx(-0.5)  # clipped token gets no gradient
    # GSPO: sequence ratio exp(mean log ratio) = e^0.25 = 1.28 shared by both tokens -> inside 1 + 0.3
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    loss, _ = weighted_loss(logp, old, torch.tensor([1.0]), w, 0.3, 0.3, seq_ratio=True)
    assert loss.item() == pytest.approx(-math.exp(0.25), rel=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, torch.full((1, 2), -0.5 * math.exp(0.25)))
    # dual clip caps the loss of a negative advantage at -A * c
    loss, _ = weighted_loss(torch.tensor([[2.0]]), torch.tensor([[0.0]]), torch.tensor([-1.0]),
                                 torch.tensor([[1.0]]), 0.2, 0.28, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(3.0)


def test_kl_penalty_is_k3():
    logp, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])
    loss, _ = weighted_loss(logp, logp, torch.tensor([0.0]), torch.tensor([[1.0]]), 0.2, 0.2,
                                 ref_logp=ref, kl_coef=0.5)
    assert loss.item() == pytest.approx(0.5 * (math.exp(-0.5) + 0.5 - 1), rel=1e-6)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_microbatch_split_does_not_change_loss_or_gradient(float64_model, loss_agg):
    """One update in one micro-batch vs in uneven micro-batches (sizes 1, 4, 2, 5): same loss, same gradient (float64:
    the tolerance measures the method, not float32's summation order)."""
    model, tok = float64_model
    g = torch.Generator().manual_seed(0)
    batch = off_policy_batch(model, tok, 12, g)
    batch["advantage"] = torch.randn(12, generator=g, dtype=torch.float64)
    batch["weight"] = common.loss_weights(batch["mask"].double(), loss_agg, 10)

    def run(sizes):
        return accumulate(model, batch, sizes)

    loss_one, grads_one = run([12])
    loss_many, grads_many = run([1, 4, 2, 5])
    assert loss_one == pytest.approx(loss_many, rel=1e-10, abs=1e-14)
    for a, b in zip(grads_one, grads_many):  # float64 summation order differs between splits: compare at its scale
        assert (a - b).abs().max() <= 1e-10 * a.abs().max() + 1e-14, ((a - b).abs().max(), a.abs().max())
    assert any(g.abs().sum() > 0 for g in grads_one)


def test_token_logprobs_match_generate_scores(demo_dir):
    """The trainer's log-probs of sampled tokens equal the ones generate() sampled from (left padding included)."""
    model, tok = modeling.load_model(demo_dir, torch.device("cpu"))
    prompts = [tok("12+3", add_special_tokens=False)["input_ids"], tok("7+456", add_special_tokens=False)["input_ids"]]
    ids, attn, _ = common.pad_prompt_completion(prompts, [[]] * 2, tok.pad_token_id)
    ids, attn = ids[:, :-1], attn[:, :-1]
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=5, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, min_new_tokens=5)
    gen_logp = torch.stack([s.log_softmax(-1) for s in out.logits], 1).gather(-1, out.sequences[:, -5:, None])[..., 0]
    full_attn = torch.cat([attn, torch.ones(2, 5, dtype=attn.dtype)], 1)
    logp, entropy = shortcuts.token_logprobs(model, out.sequences, full_attn, 5, with_entropy=True)
    assert torch.allclose(logp, gen_logp, atol=1e-4)
    assert (entropy >= 0).all()


def test_pass_at_k():
    assert common.pass_at_k(32, 3, 8) == pytest.approx(1 - math.comb(29, 8) / math.comb(32, 8))
    assert common.pass_at_k(4, 0, 1) == 0.0 and common.pass_at_k(4, 4, 4) == 1.0
    assert common.pass_at_k(4, 1, 1) == pytest.approx(0.25)


def test_overlong_shaping():
    # L_max 20, buffer 4: penalty starts after 16 tokens, reaches -1 at 20
    assert common.shaped_reward(True, 16, 20, 4) == 1.0
    assert common.shaped_reward(True, 18, 20, 4) == pytest.approx(0.5)
    assert common.shaped_reward(False, 20, 20, 4) == pytest.approx(-2.0)
    assert common.shaped_reward(True, 20, 20, 0) == 1.0


def test_adaptive_lam_undoes_the_dynamic_sampling_imbalance():
    G = 8
    correct = torch.zeros(3, G, dtype=torch.bool)
    correct[0, 0] = True                 # p_hat = 1/8
    correct[1, :4] = True                # p_hat = 1/2 = tau: not amplified
    correct[2, :6] = True                # p_hat = 3/4: easy
    p = correct.float().mean(-1, keepdim=True)
    factor = da3po.adaptive_lam(p, G, lam_max=4.0)
    alpha_plus, alpha_minus, _ = amplification_factors(1 / 8, G)
    assert factor[0, 0].item() == pytest.approx(alpha_minus / alpha_plus, rel=1e-5)  # = 1 / gamma
    adv = common.group_advantages(2 * correct.float() - 1)
    out, amplified = daa(adv, correct, factor, tau=0.5)
    assert amplified.sum() == 1 and amplified[0, 0]
    assert out[0, 0] == pytest.approx(adv[0, 0].item() * alpha_minus / alpha_plus, rel=1e-5)
    assert torch.equal(out[1:], adv[1:])  # no correct completion with p_hat >= tau is touched
    # the cap holds where 1/gamma is large: a running estimate p = 0.01 at G = 8 gives 1/gamma = 14.72
    assert da3po.adaptive_lam(torch.tensor([[0.01]]), 8, lam_max=100.0).item() == pytest.approx(14.72, abs=0.01)
    assert da3po.adaptive_lam(torch.tensor([[0.01]]), 8, lam_max=4.0).item() == 4.0
    assert da3po.adaptive_lam(torch.tensor([[0.5]]), 8, lam_max=4.0).item() == pytest.approx(1.0)


def test_running_pass_counts():
    counts = {}
    da3po.count_passes(counts, [{"prompt": "1+1", "answer": "2", "correct": [True, False]}])
    da3po.count_passes(counts, [{"prompt": "1+1", "answer": "2", "correct": [True, True, True, False]}])
    assert counts == {"1+1\x002": [4, 6]}


def test_plan_updates_trains_every_kept_group_once():
    groups = lambda n, G: [{"prompt_len": 1, "lengths": [1] * G, "correct": [True] * G, "id": i}  # noqa: E731
                           for i in range(n)]  # kept summaries (dynamic_sampling), here planned for any rank
    one = ranks.DistInfo()
    # 13 groups kept at the dynamic-sampling cap, 2 updates: 7 + 6 groups (the old split trained 96 of 104 rows)
    mine, updates = common.plan_updates(groups(13, 8), 2, one)
    assert [len(u) for u in updates] == [56, 48] and torch.equal(torch.cat(updates), torch.arange(104))
    assert [g["id"] for g in mine] == list(range(13))
    # fewer groups than updates: fewer updates, none empty (the old split made 16 empty updates)
    assert [u.tolist() for u in common.plan_updates(groups(1, 8), 16, one)[1]] == [list(range(8))]
    # the README's 8-rank recipe at a cap of 120 groups: 15 per rank, so 15 updates of one group on every rank
    seen = []
    for rank in range(8):
        mine, updates = common.plan_updates(groups(120, 2), 16, ranks.DistInfo(rank=rank, world_size=8))
        assert len(updates) == 15 and all(len(u) == 2 for u in updates)
        seen += [g["id"] for g in mine]
    assert sorted(seen) == list(range(120))  # every group on exactly one rank
    assert [len(u) for u in common.plan_updates(groups(32, 8), 2, one)[1]] == [128, 128]  # the usual case


def test_loss_formulas_keep_float64():
    """The loss weights and the clipped surrogate compute in the inputs' dtype: float64 in, agreement to 1e-12."""
    d = torch.float64
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -1.5, -3.0]], dtype=d)
    old = torch.tensor([[-1.1, -0.2, -2.0], [-0.6, -1.4, -9.0]], dtype=d)
    adv = torch.tensor([1.0, -2.0], dtype=d)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=d)
    for agg, norm in [("token-mean", lambda i: 5), ("seq-mean-token-mean", lambda i: 2 * mask[i].sum().item()),
                      ("seq-mean-token-sum-norm", lambda i: 2 * 7)]:
        weights = common.loss_weights(mask, agg, max_new_tokens=7)
        assert weights.dtype == d
        loss, stats = weighted_loss(logp, old, adv, weights, clip_low=0.2, clip_high=0.28)
        assert loss.dtype == d and stats["clip_low"].dtype == d
        expected = math.fsum(max(-adv[i].item() * math.exp(logp[i, t] - old[i, t]),
                                 -adv[i].item() * min(max(math.exp(logp[i, t] - old[i, t]), 0.8), 1.28)) / norm(i)
                             for i in range(2) for t in range(3) if mask[i, t])
        assert abs(loss.item() - expected) < 1e-12, (agg, loss.item() - expected)
