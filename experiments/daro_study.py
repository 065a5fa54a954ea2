"""The DARO study: DARO where its weights move, against uniform weights, DAPO and a global
loss-scale control, on the endpoints fixed in experiments/learning.py before the runs (ENDPOINTS, family "daro_study").

Arms (experiments/learning.py's ARMS): daro_travel (the paper's weight travel: --weight_lr = 0.6 / the run's weight
updates), daro_closed (--weighting closed: every bin at its fixed point 1 / (|L_mu| + delta) each update), their
--shared_weight controls (every bin weighs the mean of those weights: the same overall loss scale, no reweighting),
uniform (w = 1) and DAPO. Every run is experiments/learning.py's run of that arm, task and seed, reused from
experiments/results/runs/learning/ when its command is the same (so `python -m experiments.learning --tasks hard --arms
...` and this script share their runs).

Usage: python -m experiments.daro_study          # runs what is not cached (~60-90 CPU-minutes), then the report
       python -m experiments.daro_study --jobs 2 --seeds 0-7
Writes experiments/results/daro_study.md, .json and, with matplotlib, daro_study.png (each bin's weight over the weight
updates per arm, and the primaries' differences with their intervals)."""
import argparse
import math
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from experiments import learning  # the benchmark's protocol, runs and statistics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAMILY = "daro_study"
# the global control of each DARO arm: the same weights' mean on every bin
SHARED = {"daro_travel": "daro_travel_shared", "daro_closed": "daro_closed_shared"}
W_MAX = 10.0  # daro.py's default --w_max, which every study arm keeps


def design() -> dict[str, list[str]]:
    """task -> the arms its primaries name (in ENDPOINTS' order)."""
    arms = {}
    for e in learning.ENDPOINTS:
        if e.get("family") == FAMILY:
            for a in (e["arm"], e["vs"]):
                if a not in arms.setdefault(e["task"], []):
                    arms[e["task"]].append(a)
    return arms


def weight_keys(run: dict) -> list[str]:
    return sorted(k for k in run["train"][0] if k.startswith("daro/w_"))


def weights(run: dict) -> list[list[float]]:
    """w_mu after each RL step (rows: steps; columns: bins mu = 1/G .. (G-1)/G), as daro.py logs them."""
    return [[r[k] for k in weight_keys(run)] for r in run["train"]]


def fixed_points(run: dict, delta: float = 1e-3) -> list[list[float]]:
    """1 / (|L_mu| + delta) clamped to [0.1, 10] from each step's logged L_mu (the mean over the step's updates that
    had bin mu; None where the bin was absent all step)."""
    rows = []
    for r in run["train"]:
        row = []
        for k in weight_keys(run):
            mu = k[len("daro/w_"):]
            row.append(None if r[f"daro/n_{mu}"] == 0 else min(W_MAX, max(0.1, 1 / (abs(r[f"daro/L_{mu}"]) + delta))))
        rows.append(row)
    return rows


def weight_summary(runs: list[dict]) -> dict:
    """Per arm: the bins' weights at the last step (mean over seeds per bin; the spread max / min within a run), the
    share of the last step's present bins at the w_max clamp, and w / fixed point at the last step."""
    last = [weights(r)[-1] for r in runs]
    fixed = [fixed_points(r)[-1] for r in runs]
    ratios = [w / f for ws, fs in zip(last, fixed) for w, f in zip(ws, fs) if f is not None]
    at_max = [w >= W_MAX * (1 - 1e-6) for ws, fs in zip(last, fixed) for w, f in zip(ws, fs) if f is not None]
    return {"w_last_per_bin": [statistics.mean(col) for col in zip(*last)],
            "spread_last": statistics.mean(max(ws) / min(ws) for ws in last),
            "mean_w_last": statistics.mean(statistics.mean(ws) for ws in last),
            "share_at_w_max": sum(at_max) / max(1, len(at_max)),
            "w_over_fixed_median": statistics.median(ratios) if ratios else math.nan,
            "w_over_fixed_range": [min(ratios), max(ratios)] if ratios else None}


