"""DARO: bins, per-bin losses, learnable weights, presets, resume. Run: python -m pytest -q tests/test_daro.py"""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import shortcuts
import config
import modeling
import daro
from tests.conftest import ROOT, accumulate, off_policy_batch
from daro import (PRESETS, Config, bin_token_weights, bin_weights, check_algorithm_config, closed_form_weights,
                  tokens_per_bin, update_weights, weight_objective)
from demo.build import warm_start

G = 8  # group size K: bins mu = 0, 1/8, ..., 1


def make_log_w(values=None, dtype=torch.float32):
    """Log-weights s_mu as the script makes them: one scalar tensor per bin mu = 1/G .. (G-1)/G (w = exp(-s))."""
    values = [0.0] * (G - 1) if values is None else values
    return [torch.tensor(float(v), requires_grad=True, dtype=dtype) for v in values]


# -----------------------------------------------------------------------------------------------------------------
# The weights alone, on fixed bin losses


@pytest.mark.parametrize("literal", [False, True])
def test_weights_converge_to_inverse_bin_loss_within_the_clamp(literal):
    # bins 0 and G carry huge losses that must be ignored; bin 5/8 would want w = 20 and bin 6/8 w = 1/30: clamped
    bin_loss = torch.tensor([1e6, 0.5, 2.0, 0.25, 1.0, 0.05, 30.0, -0.4, 1e6])
    cfg = Config(weight_lr=0.1, daro_literal=literal)
    log_w = make_log_w()
    opt = torch.optim.Adam(log_w, lr=cfg.weight_lr)
    for _ in range(400):
        update_weights(log_w, opt, bin_loss, torch.ones(G + 1, dtype=torch.bool), cfg)
    w = bin_weights(log_w, "learned")
    target = bin_loss if literal else bin_loss.abs() + cfg.daro_delta
    expected = (1 / target[1:G]).clamp(cfg.w_min, cfg.w_max)
    if literal:  # L_mu < 0: Eq. (1) as written has no minimum; the weight runs into the upper clamp
        expected[-1] = cfg.w_max
    assert torch.allclose(w[1:G], expected, rtol=1e-2), (w, expected)
    assert w[0] == 0 and w[G] == 0  # mu = 0 and 1 carry no loss at all
    assert w[1].item() == pytest.approx(1 / 0.501 if not literal else 2.0, rel=1e-2)


def test_edge_and_absent_bins_get_no_gradient_and_no_update():
    cfg = Config(weight_lr=0.1)
    bin_loss = torch.tensor([5.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 5.0])
    all_bins = torch.ones(G + 1, dtype=torch.bool)
    # the losses of bins 0 and G do not enter the weights' gradient
    grads = []
    for edge in (0.0, 1e3):
        log_w = make_log_w()
        weight_objective(log_w, bin_loss.index_fill(0, torch.tensor([0, G]), edge), all_bins, 1e-3, False).backward()
        grads.append(torch.stack([s.grad for s in log_w]))
    assert torch.equal(grads[0], grads[1]) and (grads[0] != 0).all()
    # an absent bin has no gradient at all (None, not 0)
    log_w = make_log_w()
    present = all_bins.clone()
    present[[2, 5]] = False
    weight_objective(log_w, bin_loss, present, 1e-3, False).backward()
    assert log_w[1].grad is None and log_w[4].grad is None and log_w[0].grad is not None
    # a bin present once, then absent: Adam's momentum must not keep moving it
    log_w = make_log_w()
    opt = torch.optim.Adam(log_w, lr=cfg.weight_lr)
    update_weights(log_w, opt, bin_loss, all_bins, cfg)
    before = torch.stack([s.detach().clone() for s in log_w])
    assert (before != 0).all()
    for _ in range(5):
        update_weights(log_w, opt, bin_loss, present, cfg)
    after = torch.stack([s.detach() for s in log_w])
    assert after[1] == before[1] and after[4] == before[4]  # bins 2/8 and 5/8 untouched
    assert (after[[0, 2, 3, 5, 6]] != before[[0, 2, 3, 5, 6]]).all()
    assert opt.state[log_w[1]]["step"] == 1 and opt.state[log_w[0]]["step"] == 6
    # no bin present at all: nothing happens
    update_weights(log_w, opt, bin_loss, torch.zeros(G + 1, dtype=torch.bool), cfg)
    assert torch.equal(torch.stack([s.detach() for s in log_w]), after)


