"""
Plot the metrics.jsonl of one or more runs (da3po.py / daro.py out_dir folders) as one PNG: a panel per metric against
step, runs overlaid, each labelled by its folder name and, from its config.json, algo and seed.

Run:
  python -m experiments.plot out/da3po out/dapo                           # -> plot.png
  python -m experiments.plot /tmp/p1 /tmp/p2 --out curves.png --smooth 5  # moving average over 5 steps (train metrics)
  python -m experiments.plot out/* --metrics train/acc,eval/acc,train/clipfrac_high
Needs matplotlib (pip install -r requirements/bench.txt).
"""
import argparse
import json
import math
import os

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

METRICS = "train/reward,train/acc,train/keep_rate,train/entropy,train/response_len,eval/acc"


def load_run(out_dir: str) -> tuple[str, dict[str, list[tuple[int, float]]]]:
    """(label, {metric: [(step, value), ...]}) from out_dir/metrics.jsonl; a later record for a step wins."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"error: {path} not found (is {out_dir!r} a run's out_dir?)")
    series: dict[str, dict[int, float]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    series.setdefault(key, {})[record["step"]] = value
    label = os.path.basename(os.path.normpath(out_dir))
    config = os.path.join(out_dir, "config.json")
    if os.path.exists(config):
        with open(config, encoding="utf-8") as f:
            cfg = json.load(f)
        label += f" ({cfg.get('algo', '?')}, seed {cfg.get('seed', '?')})"
    return label, {k: sorted(v.items()) for k, v in series.items()}


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over `window` points (1 = unchanged)."""
    return [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def main():
    p = argparse.ArgumentParser(description="Plot runs' metrics.jsonl against step, one panel per metric.")
    p.add_argument("out_dirs", nargs="+", help="run folders holding metrics.jsonl (and config.json)")
    p.add_argument("--out", default="plot.png", help="PNG to write")
    p.add_argument("--metrics", default=METRICS, help="comma-separated metric keys, one panel each")
    p.add_argument("--smooth", type=int, default=1, help="moving average over N steps for train/ metrics (1 = raw)")
    args = p.parse_args()
    runs = [load_run(d) for d in args.out_dirs]
    metrics = [m for m in args.metrics.split(",") if any(m in series for _, series in runs)]
    missing = set(args.metrics.split(",")) - set(metrics)
    if missing:
        print(f"not in any run, skipped: {', '.join(sorted(missing))}")
    if not metrics:
        raise SystemExit("error: none of the metrics is in any run")

    cols = min(3, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    for ax, metric in zip(axes.flat, metrics):
        for i, (label, series) in enumerate(runs):
            if metric not in series:
                continue
            steps, values = zip(*series[metric])
            sparse = metric.startswith("eval/")  # evaluations come every N steps: show the points
            values = list(values) if sparse else smooth(list(values), args.smooth)
            ax.plot(steps, values, marker="o" if sparse else None, markersize=3, color=f"C{i % 10}", label=label)
        ax.set_title(metric + (f" (moving avg {args.smooth})" if args.smooth > 1 and not metric.startswith("eval/")
                               else ""))
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    for ax in axes.flat:  # one legend for the figure, with every run (some runs may lack the first metric)
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), frameon=False)
    fig.tight_layout(rect=(0, 0.04 * math.ceil(len(labels) / 4) + 0.02, 1, 1))
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}: {len(metrics)} panels x {len(runs)} runs")


if __name__ == "__main__":
    main()
