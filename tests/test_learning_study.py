"""experiments/learning.py's statistics by hand (t quantiles for any number of seeds, paired tests, Holm's adjustment,
the mean-of-the-last-three endpoint, the bounds, the mix trend), the protocol tables' consistency, its bad-flag exits,
and the committed data of tools/hard_prompts.py against its manifest."""
import hashlib
import json
import math
import os

import pytest

from experiments import daro_study, learning, neighbours_study
from tests.conftest import ROOT, run_script

DATA = os.path.join(ROOT, "experiments", "data")


@pytest.mark.parametrize("df, t", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (11, 2.2010), (19, 2.0930),
                                   (29, 2.0452), (120, 1.9799)])
def test_t_quantile_matches_the_printed_table_for_any_seed_count(df, t):
    # 97.5% points of Student's t (any statistics table); 12 seeds -> 11 degrees of freedom -> 2.201
    assert learning.t_quantile(0.975, df) == pytest.approx(t, abs=1e-4)


def test_two_sided_p_of_t_in_closed_form():
    # df = 2: P(|T| >= t) = 1 - t / sqrt(2 + t^2); df = 1 (Cauchy): 1 - 2 atan(t) / pi
    assert learning.t_two_sided_p(4.0, 2) == pytest.approx(1 - 4 / math.sqrt(18), abs=1e-12)
    assert learning.t_two_sided_p(1.0, 1) == pytest.approx(0.5, abs=1e-12)
    assert learning.t_two_sided_p(0.0, 7) == 1.0
    assert learning.t_two_sided_p(learning.t_quantile(0.975, 11), 11) == pytest.approx(0.05, abs=1e-10)


def test_mean_ci_and_the_paired_test_by_hand():
    mean, half = learning.mean_ci([1.0, 2.0, 3.0])  # stdev 1, n 3: t(0.975, 2) / sqrt(3)
    assert mean == 2.0 and half == pytest.approx(4.302653 / math.sqrt(3))
    assert math.isnan(learning.mean_ci([5.0])[1])
    # differences 0.1, 0.1, 0.2: mean 2/15, sd 1/sqrt(300), t = (2/15) / (1/30) = 4 on 2 df
    d = learning.paired([0.5, 0.6, 0.7], [0.4, 0.5, 0.5])
    assert d["mean"] == pytest.approx(2 / 15) and d["sd"] == pytest.approx(1 / math.sqrt(300))
    assert d["p"] == pytest.approx(1 - 4 / math.sqrt(18))
    assert d["hi"] - d["mean"] == pytest.approx(4.302653 / 30, abs=1e-6)
    assert learning.paired([0.3, 0.4], [0.3, 0.4])["p"] == 1.0  # identical arms: no difference at all


def test_holm_on_a_worked_example():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 -> 0.02, 0.03, 0.06, 0.04 -> running max 0.02, 0.03, 0.06, 0.06
    assert learning.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert learning.holm([0.3, 0.9]) == pytest.approx([0.6, 0.9])
    assert learning.holm([0.6, 0.7]) == pytest.approx([1.0, 1.0])  # capped at 1


def test_endpoint_is_the_mean_of_the_last_three_evals():
    evals = [{"step": s, "eval/acc": a} for s, a in ((0, 0.1), (10, 0.2), (20, 0.3), (30, 0.4), (40, 0.5))]
    assert learning.last_mean(evals, "eval/acc") == pytest.approx(0.4)  # (0.3 + 0.4 + 0.5) / 3
    run = {"evals": evals, "hard": "hard_eval", "K": 4}
    assert learning.value(run, "eval/acc", "start") == 0.1
    s = {"steps": 40, "eval_every": 10}
    assert learning.value(run, "eval/acc", "steps_to", 0.45, s) == pytest.approx(35)
    assert learning.value(run, "eval/acc", "steps_to", 0.9, s) == 50  # never reached: censored at steps + eval_every
    assert learning.metric_key("eval/{hard}/pass@K", run) == "eval/hard_eval/pass@4"
    assert learning.eval_steps(60, 10) == [0, 10, 20, 30, 40, 50, 60]
    assert learning.eval_steps(10, 3) == [0, 3, 6, 9, 10]