def test_closed_form_weights_hand_worked():
    """--weighting closed sets w_mu = 1 / (|L_mu| + delta) in one go, clamped to [w_min, w_max] = [0.1, 10], for the
    bins present; an absent bin keeps its weight and bins 0 and G weigh 0. float64 throughout."""
    cfg = Config(weighting="closed")  # delta 1e-3
    log_w = make_log_w([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, math.log(2.0)], torch.float64)  # bin 7/8 was set to w = 0.5
    assert torch.equal(bin_weights(log_w, "closed"), torch.tensor([0.0] + [1.0] * 6 + [0.5, 0.0], dtype=torch.float64))
    bin_loss = torch.tensor([9.0, 0.5, -0.249, 0.0, 2.0, 30.0, 0.099, 0.05, 9.0], dtype=torch.float64)
    present = torch.tensor([True] * 7 + [False, True])  # bin 7/8 absent from this update
    closed_form_weights(log_w, bin_loss, present, cfg)
    # 1/0.501, 1/0.25 (the sign of L_mu does not matter), 1/0.001 -> 10, 1/2.001, 1/30.001 -> 0.1, 1/0.1 = 10, kept
    expected = [0.0, 1 / 0.501, 4.0, 10.0, 1 / 2.001, 0.1, 10.0, 0.5, 0.0]
    assert bin_weights(log_w, "closed").tolist() == pytest.approx(expected, rel=1e-12)
    # the same function, applied as the global control, gives every bin the mean of bins 1/8 .. 7/8
    shared = sum(expected) / 7
    assert bin_weights(log_w, "closed", shared=True).tolist() == pytest.approx([0.0] + [shared] * 7 + [0.0], rel=1e-12)
    # delta 0 and L_mu = 0: an infinite fixed point, clamped to w_max, not a crash or a nan
    closed_form_weights(log_w, bin_loss, present, Config(weighting="closed", daro_delta=0.0))
    assert bin_weights(log_w, "closed")[3].item() == pytest.approx(10.0, rel=1e-12)


def test_shared_weight_is_the_mean_of_the_learned_ones_hand_worked():
    """--shared_weight: the learned weights still take their own Adam steps; every bin weighs their mean. Weights
    e^0 = 1, e^-ln2 = 2 (s = -ln 2), e^ln4 = 1/4, and four at 1: mean (1 + 2 + 0.25 + 4) / 7 = 7.25 / 7."""
    log_w = make_log_w([0.0, -math.log(2.0), math.log(4.0), 0.0, 0.0, 0.0, 0.0], torch.float64)
    w = bin_weights(log_w, "learned", shared=True)
    assert w.tolist() == pytest.approx([0.0] + [7.25 / 7] * 7 + [0.0], rel=1e-12)
    assert bin_weights(log_w, "learned")[2].item() == pytest.approx(2.0, rel=1e-12)  # unshared: each its own
    assert torch.equal(bin_weights(log_w, "uniform", shared=False)[1:G], torch.ones(G - 1, dtype=torch.float32))


@pytest.mark.parametrize("flags, message", [
    ({"weighting": "closd"}, "--weighting 'closd': choose one of learned, closed"),
    ({"weighting": "closed", "daro_literal": True}, "--daro_literal does not apply to --weighting closed"),
    ({"daro_delta": -1e-3}, "--daro_delta must be >= 0"),
    ({"weight_lr": 0.0}, "--weighting learned needs --weight_lr > 0"),
    ({"weighting": "uniform", "shared_weight": True}, "--shared_weight needs --weighting learned or closed"),
])
def test_bad_weighting_flags_stop_with_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as stop:
        check_algorithm_config(Config(**flags))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    check_algorithm_config(Config(weighting="closed", weight_lr=0.0))  # closed has no optimizer: its lr is moot


