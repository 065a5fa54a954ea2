"""Does low rank cost accuracy in RL? DA3PO with LoRA adapters of rank 1, 8 and 32 on every linear layer of the
blocks against full fine-tuning, each at the learning rate a sweep picked for it, on the two tasks of
experiments/learning.py: the reasoning demo (wrong answers run long) and the hard sums (experiments/data/hard_*.jsonl).
The published claim: LoRA of rank 1-32 on all linear layers matched full fine-tuning in RL on math reasoning, at about
10x full fine-tuning's learning rate (Schulman et al., "LoRA Without Regret", Thinking Machines Lab, 2025).

The protocol is fixed in this file before any run (see git log): the arms, the tasks and their settings (those
of experiments/learning.py), the sweep and its selection rule, the seeds, the endpoints, the equivalence margin and
the tests.
  1. Sweep (seeds SWEEP_SEEDS, outside the test seeds): every arm at every learning rate of its grid, on each task.
     Each arm takes, per task, the rate with the best mean accuracy endpoint over the sweep seeds (a tie: the
     smaller). A best rate at an end of its grid extends the grid by one x3 step that way, once, and reselects.
  2. Test (seeds TEST_SEEDS): every arm at its rate, paired by seed (same prompts, sampling stream and start).
  3. Endpoints (ENDPOINTS, 12): LoRA rank r - full fine-tuning, on each task, in final accuracy and pass@k (the
     mean of the last 3 evaluations, as experiments/learning.py). Each is tested two ways, Holm across the 12 in each:
     equivalence within +-MARGIN points (two one-sided paired t-tests, TOST: "matches"), and a difference (two-sided
     paired t-test: "worse" or "better").

Usage: python -m experiments.lora_study                  # sweep, test and report (runs cached: reruns are free)
       python -m experiments.lora_study --stage sweep     # only the sweep and its choice
       python -m experiments.lora_study --plan            # the runs and their estimated CPU time; runs nothing
Runs: experiments/results/runs/lora_study/<task>/<arm>-lr<lr>-s<seed>/ (reused while the command is the same);
report: experiments/results/lora_study.md and .json. One run at a time (the machine is shared); start it with
`nice -n 10`."""
import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time

from experiments import learning  # the tasks, their settings, summaries and the statistics (Student's t, Holm)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results")

# ------------------------------------------------------------------------------------------------------------
# The protocol, as data: fixed before any run.
ALGO = ["--algo", "da3po", "--lam", "2"]  # DA3PO as experiments/learning.py's da3po_lam2 arm
RANKS = [1, 8, 32]  # LoRA ranks, every linear layer of the blocks (da3po.py's default targets)
ALPHA = 32  # --lora_alpha (the default; as "LoRA Without Regret": alpha 32, the adapter scaled by alpha / r)
ARMS = {"full": [], **{f"lora_r{r}": ["--lora_rank", str(r), "--lora_alpha", str(ALPHA)] for r in RANKS}}
# The sweep's grids, x3 apart: full fine-tuning around the demos' --lr 1e-4; LoRA around 10x that, the claim's ratio
GRIDS = {"full": [3e-5, 1e-4, 3e-4], **{f"lora_r{r}": [3e-4, 1e-3, 3e-3] for r in RANKS}}
TASKS = ["reasoning", "hard"]  # experiments/learning.py's tasks: model, data, eval sets, steps, evals, batch
SWEEP_SEEDS, TEST_SEEDS = [100, 101], list(range(8))
# The accuracy endpoint (the sweep's criterion too) and the pass@k endpoint of each task: the hard task's on its hard
# eval set, the reasoning demo's on its own; k = the task's eval samples (16 and 4)
METRICS = {"reasoning": {"acc": "eval/acc", "pass@k": "eval/pass@4"},
           "hard": {"acc": "eval/hard_eval/acc", "pass@k": "eval/hard_eval/pass@16"}}
MARGIN = 0.03  # equivalence margin: 3 points, under a tenth of what full fine-tuning gains on either task (+36
#                and +39 points from step 0 in experiments/results/learning_hard.md)
ENDPOINTS = [{"id": f"L{i + 1}", "task": t, "arm": f"lora_r{r}", "vs": "full", "metric": m}
             for i, (t, m, r) in enumerate((t, m, r) for t in TASKS for m in ("acc", "pass@k") for r in RANKS)]
LEVEL = 0.05  # each family's alpha, Holm-adjusted
PUBLISHED = ("Schulman et al., \"LoRA Without Regret\" (Thinking Machines Lab, 2025): in policy-gradient RL on math "
             "(Llama-3.1-8B-Base on GSM8K and DeepMath, Qwen3-8B-Base on DeepMath), LoRA of rank 1 and up on all "
             "layers matched full fine-tuning, at about 10x its learning rate")