def test_crossing_interpolates_the_first_reach():
    assert learning.crossing([0, 10, 20], [0.4, 0.5, 0.7], 0.6) == pytest.approx(15)
    assert learning.crossing([0, 10], [0.6, 0.7], 0.55) == 0  # already there at the start
    assert learning.crossing([0, 10], [0.4, 0.5], 0.55) == math.inf


def test_bounds_say_what_the_data_exclude():
    d = {"mean": 0.002, "lo": -0.008, "hi": 0.012}
    assert learning.bound_text(d, 1, 100, "points") == "the data exclude gains above +1.2 and losses beyond -0.8 points"
    assert learning.bound_text({"mean": 0.02, "lo": 0.01, "hi": 0.03}, 1, 100, "points") == \
        "the data exclude gains below +1.0 and above +3.0 points"
    # steps to target: fewer is better, so a difference of -5 [-8, -2] steps is a gain of 2 to 8 steps
    assert learning.bound_text({"mean": -5, "lo": -8, "hi": -2}, -1, 1, "steps") == \
        "the data exclude gains below +2.0 and above +8.0 steps"
    assert learning.verdict({"mean": -0.01}, 1, 0.01) == "no: the reverse"
    assert learning.verdict({"mean": 0.01}, 1, 0.2) == "not shown"


def test_mix_trend_slope_per_seed():
    def runs(values):
        return [{"evals": [{"step": 0, "eval/hard_eval/acc": v}] * 3, "hard": "hard_eval", "K": 16} for v in values]
    # seed 0: DA3PO - DAPO = 0.04 on the hard set, 0.02 on the 50% mix -> slope 0.04; seed 1: 0.02 and 0.02 -> 0
    stats = {("hard", "dapo"): runs([0.5, 0.5]), ("hard", "da3po_lam2"): runs([0.54, 0.52]),
             ("mix_easy50", "dapo"): runs([0.4, 0.4]), ("mix_easy50", "da3po_lam2"): runs([0.42, 0.42])}
    points, slope = learning.mix_trend(stats, {"hard": {}, "mix_easy50": {}}, "eval/{hard}/acc")
    assert [(h, t) for h, t, _ in points] == [(0.5, "mix_easy50"), (1.0, "hard")]
    assert points[1][2]["mean"] == pytest.approx(0.03) and slope["mean"] == pytest.approx(0.02)


def test_protocol_tables_are_consistent():
    claims = [e["claim"] for e in learning.ENDPOINTS]
    assert len(claims) == len(set(claims))  # one primary per claim
    for e in learning.ENDPOINTS:
        task = learning.TASKS[e["task"]]
        arms = task["arms"] + task.get("study_arms", [])
        assert e["arm"] in arms and e["vs"] in arms and e["better"] in (1, -1)
        assert e["kind"] in ("last3", "steps_to") and ("target" in e) == (e["kind"] == "steps_to")
    for task in learning.TASKS.values():
        assert all(a in learning.ARMS for a in task["arms"])
    assert len(learning.TASKS["hard"]["arms"]) >= 10 and len(learning.PROTOCOL["seeds"]) >= 8


