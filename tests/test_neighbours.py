"""DA3PO's neighbours (neighbours.py, --algo maxrl | dgpo | asym | hadw): each paper's formula against the one written
here independently, in float64 on hand-worked groups and on the golden vectors; the loss and metrics the same whatever
the micro-batch split and on 2 gloo ranks; the same collectives on both ranks of a real torchrun run with skewed data;
HA-DW's anchor carried exactly across a checkpoint; a 3-step run of each in both demos.
Run: python -m pytest -q tests/test_neighbours.py"""
import json
import math
import os
import random
import statistics
import subprocess
import sys

import pytest
import torch

import common
import neighbours
from da3po import PRESETS, Config
from tests import golden_neighbours
from tests.conftest import ROOT, accumulate, off_policy_batch, run_script

F64 = dict(dtype=torch.float64)


# --------------------------------------------------------------------------------------------------------------------
# The formulas, written here again in plain Python: one group (a list of G numbers) at a time


def maxrl_ref(c: list) -> list:
    """MaxRL (arXiv:2602.02710, Alg. 1 and Eq. final-estimator): N (r_i / K - 1 / N), and 0 when K = 0."""
    N, K = len(c), sum(c)
    return [N * (r / K - 1 / N) if K else 0.0 for r in c]


def linear_r_ref(c: list) -> list:
    """Linear-R (arXiv:2602.11128): w (r - rho) with w = 1 / rho; -1 (the limit) for a wrong answer at rho = 0."""
    rho = sum(c) / len(c)
    return [(r - rho) / rho if rho else -1.0 for r in c]


def dgae_ref(R: list) -> list:
    """DGAE (arXiv:2601.20614; MathForge's trainer): G (R_i - mean) / sum_j |R_j - mean|, 0 on equal rewards."""
    m = sum(R) / len(R)
    spread = sum(abs(x - m) for x in R)
    return [len(R) * (x - m) / spread if spread else 0.0 for x in R]


def dqw_ref(correct: list, T: float) -> list:
    """DQW: B_v exp(D_s / T) / sum_valid exp(D_s' / T), D = -mean accuracy, over the valid (mixed) groups; 1 else."""
    valid = [0 < sum(c) < len(c) for c in correct]
    e = [math.exp(-sum(c) / len(c) / T) for c in correct]
    total = sum(x for x, v in zip(e, valid) if v)
    return [sum(valid) * x / total if v else 1.0 for x, v in zip(e, valid)]


def grpo_ref(R: list) -> list:
    """GRPO's advantages as common.group_advantages computes them: (R_i - mean) / (unbiased std + 1e-6)."""
    m = sum(R) / len(R)
    return [(x - m) / (statistics.stdev(R) + 1e-6) for x in R]


def sgn(x: float) -> int:
    return (x > 0) - (x < 0)


def hadw_phi_ref(A: list, c: list, C: float, scale: float) -> list:
    """HA-DW (arXiv:2601.08521): diff = p_hat - C (Eq. 13), D_i = -sgn(A_i) sgn(diff) (Eq. 14), M = |diff| (Eq. 15),
    Phi_i = lambda_scale exp(D_i M) (Eq. 16)."""
    diff = sum(c) / len(c) - C
    return [scale * math.exp(-sgn(a) * sgn(diff) * abs(diff)) for a in A]


def window_priors_ref(ys: list, h: int) -> list:
    """The window anchor (App. F, Eq. 134) each step's weights use: the mean of the h accuracies before it (Eq. 12:
    the prior is the last posterior); at the first step, its own accuracy."""
    return [ys[0]] + [sum(ys[max(0, t - h):t]) / len(ys[max(0, t - h):t]) for t in range(1, len(ys))]


def kalman_priors_ref(ys: list, m: int, eta: float) -> list:
    """The Kalman-style anchor (Eqs. 8-12): C+ = (1 - eta_t) C- + eta_t y, eta_t = eta * pstdev(the last m beliefs),
    at most 1; the first belief is the first accuracy, and eta_t = eta while one belief is all there is."""
    beliefs, priors = [], []
    for y in ys:
        priors.append(beliefs[-1] if beliefs else y)
        recent = beliefs[-m:]
        e = min(1.0, eta * (statistics.pstdev(recent) if len(recent) > 1 else 1.0))
        beliefs.append((1 - e) * beliefs[-1] + e * y if beliefs else y)
    return priors


def close(a, b, tol=1e-12):
    return abs(a - b) <= tol * (1 + abs(b))


