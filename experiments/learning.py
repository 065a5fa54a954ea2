"""The learning benchmark: does DA3PO learn more on hard prompts than DAPO, and does DARO beat DAPO and static
weights? Every arm x seed trains from the same model on a task (a table entry: model, training set, eval sets,
extra flags), and the claims are tested on endpoints fixed in this file before any run (ENDPOINTS), paired by
seed, with t-intervals for any number of seeds and Holm's correction across the primary family.

Tasks (TASKS; tools/hard_prompts.py writes the data): `hard` (2,000 prompts the shipped demo model solves 5-40% of
the time) with every arm; `mix_easy25/50/75` (25 / 50 / 75% of the rows easy, start pass rate 60-95%) with DAPO and
DA3PO lam 2, to vary the hard share of an update; each evaluated on experiments/data/hard_eval.jsonl (320 problems, 4
levels by start pass rate) and demo/arith/eval.jsonl (the demo's own eval set, to watch forgetting); `reasoning`, the
reasoning demo (demo/reasoning/: wrong answers run longer, so DARO's bins differ in loss scale) with DAPO, DARO,
uniform and var, evaluated on its own calibrated set; `arith`, the demo's own training mix (optional).

Usage: python -m experiments.learning --plan                       # the runs and their estimated CPU time; runs nothing
       python -m experiments.learning                              # the full benchmark (see the plan for its cost)
       python -m experiments.learning --tasks hard --arms dapo,da3po_lam2 --seeds 0,1 --steps 10 --eval_every 2 \\
           --name smoke
Runs are cached in experiments/results/runs/learning/<task>/<arm>-s<seed>-<steps>steps/ and reused while their command
is the same (delete a folder to redo it); the report goes to experiments/results/<name>.md and the figures to
<name>_*.png (matplotlib: requirements/bench.txt). --jobs 2 runs two at a time, one thread each."""
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
RESULTS = os.path.join(ROOT, "experiments", "results")

# -----------------------------------------------------------------------------------------------------------------
# The protocol, as data. Everything below this section only reads it.

# Arms: name -> (script, flags). DAPO, GRPO and the static weightings run in daro.py, which logs each difficulty bin's
# groups (daro/n_mu: the hard share of an update); daro.py --algo dapo and da3po.py --algo dapo write the same
# metrics.jsonl record for record, so an arm pairs with any other by seed.
ARMS = {
    "dapo": ("daro.py", ["--algo", "dapo"]),
    "da3po_lam1.5": ("da3po.py", ["--algo", "da3po", "--lam", "1.5"]),
    "da3po_lam2": ("da3po.py", ["--algo", "da3po", "--lam", "2"]),
    "da3po_lam4": ("da3po.py", ["--algo", "da3po", "--lam", "4"]),
    "da3po_adaptive": ("da3po.py", ["--algo", "da3po", "--adaptive_lam"]),
    # the symmetric control: every advantage of a hard group x2, both signs: up-weights hard prompts without DAA's
    # tilt toward their correct answers
    "da3po_all": ("da3po.py", ["--algo", "da3po", "--lam", "2", "--daa_scope", "all"]),
    "grpo": ("daro.py", ["--algo", "grpo"]),
    "daro": ("daro.py", ["--algo", "daro"]),  # the paper's weight lr 1e-3
    "uniform": ("daro.py", ["--algo", "uniform"]),
    "var": ("daro.py", ["--algo", "var"]),
    # The DARO study (experiments/daro_study.py runs it): DARO where its weights move. "{travel}" stands for the
    # weight lr at which ln w can travel TRAVEL in the run: TRAVEL / (steps x updates per step) (command() fills it
    # in), the paper's 600 updates x 1e-3; the closed form w_mu = 1 / (|L_mu| + delta) is DARO's fixed point at every
    # update; --shared_weight gives every bin the mean of those weights: the same overall loss scale, no reweighting.
    "daro_travel": ("daro.py", ["--algo", "daro", "--weight_lr", "{travel}"]),
    "daro_travel_shared": ("daro.py", ["--algo", "daro", "--weight_lr", "{travel}", "--shared_weight"]),
    "daro_closed": ("daro.py", ["--algo", "daro", "--weighting", "closed"]),
    "daro_closed_shared": ("daro.py", ["--algo", "daro", "--weighting", "closed", "--shared_weight"]),
    # The neighbours (neighbours.py, docs/neighbours.md), each with its paper's preset: no dynamic sampling, clip
    # 0.2/0.2, token mean. The hard task runs them in the neighbours study only (its study_arms).
    "maxrl": ("da3po.py", ["--algo", "maxrl"]),
    "dgpo": ("da3po.py", ["--algo", "dgpo"]),
    "asym": ("da3po.py", ["--algo", "asym"]),
    # The neighbours' entropy pilot (experiments/neighbours_study.py): DA3PO lam 2 with each control at the defaults
    # docs/entropy.md states (the bonus at 1e-3, the top of the range the paper found to barely move the entropy);
    # da3po_entropy is set to the pilot's winner once it has run.
    "da3po_entropy_bonus": ("da3po.py", ["--algo", "da3po", "--lam", "2", "--entropy_coef", "0.001"]),
    "da3po_clip_cov": ("da3po.py", ["--algo", "da3po", "--lam", "2", "--entropy_control", "clip_cov"]),
    "da3po_kl_cov": ("da3po.py", ["--algo", "da3po", "--lam", "2", "--entropy_control", "kl_cov"]),
    # the pilot's winner (experiments/results/neighbours_pilot.txt): Clip-Cov
    "da3po_entropy": ("da3po.py", ["--algo", "da3po", "--lam", "2", "--entropy_control", "clip_cov"]),
    # HA-DW (arXiv 2601.08521, neighbours.py), added after the neighbours' family ran: its preset is GRPO's with the
    # history-aware weights (docs/neighbours.md), so its own base is the grpo arm above
    "hadw": ("da3po.py", ["--algo", "hadw"]),
}
TRAVEL = 600 * 1e-3  # the paper's weight updates (300 steps x 2) x its weight lr: how far ln w_mu can move
DARO_STUDY_ARMS = ["daro_travel", "daro_travel_shared", "daro_closed", "daro_closed_shared"]
NEIGHBOUR_ARMS = ["asym", "maxrl", "dgpo", "da3po_entropy", "hadw"]  # the neighbours' studies (NEIGHBOURS below)
DA3PO_ARMS = ["dapo", "da3po_lam1.5", "da3po_lam2", "da3po_lam4", "da3po_adaptive", "da3po_all", "grpo", "daro",
              "uniform", "var"]
HARD_EVAL = "experiments/data/hard_eval.jsonl"
DEMO_EVAL = "arith"  # the built-in name of demo/arith/eval.jsonl: its keys read eval/arith/...
# Task: model, training data, eval sets, extra flags, arms; "hard_set" names the eval set whose accuracy and pass@k
# are the hard-prompt endpoints, "forget_set" the one that watches forgetting, "hard_share" the share of hard rows in
# the training set (the x-axis of the mix trend). Optional "steps", "eval_every", "eval_samples" replace the protocol
# defaults for that task (the command line replaces both); "cpu_s" is the measured cost model of one run (CPU seconds:
# start-up + per RL step + per evaluation), None until measured. Measured here (user + system time, one thread):
# start-up 7 s and one evaluation of both sets at 16 samples 3.2 s (da3po.py --eval_only); 60-step runs on `hard`:
# dapo 42.7, da3po_lam2 44.0, grpo 41.6, daro 46.5 s; dapo on mix_easy75 54.7 s (more all-correct groups to refill);
# the other mixes interpolated.
HARD_TASK = {"model": "demo/arith/model", "eval": [HARD_EVAL, DEMO_EVAL], "flags": ["--demo", "arith"],
             "hard_set": "hard_eval", "forget_set": "arith", "cpu_s": {"start": 7.0, "step": 0.25, "eval": 3.2}}