def test_the_daro_study_is_its_own_holm_family_at_the_papers_travel():
    """The study's arms run only when named; its weight lr makes lr x (weight updates) = 600 x 1e-3 on each task's
    horizon; its primaries form their own Holm family (the benchmark's report and p-values stay as they were)."""
    study = [e for e in learning.ENDPOINTS if e.get("family") == "daro_study"]
    assert len(study) == 7 and {e["task"] for e in study} == {"hard", "reasoning"}
    args = learning.parse_args(["--tasks", "hard,reasoning", "--arms", "dapo,daro_travel", "--seeds", "0,1"])
    assert "daro_travel" not in learning.task_arms("hard", [])  # the default benchmark does not run it
    for task, updates in (("hard", 60 * 4), ("reasoning", 20 * 4)):
        s = args.sets[task]
        cmd = learning.command(task, "daro_travel", 0, s, "/tmp/x")
        lr = float(cmd[cmd.index("--weight_lr") + 1])
        assert lr * updates == pytest.approx(0.6) and "{travel}" not in cmd
    def runs(values):
        return [{"evals": [{"step": 0, "eval/acc": v}] * 3, "hard": None, "K": 4} for v in values]
    stats = {("hard", "dapo"): runs([0.5, 0.5, 0.5]), ("hard", "daro"): runs([0.6, 0.6, 0.61]),
             ("hard", "daro_travel"): runs([0.6, 0.6, 0.61]), ("hard", "uniform"): runs([0.5, 0.5, 0.5])}
    sets = {"hard": {"steps": 60, "eval_every": 10}}
    study_rows = learning.primaries(stats, sets, "daro_study")
    bench_rows = learning.primaries(stats, sets)
    assert [r["id"] for r in study_rows] == ["D1", "D2"] and {r["id"] for r in bench_rows} == {"P3", "P4", "P5"}
    # the same difference in each family: Holm multiplies by the family's own size (2 here), not by 4
    assert study_rows[0]["p_adj"] == pytest.approx(min(1, 2 * study_rows[0]["d"]["p"]))


def test_the_neighbours_are_their_own_holm_family_with_a_fixed_pilot(monkeypatch):
    """Seven primaries on the hard set's accuracy, Holm across them alone; an arm without a command is reported, not
    run; the pilot's winner is the highest mean and a tie goes to KL-Cov, whatever the order of the arms."""
    family = [e for e in learning.ENDPOINTS if e.get("family") == "neighbours"]
    assert len(family) == 7 and {e["task"] for e in family} == {"hard"}
    assert {e["metric"] for e in family} == {"eval/{hard}/acc"} and {e["vs"] for e in family} == {"dapo", "da3po_lam2"}
    assert set(neighbours_study.design("neighbours")) == {"da3po_lam2", "dapo", "daro", "asym", "maxrl", "dgpo",
                                                          "da3po_entropy"}
    # HA-DW, built after these ran: a family of its own (H1 against its own base, GRPO; H2 against DAPO)
    hadw = [e for e in learning.ENDPOINTS if e.get("family") == "neighbours_hadw"]
    assert [(e["id"], e["arm"], e["vs"]) for e in hadw] == [("H1", "hadw", "grpo"), ("H2", "hadw", "dapo")]
    assert neighbours_study.design("neighbours_hadw") == ["hadw", "grpo", "dapo"]
    assert learning.ARMS["hadw"] == ("da3po.py", ["--algo", "hadw"])

    def runs(values):
        return [{"evals": [{"step": 0, "eval/hard_eval/acc": v}] * 3, "hard": "hard_eval", "K": 4} for v in values]
    stats = {("hard", "dapo"): runs([0.5, 0.5, 0.52]), ("hard", "da3po_lam2"): runs([0.6, 0.62, 0.61]),
             ("hard", "maxrl"): runs([0.5, 0.51, 0.52])}
    rows = learning.primaries(stats, {"hard": {"steps": 60, "eval_every": 10}}, "neighbours")
    assert [r["id"] for r in rows] == ["N1", "N4"]
    assert rows[0]["p_adj"] == pytest.approx(min(1, 2 * rows[0]["d"]["p"]))  # Holm over the 2 run, not all 22
    by_arm = {"da3po_entropy_bonus": [0.5, 0.75], "da3po_clip_cov": [0.625, 0.625], "da3po_kl_cov": [0.75, 0.5]}
    def fake_run_all(arms, seeds, s, jobs):
        return {("hard", a): runs(by_arm[a]) for a in arms}, {}, []
    monkeypatch.setattr(neighbours_study, "run_all", fake_run_all)
    winner, means = neighbours_study.pilot({}, 1)
    assert winner == "da3po_kl_cov" and means["da3po_clip_cov"] == 0.625  # a three-way tie: KL-Cov
    by_arm["da3po_clip_cov"] = [0.75, 0.625]
    assert neighbours_study.pilot({}, 1)[0] == "da3po_clip_cov"