def test_bin_token_weights_hand_worked():
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    bins = torch.tensor([1, 1, 3, 0, 8])  # bins 0 and G (mu = 0, 1) weigh nothing
    tokens = tokens_per_bin(mask, bins, G)
    assert tokens.tolist() == [3, 6, 0, 5, 0, 0, 0, 0, 1]
    weights = bin_token_weights(mask, bins, tokens)
    expected = mask.float() * torch.tensor([[1 / 6], [1 / 6], [1 / 5], [0.0], [0.0]])
    assert torch.allclose(weights, expected)
    assert bin_weights(make_log_w(), "uniform").tolist() == [0.0] + [1.0] * (G - 1) + [0.0]
    var = bin_weights(make_log_w(), "var")
    assert var[4].item() == pytest.approx(0.5) and var[1].item() == pytest.approx(math.sqrt(7) / 8)
    assert bin_weights(make_log_w([math.log(2.0)] * (G - 1)), "learned")[3].item() == pytest.approx(0.5)
    assert bin_weights(make_log_w(), "none").tolist() == [1.0] * (G + 1)


# -----------------------------------------------------------------------------------------------------------------
# One update on the real tiny model: micro-batch split, per-bin losses, both readings


@pytest.fixture
def update_batch(float64_model):
    """The tiny demo model in float64 and 16 completions in bins 0..G (edge bins included), with off-policy old
    log-probs: the exactness checks below then measure the method, not float32's summation order."""
    model, tok = float64_model
    g = torch.Generator().manual_seed(0)
    n = 16
    batch = off_policy_batch(model, tok, n, g)
    mask = batch["mask"] = batch["mask"].double()
    bins = torch.tensor([1, 1, 2, 0, 3, 3, 3, 8, 5, 5, 7, 1, 0, 2, 7, 5])  # bins 4/8 and 6/8 empty
    batch.update(bin=bins, advantage=torch.randn(n, generator=g, dtype=torch.float64),
                 weight=bin_token_weights(mask, bins, tokens_per_bin(mask, bins, G)))
    log_w = make_log_w(torch.linspace(-0.5, 0.7, G - 1).tolist(), torch.float64)  # away from 1, all different
    return model, batch, log_w


def same_scale(a, b):
    """Equal up to float64 summation order (which differs between micro-batch splits), at the tensor's own scale."""
    return (a - b).abs().max() <= 1e-10 * a.abs().max() + 1e-14


def run_update(model, batch, log_w, sizes):
    """The script's update, step 4: per-bin weighted losses over the given micro-batch sizes.
    Returns (loss, model gradients, L_mu (G+1,))."""
    coef = bin_weights(log_w, "learned").requires_grad_()
    coef.grad = torch.zeros_like(coef)
    total, grads = accumulate(model, batch, sizes, lambda mb: mb["weight"] * coef[mb["bin"]].unsqueeze(-1))
    return total, grads, coef.grad.clone()


def direct_bin_losses(model, batch):
    """L_mu by the formula, Eq. (2), on the whole batch at once: the token mean of the clipped loss within each bin."""
    logp, _ = shortcuts.token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["mask"].shape[1])
    ratio = torch.exp(logp - batch["old_logp"])
    adv = batch["advantage"].unsqueeze(-1)
    token_loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28)) * batch["mask"]
    return [(token_loss[batch["bin"] == i].sum() / batch["mask"][batch["bin"] == i].sum()) if (batch["bin"] == i).any()
            else torch.zeros(()) for i in range(G + 1)]


def test_microbatch_split_does_not_change_bin_losses_or_gradient(update_batch):
    model, batch, log_w = update_batch
    loss_one, grads_one, bins_one = run_update(model, batch, log_w, [16])
    loss_many, grads_many, bins_many = run_update(model, batch, log_w, [1, 6, 2, 7])
    assert loss_one == pytest.approx(loss_many, rel=1e-10, abs=1e-14)
    assert torch.allclose(bins_one, bins_many, rtol=1e-10, atol=1e-14)
    assert all(same_scale(a, b) for a, b in zip(grads_one, grads_many))
    # L_mu is the within-bin token mean, Eq. (2); bins 0, G and the empty ones are exactly 0
    direct = torch.stack([x.detach() for x in direct_bin_losses(model, batch)])
    expected = direct.index_fill(0, torch.tensor([0, G]), 0.0)
    assert torch.allclose(bins_one, expected, rtol=1e-10, atol=1e-14)
    assert bins_one[4] == 0 and bins_one[6] == 0 and (bins_one[[1, 2, 3, 5, 7]] != 0).all()
    # the loss is sum_mu w_mu L_mu, and the edge bins' advantages do not matter at all
    w = bin_weights(log_w, "learned")
    assert loss_one == pytest.approx((w * bins_one).sum().item(), rel=1e-10)
    edited = {**batch, "advantage": batch["advantage"].clone()}
    edited["advantage"][batch["bin"] == 0] = 5.0
    edited["advantage"][batch["bin"] == G] = -5.0
    _, grads_edge, _ = run_update(model, edited, log_w, [16])
    assert all(torch.equal(a, b) for a, b in zip(grads_one, grads_edge))