# --------------------------------------------------------------------------------------------------------------------
# Hand-worked groups


def test_maxrl_hand_worked():
    # K = 1 of G = 4: p = 1/4, the correct one (1 - 1/4) / (1/4) = 3, the wrong ones (0 - 1/4) / (1/4) = -1;
    # K = 2 of 8: p = 1/4 again, the same values; K = 0 and K = G: no gradient
    assert neighbours.maxrl_advantages(torch.tensor([[1, 0, 0, 0]], **F64)).tolist() == [[3.0, -1.0, -1.0, -1.0]]
    c = torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0], [0] * 8, [1] * 8], **F64)
    assert neighbours.maxrl_advantages(c).tolist() == [[3.0] * 2 + [-1.0] * 6, [0.0] * 8, [0.0] * 8]
    # the advantage of a correct answer is 1 / p - 1: the inverse pass rate of maximum likelihood, less the baseline
    g = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 1, 0, 0]], **F64)
    assert neighbours.maxrl_advantages(g)[:, 0].tolist() == pytest.approx([5 - 1, 5 / 3 - 1], rel=1e-15)


def test_linear_r_hand_worked_and_its_one_difference_from_maxrl():
    c = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]], **F64)
    # rho = 1/4: [3, -1, -1, -1]; rho = 0: every answer -1 (the weighting's signal where GRPO and MaxRL give none);
    # rho = 1: 0; rho = 3/4: (1 - 3/4) / (3/4) = 1/3 and -1
    assert neighbours.linear_r_advantages(c).tolist() == [[3.0, -1.0, -1.0, -1.0], [-1.0] * 4, [0.0] * 4,
                                                          [1 / 3, 1 / 3, 1 / 3, -1.0]]
    # w = 1 / rho gives MaxRL's advantages on every group with a correct answer: they differ on all-wrong groups only
    rng = torch.Generator().manual_seed(0)
    c = (torch.rand(200, 8, generator=rng) < torch.rand(200, 1, generator=rng)).double()
    some = c.sum(-1) > 0
    assert torch.equal(neighbours.linear_r_advantages(c)[some], neighbours.maxrl_advantages(c)[some])
    assert (neighbours.linear_r_advantages(c)[~some] == -1).all() and (~some).any()


def test_dgae_hand_worked():
    # [1, -1, -1, -1]: mean -1/2, |R - mean| = [3/2, 1/2, 1/2, 1/2], MAD = 3/4: A = [2, -2/3, -2/3, -2/3]
    # (GRPO's unbiased std is 1 here: [1.5, -0.5, ...]); the |A| of a group sum to G whatever its pass rate
    R = torch.tensor([[1.0, -1.0, -1.0, -1.0], [1.0, 1.0, 1.0, -1.0], [-1.0] * 4], **F64)
    A = neighbours.dgae_advantages(R)
    assert A[0].tolist() == pytest.approx([2, -2 / 3, -2 / 3, -2 / 3], rel=1e-15)
    assert A[:2].abs().sum(-1).tolist() == pytest.approx([4.0, 4.0], rel=1e-15) and A[2].tolist() == [0.0] * 4
    # a two-level reward: MAD = 2 p (1 - p) times the gap, so A does not depend on the reward's levels
    assert torch.allclose(neighbours.dgae_advantages(R * 3 + 7), A, rtol=1e-14, atol=0)


def test_dqw_hand_worked():
    # valid groups p = 1/4 and 1/2, T = 2: weights 2 e^(-1/8) / (e^(-1/8) + e^(-1/4)) = 1.0624... and
    # 2 e^(-1/4) / (...) = 0.9375...; the all-wrong and all-correct groups keep 1
    c = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], **F64)
    s = neighbours.dqw_sums(c, 2.0)
    total = math.exp(-1 / 8) + math.exp(-1 / 4)
    assert s.tolist() == pytest.approx([2, total], rel=1e-15)
    w = neighbours.dqw_weights(c, 2.0, s)[:, 0].tolist()
    assert w == pytest.approx([2 * math.exp(-1 / 8) / total, 2 * math.exp(-1 / 4) / total, 1, 1], rel=1e-15)
    assert w[0] == pytest.approx(1.0624187467475, rel=1e-12) and (w[0] + w[1]) / 2 == pytest.approx(1, rel=1e-15)
    # the softmax spans every rank: the sums of two halves, added, give the whole batch's weights
    halves = neighbours.dqw_sums(c[:1], 2.0) + neighbours.dqw_sums(c[1:], 2.0)
    assert torch.equal(neighbours.dqw_weights(c[:1], 2.0, halves), neighbours.dqw_weights(c, 2.0, s)[:1])
    # a large T weighs every valid group 1; a small one gives the hardest nearly all of B_v
    assert neighbours.dqw_weights(c, 1e6, neighbours.dqw_sums(c, 1e6))[:2, 0].tolist() == pytest.approx([1, 1])
    assert neighbours.dqw_weights(c, 0.01, neighbours.dqw_sums(c, 0.01))[0, 0].item() == pytest.approx(2, rel=1e-9)


