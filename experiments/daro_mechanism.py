"""DARO's mechanism, measured: where do its weights go, and do they reweight the bins or only scale the loss?

For each task of experiments/learning.py that DARO runs on (hard, reasoning), the real daro.py (`--algo daro`, the
benchmark's flags) trains with its class DARO wrapped to record, at every update and for every difficulty bin mu
present: |L_mu| (the bin's token-mean clipped surrogate over all its tokens), w_mu (the weight the update used), its
fixed point 1 / (|L_mu| + delta) clamped to [w_min, w_max], the bin's share of the weighted loss
w_mu |L_mu| / sum_nu w_nu |L_nu| and of the gradient, ||grad w_mu L_mu|| / sum_nu ||grad w_nu L_nu|| (one extra
autograd pass per bin and micro-batch), and how far s_mu = -ln w_mu moved in the weight step, in units of --weight_lr.

The reading this checks: Adam moves each s_mu by about --weight_lr per update whatever the gradient's
size, so while every w_mu is below its fixed point all bins rise together at the same rate: at the paper's rate
DARO is, for its first hundreds of updates, a global loss-scale ramp, not a reweighting between bins.

Usage: python -m experiments.daro_mechanism                         # both tasks, seeds 0 and 1 (~10 CPU-minutes)
       python -m experiments.daro_mechanism --tasks reasoning --seeds 0 --steps 4 --out /tmp/m    # a smoke run
Writes <out>.json (every update's record), <out>.md (the summary) and, with matplotlib, <out>.png; --replot
writes the last two again from the first."""
import argparse
import json
import os
import shutil
import tempfile

import torch

import config
import daro
import ranks
from experiments.learning import ARMS, PROTOCOL, TASKS  # the benchmark's own task definitions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TracedDARO(daro.DARO):
    """daro.DARO, recording what each update does per bin (the model's and the weights' arithmetic unchanged)."""
    model = None  # the trained model (set by the prepare_models wrapper below)
    updates: list = []  # every update's record, appended to by every instance
    step_ends: list = []  # len(updates) at the end of each RL step (end_step() is called once per step)

    def start_update(self, batch, rows):
        self.grads = {}  # bin index -> this update's gradient of w_mu * L_mu, flattened, summed over micro-batches
        return super().start_update(batch, rows)

    def loss(self, token_loss, mb):
        total = super().loss(token_loss, mb)
        params = [p for p in TracedDARO.model.parameters() if p.requires_grad]
        weighted = token_loss * mb["weight"] * self.w[mb["bin"]].unsqueeze(-1)  # (B, T): Eq. (1)'s theta side
        for i in mb["bin"].unique().tolist():
            if 0 < i < self.G:
                term = weighted[mb["bin"] == i].sum()
                grads = torch.autograd.grad(term, params, retain_graph=True, allow_unused=True)
                flat = torch.cat([(g if g is not None else torch.zeros_like(p)).flatten()
                                  for g, p in zip(grads, params)])
                self.grads[i] = self.grads.get(i, 0) + flat
        return total

    def after_update(self):
        w_used, s_before = self.w.clone(), torch.stack(self.neg_log_w).detach().clone()
        present = self.bin_tokens > 0
        L = ranks.all_reduce_sum(self.bin_loss).abs()  # |L_mu| (G+1,)
        super().after_update()
        moved = (s_before - torch.stack(self.neg_log_w).detach()) / self.cfg.weight_lr  # ln w's step, in lr units
        cfg, loss_terms = self.cfg, {}
        norms = {i: g.norm().item() for i, g in self.grads.items()}
        bins = [i for i in range(1, self.G) if present[i]]
        for i in bins:
            loss_terms[i] = (w_used[i] * L[i]).item()
        record = {"step": len(self.step_ends) + 1, "bins": {}}
        for i in bins:
            fixed = min(max(1 / (L[i].item() + cfg.daro_delta), cfg.w_min), cfg.w_max)
            record["bins"][f"{i / self.G:.3f}"] = {
                "L": L[i].item(), "w": w_used[i].item(), "fixed": fixed, "moved_lr": moved[i - 1].item(),
                "loss_share": loss_terms[i] / max(sum(loss_terms.values()), 1e-30),
                "grad_share": norms.get(i, 0.0) / max(sum(norms.values()), 1e-30)}
        TracedDARO.updates.append(record)

    def end_step(self):
        self.step_ends.append(len(TracedDARO.updates))
        return super().end_step()


def trace(task: str, seed: int, steps: int, out_dir: str) -> list[dict]:
    """One DARO run of the benchmark's task, traced; returns its updates' records."""
    t = TASKS[task]
    flags = [*ARMS["daro"][1], "--model", t["model"], "--train_data", t["train"], "--eval_data", t["eval"][0],
             "--seed", str(seed), "--steps", str(steps), "--eval_every", "0", "--eval_size", "4",
             "--eval_samples", "1", "--updates_per_step", str(PROTOCOL["updates_per_step"]), "--sample_every", "0",
             *t["flags"], "--out_dir", out_dir]
    cfg = config.parse_config(daro.Config, flags, daro.PRESETS)
    real_prepare = daro.prepare_models

    def prepare(*args, **kwargs):
        model, ref = real_prepare(*args, **kwargs)
        TracedDARO.model = model
        return model, ref
    TracedDARO.updates, TracedDARO.step_ends = [], []
    daro.prepare_models, daro.DARO = prepare, TracedDARO
    try:
        daro.main(cfg)
    finally:
        daro.prepare_models, daro.DARO = real_prepare, TracedDARO.__bases__[0]
    return TracedDARO.updates