def test_guarded_and_literal_readings_share_the_model_gradient(update_batch):
    """Eq. (1) as written, differentiated jointly in theta and s by autograd, vs the script's update: same model
    gradient sum_mu w_mu grad L_mu; the weights' gradients differ only by -w_mu * delta when every L_mu > 0."""
    model, batch, log_w = update_batch
    _, grads_script, bin_loss = run_update(model, batch, log_w, [5, 11])
    present = torch.tensor([(batch["bin"] == i).any() and 0 < i < G for i in range(G + 1)])
    # the literal objective, one autograd graph through theta and the weights
    model.zero_grad()
    joint = make_log_w([s.item() for s in log_w], torch.float64)
    losses = direct_bin_losses(model, batch)
    objective = sum(torch.exp(-s) * losses[i] + s for i, s in enumerate(joint, 1) if present[i])
    objective.backward()
    assert all(same_scale(a, p.grad) for a, p in zip(grads_script, model.parameters()))
    literal = make_log_w([s.item() for s in log_w], torch.float64)
    weight_objective(literal, bin_loss, present, 1e-3, literal=True).backward()
    for s_joint, s_lit, i in zip(joint, literal, range(1, G)):
        assert (s_lit.grad is None) == (not present[i])
        if present[i]:
            assert s_lit.grad.item() == pytest.approx(s_joint.grad.item(), rel=1e-10, abs=1e-14)
    # every L_mu positive: guarded minus literal = -w_mu * delta, bin by bin
    positive = bin_loss.abs() + 0.1
    delta = 1e-3
    guarded, literal = make_log_w([s.item() for s in log_w]), make_log_w([s.item() for s in log_w])
    weight_objective(guarded, positive, present, delta, literal=False).backward()
    weight_objective(literal, positive, present, delta, literal=True).backward()
    for s_g, s_l, i in zip(guarded, literal, range(1, G)):
        if present[i]:
            assert s_g.grad.item() - s_l.grad.item() == pytest.approx(-math.exp(-s_g.item()) * delta, rel=1e-3)


# -----------------------------------------------------------------------------------------------------------------
# End to end: every preset, and a resume


@pytest.fixture(scope="module")
def coin(demo_dir, tmp_path_factory):
    """A model that answers '1+1' with \\boxed{1} or \\boxed{2} about equally often (a few seconds of supervised
    steps on the demo model), and a data file of that problem: nearly every group is mixed, so every preset trains in
    every step and many bins occur, which the demo model on the arith task (it solves few sums) does not guarantee."""
    folder = tmp_path_factory.mktemp("coin")
    model, tok = modeling.load_model(demo_dir, torch.device("cpu"))
    warm_start(model, tok, [{"prompt": "1+1", "answer": str(1 + i % 2)} for i in range(64)], steps=30)
    model.save_pretrained(folder / "model")
    tok.save_pretrained(folder / "model")
    with open(folder / "coin.jsonl", "w") as f:
        f.writelines(json.dumps({"problem": "1+1", "answer": "2"}) + "\n" for _ in range(16))
    return str(folder / "model"), str(folder / "coin.jsonl")


def daro_args(coin, out, *extra):
    model, data = coin
    return ["daro.py", "--demo", "arith", "--model", model, "--train_data", data, "--eval_data", data,
            "--prompt_template", "none", "--out_dir", str(out), "--prompts_per_step", "8", "--updates_per_step", "2",
            "--eval_size", "16", "--eval_samples", "2", *extra]