def test_hadw_hand_worked():
    # anchor C = 1/2. A hard group [1, 0, 0, 0]: p = 1/4, diff = -1/4; its correct answer (A > 0) gets D = +1, the
    # wrong ones D = -1: Phi = 1.3 e^(1/4) and 1.3 e^(-1/4). An easy group [1, 1, 1, 0]: diff = +1/4, the other way
    # round. A group at the anchor [1, 1, 0, 0]: Phi = 1.3 for all. An all-wrong group: A = 0, so D = 0 and Phi = 1.3
    c = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], **F64)
    A = torch.tensor([[1.5, -0.5, -0.5, -0.5], [0.5, 0.5, 0.5, -1.5], [1, 1, -1, -1], [0, 0, 0, 0]], **F64)
    up, down = 1.3 * math.exp(0.25), 1.3 * math.exp(-0.25)
    assert neighbours.hadw_weights(A, c, 0.5, 1.3).flatten().tolist() == pytest.approx(
        [up, down, down, down, down, down, down, up] + [1.3] * 8, rel=1e-15)
    # the anchor: accuracies 1/2, 1/4, 3/4. Window h = 2: priors 1/2 (the first step's own), 1/2, (1/2 + 1/4) / 2.
    # Kalman, eta = 1: C1 = 1/2; one belief, eta_2 = 1: C2 = 1/4; sigma over [1/2, 1/4] = 1/8: C3 = 7/8 C2 + 1/8 * 3/4
    ys = [0.5, 0.25, 0.75]
    for kind, want, last in (("window", [0.5, 0.5, 0.375], 0.5), ("kalman", [0.5, 0.5, 0.25], 0.3125)):
        beliefs, priors = [], []
        for t in range(3):
            priors.append(beliefs[-1] if beliefs else ys[t])
            beliefs.append(neighbours.next_anchor(beliefs, ys[max(0, t - 1):t + 1], kind, 1.0))
        assert priors == want and beliefs[-1] == last, kind


@pytest.mark.parametrize("seed", range(5))
def test_random_groups_against_the_formulas(seed):
    rng = random.Random(seed)
    G = rng.choice([2, 3, 5, 8, 16])
    correct = [[int(rng.random() < p) for _ in range(G)] for p in [0, 1] + [rng.random() for _ in range(20)]]
    rewards = [[(1.0 if x else -1.0) - rng.choice([0, 0, 0.25, 0.5]) for x in row] for row in correct]
    T = rng.choice([0.5, 2.0, 5.0])
    c, R = torch.tensor(correct, **F64), torch.tensor(rewards, **F64)
    for got, ref in ((neighbours.maxrl_advantages(c), [maxrl_ref(x) for x in correct]),
                     (neighbours.linear_r_advantages(c), [linear_r_ref(x) for x in correct]),
                     (neighbours.dgae_advantages(R), [dgae_ref(x) for x in rewards])):
        assert got.dtype == torch.float64
        assert all(close(a, b) for a, b in zip(sum(got.tolist(), []), sum(ref, [])))
    w = neighbours.dqw_weights(c, T, neighbours.dqw_sums(c, T))[:, 0].tolist()
    assert all(close(a, b) for a, b in zip(w, dqw_ref(correct, T)))
    C, scale = rng.random(), rng.choice([0.5, 1.3, 2.0])
    A = common.group_advantages(R)
    assert all(close(a, b) for a, b in zip(A.flatten().tolist(), sum([grpo_ref(x) for x in rewards], [])))
    phi = neighbours.hadw_weights(A, c, C, scale).tolist()
    want = [hadw_phi_ref(a, x, C, scale) for a, x in zip(A.tolist(), correct)]
    assert all(close(a, b) for a, b in zip(sum(phi, []), sum(want, [])))
    ys, h, eta = [rng.random() for _ in range(30)], rng.choice([1, 3, 10]), rng.choice([0.5, 1.0, 4.0])
    for kind, ref in (("window", window_priors_ref(ys, h)), ("kalman", kalman_priors_ref(ys, h, eta))):
        observations, beliefs, priors = [], [], []
        for y in ys:  # as HADW keeps its history
            observations = (observations + [y])[-h:]
            priors.append(beliefs[-1] if beliefs else y)
            beliefs = (beliefs + [neighbours.next_anchor(beliefs, observations, kind, eta)])[-h:]
        assert all(close(a, b) for a, b in zip(priors, ref)), kind


