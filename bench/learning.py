"""What the toy can show of the papers' claims: every method on the built-in task from the same shipped demo model,
several seeds, at equal steps and at equal rollout budget, with per-level accuracy (the levels are the demo model's
pass-rate bands at the start: demo/arith_eval.jsonl), pass@k, the loss share of each difficulty bin, DARO's weights,
and paired differences between methods across seeds with 95% intervals.

Usage: python bench/learning.py [--seeds 0,1,2,3,4] [--steps 100] [--methods a,b,...] [--jobs 2]
       python bench/learning.py --seeds 0,1 --methods dapo,da3po_lam2 --steps 20 --name small   # a smaller run
Runs are cached in bench/results/runs/<method>-s<seed>-<steps>steps/ (delete a folder to redo it); the report goes to
bench/results/<name>.md and the figures to bench/results/<name>_*.png (--name, default learning; matplotlib:
bench/requirements.txt). About half an hour for the default 12 methods x 5 seeds on a 2-core CPU (--jobs 2: two runs
at a time, one thread each)."""
import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
# The same task, model, batch (32 prompts x 8), 4 optimizer updates per step (so the clip can act) and evaluation
# (the 200 calibrated sums, 8 samples each, every 10 steps) for every method; only the algorithm differs.
COMMON = ["--updates_per_step", "4", "--eval_every", "10", "--eval_samples", "8", "--sample_every", "0"]
METHODS = {  # name -> (script, flags); GRPO, DAPO and the static weightings run in daro.py, which logs the bins
    "grpo": ("daro.py", ["--algo", "grpo"]),
    "dapo": ("daro.py", ["--algo", "dapo"]),
    "da3po_lam1.5": ("da3po.py", ["--algo", "da3po", "--lam", "1.5"]),
    "da3po_lam2": ("da3po.py", ["--algo", "da3po", "--lam", "2"]),
    "da3po_adaptive": ("da3po.py", ["--algo", "da3po", "--adaptive_lam"]),
    "gspo": ("da3po.py", ["--algo", "gspo"]),  # its paper's 4 updates per step: the same as everyone's here
    "uniform": ("daro.py", ["--algo", "uniform"]),
    "var": ("daro.py", ["--algo", "var"]),
    "daro": ("daro.py", ["--algo", "daro"]),  # the paper's weight lr 1e-3: w moves by e^0.4 at most in 400 updates
    "daro_literal": ("daro.py", ["--algo", "daro", "--daro_literal"]),
    "daro_wlr0.05": ("daro.py", ["--algo", "daro", "--weight_lr", "0.05"]),  # fast enough to reach their optimum
    # ... and a clamp wide enough to hold it: here 1 / (|L_mu| + delta) is in the hundreds for every bin
    "daro_free": ("daro.py", ["--algo", "daro", "--weight_lr", "0.05", "--w_max", "1000"]),
}
T_975 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262}


def run_dir(method: str, seed: int, steps: int) -> str:
    return os.path.join(RESULTS, "runs", f"{method}-s{seed}-{steps}steps")


def run(method: str, seed: int, steps: int, threads: int) -> tuple[list[dict], float]:
    """One training run (reused when it finished before); returns its metrics records and its wall seconds."""
    out = run_dir(method, seed, steps)
    path, wall = os.path.join(out, "metrics.jsonl"), os.path.join(out, "wall_s.txt")
    if not os.path.exists(wall):  # written last: a run killed halfway is redone
        script, flags = METHODS[method]
        cmd = [sys.executable, script, *flags, "--seed", str(seed), "--steps", str(steps), "--out_dir", out, *COMMON]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.time()
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{method} seed {seed} failed:\n{r.stderr[-2000:]}")
        for name in os.listdir(out):  # the checkpoint is not needed here
            if name.startswith("step_"):
                shutil.rmtree(os.path.join(out, name))
        open(wall, "w").write(f"{time.time() - t0:.1f}\n")
    return [json.loads(x) for x in open(path)], float(open(wall).read())