def test_a_study_saves_its_report_data_and_figure_or_says_why_not(tmp_path, capsys):
    """learning.save_report, the ending the studies share: <out>.md and .json always; the figure when plot() can run,
    else a line saying matplotlib is missing."""
    def drawn(data, path):
        open(path, "w").write(str(data["x"]))
    def missing(data, path):
        raise ImportError("matplotlib")
    out = str(tmp_path / "study")
    learning.save_report(out, "# report", {"x": 1}, drawn, 0.0)
    assert open(out + ".md").read() == "# report\n" and json.load(open(out + ".json")) == {"x": 1}
    assert open(out + ".png").read() == "1" and "wrote" in capsys.readouterr().out
    other = str(tmp_path / "other")
    learning.save_report(other, "# r", {"x": 2}, missing, 0.0)
    assert not os.path.exists(other + ".png") and "matplotlib not installed" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--tasks", "hard,nope"], "--tasks: unknown nope"),
    (["--arms", "dapo,nope"], "--arms: unknown nope"),
    (["--seeds", "0"], "--seeds: give at least 2 distinct seeds"),
    (["--seeds", "a-b"], "--seeds: expected"),
    (["--eval_samples", "12"], "--eval_samples: must be a power of 2"),
    (["--steps", "20", "--eval_every", "10"], "--steps/--eval_every: task hard would evaluate at steps [0, 10, 20]"),
    (["--jobs", "0"], "--jobs: must be >= 1")])
