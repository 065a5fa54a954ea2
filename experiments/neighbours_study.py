"""The neighbours side by side: DAPO, DA3PO, DARO, MaxRL, DGPO, asymmetric prompt weighting and DA3PO with an entropy
control, on one code path and one task, on the endpoints fixed in experiments/learning.py before any run (ENDPOINTS,
family "neighbours": the hard set's accuracy, Holm across the seven primaries).

The entropy control is chosen first, by the pilot the protocol fixes: da3po_lam2 with each control (PILOT_ARMS) on
`hard` at seeds 100 and 101; the highest mean hard-set accuracy (mean of the last 3 evaluations) wins, ties going to
KL-Cov. `--pilot` runs it and prints the winner; experiments/learning.py's ARMS["da3po_entropy"] is then set to the
winner's flags (the report states which, and the pilot's figures).

Every run is experiments/learning.py's run of that arm, task and seed, reused from experiments/results/runs/learning/
when its command is the same.

HA-DW (arXiv 2601.08521) was built after that family ran: its primaries are a family of their own,
neighbours_hadw, fixed in experiments/learning.py before its runs (`--family neighbours_hadw`).

Usage: python -m experiments.neighbours_study --pilot          # the entropy control's pilot (6 runs)
       python -m experiments.neighbours_study --jobs 2         # the comparison (7 arms x 8 seeds), then the report
       python -m experiments.neighbours_study --family neighbours_hadw --jobs 2   # HA-DW's family
Writes experiments/results/<family>.md, .json and, with matplotlib, <family>.png (the primaries' differences with
their Holm-family intervals, and each arm's hard-set accuracy over steps)."""
import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from experiments import learning  # the benchmark's protocol, runs and statistics

FAMILIES = ("neighbours", "neighbours_hadw")
TASK = "hard"
PILOT_SEEDS = [100, 101]
PILOT_ARMS = {"da3po_entropy_bonus": "entropy bonus", "da3po_clip_cov": "Clip-Cov", "da3po_kl_cov": "KL-Cov"}
TIE_WINNER = "da3po_kl_cov"
HARD = "eval/{hard}/acc"
FORGET = f"eval/{learning.TASKS[TASK]['forget_set']}/acc"  # the demo's own eval set: forgetting


def design(family: str) -> list[str]:
    """The arms the family's primaries name, in ENDPOINTS' order."""
    arms = []
    for e in learning.ENDPOINTS:
        if e.get("family") == family:
            arms += [a for a in (e["arm"], e["vs"]) if a not in arms]
    return arms