def torch_version() -> str:
    return subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                          text=True).stdout.strip()


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval."""
    m = statistics.mean(xs)
    return m, (T_975[len(xs)] * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan"))


def crossing(xs: list[float], ys: list[float], level: float) -> float:
    """The first x at which the piecewise-linear curve (xs, ys) reaches level (inf if it never does)."""
    for i, (x, y) in enumerate(zip(xs, ys)):
        if y >= level:
            return x if i == 0 else xs[i - 1] + (x - xs[i - 1]) * (level - ys[i - 1]) / (y - ys[i - 1])
    return math.inf


def summarise(records: list[dict], budget: float, target: float) -> dict:
    """One run's numbers: final accuracies, the accuracy at the rollout budget (linearly interpolated between two
    evaluations), the steps to reach the target accuracy (interpolated too) and the curves."""
    evals = [r for r in records if "eval/acc" in r]
    train = [r for r in records if "train/loss" in r]
    spent, spent_at = 0, {0: 0}
    for r in train:
        spent += r["train/num_completions"]
        spent_at[r["step"]] = spent
    xs, ys = [spent_at[e["step"]] for e in evals], [e["eval/acc"] for e in evals]
    at_budget = next((ys[i - 1] + (ys[i] - ys[i - 1]) * (budget - xs[i - 1]) / (xs[i] - xs[i - 1])
                      for i in range(1, len(xs)) if xs[i - 1] <= budget <= xs[i]), math.nan)
    final = evals[-1]
    levels = sorted(int(k.rsplit("level", 1)[1]) for k in final if k.startswith("eval/acc_level"))
    return {"final": final["eval/acc"], "levels": {lv: final[f"eval/acc_level{lv}"] for lv in levels},
            "start_levels": {lv: evals[0][f"eval/acc_level{lv}"] for lv in levels},
            "pass": {int(k.split("@")[1]): v for k, v in final.items() if k.startswith("eval/pass@")},
            "at_budget": at_budget, "completions": spent,
            "to_target": crossing([e["step"] for e in evals], ys, target),
            "curve": [(e["step"], spent_at[e["step"]], e["eval/acc"],
                       {lv: e[f"eval/acc_level{lv}"] for lv in levels}) for e in evals],
            "train": train}


def bin_names(record: dict) -> list[str]:
    """The difficulty bins mu a daro.py record logs, as its keys spell them ('0.125', ...)."""
    return sorted(k[len("daro/L_"):] for k in record if k.startswith("daro/L_"))


def bin_shares(train: list[dict]) -> tuple[list[str], list[int], list[list[float]]]:
    """Per step, each difficulty bin's share of |loss|: |w_mu L_mu| / sum_mu |w_mu L_mu| (daro.py's records; for the
    baselines' own losses w = 1 and daro/L_mu is already the bin's part of the loss)."""
    bins = bin_names(train[0])
    steps, shares = [], []
    for r in train:
        parts = [abs(r.get(f"daro/w_{b}", 1.0) * r[f"daro/L_{b}"]) for b in bins]
        if sum(parts) > 0:
            steps.append(r["step"])
            shares.append([p / sum(parts) for p in parts])
    return bins, steps, shares


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated; at least 2 for the intervals")
    p.add_argument("--steps", type=int, default=100, help="RL steps per run")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated, from: " + ", ".join(METHODS))
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (threads per run: 2 // jobs, at least 1)")
    p.add_argument("--name", default="learning", help="bench/results/<name>.md and <name>_*.png")
    p.add_argument("--target", type=float, default=0.55, help="eval accuracy for the steps-to-target column")
    args = p.parse_args()
    seeds, methods = [int(s) for s in args.seeds.split(",")], args.methods.split(",")
    if unknown := [m for m in methods if m not in METHODS]:
        p.error(f"--methods: unknown {', '.join(unknown)} (choose from {', '.join(METHODS)})")
    if not 2 <= len(seeds) <= max(T_975):
        p.error(f"--seeds: give 2 to {max(T_975)} seeds, got {len(seeds)}")
    t0 = time.time()
    threads = max(1, 2 // args.jobs)
    jobs = [(m, s) for m in methods for s in seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda ms: run(*ms, args.steps, threads), jobs))
    runs = {job: records for job, (records, _) in zip(jobs, results)}
    run_seconds, wall = sum(s for _, s in results), time.time() - t0
    # equal rollout budget: what the cheapest method (no dynamic sampling) generates over the whole run
    budget = min(sum(r["train/num_completions"] for r in recs if "train/loss" in r) for recs in runs.values())
    stats = {m: [summarise(runs[m, s], budget, args.target) for s in seeds] for m in methods}
    levels = sorted(stats[methods[0]][0]["levels"])
    start = stats[methods[0]][0]["start_levels"]
    ks = sorted(stats[methods[0]][0]["pass"])

    def cell(m, fn, fmt="{:.3f}"):
        xs = [fn(x) for x in stats[m]]
        if not all(math.isfinite(x) for x in xs):  # steps to target: a seed that never got there
            return f"{sum(map(math.isfinite, xs))}/{len(xs)} seeds reached it"
        mean, ci = mean_ci(xs)
        return f"{fmt.format(mean)} +- {fmt.format(ci)}"

    def paired(m, base, fn):
        if m == base or base not in stats:
            return ""
        d = [fn(a) - fn(b) for a, b in zip(stats[m], stats[base])]
        mean, ci = mean_ci(d)
        return f"{100 * mean:+.1f} [{100 * (mean - ci):+.1f}, {100 * (mean + ci):+.1f}]"

    lines = [f"Built-in task, shipped demo model, {args.steps} steps of 32 prompts x 8 completions, 4 optimizer "
             f"updates per step; evaluation on the 200 calibrated sums, 8 samples each. Seeds {args.seeds}; mean +- "
             f"the half-width of the 95% t-interval over seeds. Levels: the demo model's pass-rate bands at the start "
             f"(start accuracy here: " + ", ".join(f"L{lv} {start[lv]:.2f}" for lv in levels) + "). `at budget`: eval "
             f"accuracy after {budget:,} generated completions (what a method without dynamic sampling generates in "
             f"{args.steps} steps; linearly interpolated between the two evaluations around it, every 10 steps). "
             f"`steps to {args.target}`: when eval accuracy first reaches {args.target} (interpolated likewise). "
             f"Paired differences: the same seed of two methods starts from the same model and prompts; percentage "
             f"points, [95% interval].", "",
             "| method | final eval/acc | " + " | ".join(f"L{lv}" for lv in levels) + f" | pass@{ks[-1]} | "
             f"acc at budget | steps to {args.target} | completions generated | vs DAPO (final) | vs GRPO (final) |",
             "|" + "---|" * (8 + len(levels))]
    for m in methods:
        lines.append(f"| {m} | {cell(m, lambda x: x['final'])} | " +
                     " | ".join(cell(m, lambda x, lv=lv: x["levels"][lv], "{:.2f}") for lv in levels) +
                     f" | {cell(m, lambda x: x['pass'][ks[-1]])} | {cell(m, lambda x: x['at_budget'])} | "
                     f"{cell(m, lambda x: x['to_target'], '{:.0f}')} | "
                     f"{cell(m, lambda x: x['completions'], '{:,.0f}')} | "
                     f"{paired(m, 'dapo', lambda x: x['final'])} | {paired(m, 'grpo', lambda x: x['final'])} |")
    hard = [lv for lv in levels if 0.05 <= start[lv] < 0.5]
    if hard:
        lines += ["", "Hard levels (start pass rate 5-50%: " + ", ".join(f"L{lv}" for lv in hard) +
                  "): accuracy at the end (the levels' mean), paired differences per level and for their mean; and the "
                  f"paired difference of pass@{ks[-1]} over the whole eval set (DA3PO's coverage claim):", "",
                  "| method | hard levels | " + " | ".join(f"vs DAPO, L{lv}" for lv in hard) +
                  f" | vs DAPO | vs GRPO | pass@{ks[-1]} vs DAPO |", "|" + "---|" * (5 + len(hard))]
        hard_acc = lambda x: statistics.mean(x["levels"][lv] for lv in hard)  # noqa: E731
        for m in methods:
            lines.append(f"| {m} | {cell(m, hard_acc)} | " +
                         " | ".join(paired(m, "dapo", lambda x, lv=lv: x["levels"][lv]) for lv in hard) +
                         f" | {paired(m, 'dapo', hard_acc)} | {paired(m, 'grpo', hard_acc)} | "
                         f"{paired(m, 'dapo', lambda x: x['pass'][ks[-1]])} |")
    amplified = [m for m in methods if any(r.get("daa/lam_mean") for x in stats[m] for r in x["train"])]
    if amplified:
        def reach(m):
            records = [r for x in stats[m] for r in x["train"]]
            return (f"{m} {statistics.mean(r['daa/amplified_frac'] for r in records):.3f}, "
                    f"x{statistics.mean(r['daa/lam_mean'] for r in records if r['daa/lam_mean']):.2f}")
        lines += ["", "DAA's reach: the share of a step's completions whose advantage was amplified, and the mean "
                  "factor applied (all steps and seeds): " + "; ".join(map(reach, amplified))]
    pairs = [(m, b) for m in methods if m.startswith("daro") for b in ("uniform", "var", "dapo") if b in stats]
    vs_grpo = [m for m in methods if m != "grpo" and "grpo" in stats]
    if pairs or vs_grpo:
        lines += ["", "More paired differences (percentage points, [95% interval]): final accuracy of DARO against "
                  "the static weightings, and accuracy at the equal rollout budget against GRPO.", "",
                  "| method | vs | final | at budget |", "|---|---|---|---|"]
        lines += [f"| {m} | {b} | {paired(m, b, lambda x: x['final'])} | {paired(m, b, lambda x: x['at_budget'])} |"
                  for m, b in pairs]
        lines += [f"| {m} | grpo | {paired(m, 'grpo', lambda x: x['final'])} | "
                  f"{paired(m, 'grpo', lambda x: x['at_budget'])} |" for m in vs_grpo]
    shown = [m for m in methods if "daro/L_0.500" in stats[m][0]["train"][0]]  # daro.py's runs log the bins
    if shown:
        bins = bin_names(stats[shown[0]][0]["train"][0])
        lines += ["", "Difficulty bins (mu = pass rate of the group): each bin's mean share of sum_mu |w_mu L_mu| over "
                  "all steps and seeds (the loss-scale picture; L_mu is the bin's token-mean clipped loss, w = 1 for "
                  "GRPO/DAPO/uniform), then mean |L_mu|, the groups trained on per step, and the weights w_mu at the "
                  "end next to their optimum, 1 / (|L_mu| + 0.001) clamped to [w_min, w_max] = [0.1, 10] (1000 for "
                  "daro_free), with the mean |L_mu| of the last 10 steps:", "",
                  "| method | quantity | " + " | ".join(f"mu={b}" for b in bins) + " |", "|" + "---|" * (2 + len(bins))]
        for m in shown:
            shares = [sh for x in stats[m] for sh in bin_shares(x["train"])[2]]

            def abs_loss(b, records):  # mean |L_mu| over the steps that trained on bin mu
                return statistics.mean([abs(r[f"daro/L_{b}"]) for r in records if r[f"daro/n_{b}"] > 0] or [0.0])
            rows = [("share of abs(w L)", [statistics.mean(sh[i] for sh in shares) for i in range(len(bins))],
                     "{:.2f}"),
                    ("mean abs(L_mu)", [abs_loss(b, [r for x in stats[m] for r in x["train"]]) for b in bins],
                     "{:.4f}"),
                    ("groups per step", [statistics.mean(r[f"daro/n_{b}"] for x in stats[m] for r in x["train"])
                                         for b in bins], "{:.1f}")]
            if m.startswith("daro"):
                rows.append(("w_mu at the end", [statistics.mean(x["train"][-1][f"daro/w_{b}"] for x in stats[m])
                                                 for b in bins], "{:.2f}"))
                w_max = json.load(open(os.path.join(run_dir(m, seeds[0], args.steps), "config.json")))["w_max"]
                rows.append(("optimum of w_mu", [statistics.mean(min(w_max, 1 / (abs_loss(b, x["train"][-10:]) + 1e-3))
                                                                 for x in stats[m]) for b in bins], "{:.2f}"))
            lines += [f"| {m} | {name} | " + " | ".join(fmt.format(v) for v in vals) + " |" for name, vals, fmt in rows]
    lines += ["", f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
              f"{torch_version()}. {len(jobs)} runs of {run_seconds / len(jobs):.0f} s on average, "
              f"{run_seconds / 60:.0f} min in all, {args.jobs} at a time ({threads} thread(s) each): about "
              f"{run_seconds / 60 / args.jobs:.0f} min of wall time (this invocation: {wall / 60:.0f} min, cached runs "
              f"reused). Command: `{' '.join(['python bench/learning.py', *sys.argv[1:]])}`"]
    report = "\n".join(lines)
    print(report)
    os.makedirs(RESULTS, exist_ok=True)
    open(os.path.join(RESULTS, f"{args.name}.md"), "w").write(report + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return print("matplotlib not installed: table written, figures skipped (pip install -r bench/requirements.txt)")
    plots(plt, methods, stats, levels, ks, budget, runs, seeds, args.name)


def plots(plt, methods, stats, levels, ks, budget, runs, seeds, name):
    """The figures: learning curves (steps, budget), per-level curves, pass@k, bin loss shares, DARO's weights."""
    def style(m):  # ten colours, then the same colours dashed, so that no two methods look alike
        i = methods.index(m)
        return {"label": m, "color": f"C{i % 10}", "ls": "-" if i < 10 else "--"}

    def mean_curve(m, index):  # x (index 0: step, 1: completions generated) and eval/acc, both averaged over seeds
        curves = [x["curve"] for x in stats[m]]
        return [[statistics.mean(c[i][j] for c in curves) for i in range(len(curves[0]))] for j in (index, 2)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for m in methods:
        for ax, index in ((axes[0], 0), (axes[1], 1)):
            xs, ys = mean_curve(m, index)
            ax.plot(xs, ys, **style(m))
    axes[0].set(xlabel="step", ylabel="eval/acc (avg@8)", title="equal optimizer steps")
    axes[1].set(xlabel="completions generated", ylabel="eval/acc (avg@8)", title="equal rollout budget")
    axes[1].axvline(budget, color="gray", lw=0.8, ls="--")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, f"{name}_curves.png"), dpi=110)
    fig, axes = plt.subplots(1, len(levels), figsize=(3.2 * len(levels), 3.4), sharey=False)
    for ax, lv in zip(axes, levels):
        for m in methods:
            curves = [x["curve"] for x in stats[m]]
            ax.plot([c[0] for c in curves[0]], [statistics.mean(c[i][3][lv] for c in curves)
                                                for i in range(len(curves[0]))], **style(m))
        ax.set(title=f"level {lv}", xlabel="step")
    axes[0].set_ylabel("accuracy")
    axes[-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, f"{name}_levels.png"), dpi=110)
    fig, ax = plt.subplots(figsize=(5, 4))
    for m in methods:
        ax.plot(ks, [statistics.mean(x["pass"][k] for x in stats[m]) for k in ks], marker="o", **style(m))
    ax.set(xscale="log", xticks=ks, xticklabels=ks, xlabel="k", ylabel="pass@k", title="pass@k at the end")
    ax.minorticks_off()
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, f"{name}_passk.png"), dpi=110)
    shown = [m for m in ("grpo", "uniform", "var", "daro", "daro_free") if m in stats]
    if shown:
        fig, axes = plt.subplots(1, len(shown), figsize=(4 * len(shown), 3.6), sharey=True)
        for ax, m in zip(axes if len(shown) > 1 else [axes], shown):
            by_step = {}  # step -> the shares of every seed
            for s in seeds:
                bins, steps, shares = bin_shares([r for r in runs[m, s] if "train/loss" in r])
                for step, sh in zip(steps, shares):
                    by_step.setdefault(step, []).append(sh)
            steps = sorted(by_step)
            mean = [[statistics.mean(sh[i] for sh in by_step[t]) for i in range(len(bins))] for t in steps]
            smooth = [[statistics.mean(row[i] for row in mean[max(0, j - 9):j + 1]) for i in range(len(bins))]
                      for j in range(len(mean))]  # the mean of the last 10 steps
            ax.stackplot(steps, list(zip(*smooth)), labels=[f"mu={b}" for b in bins])
            ax.set(title=f"{m}: share of |w L| per bin", xlabel="step (10-step mean, all seeds)")
        (axes[0] if len(shown) > 1 else axes).set_ylabel("share")
        (axes[-1] if len(shown) > 1 else axes).legend(fontsize=6, loc="upper right")
        fig.tight_layout()
        fig.savefig(os.path.join(RESULTS, f"{name}_bins.png"), dpi=110)
    shown = [m for m in ("daro", "daro_literal", "daro_wlr0.05", "daro_free") if m in stats]
    if shown:
        fig, axes = plt.subplots(1, len(shown), figsize=(4 * len(shown), 3.6))
        for ax, m in zip(axes if len(shown) > 1 else [axes], shown):
            train = [r for r in runs[m, seeds[0]] if "train/loss" in r]
            for k in sorted(k for k in train[0] if k.startswith("daro/w_")):
                ax.plot([r["step"] for r in train], [r[k] for r in train], label=f"mu={k[7:]}")
            ax.set(title=f"{m}: w_mu (seed {seeds[0]})", xlabel="step", yscale="log")
        (axes[-1] if len(shown) > 1 else axes).legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(os.path.join(RESULTS, f"{name}_weights.png"), dpi=110)
    print(f"wrote {RESULTS}/{name}.md and {name}_*.png")


if __name__ == "__main__":
    main()