TASKS = {
    "hard": {**HARD_TASK, "train": "experiments/data/hard_train.jsonl", "arms": DA3PO_ARMS, "hard_share": 1.0,
             "study_arms": DARO_STUDY_ARMS + NEIGHBOUR_ARMS},  # run only when --arms names them
    **{f"mix_easy{e}": {**HARD_TASK, "train": f"experiments/data/mix_easy{e}_train.jsonl",
                        "arms": ["dapo", "da3po_lam2"], "hard_share": 1 - e / 100,
                        "cpu_s": {"start": 7.0, "step": step, "eval": 3.2}}
       for e, step in ((25, 0.30), (50, 0.36), (75, 0.42))},
    # The reasoning demo (`--demo reasoning`; demo/reasoning/README.md): its flags, 20 steps (it nears its ceiling by
    # then), an eval every 5 steps at 4 samples per problem (an eval of 200 problems x 16 samples of up to 72 tokens
    # costs 55 CPU-s, 4 samples 14). A pilot DAPO run at seed 100: 62 CPU-s, eval/acc 0.449, 0.685, 0.770, 0.829,
    # 0.858 at steps 0, 5, 10, 15, 20.
    "reasoning": {"model": "demo/reasoning/model", "train": "demo/reasoning/train.jsonl",
                  "eval": ["demo/reasoning/eval.jsonl"], "arms": ["dapo", "daro", "uniform", "var"],
                  "flags": ["--max_new_tokens", "72", "--overlong_buffer", "16", "--prompts_per_step", "16"],
                  "steps": 20, "eval_every": 5, "eval_samples": 4, "hard_set": None, "forget_set": None,
                  "cpu_s": {"start": 7.0, "step": 1.9, "eval": 13.6}, "study_arms": DARO_STUDY_ARMS},
    # The demo's own training mix (experiments/results/learning.md's task), on the same eval sets: few hard prompts.
    "arith": {**HARD_TASK, "train": "arith", "arms": ["dapo", "da3po_lam2"], "hard_share": None,
              "cpu_s": {"start": 7.0, "step": 0.45, "eval": 3.2}},
}
DEFAULT_TASKS = ["hard", "mix_easy25", "mix_easy50", "mix_easy75", "reasoning"]
PROTOCOL = {"steps": 60, "eval_every": 10, "eval_samples": 16, "updates_per_step": 4, "seeds": list(range(8))}
LAST = 3  # an accuracy endpoint is the mean of the last LAST evaluations (steps 40, 50, 60 by default)
ALPHA = 0.05

# The endpoints, fixed before the runs: one primary per claim, tested as `arm - vs`, paired by seed, two-sided, Holm
# across every primary whose task is run. metric: a metrics.jsonl key ("{hard}" = the task's hard_set, "pass@K" =
# the largest k evaluated); kind "last3" = mean of the last 3 evaluations, "steps_to" = the first step at which the
# curve reaches `target` (linear between evaluations; a seed that never does counts as steps + eval_every).
# better: +1 when larger is better, -1 when smaller is (steps). Targets come from a pilot DAPO run at seed 100, not
# a benchmark seed: eval/acc (the mean of hard_eval and arith) 0.32 at step 0, 0.54 at 30, 0.56 at 40, 0.61 at 60.
ENDPOINTS = [
    {"id": "P1", "claim": "DA3PO learns more on hard prompts than DAPO", "task": "hard", "arm": "da3po_lam2",
     "vs": "dapo", "metric": "eval/{hard}/acc", "kind": "last3", "better": 1},
    {"id": "P2", "claim": "DA3PO broadens coverage on hard prompts (pass@k)", "task": "hard", "arm": "da3po_lam2",
     "vs": "dapo", "metric": "eval/{hard}/pass@K", "kind": "last3", "better": 1},
    {"id": "P3", "claim": "DARO beats DAPO", "task": "hard", "arm": "daro", "vs": "dapo", "metric": "eval/acc",
     "kind": "last3", "better": 1},
    {"id": "P4", "claim": "DARO converges faster than DAPO", "task": "hard", "arm": "daro", "vs": "dapo",
     "metric": "eval/acc", "kind": "steps_to", "target": 0.55, "better": -1},
    {"id": "P5", "claim": "DARO's learned weights beat static (uniform) ones", "task": "hard", "arm": "daro",
     "vs": "uniform", "metric": "eval/acc", "kind": "last3", "better": 1},
    {"id": "R1", "claim": "DARO beats DAPO (reasoning demo)", "task": "reasoning", "arm": "daro", "vs": "dapo",
     "metric": "eval/acc", "kind": "last3", "better": 1},
    {"id": "R2", "claim": "DARO converges faster than DAPO (reasoning demo)", "task": "reasoning", "arm": "daro",
     "vs": "dapo", "metric": "eval/acc", "kind": "steps_to", "target": 0.80, "better": -1},  # pilot: step ~12.5
    {"id": "R3", "claim": "DARO's learned weights beat static ones (reasoning demo)", "task": "reasoning",
     "arm": "daro", "vs": "uniform", "metric": "eval/acc", "kind": "last3", "better": 1},
]
# The DARO study, fixed before its runs: DARO where its weights move, a family of its own (Holm
# across these 7; experiments/daro_study.py). `hard` at 60 steps (240 weight updates: --weight_lr 2.5e-3 for the matched
# travel), `reasoning` at 20 (80 updates: 7.5e-3), 8 seeds. On `hard` every bin's fixed point sits at the w_max clamp
# (experiments/results/daro_mechanism.md), so there the closed form is one global scale of 10 and the shared control of
# the matched-travel arm is the informative one; on `reasoning` the bins' loss scales differ, so the closed form really
# reweighs and its shared control asks whether a gain is reweighting or a larger step. DAPO is not run on `reasoning`
# (the CPU budget of the study, ~100 CPU-minutes): there the weights are tested against uniform weights, whose loss
# differs from DARO's only by w. Cut before any `reasoning` run, when the hard runs showed the machine's wall time
# (shared, ~2x the CPU time): daro_travel on `reasoning` (D6, vs uniform; its id stays unused). There ln w can
# travel 0.6 in 80 updates, below ln 3.4 = 1.22, the smallest fixed point measured
# (experiments/results/daro_mechanism.md): its weights would still rise together, the loss-scale ramp that D1-D3 test
# on `hard`.
DARO_STUDY = [
    {"id": "D1", "claim": "DARO at the paper's weight travel beats DAPO", "task": "hard", "arm": "daro_travel",
     "vs": "dapo"},
    {"id": "D2", "claim": "DARO at the paper's weight travel beats uniform weights", "task": "hard",
     "arm": "daro_travel", "vs": "uniform"},
    {"id": "D3", "claim": "DARO's gain at the paper's travel is reweighting, not its overall loss scale",
     "task": "hard", "arm": "daro_travel", "vs": "daro_travel_shared"},
    {"id": "D4", "claim": "DARO's converged (closed-form) weights beat DAPO", "task": "hard", "arm": "daro_closed",
     "vs": "dapo"},
    {"id": "D5", "claim": "DARO's converged (closed-form) weights beat uniform weights", "task": "hard",
     "arm": "daro_closed", "vs": "uniform"},
    {"id": "D7", "claim": "DARO's converged (closed-form) weights beat uniform weights (reasoning demo)",
     "task": "reasoning", "arm": "daro_closed", "vs": "uniform"},
    {"id": "D8", "claim": "DARO's converged weights' gain is reweighting, not their overall loss scale (reasoning "
     "demo)", "task": "reasoning", "arm": "daro_closed", "vs": "daro_closed_shared"},
]
ENDPOINTS += [{**e, "family": "daro_study", "metric": "eval/acc", "kind": "last3", "better": 1} for e in DARO_STUDY]
# The neighbours, fixed before their runs: the difficulty-aware methods of 2026 beside DA3PO and DARO on one code path,
# a family of its own (Holm across these 7; experiments/neighbours_study.py runs it). Task `hard` at 60 steps,
# seeds 0-7, paired by seed. Arms: dapo, da3po_lam2 and daro as above; maxrl (MaxRL, arXiv 2602.02710), dgpo (DGPO,
# arXiv 2601.20614) and asym (asymmetric prompt weighting, arXiv 2602.11128), each at its paper's defaults as
# docs/neighbours.md states them; da3po_entropy, DA3PO lam 2 with the one entropy control a pilot favours. The pilot,
# also fixed here: da3po_lam2 with each of the entropy bonus, Clip-Cov and KL-Cov at the defaults docs/entropy.md
# states, on `hard` at seeds 100 and 101 (never benchmark seeds), 60 steps; the control with the highest mean
# eval/hard_eval/acc (mean of the last 3 evaluations) becomes da3po_entropy, ties going to KL-Cov. Every primary:
# the hard set's accuracy, the mean of the last 3 evaluations, two-sided. The asymmetric-weighting paper expects little
# gain on top of DAPO-style training (N3): "not shown" is its prediction. A method that could not be sourced is not
# run, and the report says so. Secondary, reported without tests: pass@K on the hard set, the forgetting set's
# accuracy, train/entropy.
NEIGHBOURS = [
    {"id": "N1", "claim": "DA3PO beats DAPO on hard prompts", "arm": "da3po_lam2", "vs": "dapo"},
    {"id": "N2", "claim": "DARO beats DAPO on hard prompts", "arm": "daro", "vs": "dapo"},
    {"id": "N3", "claim": "asymmetric prompt weighting beats DAPO on hard prompts", "arm": "asym", "vs": "dapo"},
    {"id": "N4", "claim": "MaxRL beats DAPO on hard prompts", "arm": "maxrl", "vs": "dapo"},
    {"id": "N5", "claim": "DGPO beats DAPO on hard prompts", "arm": "dgpo", "vs": "dapo"},
    {"id": "N6", "claim": "DA3PO with an entropy control beats DAPO on hard prompts", "arm": "da3po_entropy",
     "vs": "dapo"},
    {"id": "N7", "claim": "an entropy control adds to DA3PO on hard prompts", "arm": "da3po_entropy",
     "vs": "da3po_lam2"},
]
ENDPOINTS += [{**e, "family": "neighbours", "task": "hard", "metric": "eval/{hard}/acc", "kind": "last3", "better": 1}
              for e in NEIGHBOURS]