def test_bad_flags_exit_2_naming_the_flag(args, message):
    r = run_script(["-m", "experiments.learning", *args], timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_a_task_without_its_files_or_its_target_exits_2(monkeypatch, capsys):
    monkeypatch.setitem(learning.TASKS, "reasoning", {**learning.TASKS["reasoning"], "train": "nowhere/train.jsonl"})
    with pytest.raises(SystemExit) as e:
        learning.parse_args(["--tasks", "reasoning"])
    assert e.value.code == 2 and "--tasks: reasoning is not available here (missing nowhere/train.jsonl)" in \
        capsys.readouterr().err
    monkeypatch.setattr(learning, "ENDPOINTS", [{**e, "target": None} if e["kind"] == "steps_to" else e
                                                for e in learning.ENDPOINTS])
    with pytest.raises(SystemExit) as e:
        learning.parse_args(["--tasks", "hard"])
    assert e.value.code == 2 and "--tasks: hard has a steps-to-target endpoint without a target" in \
        capsys.readouterr().err


def test_plan_prints_the_estimate_and_runs_nothing():
    r = run_script(["-m", "experiments.learning", "--plan"], timeout=60)
    assert r.returncode == 0, r.stderr
    assert "plan: 160 runs" in r.stdout and "estimate:" in r.stdout and "CPU-hours" in r.stdout


def test_committed_data_match_the_manifest():
    manifest = json.load(open(os.path.join(DATA, "manifest.json")))
    for name, digest in manifest["files"].items():
        assert hashlib.sha256(open(os.path.join(DATA, name), "rb").read()).hexdigest() == digest, name
    rows = {name: [json.loads(x) for x in open(os.path.join(DATA, name))] for name in manifest["files"]}
    eval_rows = rows["hard_eval.jsonl"]
    assert sorted({r["level"] for r in eval_rows}) == [1, 2, 3, 4]
    assert all(sum(r["level"] == lv for r in eval_rows) == 80 for lv in (1, 2, 3, 4))
    demo = {json.loads(x)["problem"] for x in open(os.path.join(ROOT, "demo", "arith", "eval.jsonl"))}
    evals = {r["problem"] for r in eval_rows}
    for name, rs in rows.items():
        if name != "hard_eval.jsonl":
            assert len(rs) == 2000 and not ({r["problem"] for r in rs} & (evals | demo)), name
    assert all(0.05 <= r["pass_rate_at_build"] < 0.40 for r in rows["hard_train.jsonl"])


def test_hard_prompts_survey_runs_the_real_calibration_as_a_script():
    """tools/hard_prompts.py as a user runs it (python -m tools.hard_prompts): the survey measures pass rates through
    demo/build.py's calibration and shows why the pool is 3+3 and 2+2 sums."""
    r = run_script(["-m", "tools.hard_prompts", "--survey"], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {line.split(":")[0].strip(): line for line in r.stdout.splitlines() if "mean pass rate" in line}
    assert len(rows) == 9, r.stdout
    mean = {shape: float(line.split("mean pass rate ")[1].split(";")[0]) for shape, line in rows.items()}
    hard = {shape: int(line.split("[")[1].split(",")[1]) for shape, line in rows.items()}  # problems in [5%, 40%)
    assert max(hard, key=hard.get) == "3+3" and hard["3+3"] >= 20, rows
    assert mean["2+1"] > 0.7 and mean["4+4"] < 0.05, mean


def test_daro_study_weight_summaries_by_hand():
    """experiments/daro_study.py on two fake runs of G = 4 (bins 1/4, 2/4, 3/4): the design read from ENDPOINTS, the
    weights' spread and clamp share, w over its fixed point, and the shared control's distance to DARO's mean weight."""
    study = daro_study
    arms = study.design()
    assert arms["hard"] == ["daro_travel", "dapo", "uniform", "daro_travel_shared", "daro_closed"]
    assert arms["reasoning"] == ["daro_closed", "uniform", "daro_closed_shared"]

    def run(ws, Ls, ns=(1, 1, 1)):
        mus = ("0.250", "0.500", "0.750")
        return {"train": [{**{f"daro/w_{m}": w for m, w in zip(mus, row)},
                           **{f"daro/L_{m}": L for m, L in zip(mus, Ls)},
                           **{f"daro/n_{m}": n for m, n in zip(mus, ns)}} for row in ws]}
    # |L| + delta = 0.1, 0.5, 0.001 -> fixed points 10, 2, 10 (1000 clamped); bin 3/4 absent in the last step of b
    a = run([[1.0, 1.0, 1.0], [5.0, 2.0, 10.0]], [-0.099, 0.499, 0.0])
    b = run([[1.0, 1.0, 1.0], [10.0, 1.0, 10.0]], [0.099, 0.499, 0.0], ns=(2, 1, 0))
    s = study.weight_summary([a, b])
    assert s["w_last_per_bin"] == pytest.approx([7.5, 1.5, 10.0])
    assert s["spread_last"] == pytest.approx((5 + 10) / 2) and s["mean_w_last"] == pytest.approx((17 / 3 + 7) / 2)
    assert s["share_at_w_max"] == pytest.approx(2 / 5)  # a: bin 3/4; b: bin 1/4 (b's bin 3/4 was absent)
    assert s["w_over_fixed_range"] == pytest.approx([0.5, 1.0]) and s["w_over_fixed_median"] == pytest.approx(1.0)
    shared = run([[1.0, 1.0, 1.0], [2 * 17 / 3] * 3], [0.1] * 3)  # twice DARO a's mean at its last step
    c = study.closeness([a], [shared])
    assert c["abs_log_ratio_max"] == pytest.approx(math.log(2)) and c["ratio_last_mean"] == pytest.approx(2.0)
    assert c["abs_log_ratio_median"] == pytest.approx(math.log(2) / 2)  # steps: 0 and ln 2
    # clipping: norms over steps and seeds, and a shared control that reproduces uniform's endpoint in 1 of 2 seeds
    def fake(norms, acc):
        return {"train": [{"train/grad_norm": g} for g in norms], "evals": [{"eval/acc": acc}] * 3, "hard": None,
                "K": 4}
    stats = {("hard", "uniform"): [fake([0.5, 2.0], 0.6), fake([3.0, 4.0], 0.7)],
             ("hard", "daro_travel_shared"): [fake([2.0, 2.0], 0.6), fake([2.0, 2.0], 0.71)]}
    clip = study.clipping(stats, {"hard": ["uniform", "daro_travel_shared"]})
    assert clip["norms"]["hard/uniform"] == {"min": 0.5, "median": 2.5, "max": 4.0, "above_1": 0.75}
    assert clip["equal_to_uniform"] == {"hard/daro_travel_shared": 1}