# ------------------------------------------------------------------------------------------------------------
# Runs: one subprocess each, cached with the command that made it (as experiments/learning.run, in a folder of its own).
def run_dir(task: str, arm: str, lr: float, seed: int) -> str:
    return os.path.join(RESULTS, "runs", "lora_study", task, f"{arm}-lr{lr:g}-s{seed}")


def command(task: str, arm: str, lr: float, seed: int, out: str) -> list[str]:
    """da3po.py on experiments/learning.py's task, as its da3po_lam2 arm, with the arm's LoRA flags and this lr."""
    t, s = learning.TASKS[task], settings(task)
    return ["da3po.py", *ALGO, *ARMS[arm], "--lr", f"{lr:g}", "--model", t["model"], "--train_data", t["train"],
            "--eval_data", ",".join(t["eval"]), "--seed", str(seed), "--steps", str(s["steps"]),
            "--eval_every", str(s["eval_every"]), "--eval_samples", str(s["eval_samples"]),
            "--updates_per_step", str(learning.PROTOCOL["updates_per_step"]), "--sample_every", "0", *t["flags"],
            "--out_dir", os.path.relpath(out, ROOT)]


def settings(task: str) -> dict:
    """experiments/learning.py's steps, eval_every and eval_samples of the task."""
    return learning.settings(task, argparse.Namespace(steps=None, eval_every=None, eval_samples=None))


def run(task: str, arm: str, lr: float, seed: int) -> dict:
    """One training run (reused when a finished one with the same command exists): its summary and CPU seconds."""
    out = run_dir(task, arm, lr, seed)
    cmd = command(task, arm, lr, seed, out)
    done = os.path.join(out, "run.json")  # written last: a run killed halfway, or made by another command, is redone
    if not (os.path.exists(done) and json.load(open(done))["command"] == cmd):
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        print(f"run: {task} {arm} lr {lr:g} seed {seed}", flush=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        t0 = time.time()
        with open(os.path.join(out, "log.txt"), "w") as log:
            proc = subprocess.Popen([sys.executable, *cmd], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)  # this child's own CPU time, whatever else runs at once
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{task} {arm} lr {lr:g} seed {seed} failed:\n"
                             + open(os.path.join(out, "log.txt")).read()[-2000:])
        for name in os.listdir(out):  # the checkpoint is not needed here
            if name.startswith("step_"):
                shutil.rmtree(os.path.join(out, name))
        json.dump({"command": cmd, "wall_s": round(time.time() - t0, 1),
                   "cpu_s": round(usage.ru_utime + usage.ru_stime, 1)}, open(done, "w"))
    records = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    return {**learning.summarise(records, task, settings(task)), "cpu_s": json.load(open(done))["cpu_s"]}


def endpoint(run_summary: dict, task: str, metric: str) -> float:
    """The mean of the last 3 evaluations of a metric (experiments/learning.py's `last3`)."""
    return learning.last_mean(run_summary["evals"], METRICS[task][metric])


# ------------------------------------------------------------------------------------------------------------
# 1. The sweep: each arm's learning rate per task, by the rule in the docstring.
def sweep(runs: dict) -> dict:
    """(task, arm) -> {"lr": the chosen rate, "grid": the rates run, "means": the sweep's mean accuracy per rate}."""
    chosen = {}
    for task in TASKS:
        for arm in ARMS:
            grid, extended = list(GRIDS[arm]), False
            while True:
                means = {lr: statistics.mean(endpoint(get(runs, task, arm, lr, s), task, "acc")
                                             for s in SWEEP_SEEDS) for lr in grid}
                best = min(grid, key=lambda lr: (-means[lr], lr))  # the best mean; a tie: the smaller rate
                edge = -1 if best == grid[0] else 1 if best == grid[-1] else 0
                if not edge or extended:
                    break
                grid = sorted(grid + [best * 3.0 ** edge])  # one x3 step past the end, once
                extended = True
            chosen[task, arm] = {"lr": best, "grid": grid, "means": means, "at_edge": bool(edge)}
    return chosen


def get(runs: dict, task: str, arm: str, lr: float, seed: int) -> dict:
    """A run's summary, made (or read from the cache) on first use."""
    key = (task, arm, lr, seed)
    if key not in runs:
        runs[key] = run(task, arm, lr, seed)
    return runs[key]


# ------------------------------------------------------------------------------------------------------------
# 2.-3. The test runs and the endpoints' two families of tests.
def tost_p(d: list[float], margin: float) -> float:
    """The equivalence p-value of paired differences d within +-margin: the larger of the two one-sided t-tests'
    (H0: mean <= -margin; H0: mean >= +margin), Student's t with n - 1 degrees of freedom."""
    n, mean, sd = len(d), statistics.mean(d), statistics.stdev(d)
    if sd == 0:
        return 0.0 if abs(mean) < margin else 1.0
    se = sd / math.sqrt(n)

    def one_sided(t: float) -> float:  # P(T >= t)
        half = learning.t_two_sided_p(t, n - 1) / 2
        return half if t > 0 else 1 - half
    return max(one_sided((mean + margin) / se), one_sided((margin - mean) / se))