# HA-DW, fixed before its runs, in a family of its own (the seven above ran before it was built; adding it to their
# family would change their Holm adjustment after the fact). Task `hard` at 60 steps, seeds 0-7, paired by seed; the
# hard set's accuracy, mean of the last 3 evaluations, two-sided; Holm across these 2. H1 is the paper's own claim:
# its history-aware weights on top of GRPO, the base its preset keeps (the grpo arm, daro.py --algo grpo, which writes
# da3po.py --algo grpo's records). H2 sets it beside the neighbours' common baseline. `python -m
# experiments.neighbours_study --family neighbours_hadw` runs it.
NEIGHBOURS_HADW = [
    {"id": "H1", "claim": "HA-DW adds to GRPO on hard prompts", "arm": "hadw", "vs": "grpo"},
    {"id": "H2", "claim": "HA-DW beats DAPO on hard prompts", "arm": "hadw", "vs": "dapo"},
]
ENDPOINTS += [{**e, "family": "neighbours_hadw", "task": "hard", "metric": "eval/{hard}/acc", "kind": "last3",
               "better": 1} for e in NEIGHBOURS_HADW]
# The papers' headline numbers, for scale only (other models, benchmarks and units), as the papers' summaries state
# them (their full tables were not available to us): DA3PO, arXiv:2608.27982; DARO, arXiv:2510.09001 (summary at
# papers.lunadong.com/paper/14080). Percentage points of benchmark accuracy.
PAPER = {
    "P1": "Qwen3-4B/8B-Base: avg accuracy 39.63 / 46.89 at lam 2; >= +5.02 / +4.95 over the best other GRPO variant "
          "(DAPO among them); on AIME (the hardest) up to +5.00 / +6.25",
    "P2": "avg pass@k >= +5.81 / +5.87 over baselines (Qwen3-4B/8B-Base)",
    "P3": "Qwen2.5-Math-7B: avg 50.8 over 6 benchmarks, +2.4 over DAPO (+1.4 over GRPO)",
    "P4": "Llama-3.1-8B reaches a 20% pass rate in half DAPO's steps; Qwen2.5-Math-7B: not available",
    "P5": "not available (static baselines in the paper: GRPO +1.4, DAPO +2.4 on Qwen2.5-Math-7B)",
    "lam1.5": "lam 1.5 over DAPO: +4.42 / +3.38 (Qwen3-4B/8B-Base); lam 2 best of 1.5, 2, 2.5",
    "grpo": "DA3PO over GRPO: >= +5.02 / +4.95 (the 'other GRPO variants' figure)",
}
PAPER["R1"], PAPER["R2"], PAPER["R3"] = PAPER["P3"], PAPER["P4"], PAPER["P5"]

# -----------------------------------------------------------------------------------------------------------------
# Statistics: Student's t for any degrees of freedom (no table), paired intervals, Holm's step-down adjustment.


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (modified Lentz; Numerical
    Recipes 6.4), accurate to ~1e-14."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast only below the mean; use the symmetry
        return 1.0 - betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(1 - x)) / a
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * f


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with df degrees of freedom: I_{df / (df + t^2)}(df / 2, 1 / 2)."""
    return 1.0 if t == 0 else betainc(df / 2, 0.5, df / (df + t * t))


def t_quantile(q: float, df: int) -> float:
    """The q quantile (q in (0.5, 1)) of Student's t with df degrees of freedom, by bisection on the CDF."""
    lo, hi = 0.0, 1.0
    while t_two_sided_p(hi, df) > 2 * (1 - q):
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_two_sided_p(mid, df) > 2 * (1 - q) else (lo, mid)
    return (lo + hi) / 2


def mean_ci(xs: list[float], level: float = 0.95) -> tuple[float, float]:
    """Mean and the half-width of its t-interval (nan for a single value)."""
    m = statistics.mean(xs)
    if len(xs) < 2:
        return m, math.nan
    return m, t_quantile(0.5 + level / 2, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))