def closeness(daro_runs: list[dict], shared_runs: list[dict]) -> dict:
    """How close the shared control's weight (one per step, every bin) is to the DARO arm's mean weight over bins at
    the same step and seed (two runs: their trajectories differ, so this measures the control, not an identity):
    |ln(shared / DARO mean)| per step, its median and maximum over steps and seeds, and the ratio at the last step."""
    logs, last = [], []
    for d, s in zip(daro_runs, shared_runs):
        for wd, ws in zip(weights(d), weights(s)):
            logs.append(abs(math.log(statistics.mean(ws) / statistics.mean(wd))))
        last.append(statistics.mean(weights(s)[-1]) / statistics.mean(weights(d)[-1]))
    return {"abs_log_ratio_median": statistics.median(logs), "abs_log_ratio_max": max(logs),
            "ratio_last_mean": statistics.mean(last), "ratio_last_range": [min(last), max(last)]}


def clipping(stats: dict, arms: dict) -> dict:
    """Per arm, the pre-clip gradient norm over steps and seeds (min, median, max, share of steps above 1), and per
    shared control the seeds whose endpoint equals uniform weights' (a loss scale that the clip divides out)."""
    norms, equal = {}, {}
    for t in arms:
        for a in arms[t]:
            g = [r["train/grad_norm"] for run in stats[t, a] for r in run["train"]]
            norms[f"{t}/{a}"] = {"min": min(g), "median": statistics.median(g), "max": max(g),
                                 "above_1": sum(x > 1 for x in g) / len(g)}
            if a.endswith("_shared") and "uniform" in arms[t]:
                equal[f"{t}/{a}"] = sum(abs(learning.value(x, "eval/acc") - learning.value(y, "eval/acc")) < 1e-9
                                        for x, y in zip(stats[t, a], stats[t, "uniform"]))
    return {"norms": norms, "equal_to_uniform": equal}