def start(args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out


def train_records(out):
    return [r for r in map(json.loads, open(out / "metrics.jsonl")) if "train/loss" in r]


def test_every_preset_runs_and_logs_every_bin(coin, tmp_path):
    """`python daro.py --algo X --steps 2` for every preset, all started at once (each run is mostly start-up)."""
    procs = {algo: start(daro_args(coin, tmp_path / algo, "--algo", algo, "--steps", "2")) for algo in PRESETS}
    results = {algo: finish(proc) for algo, proc in procs.items()}
    mus = [f"{i / G:.3f}" for i in range(1, G)]
    for algo, stdout in results.items():
        out = tmp_path / algo
        train = train_records(out)
        assert [r["step"] for r in train] == [1, 2], algo
        assert "step    2/2 |" in stdout and "| w " in stdout and "eval/acc before" in stdout
        cfg = json.load(open(out / "config.json"))
        given = {"updates_per_step"}  # daro_args sets it: it overrides GSPO's 4 (with a note)
        assert cfg["algo"] == algo and all(cfg[k] == v for k, v in PRESETS[algo].items() if k not in given)
        for r in train:
            for key in ["train/loss", "train/grad_norm", "train/entropy", "train/clipfrac_high", "time/step_s"] + \
                    [f"daro/{x}_{mu}" for x in "wLn" for mu in mus] + ["daro/n_0.000", "daro/n_1.000"]:
                assert math.isfinite(r[key]), (algo, key)
            assert sum(r[f"daro/n_{i / G:.3f}"] for i in range(G + 1)) == r["train/num_groups"] > 0
            assert r["train/grad_norm"] > 0, algo  # the coin model gives mixed groups: every preset really trains
            # L_mu is measured (on-policy, a bin whose completions share one length has L_mu = 0 exactly: the sign
            # problem of the docstring, so not every bin)
            assert any(r[f"daro/L_{mu}"] != 0 for mu in mus), algo
        w = torch.tensor([train[-1][f"daro/w_{mu}"] for mu in mus])
        mu = torch.arange(1, G) / G
        if algo == "daro":  # learned: moved from 1 by at most weight_lr per update (4 updates), within the clamp
            assert (w != 1).any() and (w.log().abs() < 0.02).all()
        elif algo == "var":
            assert torch.allclose(w, (mu * (1 - mu)).sqrt())
        else:
            assert torch.equal(w, torch.ones(G - 1))
        if algo not in ("grpo", "dr_grpo", "gspo"):  # dynamic sampling: only mixed groups are trained on
            assert train[-1]["daro/n_0.000"] == 0 and train[-1]["daro/n_1.000"] == 0
    # step 1 rolls out the same groups in every run: the weights must reach the model's loss (whose gradient the
    # update follows). DARO starts at w = 1, so its first update is the uniform one (its second sees weights moved by
    # ~weight_lr); var's is not. (The loss, not the gradient norm: the second update's gradient is ~1e-5 here.)
    loss = {algo: train_records(tmp_path / algo)[0]["train/loss"] for algo in ("daro", "uniform", "var")}
    assert loss["daro"] == pytest.approx(loss["uniform"], rel=1e-2) and loss["daro"] != loss["uniform"]
    assert loss["var"] != pytest.approx(loss["uniform"], rel=1e-3)


# closed: w_max raised so that the bins' 1 / (|L_mu| + delta) are not all cut to the same clamp (under torch's
# ATEN_CPU_CAPABILITY=default kernels every bin's lies above the default w_max 10 here, and the weights tie)
@pytest.mark.parametrize("mode", [[], ["--weighting", "closed", "--w_max", "1000"], ["--shared_weight"]])
def test_resume_restores_the_weights_and_their_optimizer(coin, tmp_path, capsys, mode):
    """3 steps in one go (checkpoints every step) vs 2 steps + --resume for the 3rd: the same weights at step 3. A
    large weight_lr makes the weights move far from 1, so a lost weight or Adam state would show; the closed form's
    weights are far from 1 at once (its state is s_mu alone), the shared control's are one mean. In-process
    (main(parse_config(argv)), the script's own entry) to save two interpreter start-ups."""
    out = tmp_path / "run"
    args = daro_args(coin, out, "--steps", "3", "--save_every", "1", "--weight_lr", "0.2", *mode)[1:]
    daro.main(config.parse_config(Config, args, PRESETS))
    straight = train_records(out)[-1]
    state = torch.load(out / "step_000002" / "trainer.pt", weights_only=False)
    assert state["daro_neg_log_w"].shape == (G - 1,) and state["daro_neg_log_w"].abs().max() > 0.1
    assert (len(state["weight_optimizer"]["state"]) > 0) == ("closed" not in mode)  # closed: no optimizer steps
    ws = [straight[f"daro/w_{i / G:.3f}"] for i in range(1, G)]
    assert (max(ws) == pytest.approx(min(ws), rel=1e-6)) == ("--shared_weight" in mode) and max(ws) != 1
    shutil.rmtree(out / "step_000003")
    capsys.readouterr()
    daro.main(config.parse_config(Config, args + ["--resume"], PRESETS))
    stdout = capsys.readouterr().out
    assert "resumed from" in stdout and "(step 2)" in stdout
    resumed = train_records(out)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for i in range(1, G):
        key = f"daro/w_{i / G:.3f}"
        assert resumed[-1][key] == pytest.approx(straight[key], rel=1e-5, abs=1e-7), key
    assert resumed[-1]["train/loss"] == pytest.approx(straight["train/loss"], rel=1e-4, abs=1e-7)


def test_weight_lr_bounds_how_far_the_weights_travel():
    """What docs/metrics.md says of --weight_lr, checked on the real weight step: Adam moves ln w by ~weight_lr per
    update whatever the bin's loss, so after 120 updates at 1e-3 every bin's w is ~exp(0.12) = 1.13, for a loss scale
    of 0.1 (fixed point 9.9) and of 0.004 (fixed point 200) alike: the bins rise together."""
    cfg = config.parse_config(daro.Config, ["--group_size", "4"], daro.PRESETS)
    neg_log_w = [torch.zeros((), requires_grad=True) for _ in range(3)]
    opt = torch.optim.Adam(neg_log_w, lr=cfg.weight_lr)
    bin_loss = torch.tensor([0.0, 0.1, 0.004, -0.05, 0.0])  # per bin mu = 0, 1/4, .., 1; |L_mu| is what the weights fit
    for _ in range(120):
        daro.update_weights(neg_log_w, opt, bin_loss, torch.tensor([False, True, True, True, False]), cfg)
    travel = [-s.item() for s in neg_log_w]
    assert all(abs(t - 120 * cfg.weight_lr) < 2e-3 for t in travel), travel
    docs = " ".join(open(os.path.join(ROOT, "docs", "metrics.md"), encoding="utf-8").read().split())
    assert "ln w_mu travels at most ~weight_lr x (weight updates): 0.12 in the demo's 120 updates (w <= 1.13)" in docs


def test_mechanism_trace_records_every_update_and_bin(tmp_path):
    """experiments/daro_mechanism.py on one step of the hard task: a record per update with every present bin; Adam's
    first step moves each bin's ln w by lr exactly (then its gradient's size no longer matters), the loss and gradient
    shares sum to 1 over the bins, and every w sits at or below its fixed point at the start."""
    from experiments import daro_mechanism
    out = str(tmp_path / "m")
    daro_mechanism.main(["--tasks", "hard", "--seeds", "0", "--steps", "1", "--out", out])
    updates = json.load(open(out + ".json"))["hard"]["0"]
    assert len(updates) == 4 and all(u["step"] == 1 and u["bins"] for u in updates)  # 4 updates per step
    first = updates[0]["bins"].values()
    assert all(abs(b["moved_lr"] - 1.0) < 1e-4 and b["w"] == 1.0 <= b["fixed"] for b in first)
    for u in updates:
        assert sum(b["loss_share"] for b in u["bins"].values()) == pytest.approx(1.0)
        assert sum(b["grad_share"] for b in u["bins"].values()) == pytest.approx(1.0)
    assert "| step | bins |" in open(out + ".md").read() and daro.DARO is daro_mechanism.TracedDARO.__bases__[0]