def paired(xs: list[float], ys: list[float]) -> dict:
    """The paired difference xs - ys (same seeds, same order): mean, 95% interval, two-sided t-test p-value."""
    d = [x - y for x, y in zip(xs, ys)]
    mean, half = mean_ci(d)
    sd = statistics.stdev(d) if len(d) > 1 else math.nan
    if len(d) < 2:
        p = math.nan
    elif sd == 0:
        p = 1.0 if mean == 0 else 0.0
    else:
        p = t_two_sided_p(mean / (sd / math.sqrt(len(d))), len(d) - 1)
    return {"n": len(d), "mean": mean, "lo": mean - half, "hi": mean + half, "sd": sd, "p": p}


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values: sort ascending, p_(i) x (m - i + 1) (i from 1), running maximum, capped at
    1; returned in the input order. A test survives at alpha when its adjusted p-value is below alpha."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def last_mean(evals: list[dict], key: str, n: int = LAST) -> float:
    """An accuracy endpoint: the mean of `key` over the last n evaluation records (less eval noise than one)."""
    return statistics.mean(e[key] for e in evals[-n:])


def crossing(xs: list[float], ys: list[float], level: float) -> float:
    """The first x at which the piecewise-linear curve (xs, ys) reaches level (inf if it never does)."""
    for i, (x, y) in enumerate(zip(xs, ys)):
        if y >= level:
            return x if i == 0 else xs[i - 1] + (x - xs[i - 1]) * (level - ys[i - 1]) / (y - ys[i - 1])
    return math.inf


def bound_text(d: dict, better: int, scale: float, unit: str) -> str:
    """The interval of a paired difference as what the data exclude, in gains (better x difference): e.g. 'the data
    exclude gains above +1.2 and losses beyond -0.8 points'."""
    if d.get("none_reached"):
        return "not estimable: no run reached the target"
    lo, hi = sorted((better * d["lo"] * scale + 0.0, better * d["hi"] * scale + 0.0))  # + 0.0: no '-0.0
    if lo > 0:
        return f"the data exclude gains below {lo:+.1f} and above {hi:+.1f} {unit}"
    if hi < 0:
        return f"the data exclude any gain: a loss of {-hi:.1f} to {-lo:.1f} {unit}"
    return f"the data exclude gains above {hi:+.1f} and losses beyond {lo:+.1f} {unit}"


def verdict(d: dict, better: int, p: float) -> str:
    """Whether a claim of a gain (better x difference > 0) holds at alpha, given the p-value to judge by."""
    if not p < ALPHA or d.get("none_reached"):
        return "not shown"
    return "yes" if better * d["mean"] > 0 else "no: the reverse"

# -----------------------------------------------------------------------------------------------------------------
# Runs: one subprocess per arm x task x seed, cached with the command that made it.


def settings(task: str, args) -> dict:
    """The protocol of one task: the command line's values, else the task's, else PROTOCOL's."""
    t = TASKS[task]
    return {k: getattr(args, k) if getattr(args, k) is not None else t.get(k, PROTOCOL[k])
            for k in ("steps", "eval_every", "eval_samples")}


def eval_steps(steps: int, eval_every: int) -> list[int]:
    """The steps at which the scripts evaluate: 0, every eval_every, and the last step."""
    return sorted({0, steps, *(range(eval_every, steps, eval_every) if eval_every else [])})


def run_dir(task: str, arm: str, seed: int, steps: int) -> str:
    return os.path.join(RESULTS, "runs", "learning", task, f"{arm}-s{seed}-{steps}steps")


def travel_lr(s: dict) -> float:
    """The weight lr at which ln w can travel TRAVEL in a run of the task: one Adam step moves ln w by ~lr, and the
    run makes steps x updates_per_step weight updates (60 x 4 = 240 on `hard`: 2.5e-3)."""
    return TRAVEL / (s["steps"] * PROTOCOL["updates_per_step"])


def command(task: str, arm: str, seed: int, s: dict, out: str) -> list[str]:
    t = TASKS[task]
    script, flags = ARMS[arm]
    flags = [f"{travel_lr(s):.6g}" if f == "{travel}" else f for f in flags]
    return [script, *flags, "--model", t["model"], "--train_data", t["train"], "--eval_data", ",".join(t["eval"]),
            "--seed", str(seed), "--steps", str(s["steps"]), "--eval_every", str(s["eval_every"]),
            "--eval_samples", str(s["eval_samples"]), "--updates_per_step", str(PROTOCOL["updates_per_step"]),
            "--sample_every", "0", *t["flags"], "--out_dir", os.path.relpath(out, ROOT)]


def run(task: str, arm: str, seed: int, s: dict, threads: int) -> dict:
    """One training run, reused when a finished one with the same command exists. Returns its metrics records, wall
    seconds and CPU seconds (user + system of the run's process)."""
    out = run_dir(task, arm, seed, s["steps"])
    cmd = command(task, arm, seed, s, out)
    done = os.path.join(out, "run.json")  # written last: a run killed halfway, or made by another command, is redone
    if not (os.path.exists(done) and json.load(open(done))["command"] == cmd):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        t0 = time.time()
        with open(os.path.join(out, "log.txt"), "w") as log:
            proc = subprocess.Popen([sys.executable, *cmd], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)  # this child's own CPU time, whatever else runs at once
            proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            tail = open(os.path.join(out, "log.txt")).read()[-2000:]
            raise SystemExit(f"{task} {arm} seed {seed} failed (exit {proc.returncode}):\n{tail}")
        for name in os.listdir(out):  # the checkpoint is not needed here
            if name.startswith("step_"):
                shutil.rmtree(os.path.join(out, name))
        json.dump({"command": cmd, "wall_s": round(time.time() - t0, 1),
                   "cpu_s": round(usage.ru_utime + usage.ru_stime, 1)}, open(done, "w"))
    info = json.load(open(done))
    return {"records": [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))], "wall_s": info["wall_s"],
            "cpu_s": info["cpu_s"]}


def estimate_cpu_s(task: str, s: dict) -> float | None:
    """One run's CPU seconds by the task's cost model (None when not measured yet)."""
    c = TASKS[task]["cpu_s"]  # an evaluation's cost is measured at 16 samples per problem and scales with them
    return None if c is None else c["start"] + c["step"] * s["steps"] + \
        c["eval"] * s["eval_samples"] / 16 * len(eval_steps(s["steps"], s["eval_every"]))

# -----------------------------------------------------------------------------------------------------------------
# Summaries of runs and the comparisons between arms.


def summarise(records: list[dict], task: str, s: dict) -> dict:
    """One run's endpoints and curves."""
    evals = [r for r in records if "eval/acc" in r]
    train = [r for r in records if "train/loss" in r]
    t = TASKS[task]
    out = {"evals": evals, "train": train, "completions": sum(r["train/num_completions"] for r in train)}
    out["K"] = max(int(k.rsplit("@", 1)[1]) for k in evals[-1] if k.startswith("eval/pass@"))
    bins = sorted(k[len("daro/n_"):] for k in train[0] if k.startswith("daro/n_"))
    mixed = [b for b in bins if 0 < float(b) < 1]
    if mixed:  # daro.py's runs: the share of the kept (mixed) groups with pass rate below 0.5, per step
        shares = [sum(r[f"daro/n_{b}"] for b in mixed if float(b) < 0.5) / max(1, sum(r[f"daro/n_{b}"] for b in mixed))
                  for r in train]
        out["hard_share"], out["hard_share_first10"] = statistics.mean(shares), statistics.mean(shares[:10])
    if "daa/amplified_frac" in train[0]:
        out["amplified"] = statistics.mean(r["daa/amplified_frac"] for r in train)
    out["hard"] = t.get("hard_set")
    return out


def metric_key(template: str, run: dict) -> str:
    return template.replace("{hard}", run["hard"] or "").replace("pass@K", f"pass@{run['K']}")


