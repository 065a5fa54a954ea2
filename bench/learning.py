"""Learning curves of every method on the built-in arith task, several seeds each, at equal optimizer steps and at
equal rollout budget (completions generated). Writes bench/results/learning.md (the table the README includes) and
bench/results/learning.png (needs matplotlib: pip install -r bench/requirements.txt).
Usage: python bench/learning.py [--seeds 0,1,2] [--steps 60] [--methods grpo,dapo,...] [--jobs 1]
Runs are cached in bench/results/runs/<method>-s<seed>/ (delete a folder to redo it)."""
import argparse
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
# Every method gets the same task, model, batch and 4 optimizer updates per step (mini-batch 8 of 32 prompts), so that
# clip-higher can act; only the algorithm differs.
COMMON = ["--updates_per_step", "4", "--eval_every", "5", "--eval_samples", "4", "--sample_every", "0"]
METHODS = {
    "grpo": ["da3po.py", "--algo", "grpo"],
    "dapo": ["da3po.py", "--algo", "dapo"],
    "da3po_lam1.5": ["da3po.py", "--algo", "da3po", "--lam", "1.5"],
    "da3po_lam2.0": ["da3po.py", "--algo", "da3po", "--lam", "2.0"],
    "da3po_lam2.5": ["da3po.py", "--algo", "da3po", "--lam", "2.5"],
    "da3po_adaptive": ["da3po.py", "--algo", "da3po", "--adaptive_lam"],
    "daro": ["daro.py", "--algo", "daro"],
}


def run(method, seed, steps):
    """One training run (skipped when its metrics are already complete); returns its metrics records."""
    out = os.path.join(RESULTS, "runs", f"{method}-s{seed}")
    path = os.path.join(out, "metrics.jsonl")
    if not (os.path.exists(path) and any(json.loads(x).get("step") == steps and "eval/acc" in x for x in open(path))):
        cmd = [sys.executable, *METHODS[method], "--seed", str(seed), "--steps", str(steps), "--out_dir", out, *COMMON]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        subprocess.run(["rm", "-rf", out])
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{method} seed {seed} failed:\n{r.stderr[-2000:]}")
    return [json.loads(x) for x in open(path)]


def mean_std(xs):
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1))


def summarise(records, target, budget):
    """Per-run numbers: final eval accuracy, hardest level, pass@4, steps to target, accuracy at a rollout budget."""
    evals = [r for r in records if "eval/acc" in r]
    train = [r for r in records if "train/loss" in r]
    spent, spent_at = 0, {0: 0}
    for r in train:
        spent += r["train/num_completions"]
        spent_at[r["step"]] = spent
    hardest = max(int(k.rsplit("level", 1)[1]) for k in evals[-1] if k.startswith("eval/acc_level"))
    reached = next((e["step"] for e in evals if e["eval/acc"] >= target), None)
    within = [e for e in evals if spent_at.get(e["step"], math.inf) <= budget]
    return {"final": evals[-1]["eval/acc"], "hard": evals[-1][f"eval/acc_level{hardest}"],
            "pass4": evals[-1].get("eval/pass@4", float("nan")), "to_target": reached,
            "at_budget": within[-1]["eval/acc"] if within else float("nan"),
            "clip_high": sum(r["train/clipfrac_high"] for r in train) / len(train),
            "completions": spent, "curve": [(e["step"], spent_at.get(e["step"], 0), e["eval/acc"]) for e in evals]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--target", type=float, default=0.45, help="eval accuracy for the steps-to-target column")
    args = p.parse_args()
    seeds, methods = [int(s) for s in args.seeds.split(",")], args.methods.split(",")
    runs = {}
    for m in methods:
        for s in seeds:
            runs[m, s] = run(m, s, args.steps)
            print(f"{m} seed {s}: final eval/acc {[r for r in runs[m, s] if 'eval/acc' in r][-1]['eval/acc']:.3f}",
                  flush=True)
    # equal rollout budget: what the cheapest method (no dynamic sampling) generates over the whole run
    budget = min(sum(r["train/num_completions"] for r in recs if "train/loss" in r) for recs in runs.values())
    stats = {m: [summarise(runs[m, s], args.target, budget) for s in seeds] for m in methods}
    lines = [f"Built-in arith task, demo model, {args.steps} steps of 32 prompts x 8 completions, 4 optimizer updates "
             f"per step, seeds {args.seeds}; mean +- std over seeds. `at budget` = eval accuracy after "
             f"{budget:,} generated completions (what the cheapest method generates in {args.steps} steps).", "",
             f"| method | final eval/acc | hardest level acc | pass@4 | steps to {args.target:.2f} | acc at budget | "
             f"completions generated | clipfrac_high |", "|---|---|---|---|---|---|---|---|"]
    for m in methods:
        cell = lambda key, fmt="{:.3f}": "{} +- {}".format(*(fmt.format(v) for v in mean_std([x[key] for x in stats[m]])))  # noqa: E731
        reached = [x["to_target"] for x in stats[m]]
        reach = f"{mean_std([r for r in reached if r is not None])[0]:.0f} ({sum(r is not None for r in reached)}/" \
                f"{len(reached)} runs)" if any(r is not None for r in reached) else f"not reached (0/{len(reached)})"
        lines.append(f"| {m} | {cell('final')} | {cell('hard')} | {cell('pass4')} | {reach} | {cell('at_budget')} | "
                     f"{cell('completions', '{:,.0f}')} | {cell('clip_high', '{:.4f}')} |")
    table = "\n".join(lines)
    print(table)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "learning.md"), "w") as f:
        f.write(table + "\n\nCommand: `python bench/learning.py " + " ".join(sys.argv[1:]) + "`\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return print("matplotlib not installed: table written, plot skipped (pip install -r bench/requirements.txt)")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for m in methods:
        for ax, x_index in ((axes[0], 0), (axes[1], 1)):
            curves = [x["curve"] for x in stats[m]]
            xs = [c[x_index] for c in curves[0]]
            ys = [[c[i][2] for c in curves] for i in range(len(xs))]
            mean = [mean_std(y)[0] for y in ys]
            std = [mean_std(y)[1] for y in ys]
            ax.plot(xs, mean, label=m)
            ax.fill_between(xs, [a - b for a, b in zip(mean, std)], [a + b for a, b in zip(mean, std)], alpha=0.15)
    axes[0].set(xlabel="step", ylabel="eval/acc (avg@4)", title="equal optimizer steps")
    axes[1].set(xlabel="completions generated", ylabel="eval/acc (avg@4)", title="equal rollout budget")
    axes[1].axvline(budget, color="gray", lw=0.8, ls="--")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "learning.png"), dpi=120)
    print(f"wrote {RESULTS}/learning.md and learning.png")


if __name__ == "__main__":
    main()