def test_functions_keep_the_dtype():
    c = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    for f in (neighbours.maxrl_advantages, neighbours.linear_r_advantages, neighbours.dgae_advantages):
        assert f(c).dtype == torch.float32 and f(c.double()).dtype == torch.float64
    assert neighbours.hadw_weights(c, c, 0.5, 1.3).dtype == torch.float32
    assert neighbours.hadw_weights(c.double(), c.double(), 0.5, 1.3).dtype == torch.float64
    assert neighbours.dqw_weights(c.double(), 2.0, neighbours.dqw_sums(c.double(), 2.0)).dtype == torch.float64


# --------------------------------------------------------------------------------------------------------------------
# Golden vectors


def test_golden_file_is_what_the_script_writes():
    with open(golden_neighbours.PATH) as f:
        assert f.read() == golden_neighbours.dumps(golden_neighbours.build()), "run python -m tests.golden_neighbours"


def test_golden_vectors_against_the_formulas():
    data = json.load(open(golden_neighbours.PATH))
    assert data["dtype"] == "float64" and len(data["cases"]) >= 4
    compared = 0
    for case in data["cases"]:
        inp, exp = case["inputs"], case["expected"]
        w = dqw_ref(inp["correct"], inp["temperature"])
        want = {"maxrl": [maxrl_ref(x) for x in inp["correct"]], "linear_r": [linear_r_ref(x) for x in inp["correct"]],
                "dgae": [dgae_ref(x) for x in inp["rewards"]], "dqw": w,
                "dgpo": [[a * wi for a in dgae_ref(x)] for x, wi in zip(inp["rewards"], w)],
                "hadw": [[a * f for a, f in zip(grpo_ref(R), hadw_phi_ref(grpo_ref(R), x, inp["anchor"],
                                                                          inp["hadw_scale"]))]
                         for x, R in zip(inp["correct"], inp["rewards"])]}
        for key, ref in want.items():
            flat_got, flat_ref = torch.tensor(exp[key]).flatten().tolist(), torch.tensor(ref).flatten().tolist()
            assert len(flat_got) == len(flat_ref) and all(close(a, b) for a, b in zip(flat_got, flat_ref)), key
            compared += len(flat_got)
        assert exp["valid"] == [0 < sum(x) < len(x) for x in inp["correct"]]
    assert compared > 500
    # every case has an all-wrong group, where Linear-R's -1 is the only signal
    assert all(any(sum(x) == 0 for x in c["inputs"]["correct"]) for c in data["cases"])
    run = data["hadw_anchor"]
    ys, h, eta = run["inputs"]["observations"], run["inputs"]["window"], run["inputs"]["eta"]
    for kind, ref in (("window", window_priors_ref(ys, h)), ("kalman", kalman_priors_ref(ys, h, eta))):
        got = run["expected"][kind]
        assert len(got) == len(ys) > h and all(close(a, b) for a, b in zip(got, ref)), kind
    assert run["expected"]["window"] != run["expected"]["kalman"]


# --------------------------------------------------------------------------------------------------------------------
# The hooks: micro-batch split, ranks, the token mean over DGPO's valid groups


def _groups(G=4):
    ks = [1, 0, 2, G]  # a mixed group, an all-wrong one, a mixed one, an all-correct one
    return [{"correct": [j < k for j in range(G)], "reward": [1.0 if j < k else -1.0 for j in range(G)]} for k in ks]