def value(run: dict, template: str, kind: str = "last3", target: float | None = None, s: dict | None = None) -> float:
    """An endpoint of one run: mean of the last 3 evaluations of a metric, its value at the start, or the steps to a
    target (a run that never reaches it counts as steps + eval_every: censored)."""
    key = metric_key(template, run)
    if kind == "last3":
        return last_mean(run["evals"], key)
    if kind == "start":
        return run["evals"][0][key]
    x = crossing([e["step"] for e in run["evals"]], [e[key] for e in run["evals"]], target)
    return x if math.isfinite(x) else s["steps"] + s["eval_every"]


def compare(stats: dict, task: str, arm: str, vs: str, template: str, kind: str = "last3",
            target: float | None = None, s: dict | None = None) -> dict | None:
    """The paired difference arm - vs on one task's endpoint (None when either arm was not run)."""
    if (task, arm) not in stats or (task, vs) not in stats:
        return None
    xs = [value(r, template, kind, target, s) for r in stats[task, arm]]
    ys = [value(r, template, kind, target, s) for r in stats[task, vs]]
    d = paired(xs, ys)
    if kind == "steps_to":
        d["censored"] = sum(v > s["steps"] for v in xs + ys)
        if d["censored"] == len(xs + ys):  # no run reached the target: nothing to compare (p = 1 in Holm's family)
            d.update(mean=math.nan, lo=math.nan, hi=math.nan, p=1.0, none_reached=True)
    return d


def fmt_d(d: dict | None, scale: float = 100, digits: int = 1) -> str:
    if d is None:
        return "not run"
    if d.get("none_reached"):
        return "no run reached the target"
    f = f"{{:+.{digits}f}}"
    return f"{f.format(scale * d['mean'] + 0.0)} [{f.format(scale * d['lo'] + 0.0)}, {f.format(scale * d['hi'] + 0.0)}]"


def cell(xs: list[float], scale: float = 1, digits: int = 3) -> str:
    mean, half = mean_ci(xs)
    return f"{scale * mean:.{digits}f} +- {scale * half:.{digits}f}"

# -----------------------------------------------------------------------------------------------------------------
# The report.


def endpoint_text(e: dict, s: dict | None = None) -> str:
    """An endpoint in words, with the task's hard eval set and the largest k (the eval samples) filled in."""
    metric = e["metric"].replace("{hard}", TASKS[e["task"]].get("hard_set") or "{hard}")
    if s is not None:
        metric = metric.replace("pass@K", f"pass@{s['eval_samples']}")
    what = {"last3": f"mean of the last {LAST} evals", "steps_to": f"steps to {metric} >= {e.get('target')}"}
    return f"`{metric}`, {what[e['kind']]}, {e['arm']} - {e['vs']}, task {e['task']}"


def primaries(stats: dict, sets: dict, family: str = "learning") -> list[dict]:
    """Every declared primary of a family whose task was run, with its paired test and Holm-adjusted p-value (Holm
    across that family: this benchmark's, or the DARO study's)."""
    rows = []
    for e in ENDPOINTS:
        if e["task"] not in sets or e.get("family", "learning") != family:
            continue
        d = compare(stats, e["task"], e["arm"], e["vs"], e["metric"], e["kind"], e.get("target"), sets[e["task"]])
        if d is not None:
            rows.append({**e, "d": d})
    for row, p in zip(rows, holm([r["d"]["p"] for r in rows])):
        row["p_adj"] = p
    return rows


def report(stats: dict, sets: dict, args, costs: dict, wall: float) -> str:
    tasks = list(sets)
    lines = ["# Learning benchmark: hard prompts (DA3PO) and difficulty weights (DARO)", ""]
    lines += ["Every arm starts from the same model on a task and trains with the same batch (32 prompts x 8 "
              f"completions, {PROTOCOL['updates_per_step']} optimizer updates per RL step); only the algorithm "
              "differs. Tasks: " + "; ".join(
                  f"`{t}` ({TASKS[t]['train']}, {len(stats_arms(stats, t))} arms, {sets[t]['steps']} steps, eval every "
                  f"{sets[t]['eval_every']} steps with {sets[t]['eval_samples']} samples per problem on "
                  + ", ".join(TASKS[t]["eval"]) + ")" for t in tasks) +
              f". Seeds {','.join(map(str, args.seed_list))} ({len(args.seed_list)}); the same seed of two arms "
              "starts from the same model, prompt order and sampling stream, so differences are paired by seed. "
              "Intervals: 95%, Student's t with n - 1 degrees of freedom. Differences in percentage points (steps "
              "for steps-to-target).", ""]
    prim = primaries(stats, sets)
    done = {r["id"] for r in prim}
    lines += ["## Endpoints, fixed in experiments/learning.py before the runs", "",
              f"Primary, one per claim: two-sided paired t-test, Holm's correction across the {len(prim)} primaries "
              f"run here ({', '.join(sorted(done)) or 'none'}):", ""]
    lines += [f"- {e['id']} ({e['claim']}): {endpoint_text(e, sets.get(e['task']))}" +
              ("" if e["id"] in done else " (task not run)" if e["task"] not in sets else " (an arm not run)")
              for e in ENDPOINTS if e.get("family", "learning") == "learning"]  # the DARO study: its own report
    lines += ["", "Secondary (labelled so; unadjusted, each at 95%): every other arm and metric, per-level accuracy, "
              "the easy mixes, the trend over the hard share, forgetting on the demo's eval set.", ""]
    lines += ["## Claims", "",
              "| claim | endpoint | measured: estimate [95% interval] | p (Holm-adjusted) | survives Holm? | bound | "
              "papers' numbers (for scale only) | holds here? |", "|---|---|---|---|---|---|---|---|"]
    for r in prim:
        d, steps = r["d"], r["kind"] == "steps_to"
        scale, unit = (1, "steps") if steps else (100, "points")
        note = f"; {d['censored']} of {2 * d['n']} runs never reached it (counted as censored)" if steps and \
            d.get("censored") and not d.get("none_reached") else ""
        lines.append(f"| {r['id']}: {r['claim']} | {endpoint_text(r, sets[r['task']])} | {fmt_d(d, scale)}{note} | "
                     f"{d['p']:.3f} ({r['p_adj']:.3f}) | {'yes' if r['p_adj'] < ALPHA else 'no'} | "
                     f"{bound_text(d, r['better'], scale, unit)} | {PAPER.get(r['id'], 'not available')} | "
                     f"{verdict(d, r['better'], r['p_adj'])} |")
    lines += secondary_claims(stats, sets)
    lines += ["", "Papers' numbers: percentage points of accuracy on their benchmarks (other models, data and scale; "
              "for scale only, not comparable). DA3PO: arXiv:2608.27982 as its abstract and summary state them "
              "(its main table was not available to us); DARO: the summary of arXiv:2510.09001 at "
              "papers.lunadong.com/paper/14080. "
              "'holds here?': yes / no: the reverse when p < 0.05 (Holm-adjusted for the primaries), else not shown; "
              "the bound column says what the 95% interval excludes either way."]
    for t in tasks:
        lines += task_tables(stats, t, sets[t])
    lines += mix_section(stats, sets)
    total_cpu = sum(c for c, _ in costs.values())
    lines += ["", "## Cost", "",
              f"Machine: {cpu_name()}, {os.cpu_count()} CPUs, torch {torch_version()}. "
              f"{len(costs)} runs: {total_cpu / 3600:.2f} CPU-hours measured (the runs' own user + system time; "
              f"estimated beforehand {sum(estimate_cpu_s(t, sets[t]) or 0 for t, *_ in costs) / 3600:.2f}), "
              f"{sum(w for _, w in costs.values()) / 3600:.2f} hours of run wall time, {args.jobs} at a time; this "
              f"invocation {wall / 60:.0f} min (cached runs reused). Command: "
              f"`{' '.join(['python -m experiments.learning', *sys.argv[1:]])}`"]
    return "\n".join(lines)