def test(chosen: dict, runs: dict) -> list[dict]:
    """Every endpoint's paired difference (95% interval), its TOST and difference p-values, each Holm-adjusted."""
    rows = []
    for e in ENDPOINTS:
        lr_arm, lr_vs = chosen[e["task"], e["arm"]]["lr"], chosen[e["task"], e["vs"]]["lr"]
        xs = [endpoint(get(runs, e["task"], e["arm"], lr_arm, s), e["task"], e["metric"]) for s in TEST_SEEDS]
        ys = [endpoint(get(runs, e["task"], e["vs"], lr_vs, s), e["task"], e["metric"]) for s in TEST_SEEDS]
        d = learning.paired(xs, ys)
        rows.append({**e, "d": d, "x": xs, "y": ys, "p_tost": tost_p([x - y for x, y in zip(xs, ys)], MARGIN)})
    for key in ("p_tost", "p"):
        for row, p in zip(rows, learning.holm([r[key] if key == "p_tost" else r["d"]["p"] for r in rows])):
            row[f"{key}_holm"] = p
    for row in rows:
        matches, differs = row["p_tost_holm"] < LEVEL, row["p_holm"] < LEVEL
        sign = "worse" if row["d"]["mean"] < 0 else "better"
        row["verdict"] = ("matches" + (f" (and {sign}, by less than the margin)" if differs else "") if matches
                          else sign if differs else "not shown either way")
    return rows


# ------------------------------------------------------------------------------------------------------------
# The report.
def adapter_sizes() -> dict:
    """Trainable parameters of each arm on the demos' model (0.5M parameters): the whole model, or the adapters."""
    import torch

    import modeling
    model = modeling.load_model(os.path.join(ROOT, learning.TASKS["reasoning"]["model"]))[0]
    sizes = {"full": sum(p.numel() for p in model.parameters())}
    for r in RANKS:
        linear = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
        sizes[f"lora_r{r}"] = sum(r * (m.in_features + m.out_features) for m in linear)
    return sizes