@pytest.mark.parametrize("name", sorted(neighbours.NEIGHBOURS))
def test_microbatch_split_does_not_change_loss_or_gradient(float64_model, name):
    model, tok = float64_model
    g = torch.Generator().manual_seed(1)
    groups = _groups()
    batch = off_policy_batch(model, tok, 16, g)
    batch["reward"] = torch.tensor([r for x in groups for r in x["reward"]], **F64)
    batch["correct"] = torch.tensor([c for x in groups for c in x["correct"]])
    cfg = Config(**{**PRESETS[name], "group_size": 4, "max_new_tokens": 10})
    algo = neighbours.NEIGHBOURS[name](cfg, torch.device("cpu"), {})
    batch["advantage"] = algo.advantages(batch, groups)
    batch["weight"] = algo.start_update(batch, torch.arange(16))
    loss_one, grads_one = accumulate(model, batch, [16])
    loss_many, grads_many = accumulate(model, batch, [1, 4, 2, 5, 3, 1])
    assert loss_one == pytest.approx(loss_many, rel=1e-10, abs=1e-14)
    for a, b in zip(grads_one, grads_many):  # float64 summation order differs between splits: at its scale
        assert (a - b).abs().max() <= 1e-10 * a.abs().max() + 1e-14
    assert any(x.abs().sum() > 0 for x in grads_one)
    metrics = algo.end_step()
    assert set(metrics) == set(algo.KEYS) and algo.end_step() == dict.fromkeys(algo.KEYS, 0.0)


def test_dgpo_token_mean_spans_the_valid_groups_only():
    cfg = Config(**{**PRESETS["dgpo"], "group_size": 4, "max_new_tokens": 10})
    algo = neighbours.DGPO(cfg, torch.device("cpu"), {})
    groups = _groups()
    lengths = [[3, 1, 2, 5], [4, 4, 4, 4], [1, 2, 3, 4], [2, 2, 2, 2]]
    mask = torch.tensor([[1.0] * n + [0.0] * (5 - n) for row in lengths for n in row], **F64)
    batch = {"reward": torch.tensor([r for x in groups for r in x["reward"]], **F64), "mask": mask,
             "correct": torch.tensor([c for x in groups for c in x["correct"]])}
    algo.advantages(batch, groups)
    w = algo.start_update(batch, torch.arange(16))
    valid_tokens = sum(lengths[0]) + sum(lengths[2])  # groups 0 and 2 are mixed: 11 + 10 tokens
    assert torch.equal(w[:4], mask[:4] / valid_tokens) and torch.equal(w[8:12], mask[8:12] / valid_tokens)
    assert (w[4:8] == 0).all() and (w[12:] == 0).all()
    assert w.sum().item() == pytest.approx(1.0, rel=1e-15)


@pytest.mark.parametrize("anchor", ["window", "kalman"])
def test_hadw_anchor_continues_exactly_across_a_checkpoint(tmp_path, anchor):
    """Six steps in one run against three, a checkpoint of state_dict() (torch.save, loaded as bookkeeping loads it),
    and three more: the same advantages bit for bit, and the same metrics."""
    cfg = Config(**{**PRESETS["hadw"], "group_size": 4, "hadw_anchor": anchor, "hadw_window": 3})
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(6):
        correct = torch.rand(5, 4, generator=g) < torch.rand(5, 1, generator=g)
        batches.append({"correct": correct.flatten(), "reward": correct.flatten().double() * 2 - 1})
    whole = neighbours.HADW(cfg, torch.device("cpu"), {})
    straight = [(whole.advantages(dict(b), []), whole.end_step()) for b in batches]
    first = neighbours.HADW(cfg, torch.device("cpu"), {})
    resumed = [(first.advantages(dict(b), []), first.end_step()) for b in batches[:3]]
    torch.save(first.state_dict(), tmp_path / "state.pt")
    second = neighbours.HADW(cfg, torch.device("cpu"), torch.load(tmp_path / "state.pt", weights_only=True))
    resumed += [(second.advantages(dict(b), []), second.end_step()) for b in batches[3:]]
    assert all(torch.equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(straight, resumed))
    anchors = [m["hadw/anchor"] for _, m in straight]
    assert len(set(anchors)) > 2 and len(second.state_dict()["hadw_beliefs"]) == 3
    # a fresh start instead of the checkpoint would weigh step 4 otherwise
    fresh = neighbours.HADW(cfg, torch.device("cpu"), {})
    assert not torch.equal(fresh.advantages(dict(batches[3]), []), straight[3][0])