def stats_arms(stats: dict, task: str) -> list[str]:
    return [a for (t, a) in stats if t == task]


def secondary_claims(stats: dict, sets: dict) -> list[str]:
    """Secondary rows of the claims table (unadjusted): the other factors, the control, GRPO, var, the mix trend."""
    rows, task, s = [], "hard", sets.get("hard")
    if s is None:
        return rows
    hard, acc = "eval/{hard}/acc", "eval/acc"
    for claim, arm, vs, metric, better, paper in [
            ("lam 1.5 already beats DAPO", "da3po_lam1.5", "dapo", hard, 1, PAPER["lam1.5"]),
            ("lam 2 beats lam 1.5 (lam 2 best)", "da3po_lam2", "da3po_lam1.5", hard, 1, PAPER["lam1.5"]),
            ("lam 2 beats lam 4 (lam 2 best)", "da3po_lam2", "da3po_lam4", hard, 1, "not available (lam 4 not run)"),
            ("adaptive lam beats DAPO (our extension)", "da3po_adaptive", "dapo", hard, 1, "not in the paper"),
            ("DAA's tilt toward correct answers matters: lam 2 beats the symmetric control", "da3po_lam2",
             "da3po_all", hard, 1, "not in the paper (our control)"),
            ("the symmetric control (hard prompts x2, both signs) beats DAPO", "da3po_all", "dapo", hard, 1,
             "not in the paper (our control)"),
            ("DA3PO beats GRPO", "da3po_lam2", "grpo", hard, 1, PAPER["grpo"]),
            ("DAPO beats GRPO (the base both papers build on)", "dapo", "grpo", acc, 1, "not available"),
            ("DARO beats var (static sqrt(mu(1 - mu)) weights)", "daro", "var", acc, 1, "not available"),
            ("var weighting can hurt (claimed for weaker models): var below DAPO", "var", "dapo", acc, -1,
             "var-type weights below GRPO on Llama-3.1-8B (no number found)")]:
        d = compare(stats, task, arm, vs, metric)
        if d is None:
            continue
        rows.append(f"| secondary: {claim} | `{metric.replace('{hard}', 'hard_eval')}`, last {LAST}, {arm} - {vs}, "
                    f"task hard | {fmt_d(d)} | {d['p']:.3f} (unadjusted) | - | {bound_text(d, better, 100, 'points')} "
                    f"| {paper} | {verdict(d, better, d['p'])} |")
    _, slope = mix_trend(stats, sets, hard)
    if slope is not None:
        rows.append(f"| secondary: the gain grows with the hard share (our reading of the theory) | DA3PO lam 2 - "
                    f"DAPO in `eval/hard_eval/acc`, last {LAST}, per seed regressed on the share of hard training rows "
                    f"| {fmt_d(slope)} points per 100% hard rows | {slope['p']:.3f} (unadjusted) | - | "
                    f"{bound_text(slope, 1, 100, 'points per 100% hard rows')} | not in the papers | "
                    f"{verdict(slope, 1, slope['p'])} |")
    return rows


def task_tables(stats: dict, task: str, s: dict) -> list[str]:
    """Per task: every arm's endpoints (mean +- 95% half-width), its paired differences against DAPO, per level."""
    arms = stats_arms(stats, task)
    runs = stats[task, arms[0]]
    K, hard, forget = runs[0]["K"], TASKS[task]["hard_set"], TASKS[task]["forget_set"]
    target = next((e["target"] for e in ENDPOINTS if e["task"] == task and e["kind"] == "steps_to"), None)
    cols = ([("hard acc", f"eval/{hard}/acc"), (f"hard pass@{K}", f"eval/{hard}/pass@{K}")] if hard else []) + \
        [("overall acc", "eval/acc")] + ([("demo eval acc", f"eval/{forget}/acc")] if forget else []) + \
        ([] if hard else [(f"pass@{K}", f"eval/pass@{K}")])
    lines = ["", f"## Task `{task}` (secondary unless named in the claims table)", "",
             f"Endpoints: mean of the last {LAST} evaluations (steps "
             f"{', '.join(map(str, eval_steps(s['steps'], s['eval_every'])[-LAST:]))}); at the start (step 0) every "
             "arm of a seed has the same weights: " + ", ".join(
                 f"{name} {statistics.mean(value(r, key, 'start') for r in runs):.3f}" for name, key in cols) + ".", "",
             "| arm | " + " | ".join(cols_name for cols_name, _ in cols) +
             (f" | steps to eval/acc {target}" if target else "") + " | completions | hard share of kept groups "
             "(first 10 steps) | amplified completions |", "|---" * (len(cols) + 5 - (not target)) + "|"]
    for a in arms:
        rs = stats[task, a]
        row = [cell([value(r, key) for r in rs]) for _, key in cols]
        if target:
            to = [value(r, "eval/acc", "steps_to", target, s) for r in rs]
            censored = sum(v > s["steps"] for v in to)
            row.append(cell(to, 1, 0) + (f" ({censored} censored)" if censored else ""))
        row.append(f"{statistics.mean(r['completions'] for r in rs):,.0f}")
        share = [r["hard_share"] for r in rs if "hard_share" in r]
        first10 = [r["hard_share_first10"] for r in rs if "hard_share" in r]
        row.append(f"{statistics.mean(share):.2f} ({statistics.mean(first10):.2f})" if share else "-")
        row.append(f"{statistics.mean(r['amplified'] for r in rs):.3f}" if "amplified" in rs[0] else "-")
        lines.append(f"| {a} | " + " | ".join(row) + " |")
    if "daro" in arms:  # DARO's learned weights at the end (the paper's weight lr moves them slowly)
        rs = stats[task, "daro"]
        ws = sorted(k for k in rs[0]["train"][-1] if k.startswith("daro/w_"))
        lines += ["", "DARO's weights w_mu at the last step (mean of seeds; 1 at the start): " + ", ".join(
            f"mu={k[len('daro/w_'):]} {statistics.mean(r['train'][-1][k] for r in rs):.3f}" for k in ws) + "."]
    refs = [b for b in ("dapo", "uniform") if b in arms]
    for ref in refs:
        others = [a for a in arms if a != ref and (ref == "dapo" or a in ("daro", "var"))]
        if not others:
            continue
        lines += ["", f"Paired differences against {ref} (points, [95% interval], unadjusted):", "",
                  "| arm | " + " | ".join(n for n, _ in cols) + (f" | steps to {target}" if target else "") + " |",
                  "|---" * (len(cols) + 1 + bool(target)) + "|"]
        for a in others:
            lines.append(f"| {a} | " + " | ".join(fmt_d(compare(stats, task, a, ref, key)) for _, key in cols) +
                         (f" | {fmt_d(compare(stats, task, a, ref, 'eval/acc', 'steps_to', target, s), 1)}"
                          if target else "") + " |")
    if hard:
        levels = sorted(int(k.rsplit("level", 1)[1]) for k in runs[0]["evals"][-1]
                        if k.startswith(f"eval/{hard}/acc_level"))
        def level_start(lv):
            return statistics.mean(value(r, f"eval/{hard}/acc_level{lv}", "start") for r in runs)
        lines += ["", f"Per level of {hard} (levels by the start pass rate: experiments/data/manifest.json); "
                  "accuracy at the start, then each arm's difference against DAPO (points, [95% interval], "
                  "unadjusted):", "",
                  "| arm | " + " | ".join(f"L{lv} (start {level_start(lv):.2f})" for lv in levels) + " |",
                  "|---" * (len(levels) + 1) + "|"]
        for a in arms:
            if a != "dapo" and "dapo" in arms:
                lines.append(f"| {a} | " + " | ".join(
                    fmt_d(compare(stats, task, a, "dapo", f"eval/{hard}/acc_level{lv}")) for lv in levels) + " |")
    return lines