def report(chosen: dict, rows: list[dict], runs: dict, argv: list[str]) -> tuple[str, dict]:
    sizes = adapter_sizes()
    pct = lambda x: f"{100 * x:+.1f}"  # noqa: E731
    lines = ["# LoRA against full fine-tuning in RL: the study", "",
             f"Command: `{' '.join(['python -m experiments.lora_study', *argv])}`. The protocol (arms, sweep, rule, "
             "seeds, "
             "endpoints, margin, tests) is fixed in experiments/lora_study.py before any run (see git log). DA3PO "
             "(lam 2) from the shipped demo models on experiments/learning.py's tasks: " + "; ".join(
                 f"`{t}`: {settings(t)['steps']} steps x {learning.PROTOCOL['updates_per_step']} updates, eval every "
                 f"{settings(t)['eval_every']} steps with {settings(t)['eval_samples']} samples per problem"
                 for t in TASKS) + f". LoRA on every linear layer of the blocks, alpha {ALPHA} (scale alpha / r).",
             "", "Trainable parameters: " + ", ".join(f"{a} {n:,}" for a, n in sizes.items()) + ".",
             "", f"The published claim: {PUBLISHED}.",
             "", "## The sweep (seeds " + ", ".join(map(str, SWEEP_SEEDS)) + ")", "",
             "Mean accuracy endpoint (last 3 evals) over the sweep seeds at each learning rate; the chosen rate in "
             "bold. A best rate at an end of its grid extends the grid once by x3.", "",
             "| task | arm | " + " | ".join(["learning rate: mean accuracy"]) + " | chosen | chosen / full's |",
             "|---|---|---|---|---|"]
    for (t, a), c in chosen.items():
        cells = ", ".join((f"**{lr:g}: {m:.3f}**" if lr == c["lr"] else f"{lr:g}: {m:.3f}")
                          for lr, m in sorted(c["means"].items()))
        ratio = c["lr"] / chosen[t, "full"]["lr"]
        lines.append(f"| {t} | {a} | {cells}{' (still at the edge)' if c['at_edge'] else ''} | {c['lr']:g} | "
                     f"{ratio:.2f}x |")
    lines += ["", f"## Endpoints (seeds {','.join(map(str, TEST_SEEDS))}, paired by seed)", "",
              f"LoRA - full fine-tuning in points, 95% t-interval; equivalence: TOST within +-{100 * MARGIN:g} points; "
              "difference: two-sided paired t-test; Holm across the 12 endpoints in each family.", "",
              "| id | task | arm - full | metric | LoRA | full | difference [95% interval] | p equivalence (Holm) "
              "| p difference (Holm) | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r["d"]
        lines.append(f"| {r['id']} | {r['task']} | {r['arm']} | {METRICS[r['task']][r['metric']]} | "
                     f"{learning.cell(r['x'])} | {learning.cell(r['y'])} | {pct(d['mean'])} [{pct(d['lo'])}, "
                     f"{pct(d['hi'])}] | {r['p_tost']:.3f} ({r['p_tost_holm']:.3f}) | {d['p']:.3f} "
                     f"({r['p_holm']:.3f}) | {r['verdict']} |")
    cost = {k: v["cpu_s"] for k, v in runs.items()}
    lines += ["", "## Each arm at its rate: start and curve", "", "| task | arm | lr | accuracy at step 0 | "
              "accuracy by eval step (mean of seeds) | CPU-s per run |", "|---|---|---|---|---|---|"]
    for t in TASKS:
        for a in ARMS:
            lr = chosen[t, a]["lr"]
            rs = [runs[t, a, lr, s] for s in TEST_SEEDS]
            key = METRICS[t]["acc"]
            curve = " ".join(f"{e['step']}:{statistics.mean(r['evals'][i][key] for r in rs):.3f}"
                             for i, e in enumerate(rs[0]["evals"]))
            lines.append(f"| {t} | {a} | {lr:g} | {statistics.mean(r['evals'][0][key] for r in rs):.3f} | {curve} "
                         f"| {statistics.mean(r['cpu_s'] for r in rs):.0f} |")
    lines += ["", "## Cost", "", f"{len(runs)} runs, {sum(cost.values()) / 3600:.2f} CPU-hours (each run's own user + "
              f"system time), one at a time; {learning.cpu_name()}."]
    data = {"command": " ".join(["python -m experiments.lora_study", *argv]), "published": PUBLISHED,
            "margin": MARGIN, "sweep_seeds": SWEEP_SEEDS, "test_seeds": TEST_SEEDS, "trainable": sizes,
            "sweep": [{"task": t, "arm": a, **{k: v for k, v in c.items() if k != "means"},
                       "means": {f"{lr:g}": m for lr, m in c["means"].items()}} for (t, a), c in chosen.items()],
            "endpoints": [{k: r[k] for k in ("id", "task", "arm", "vs", "metric", "d", "x", "y", "p_tost",
                                              "p_tost_holm", "p_holm", "verdict")} for r in rows],
            "cpu_s": {"/".join(map(str, k)): v for k, v in cost.items()}}
    return "\n".join(lines), data


def plan():
    """The runs of the sweep (before any extension) and of the test, and their estimated CPU time."""
    total = 0.0
    for t in TASKS:
        each = learning.estimate_cpu_s(t, settings(t))
        n = sum(len(g) for g in GRIDS.values()) * len(SWEEP_SEEDS) + len(ARMS) * len(TEST_SEEDS)
        print(f"{t}: {n} runs (sweep {sum(len(g) for g in GRIDS.values())} rates x {len(SWEEP_SEEDS)} seeds, test "
              f"{len(ARMS)} arms x {len(TEST_SEEDS)} seeds), ~{each:.0f} CPU-s each (full fine-tuning's)")
        total += n * each
    print(f"estimate: {total / 3600:.1f} CPU-hours before any grid extension (LoRA's steps cost more)")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--stage", default="all", choices=["sweep", "all"], help="sweep: stop after the choice of rates")
    p.add_argument("--plan", action="store_true", help="print the runs and their estimated cost, run nothing")
    args = p.parse_args(argv)
    if args.plan:
        return plan()
    runs = {}
    chosen = sweep(runs)
    for (t, a), c in chosen.items():
        print(f"sweep: {t} {a}: lr {c['lr']:g} (" + ", ".join(f"{lr:g}: {m:.3f}" for lr, m in c["means"].items())
              + ")", flush=True)
    if args.stage == "sweep":
        return
    for t in TASKS:  # seed-major: a study cut short leaves whole seeds, every arm of each
        for s in TEST_SEEDS:
            for a in ARMS:
                get(runs, t, a, chosen[t, a]["lr"], s)
    rows = test(chosen, runs)
    text, data = report(chosen, rows, runs, argv)
    print(text)
    os.makedirs(RESULTS, exist_ok=True)
    open(os.path.join(RESULTS, "lora_study.md"), "w").write(text + "\n")
    json.dump(data, open(os.path.join(RESULTS, "lora_study.json"), "w"), indent=1)
    print(f"wrote {RESULTS}/lora_study.md and .json")


if __name__ == "__main__":
    main()