def _torchrun(args, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_two_gloo_ranks_give_the_one_process_numbers(tmp_path):
    """The whole batch in one process vs split over 2 ranks (each its stride of the groups): the same advantages and
    token weights row by row, the same loss, the same metrics (DGPO's softmax, its token mean and HA-DW's
    batch accuracy span the ranks)."""
    r = run_script(["-m", "tests.dist_neighbours", str(tmp_path / "one.json")])
    assert r.returncode == 0, r.stderr[-3000:]
    r = _torchrun(["-m", "tests.dist_neighbours", str(tmp_path / "two.json")])
    assert r.returncode == 0, r.stderr[-3000:]
    one, two = json.load(open(tmp_path / "one.json")), json.load(open(tmp_path / "two.json"))
    assert set(one) == set(neighbours.NEIGHBOURS)
    for name in one:
        assert close(one[name]["loss"], two[name]["loss"]) and one[name]["loss"] != 0, name
        assert one[name]["metrics"].keys() == two[name]["metrics"].keys() and one[name]["state"] == two[name]["state"]
        assert all(close(one[name]["metrics"][k], two[name]["metrics"][k]) for k in one[name]["metrics"]), name
        assert [row[0] for row in one[name]["rows"]] == [row[0] for row in two[name]["rows"]] == list(range(40))
        assert all(close(a[1], b[1]) and close(a[2], b[2]) for a, b in zip(one[name]["rows"], two[name]["rows"]))


@pytest.mark.parametrize("name", sorted(neighbours.NEIGHBOURS))
def test_ranks_issue_the_same_collectives_with_skewed_data(tmp_path, name):
    """da3po.py --algo <name> under torchrun with rank 1's groups all wrong (tests/lockstep.py's onetoken skew, kept:
    the presets have no dynamic sampling): DGPO then has no valid group there, Linear-R only -1s."""
    from tests.test_lockstep import SMALL, launch
    code, stdout, stderr = launch(tmp_path, "da3po.py", "onetoken", [*SMALL, "--algo", name])
    assert code == 0, stderr[-3000:]
    traces = [json.load(open(tmp_path / f"collectives_rank{r}.json")) for r in (0, 1)]
    assert len(traces[0]) > 50 and traces[0] == traces[1]


# --------------------------------------------------------------------------------------------------------------------
# The runs: 3 steps of each in both demos; a bad --dgpo_temp


@pytest.mark.parametrize("demo", ["reasoning", "arith"])
@pytest.mark.parametrize("name", sorted(neighbours.NEIGHBOURS))
def test_three_steps_in_each_demo(tmp_path, name, demo):
    out = tmp_path / "run"
    r = run_script(["da3po.py", "--algo", name, "--demo", demo, "--steps", "3", "--eval_every", "0",
                    "--prompts_per_step", "8", "--group_size", "4", "--eval_size", "8", "--eval_samples", "1",
                    "--out_dir", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [x for x in records if "train/loss" in x]
    assert [x["step"] for x in train] == [1, 2, 3]
    assert all(k in x for x in train for k in neighbours.NEIGHBOURS[name].KEYS)
    assert sum(x["train/num_updates"] for x in train) > 0 and all(math.isfinite(x["train/loss"]) for x in train)
    config = json.load(open(out / "config.json"))
    assert config["algo"] == name and config["dynamic_sampling"] is False and config["lam"] == 1.0


def test_bad_dgpo_temp_stops_naming_the_flag(tmp_path):
    r = run_script(["da3po.py", "--algo", "dgpo", "--dgpo_temp", "0", "--out_dir", str(tmp_path / "x")])
    assert r.returncode == 2 and "--dgpo_temp must be > 0, got 0.0" in r.stderr + r.stdout
    for name in ("maxrl", "hadw"):
        r = run_script(["daro.py", "--algo", name, "--out_dir", str(tmp_path / "y")])
        assert r.returncode == 2 and f"invalid choice '{name}'" in r.stderr


@pytest.mark.parametrize("flags, message", [
    (["--hadw_window", "0"], "--hadw_scale must be > 0, --hadw_window >= 1 and --hadw_eta >= 0, got 1.3, 0, 1.0"),
    (["--hadw_scale", "-1"], "--hadw_scale must be > 0, --hadw_window >= 1 and --hadw_eta >= 0, got -1.0, 10, 1.0"),
    (["--hadw_anchor", "ema"], "--hadw_anchor 'ema': choose one of window, kalman")])
def test_bad_hadw_flags_stop_naming_the_flag(tmp_path, flags, message):
    r = run_script(["da3po.py", "--algo", "hadw", *flags, "--out_dir", str(tmp_path / "x")])
    assert r.returncode == 2 and message in r.stderr + r.stdout