def mix_trend(stats: dict, sets: dict, template: str) -> tuple[list, dict | None]:
    """DA3PO lam 2 - DAPO per task with a hard share, and the per-seed least-squares slope of that difference on the
    hard share (points per 100% hard rows), its t-interval across seeds."""
    tasks = [t for t in sets if TASKS[t].get("hard_share") is not None and (t, "da3po_lam2") in stats
             and (t, "dapo") in stats]
    points = [(TASKS[t]["hard_share"], t, compare(stats, t, "da3po_lam2", "dapo", template)) for t in tasks]
    if len(tasks) < 2:
        return sorted(points), None
    hs = [TASKS[t]["hard_share"] for t in tasks]
    diffs = {t: [value(a, template) - value(b, template) for a, b in zip(stats[t, "da3po_lam2"], stats[t, "dapo"])]
             for t in tasks}
    h_mean = statistics.mean(hs)
    slopes = [sum((h - h_mean) * diffs[t][i] for h, t in zip(hs, tasks)) / sum((h - h_mean) ** 2 for h in hs)
              for i in range(len(diffs[tasks[0]]))]
    return sorted(points), paired(slopes, [0.0] * len(slopes))


def mix_section(stats: dict, sets: dict) -> list[str]:
    lines = []
    for name, template in (("hard acc", "eval/{hard}/acc"), ("hard pass@K", "eval/{hard}/pass@K")):
        points, slope = mix_trend(stats, sets, template)
        if len(points) < 2:
            return lines
        if not lines:
            lines += ["", "## The hard share of an update (secondary)", "",
                      "DA3PO lam 2 - DAPO on each training mix (points, [95% interval]), the hard share of DAPO's "
                      "kept groups (pass rate < 0.5; all steps, and the first 10), and the slope of the difference "
                      "on the share of hard training rows (per seed, least squares; then its t-interval). The theory "
                      "predicts a gain that grows with the hard share.", "",
                      "| metric | " + " | ".join(f"`{t}` ({100 * h:.0f}% hard rows)" for h, t, _ in points) +
                      " | slope, points per 100% hard rows |", "|---" * (len(points) + 2) + "|"]
            lines.append("| hard share of DAPO's kept groups | " + " | ".join(
                f"{statistics.mean(r['hard_share'] for r in stats[t, 'dapo']):.2f} "
                f"({statistics.mean(r['hard_share_first10'] for r in stats[t, 'dapo']):.2f})" for _, t, _ in points) +
                " | - |")
        lines.append(f"| {name} | " + " | ".join(fmt_d(d) for _, _, d in points) + f" | {fmt_d(slope)} |")
    return lines


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def torch_version() -> str:
    return subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                          text=True).stdout.strip()

# -----------------------------------------------------------------------------------------------------------------
# Figures.


def plots(stats: dict, sets: dict, name: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []

    def mean_curve(runs, key):
        return [e["step"] for e in runs[0]["evals"]], [statistics.mean(r["evals"][i][key] for r in runs)
                                                       for i in range(len(runs[0]["evals"]))]
    for task in sets:
        arms = stats_arms(stats, task)
        hard, forget = TASKS[task]["hard_set"], TASKS[task]["forget_set"]
        keys = [k for k in (f"eval/{hard}/acc" if hard else None, f"eval/{forget}/acc" if forget else None,
                            "eval/acc") if k]
        fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4))
        for ax, key in zip(axes if len(keys) > 1 else [axes], keys):
            for i, a in enumerate(arms):
                ax.plot(*mean_curve(stats[task, a], key), label=a, color=f"C{i % 10}", ls="-" if i < 10 else "--")
            ax.set(xlabel="step", ylabel=key, title=f"{task}: {key} (mean of seeds)")
        (axes[0] if len(keys) > 1 else axes).legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(RESULTS, f"{name}_{task}_curves.png"), dpi=100)
        plt.close(fig)
        written.append(f"{name}_{task}_curves.png")
    if "hard" in sets:
        arms = stats_arms(stats, "hard")
        runs = stats["hard", arms[0]]
        levels = sorted(int(k.rsplit("level", 1)[1]) for k in runs[0]["evals"][-1]
                        if k.startswith("eval/hard_eval/acc_level"))
        fig, axes = plt.subplots(1, len(levels) + 1, figsize=(3.6 * (len(levels) + 1), 3.6))
        for ax, lv in zip(axes, levels):
            for i, a in enumerate(arms):
                ax.plot(*mean_curve(stats["hard", a], f"eval/hard_eval/acc_level{lv}"), color=f"C{i % 10}", label=a)
            ax.set(title=f"hard_eval level {lv}", xlabel="step")
        K = runs[0]["K"]
        ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= K]
        for i, a in enumerate(arms):
            axes[-1].plot(ks, [statistics.mean(value(r, f"eval/hard_eval/pass@{k}") for r in stats["hard", a])
                               for k in ks], marker="o", color=f"C{i % 10}", label=a)
        axes[-1].set(xscale="log", xticks=ks, xticklabels=ks, xlabel="k", title=f"hard_eval pass@k (last {LAST})")
        axes[-1].minorticks_off()
        axes[0].set_ylabel("accuracy")
        axes[-1].legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(os.path.join(RESULTS, f"{name}_hard_levels.png"), dpi=100)
        plt.close(fig)
        written.append(f"{name}_hard_levels.png")
    points, _ = mix_trend(stats, sets, "eval/{hard}/acc")
    if len(points) >= 2:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        K = stats["hard" if "hard" in sets else points[0][1], "dapo"][0]["K"]
        for ax, template, title in ((axes[0], "eval/{hard}/acc", "hard_eval acc"),
                                    (axes[1], "eval/{hard}/pass@K", f"hard_eval pass@{K}")):
            pts, _ = mix_trend(stats, sets, template)
            xs = [100 * h for h, _, _ in pts]
            ax.errorbar(xs, [100 * d["mean"] for _, _, d in pts], yerr=[100 * (d["hi"] - d["mean"]) for _, _, d in pts],
                        marker="o", capsize=4)
            ax.axhline(0, color="gray", lw=0.8)
            ax.set(xlabel="hard rows in the training set (%)", ylabel="DA3PO lam 2 - DAPO (points)",
                   title=f"{title}: paired difference, 95% interval")
        fig.tight_layout()
        fig.savefig(os.path.join(RESULTS, f"{name}_mixes.png"), dpi=100)
        plt.close(fig)
        written.append(f"{name}_mixes.png")
    return written

# -----------------------------------------------------------------------------------------------------------------
# Command line.