def run_all(arms: list[str], seeds: list[int], s: dict, jobs: int) -> tuple[dict, dict, list[str]]:
    """Each arm's summarised runs and CPU seconds; an arm without a command in ARMS is left out (named)."""
    missing = [a for a in arms if a not in learning.ARMS]
    todo = [(a, seed) for seed in seeds for a in arms if a in learning.ARMS]  # seed-major: whole seeds first
    with ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(lambda j: learning.run(TASK, j[0], j[1], s, max(1, 2 // jobs)), todo))
    stats, costs = {}, {}
    for (a, _), r in sorted(zip(todo, results), key=lambda x: x[0][1]):
        stats.setdefault((TASK, a), []).append(learning.summarise(r["records"], TASK, s))
        costs.setdefault(a, []).append(r["cpu_s"])
    return stats, costs, missing


def pilot(s: dict, jobs: int) -> tuple[str, dict]:
    """The pilot's winner and each control's mean hard-set accuracy (the rule in experiments/learning.py)."""
    stats, _, missing = run_all(list(PILOT_ARMS), PILOT_SEEDS, s, jobs)
    if missing:
        raise SystemExit(f"the pilot's arms {', '.join(missing)} have no command in experiments/learning.py's ARMS")
    means = {a: statistics.mean(learning.value(r, HARD) for r in stats[TASK, a]) for a in PILOT_ARMS}
    best = max(means.values())
    winners = [a for a, m in means.items() if m == best]
    return (TIE_WINNER if TIE_WINNER in winners else winners[0]), means


def report(stats: dict, costs: dict, missing: list[str], seeds: list[int], s: dict, argv: list[str],
           family: str) -> tuple:
    rows = learning.primaries(stats, {TASK: s}, family)
    cmd = " ".join(["python -m experiments.neighbours_study", *argv])
    entropy_flags = " ".join(learning.ARMS["da3po_entropy"][1]) if "da3po_entropy" in learning.ARMS else "not run"
    lines = ["# The neighbours side by side: difficulty-aware methods on one code path", "",
             f"Command: `{cmd}` (every number below; the runs are experiments/learning.py's, cached in "
             "experiments/results/runs/learning/). Endpoints fixed in experiments/learning.py (ENDPOINTS, family "
             f"{family}) before any run (see git log). Task `{TASK}` ({learning.TASKS[TASK]['train']}), "
             f"{s['steps']} steps, eval every {s['eval_every']} with {s['eval_samples']} samples; seeds "
             f"{','.join(map(str, seeds))} ({len(seeds)}), paired by seed; 95% Student-t intervals; two-sided paired "
             f"t-tests, Holm across the {len(rows)} primaries run. Differences in points of the hard set's accuracy "
             f"(mean of the last {learning.LAST} evaluations)."
             + (f" da3po_entropy: `{entropy_flags}` (the pilot's winner)." if family == "neighbours" else ""),
             "", "## Primaries", "",
             "| id | claim | arm - vs | difference [95% interval] | p (Holm) | what the data exclude | holds here? |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r["d"]
        lines.append(f"| {r['id']} | {r['claim']} | {r['arm']} - {r['vs']} | {learning.fmt_d(d)} | "
                     f"{d['p']:.3f} ({r['p_adj']:.3f}) | {learning.bound_text(d, 1, 100, 'points')} | "
                     f"{learning.verdict(d, 1, r['p_adj'])} |")
    for e in learning.ENDPOINTS:
        if e.get("family") == family and not any(r["id"] == e["id"] for r in rows):
            lines.append(f"| {e['id']} | {e['claim']} | {e['arm']} - {e['vs']} | not run | | | |")
    if missing:
        lines += ["", "Not run (no command in experiments/learning.py's ARMS: the method was not implemented): "
                  + ", ".join(missing) + "."]
    lines += ["", "## Each arm", "", "Means over seeds +- 95% half-width; secondary endpoints, not tested.", "",
              "| arm | hard acc, last 3 | hard pass@K, last 3 | forgetting set acc, last 3 | train/entropy, last "
              "step | CPU-s per run |", "|---|---|---|---|---|---|"]
    for a in [a for a in design(family) if (TASK, a) in stats]:
        rs = stats[TASK, a]
        entropy = [r["train"][-1]["train/entropy"] for r in rs]
        lines.append(f"| {a} | {learning.cell([learning.value(r, HARD) for r in rs])} | "
                     f"{learning.cell([learning.value(r, 'eval/{hard}/pass@K') for r in rs])} | "
                     f"{learning.cell([learning.value(r, FORGET) for r in rs])} | "
                     f"{learning.cell(entropy)} | {statistics.mean(costs[a]):.0f} |")
    data = {"command": cmd, "seeds": seeds, "settings": s, "missing": missing,
            "primaries": [{k: r[k] for k in ("id", "claim", "arm", "vs", "d", "p_adj")} for r in rows],
            "endpoints": {a: [learning.value(r, HARD) for r in stats[TASK, a]] for (_, a) in stats},
            "curves": {a: [[(e["step"], e[learning.metric_key(HARD, e_run)]) for e in e_run["evals"]]
                           for e_run in stats[TASK, a]] for (_, a) in stats},
            "cpu_s": costs}
    return "\n".join(lines), data


def plot(data: dict, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    learning.plot_primaries(left, data["primaries"], "points of hard-set accuracy", 7)
    for i, (arm, runs) in enumerate(data["curves"].items()):
        steps = [st for st, _ in runs[0]]
        right.plot(steps, [statistics.mean(run[j][1] for run in runs) for j in range(len(steps))], color=f"C{i}",
                   label=arm)
    right.set(xlabel="RL step", ylabel="hard-set accuracy (mean of seeds)", title="learning curves")
    right.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--pilot", action="store_true", help="run the entropy control's pilot and print the winner")
    p.add_argument("--seeds", default="0-7", help="'0-7' or '0,1,2'; at least 2 (the study was registered at 8)")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (threads per run: 2 // jobs, at least 1)")
    p.add_argument("--family", default="neighbours", choices=FAMILIES, help="whose primaries: the seven "
                   "neighbours (default) or HA-DW's")
    p.add_argument("--out", default="", help="<out>.md, .json, .png (default: experiments/results/<family>)")
    args = p.parse_args(argv)
    seeds = learning.parse_seeds(args.seeds)
    if len(set(seeds)) < 2 or args.jobs < 1:
        p.error("--seeds: at least 2 distinct seeds; --jobs: at least 1")
    s = learning.settings(TASK, argparse.Namespace(steps=None, eval_every=None, eval_samples=None))
    t0 = time.time()
    if args.pilot:
        winner, means = pilot(s, args.jobs)
        for a, m in means.items():
            print(f"pilot {a} ({PILOT_ARMS[a]}): hard-set accuracy, last 3, mean of seeds "
                  f"{','.join(map(str, PILOT_SEEDS))}: {m:.4f}")
        print(f"pilot winner: {winner} ({PILOT_ARMS[winner]}): {' '.join(learning.ARMS[winner][1])}")
        return
    stats, costs, missing = run_all(design(args.family), seeds, s, args.jobs)
    text, data = report(stats, costs, missing, seeds, s, argv, args.family)
    learning.save_report(args.out or os.path.join(learning.RESULTS, args.family), text, data, plot, t0)


if __name__ == "__main__":
    main()