def run_all(arms: dict, sets: dict, seeds: dict, jobs: int) -> tuple[dict, dict]:
    # seed-major within a task: a run cut short by the clock leaves whole seeds (every arm), still paired
    todo = [(t, a, s) for t in arms for s in seeds[t] for a in arms[t]]
    with ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(lambda j: learning.run(*j, sets[j[0]], max(1, 2 // jobs)), todo))
    stats, costs = {}, {}
    for (t, a, _), r in sorted(zip(todo, results), key=lambda x: (x[0][0], x[0][2])):  # each arm in seed order
        stats.setdefault((t, a), []).append(learning.summarise(r["records"], t, sets[t]))
        costs.setdefault((t, a), []).append(r["cpu_s"])
    return stats, costs


def report(stats: dict, costs: dict, sets: dict, arms: dict, seeds: dict, argv: list[str]) -> tuple[str, dict]:
    rows = learning.primaries(stats, sets, FAMILY)
    cmd = " ".join(["python -m experiments.daro_study", *argv])
    lines = ["# DARO where its weights move: the study", "",
             f"Command: `{cmd}` (every number below; the runs are experiments/learning.py's, cached in "
             "experiments/results/runs/learning/). Endpoints fixed in experiments/learning.py (ENDPOINTS, "
             "family daro_study) before any run of the study (see git log). Seeds: " + "; ".join(
                 f"`{t}` {','.join(map(str, seeds[t]))} ({len(seeds[t])})" for t in arms) +
             ", paired by seed; 95% Student-t intervals; two-sided paired t-tests, Holm across the "
             f"{len(rows)} primaries. Differences in points of eval/acc (mean of the last {learning.LAST} evals).",
             "", "Design: " + "; ".join(
                 f"`{t}`: {sets[t]['steps']} steps x {learning.PROTOCOL['updates_per_step']} updates = "
                 f"{sets[t]['steps'] * learning.PROTOCOL['updates_per_step']} weight updates" +
                 (f", daro_travel's --weight_lr {learning.travel_lr(sets[t]):.6g}" if "daro_travel" in arms[t] else "")
                 + ", arms " + ", ".join(arms[t]) for t in arms) + ".",
             "", "## Primaries", "",
             "| id | claim | arm - vs, task | difference [95% interval] | p (Holm) | survives Holm? | what the data "
             "exclude | holds here? |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r["d"]
        lines.append(f"| {r['id']} | {r['claim']} | {r['arm']} - {r['vs']}, {r['task']} | {learning.fmt_d(d)} | "
                     f"{d['p']:.3f} ({r['p_adj']:.3f}) | {'yes' if r['p_adj'] < learning.ALPHA else 'no'} | "
                     f"{learning.bound_text(d, 1, 100, 'points')} | {learning.verdict(d, 1, r['p_adj'])} |")
    lines += ["", "## Each arm's endpoint", "", "| task | arm | eval/acc, last 3 (mean +- 95% half-width) | "
              "eval/acc at step 0 | CPU-s per run |", "|---|---|---|---|---|"]
    for t in arms:
        for a in arms[t]:
            rs = stats[t, a]
            lines.append(f"| {t} | {a} | {learning.cell([learning.value(r, 'eval/acc') for r in rs])} | "
                         f"{statistics.mean(learning.value(r, 'eval/acc', 'start') for r in rs):.3f} | "
                         f"{statistics.mean(costs[t, a]):.0f} |")
    summaries = {f"{t}/{a}": weight_summary(stats[t, a]) for t in arms for a in arms[t] if a.startswith("daro")}
    lines += ["", "## Where the weights went", "",
              "At the last step, per arm (means over seeds): each bin's w_mu (mu = 1/8 .. 7/8), the spread "
              "max/min of a run's bins, the share of the present bins at the w_max = 10 clamp, and w_mu over its "
              "fixed point 1 / (|L_mu| + delta) (from the step's mean L_mu; the closed form uses the last update's "
              "L_mu, so its ratio is not exactly 1).", "",
              "| task/arm | w_mu per bin | spread | mean w | at w_max | w / fixed point, median [range] |",
              "|---|---|---|---|---|---|"]
    for key, w in summaries.items():
        rng = w["w_over_fixed_range"]
        lines.append(f"| {key} | {', '.join(f'{x:.2f}' for x in w['w_last_per_bin'])} | {w['spread_last']:.2f} | "
                     f"{w['mean_w_last']:.2f} | {w['share_at_w_max']:.2f} | {w['w_over_fixed_median']:.2f} "
                     f"[{rng[0]:.2f}, {rng[1]:.2f}] |")
    close = {f"{t}/{a}": closeness(stats[t, a], stats[t, SHARED[a]]) for t in arms for a in arms[t]
             if a in SHARED and SHARED[a] in arms[t]}
    lines += ["", "## The global control against DARO's mean weight", "",
              "The control (--shared_weight) fits each bin's weight as DARO does and puts their mean on every bin. Its "
              "weight against the DARO arm's mean weight over bins, same seed and step (two runs, so the trajectories "
              "differ):", "", "| task/arm | abs ln(control / DARO mean), median over steps and seeds | max | "
              "ratio at the last step, mean [range over seeds] |", "|---|---|---|---|"]
    for key, c in close.items():
        lines.append(f"| {key} | {c['abs_log_ratio_median']:.4f} | {c['abs_log_ratio_max']:.4f} | "
                     f"{c['ratio_last_mean']:.3f} [{c['ratio_last_range'][0]:.3f}, {c['ratio_last_range'][1]:.3f}] |")
    clip = clipping(stats, arms)
    lines += ["", "## Gradient clipping: what a global loss scale can change here", "",
              "daro.py clips the model's gradient to norm --grad_clip 1.0 before AdamW. Once an update's norm is above "
              "1, a weight common to every bin is divided out by the clip: only the direction, set by the bins' "
              "relative weights, reaches the optimizer. The logged pre-clip norm (train/grad_norm, per step) and "
              "whether each shared control reproduced uniform weights' endpoint to 1e-9 in every seed:", "",
              "| task/arm | pre-clip gradient norm, min / median / max over steps and seeds | steps above 1 |",
              "|---|---|---|"]
    for key, c in clip["norms"].items():
        lines.append(f"| {key} | {c['min']:.2f} / {c['median']:.2f} / {c['max']:.2f} | {c['above_1']:.3f} |")
    lines += [""] + [f"- {key}: the same endpoint as uniform in {n} of {len(seeds[key.split('/')[0]])} seeds"
                     for key, n in clip["equal_to_uniform"].items()]
    total = sum(sum(c) for c in costs.values())
    lines += ["", "## Cost", "", f"{sum(len(c) for c in costs.values())} runs, {total / 60:.0f} CPU-minutes "
              "measured (each run's own user + system time; runs made by experiments/learning.py with the same "
              "command count here too)."]
    data = {"command": cmd, "seeds": seeds, "sets": sets, "arms": arms,
            "primaries": [{k: r[k] for k in ("id", "claim", "task", "arm", "vs", "metric", "kind", "d", "p_adj")}
                          for r in rows],
            "endpoints": {f"{t}/{a}": [learning.value(r, "eval/acc") for r in stats[t, a]] for t in arms
                          for a in arms[t]},
            "weights": summaries, "closeness": close, "clipping": clip,
            "weight_traces": {f"{t}/{a}": [weights(r) for r in stats[t, a]] for t in arms for a in arms[t]
                              if a.startswith("daro")},
            "cpu_s": {f"{t}/{a}": c for (t, a), c in costs.items()}}
    return "\n".join(lines), data


def plot(data: dict, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    traces = data["weight_traces"]
    fig, axes = plt.subplots(1, len(traces) + 1, figsize=(3.4 * (len(traces) + 1), 3.4))
    updates = learning.PROTOCOL["updates_per_step"]
    for ax, (key, runs) in zip(axes, traces.items()):
        steps = len(runs[0])
        for b in range(len(runs[0][0])):  # each bin, mean over seeds, after each step's last update
            ax.plot([updates * (i + 1) for i in range(steps)],
                    [statistics.mean(run[i][b] for run in runs) for i in range(steps)], color=f"C{b}",
                    label=f"mu={(b + 1) / (len(runs[0][0]) + 1):.3f}")
        ax.set(yscale="log", xlabel="weight update", title=key, ylabel="w_mu (mean of seeds)")
    axes[0].legend(fontsize=6)
    learning.plot_primaries(axes[-1], data["primaries"], "points of eval/acc", 6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--seeds", default="0-7", help="'0-7' or '0,1,2'; at least 2 (the study was registered at 8)")
    p.add_argument("--seeds_for", action="append", default=[], metavar="TASK=SEEDS",
                   help="other seeds for one task (repeatable), e.g. reasoning=0-5 when its runs were cut short")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (threads per run: 2 // jobs, at least 1)")
    p.add_argument("--out", default=os.path.join(learning.RESULTS, "daro_study"), help="<out>.md, .json, .png")
    args = p.parse_args(argv)
    arms = design()
    seeds = {t: learning.parse_seeds(args.seeds) for t in arms}
    for item in args.seeds_for:
        task, _, text = item.partition("=")
        if task not in arms:
            p.error(f"--seeds_for: {task!r} is not a task of the study ({', '.join(arms)})")
        seeds[task] = learning.parse_seeds(text)
    if any(len(set(x)) < 2 for x in seeds.values()) or args.jobs < 1:
        p.error("--seeds: at least 2 distinct seeds per task; --jobs: at least 1")
    none = argparse.Namespace(steps=None, eval_every=None, eval_samples=None)
    sets = {t: learning.settings(t, none) for t in arms}
    t0 = time.time()
    stats, costs = run_all(arms, sets, seeds, args.jobs)
    text, data = report(stats, costs, sets, arms, seeds, argv)
    learning.save_report(args.out, text, data, plot, t0)


if __name__ == "__main__":
    main()