def plot_primaries(ax, primaries: list[dict], xlabel: str, labelsize: int):
    """A study's primaries on one axis: each difference (points) with its 95% interval, the first at the top."""
    ys = list(range(len(primaries)))[::-1]
    ax.errorbar([100 * r["d"]["mean"] for r in primaries], ys, capsize=3, fmt="o",
                xerr=[[100 * (r["d"]["mean"] - r["d"]["lo"]) for r in primaries],
                      [100 * (r["d"]["hi"] - r["d"]["mean"]) for r in primaries]])
    ax.axvline(0, color="gray", lw=0.8)
    ax.set(yticks=ys, yticklabels=[f"{r['id']} {r['arm']}-{r['vs']}" for r in primaries], xlabel=xlabel,
           title="primaries (95% intervals)")
    ax.tick_params(axis="y", labelsize=labelsize)


def save_report(out: str, text: str, data: dict, plot, t0: float):
    """A study's ending: the report printed and written to <out>.md, its data to <out>.json, and plot(data,
    <out>.png) where matplotlib is installed; the minutes since t0 printed."""
    print(text)
    print(f"({(time.time() - t0) / 60:.0f} min)")
    open(out + ".md", "w").write(text + "\n")
    json.dump(data, open(out + ".json", "w"), indent=1)
    try:
        plot(data, out + ".png")
        print(f"wrote {out}.md, .json, .png")
    except ImportError:
        print(f"wrote {out}.md, .json (matplotlib not installed: no figure)")


def parse_seeds(text: str) -> list[int]:
    """'0,1,2' or '0-9' (or a mix: '0-3,7')."""
    seeds = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return seeds


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help="comma-separated, from: " + ", ".join(TASKS))
    p.add_argument("--arms", default="", help="only these arms (comma-separated; default: each task's own list)")
    p.add_argument("--seeds", default=f"0-{PROTOCOL['seeds'][-1]}", help="'0-9' or '0,1,2'; at least 2")
    p.add_argument("--steps", type=int, default=None, help=f"RL steps per run (default {PROTOCOL['steps']})")
    p.add_argument("--eval_every", type=int, default=None, help=f"default {PROTOCOL['eval_every']}")
    p.add_argument("--eval_samples", type=int, default=None, help=f"samples per eval problem, a power of 2 "
                                                                    f"(default {PROTOCOL['eval_samples']})")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (threads per run: 2 // jobs, at least 1)")
    p.add_argument("--name", default="learning_hard", help="experiments/results/<name>.md and <name>_*.png")
    p.add_argument("--plan", action="store_true", help="print the runs and the estimated CPU time, run nothing")
    args = p.parse_args(argv)
    args.task_list = [t for t in args.tasks.split(",") if t]
    if unknown := [t for t in args.task_list if t not in TASKS]:
        p.error(f"--tasks: unknown {', '.join(unknown)} (choose from {', '.join(TASKS)})")
    for t in args.task_list:
        missing = [f for f in (TASKS[t]["train"], *TASKS[t]["eval"], TASKS[t]["model"])
                   if f not in ("arith", "demo") and not os.path.exists(os.path.join(ROOT, f))]
        if missing:
            p.error(f"--tasks: {t} is not available here (missing {', '.join(missing)}); fill in its entry in TASKS")
        if not args.plan and any(e["task"] == t and e["kind"] == "steps_to" and e["target"] is None for e in ENDPOINTS):
            p.error(f"--tasks: {t} has a steps-to-target endpoint without a target; set it in ENDPOINTS before "
                    f"its runs (from a pilot DAPO run at a seed outside --seeds)")
    args.arm_list = [a for a in args.arms.split(",") if a]
    if unknown := [a for a in args.arm_list if a not in ARMS]:
        p.error(f"--arms: unknown {', '.join(unknown)} (choose from {', '.join(ARMS)})")
    try:
        args.seed_list = parse_seeds(args.seeds)
    except ValueError:
        p.error(f"--seeds: expected '0-9' or '0,1,2', got {args.seeds!r}")
    if len(set(args.seed_list)) != len(args.seed_list) or len(args.seed_list) < 2:
        p.error(f"--seeds: give at least 2 distinct seeds, got {args.seeds!r}")
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps: must be >= 1, got {args.steps}")
    if args.eval_every is not None and args.eval_every < 1:
        p.error(f"--eval_every: must be >= 1, got {args.eval_every}")
    if args.eval_samples is not None and (args.eval_samples < 1 or args.eval_samples & (args.eval_samples - 1)):
        p.error(f"--eval_samples: must be a power of 2 (pass@k for k = 1, 2, 4, ...), got {args.eval_samples}")
    if args.jobs < 1:
        p.error(f"--jobs: must be >= 1, got {args.jobs}")
    args.sets = {t: settings(t, args) for t in args.task_list}
    for t, s in args.sets.items():
        if len(eval_steps(s["steps"], s["eval_every"])) < LAST + 1:
            p.error(f"--steps/--eval_every: task {t} would evaluate at steps {eval_steps(s['steps'], s['eval_every'])}"
                    f"; the endpoints need {LAST} evaluations after step 0")
    return args


def task_arms(task: str, arm_list: list[str]) -> list[str]:
    """A task's arms to run: its own list, or those of --arms among its own and its study arms."""
    if not arm_list:
        return TASKS[task]["arms"]
    return [a for a in TASKS[task]["arms"] + TASKS[task].get("study_arms", []) if a in arm_list]


def plan(args) -> list[tuple[str, str, int]]:
    """The runs, and a printed estimate of their CPU time."""
    jobs = [(t, a, s) for t in args.task_list for a in task_arms(t, args.arm_list) for s in args.seed_list]
    print(f"plan: {len(jobs)} runs, seeds {','.join(map(str, args.seed_list))}")
    total, unknown = 0.0, []
    for t in args.task_list:
        arms = task_arms(t, args.arm_list)
        each = estimate_cpu_s(t, args.sets[t])
        n = len(arms) * len(args.seed_list)
        s = args.sets[t]
        print(f"  {t}: {len(arms)} arms x {len(args.seed_list)} seeds x {s['steps']} steps (eval every "
              f"{s['eval_every']}, {s['eval_samples']} samples) = {n} runs, " +
              (f"~{each:.0f} CPU-s each, {n * each / 3600:.2f} CPU-hours" if each else "cost not measured yet"))
        total += n * (each or 0)
        if each is None:
            unknown.append(t)
    print(f"estimate: {total / 3600:.2f} CPU-hours" + (f" (+ {', '.join(unknown)}: not measured)" if unknown else "") +
          f", about {total / 3600 / args.jobs:.2f} h of wall time at --jobs {args.jobs} on an otherwise idle machine")
    return jobs


def main(argv=None):
    args = parse_args(argv)
    jobs = plan(args)
    if args.plan:
        return
    t0 = time.time()
    threads = max(1, 2 // args.jobs)
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda j: run(*j, args.sets[j[0]], threads), jobs))
    stats = {}
    for (t, a, _), r in zip(jobs, results):
        stats.setdefault((t, a), []).append(summarise(r["records"], t, args.sets[t]))
    costs = {job: (r["cpu_s"], r["wall_s"]) for job, r in zip(jobs, results)}
    text = report(stats, args.sets, args, costs, time.time() - t0)
    print(text)
    os.makedirs(RESULTS, exist_ok=True)
    open(os.path.join(RESULTS, f"{args.name}.md"), "w").write(text + "\n")
    try:
        written = plots(stats, args.sets, args.name)
        print(f"wrote {RESULTS}/{args.name}.md and {', '.join(written)}")
    except ImportError:
        print("matplotlib not installed: report written, figures skipped (pip install -r requirements/bench.txt)")


if __name__ == "__main__":
    main()
