"""bench/learning.py's statistics by hand: the intervals, the interpolations and the bins' loss shares that the
README's claim table is built from, and its bad-input errors."""
import importlib.util
import math
import os

import pytest

from conftest import ROOT, run_script

spec = importlib.util.spec_from_file_location("learning", os.path.join(ROOT, "bench", "learning.py"))
learning = importlib.util.module_from_spec(spec)
spec.loader.exec_module(learning)


def test_mean_ci_is_the_95_percent_t_interval():
    mean, half = learning.mean_ci([1.0, 2.0, 3.0])  # stdev 1, n 3: t(0.975, 2) / sqrt(3)
    assert mean == 2.0 and half == pytest.approx(4.303 / math.sqrt(3))
    assert math.isnan(learning.mean_ci([5.0])[1])


def test_crossing_interpolates_the_first_reach():
    assert learning.crossing([0, 10, 20], [0.4, 0.5, 0.7], 0.6) == pytest.approx(15)
    assert learning.crossing([0, 10], [0.6, 0.7], 0.55) == 0  # already there at the start
    assert learning.crossing([0, 10], [0.4, 0.5], 0.55) == math.inf


def test_summarise_reads_budget_and_target_off_the_curves():
    train = [{"step": s, "train/loss": 0.0, "train/num_completions": 100} for s in (1, 2, 3, 4)]
    evals = [{"step": s, "eval/acc": a, "eval/acc_level1": a, "eval/pass@2": a + 0.1} for s, a in
             ((0, 0.4), (2, 0.6), (4, 0.8))]
    x = learning.summarise(train + evals, budget=300, target=0.5)
    # 300 completions lie halfway between step 2 (200 spent) and step 4 (400): halfway from 0.6 to 0.8
    assert x["at_budget"] == pytest.approx(0.7) and x["to_target"] == pytest.approx(1.0)
    assert x["final"] == 0.8 and x["levels"] == {1: 0.8} and x["start_levels"] == {1: 0.4}
    assert x["pass"] == {2: pytest.approx(0.9)} and x["completions"] == 400
    assert math.isnan(learning.summarise(train + evals, budget=500, target=0.5)["at_budget"])  # past the run


def test_bin_shares_weigh_each_bin_loss_by_its_weight():
    records = [{"step": 1, "daro/L_0.500": 0.2, "daro/L_0.125": -0.1, "daro/w_0.500": 1.0, "daro/w_0.125": 2.0},
               {"step": 2, "daro/L_0.500": 0.0, "daro/L_0.125": 0.0}]  # nothing trained: no share at all
    bins, steps, shares = learning.bin_shares(records)
    assert bins == ["0.125", "0.500"] and steps == [1]
    assert shares[0] == pytest.approx([0.5, 0.5])  # |2 x -0.1| = |1 x 0.2|


@pytest.mark.parametrize("args, message", [(["--methods", "dapo,nope"], "--methods: unknown nope"),
                                           (["--seeds", "0"], "--seeds: give 2 to 10 seeds")])
def test_bad_flags_exit_2_naming_the_flag(args, message):
    r = run_script(["bench/learning.py", *args], timeout=60)
    assert r.returncode == 2 and message in r.stderr