def spread(values: list[float]) -> str:
    return f"{min(values):.4g}-{max(values):.4g}" if values else "-"


def summary(runs: dict) -> str:
    """The markdown report: per task, at a few steps, the range over bins (seeds pooled) of each traced quantity."""
    lines = ["# DARO's mechanism, measured (`python -m experiments.daro_mechanism`)", "",
             "Per task, at each listed step (its updates pooled over seeds): the range over the bins present of |L_mu|,",
             "w_mu, the fixed point 1/(|L_mu| + delta) (clamped to [w_min, w_max]), each bin's share of the weighted",
             "loss and of the gradient norm, and the step of ln w_mu per update in units of --weight_lr.", ""]
    for task, seeds in runs.items():
        steps = max(u["step"] for ups in seeds.values() for u in ups)
        show = sorted({1, 2, 5, *range(10, steps + 1, 10), steps})
        lines += [f"## {task} ({len(seeds)} seeds: {', '.join(map(str, seeds))})", "",
                  "| step | bins | abs L_mu | w_mu | fixed point | loss share | grad share | ln w step / lr |",
                  "|---|---|---|---|---|---|---|---|"]
        for step in show:
            ups = [u for s in seeds.values() for u in s if u["step"] == step]
            cells = [b for u in ups for b in u["bins"].values()]
            if not cells:
                continue
            col = lambda k: spread([c[k] for c in cells])  # noqa: E731
            lines.append(f"| {step} | {len({m for u in ups for m in u['bins']})} | {col('L')} | {col('w')} | "
                         f"{col('fixed')} | {col('loss_share')} | {col('grad_share')} | {col('moved_lr')} |")
        cells = [b for s in seeds.values() for u in s for b in u["bins"].values()]
        ratio = [c["fixed"] / c["w"] for c in cells]
        lines += ["", f"Over every update: ln w moved {statistics(c['moved_lr'] for c in cells)} x --weight_lr per "
                  f"update; w_mu / fixed point {statistics(1 / r for r in ratio)}; the bins' weights at the last "
                  f"update span {last_spread(seeds)} (max / min).", ""]
    return "\n".join(lines)


def statistics(xs) -> str:
    xs = sorted(xs)
    return f"median {xs[len(xs) // 2]:.3g} (range {xs[0]:.3g} to {xs[-1]:.3g})" if xs else "-"


def last_spread(seeds: dict) -> str:
    ratios = []
    for ups in seeds.values():
        ws = [b["w"] for b in ups[-1]["bins"].values()] if ups else []
        if ws:
            ratios.append(max(ws) / min(ws))
    return ", ".join(f"{r:.3f}" for r in ratios)


def plot(runs: dict, path: str):
    """w_mu (with its fixed point, dashed), loss share and gradient share against the update, per bin, first seed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -r requirements/bench.txt): no figure")
        return
    fig, axes = plt.subplots(len(runs), 3, figsize=(15, 4 * len(runs)), squeeze=False)
    for row, (task, seeds) in zip(axes, runs.items()):
        ups = next(iter(seeds.values()))
        for mu in sorted({m for u in ups for m in u["bins"]}):
            xs = [i for i, u in enumerate(ups) if mu in u["bins"]]
            get = lambda k: [ups[i]["bins"][mu][k] for i in xs]  # noqa: E731
            line, = row[0].plot(xs, get("w"), label=f"mu {mu}")
            row[0].plot(xs, get("fixed"), "--", color=line.get_color(), alpha=0.5)
            row[1].plot(xs, get("loss_share"), color=line.get_color())
            row[2].plot(xs, get("grad_share"), color=line.get_color())
        row[0].set_yscale("log")
        for ax, title in zip(row, ("w_mu (dashed: fixed point)", "share of the weighted loss", "share of the gradient")):
            ax.set_title(f"{task}: {title}")
            ax.set_xlabel("update")
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    print(f"figure: {os.path.relpath(path, ROOT)}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="hard,reasoning", help="comma-separated tasks of experiments/learning.py")
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds")
    p.add_argument("--steps", type=int, default=0,
                   help="RL steps per run (0: the task's own, as experiments/learning.py)")
    p.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "daro_mechanism"),
                   help="output path without extension (.json, .md, .png)")
    p.add_argument("--replot", action="store_true", help="no runs: <out>.md and <out>.png again from <out>.json")
    a = p.parse_args(argv)
    if a.replot:
        runs = json.load(open(a.out + ".json"))
        with open(a.out + ".md", "w") as f:
            f.write(summary(runs) + "\n")
        return plot(runs, a.out + ".png")
    tasks = a.tasks.split(",")
    bad = [t for t in tasks if t not in TASKS or "daro" not in TASKS[t]["arms"]]
    if bad:
        p.error(f"--tasks: {', '.join(bad)} (DARO runs on {', '.join(t for t in TASKS if 'daro' in TASKS[t]['arms'])})")
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds {a.seeds!r}: comma-separated integers")
    torch.set_num_threads(1)
    runs, scratch = {}, tempfile.mkdtemp(prefix="daro_mechanism_")  # the runs' own outputs are not kept
    try:
        for task in tasks:
            steps = a.steps or TASKS[task].get("steps", PROTOCOL["steps"])
            runs[task] = {seed: trace(task, seed, steps, os.path.join(scratch, f"{task}-s{seed}")) for seed in seeds}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump(runs, f)
    text = summary(runs)
    with open(a.out + ".md", "w") as f:
        f.write(text + "\n")
    print(text)
    plot(runs, a.out + ".png")


if __name__ == "__main__":
    main()
