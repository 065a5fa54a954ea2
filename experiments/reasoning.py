"""Measures the reasoning demo (demo/reasoning/, built by `python -m demo.build --task reasoning`) before any DARO
claim: does completion length carry difficulty, as DARO's premise needs?

  python -m experiments.reasoning lengths [--model M] [--data D] [--samples 8]     # the model as it is, no training
      per level: pass rate, mean length of right and wrong completions, truncated share, redos ("wait") per
      completion; the within-group gap (wrong minus right, mixed groups only); and each DARO bin's L_mu at ratio 1,
      -sum_i A_i |o_i| / sum_i |o_i| over the bin's groups, with DAPO's shaped reward: the size of the per-bin loss
      the bins start from (it is 0 in every bin when right and wrong completions have the same length).
  python -m experiments.reasoning compare [--algos daro,uniform,var,dapo] [--seeds 0,1,2] [--jobs 2] [daro.py flags]
      runs daro.py per algo x seed (one thread each, --jobs at a time) on the reasoning demo with RUN_FLAGS, and
      prints eval/acc at the start and end, the gain, wall seconds, mean response length and truncated share over
      the steps, and per bin the mean |L_mu| over the steps (and max/min over bins). Under `dapo` (no bins in its
      loss) daro.py's daro/L_<mu> is the bin's share of the token-mean loss, not L_mu: `uniform` is the DAPO loss
      split by bin, whose L_mu these are.

Every run writes to experiments/results/runs/reasoning/<algo><tag>-s<seed>/ (git-ignored), which is reused while its
command is the same and redone when it is not (give runs with other flags a --tag)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "demo", "reasoning")
# What a run on the reasoning demo needs (README, "The reasoning demo"): its model and data, the completion limit
# the eval set was calibrated at, DAPO's overlong buffer, and a batch that keeps a run near a minute on 2 cores.
RUN_FLAGS = ["--model", "demo/reasoning/model", "--train_data", "demo/reasoning/train.jsonl",
             "--eval_data", "demo/reasoning/eval.jsonl", "--max_new_tokens", "72", "--overlong_buffer", "16",
             "--prompts_per_step", "16", "--steps", "20", "--eval_every", "10"]


def lengths(args):
    import torch
    import common
    import modeling
    import dataset
    import ranks
    import engine as eng
    torch.set_num_threads(1)
    model, tok = modeling.load_model(args.model, torch.device("cpu"))
    problems = dataset.tokenize_problems(dataset.load_data(args.data, "eval"), tok, "none", 1024, args.data)
    cfg = argparse.Namespace(max_new_tokens=args.max_new_tokens, overlong_buffer=args.overlong_buffer,
                             overlong_penalty=1.0, answer_format="auto")
    engine = eng.HFRollout(model, tok, ranks.DistInfo(), batch_size=4096)
    torch.manual_seed(args.seed)
    t0, groups = time.time(), []
    for s in range(0, len(problems), 128):
        groups += common.roll_groups(engine, tok, problems[s:s + 128], cfg, args.samples, 1.0, 1.0)[0]
    print(f"{args.model} on {args.data}: {len(groups)} problems x {args.samples} samples, up to "
          f"{args.max_new_tokens} tokens (overlong buffer {args.overlong_buffer}), {time.time() - t0:.0f} s")
    print(f"{'level':>5} | {'n':>4} | {'acc':>5} | {'len right':>9} | {'len wrong':>9} | {'truncated':>9} | "
          f"{'wrong truncated':>15} | {'waits':>5}")

    def row(name, gs):
        flat = [(len(ids), ok, tr, text.count(" wait ")) for g in gs
                for ids, ok, tr, text in zip(g["completions"], g["correct"], g["truncated"], g["texts"])]
        right, wrong = [x for x in flat if x[1]], [x for x in flat if not x[1]]
        mean = lambda xs: statistics.mean(xs) if xs else float("nan")  # noqa: E731
        print(f"{name:>5} | {len(gs):4d} | {len(right) / len(flat):.3f} | {mean([x[0] for x in right]):9.1f} | "
              f"{mean([x[0] for x in wrong]):9.1f} | {mean([x[2] for x in flat]):9.3f} | "
              f"{mean([x[2] for x in wrong]):15.3f} | {mean([x[3] for x in flat]):5.2f}")
        return flat

    by_level = defaultdict(list)
    for g in groups:
        by_level[g["level"]].append(g)
    for level in sorted(by_level):
        row(str(level), by_level[level])
    row("all", groups)
    G, gaps, bins = args.samples, [], defaultdict(lambda: [0.0, 0.0, 0])
    for g in groups:
        k, lens = sum(g["correct"]), [len(ids) for ids in g["completions"]]
        if 0 < k < G:
            gaps.append(statistics.mean([n for n, ok in zip(lens, g["correct"]) if not ok])
                        - statistics.mean([n for n, ok in zip(lens, g["correct"]) if ok]))
            adv = common.group_advantages(torch.tensor([g["reward"]]), True)[0].tolist()
            b = bins[k]
            b[0] += -sum(a * n for a, n in zip(adv, lens))
            b[1] += sum(lens)
            b[2] += 1
    print(f"mixed groups: {len(gaps)}; wrong minus right length within a group: mean {statistics.mean(gaps):+.1f} "
          f"tokens, median {statistics.median(gaps):+.1f}")
    values = {k: b[0] / b[1] for k, b in sorted(bins.items())}
    print("L_mu at ratio 1 by bin (groups): " + "  ".join(f"{k}/{G}: {v:+.3f} ({bins[k][2]})"
                                                      for k, v in values.items()))
    mags = [abs(v) for v in values.values()]
    print(f"max/min |L_mu| over bins: {max(mags) / max(min(mags), 1e-9):.1f}")


def run_one(algo: str, seed: int, extra: list[str], threads: int, tag: str = "") -> dict:
    out = os.path.join(ROOT, "experiments", "results", "runs", "reasoning", f"{algo}{tag}-s{seed}")
    cmd = [sys.executable, "daro.py", "--algo", algo, "--seed", str(seed), *RUN_FLAGS, *extra, "--out_dir", out]
    stamp = os.path.join(out, "command.json")
    if not (os.path.isfile(stamp) and json.load(open(stamp)) == cmd[1:] and
            any('"eval/acc"' in x for x in open(os.path.join(out, "metrics.jsonl")))):
        os.makedirs(out, exist_ok=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
        t0 = time.time()
        with open(os.path.join(out, "log.txt"), "w") as log:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc:
            raise SystemExit(f"{' '.join(cmd)} failed ({rc}); see {out}/log.txt")
        json.dump({"wall_s": time.time() - t0}, open(os.path.join(out, "wall.json"), "w"))
        json.dump(cmd[1:], open(stamp, "w"))
    records = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    return {"algo": algo, "seed": seed, "wall": json.load(open(os.path.join(out, "wall.json")))["wall_s"],
            "weighting": json.load(open(os.path.join(out, "config.json")))["weighting"],
            "evals": [r for r in records if "eval/acc" in r], "train": [r for r in records if "train/loss" in r]}


def compare(args, extra: list[str]):
    algos, seeds = args.algos.split(","), [int(s) for s in args.seeds.split(",")]
    jobs = [(a, s) for s in seeds for a in algos]
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(lambda j: run_one(*j, extra, 1, args.tag), jobs))
    print(f"daro.py {' '.join(RUN_FLAGS + extra)} (one thread per run, {args.jobs} at a time)")
    print(f"{'algo':>8} | {'seed':>4} | {'acc start':>9} | {'acc end':>7} | {'gain':>6} | {'len':>5} | {'trunc':>5} | "
          f"{'wall s':>6} | mean |L_mu| by bin mu = 1/8 .. 7/8 (max/min)")
    for r in runs:
        first, last = r["evals"][0]["eval/acc"], r["evals"][-1]["eval/acc"]
        keys = sorted(k for k in r["train"][0] if k.startswith("daro/L_"))
        mags = [statistics.mean([abs(t[k]) for t in r["train"] if t.get(k.replace("L_", "n_"), 0) > 0] or [0.0])
                for k in keys]
        print(f"{r['algo']:>8} | {r['seed']:4d} | {first:9.3f} | {last:7.3f} | {100 * (last - first):+6.1f} | "
              f"{statistics.mean(t['train/response_len'] for t in r['train']):5.1f} | "
              f"{statistics.mean(t['train/truncated_frac'] for t in r['train']):5.3f} | {r['wall']:6.0f} | "
              + " ".join(f"{m:.4f}" for m in mags) + f" ({max(mags) / max(min(mags), 1e-9):.1f}x)"
              + (" shares of the token-mean loss, not L_mu" if r["weighting"] == "none" else ""))
    print("mean over seeds:")
    for algo in algos:
        rs = [r for r in runs if r["algo"] == algo]
        gains = [100 * (r["evals"][-1]["eval/acc"] - r["evals"][0]["eval/acc"]) for r in rs]
        ends = [r["evals"][-1]["eval/acc"] for r in rs]
        print(f"{algo:>8}: end {statistics.mean(ends):.3f}, gain {statistics.mean(gains):+.1f} points "
              f"(seeds: {', '.join(f'{g:+.1f}' for g in gains)})")


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    m = sub.add_parser("lengths")
    m.add_argument("--model", default=os.path.join(DEMO, "model"))
    m.add_argument("--data", default=os.path.join(DEMO, "eval.jsonl"))
    m.add_argument("--samples", type=int, default=8)
    m.add_argument("--max_new_tokens", type=int, default=int(RUN_FLAGS[RUN_FLAGS.index("--max_new_tokens") + 1]))
    m.add_argument("--overlong_buffer", type=int, default=int(RUN_FLAGS[RUN_FLAGS.index("--overlong_buffer") + 1]))
    m.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("compare")
    c.add_argument("--algos", default="daro,uniform,var,dapo")
    c.add_argument("--seeds", default="0,1,2")
    c.add_argument("--jobs", type=int, default=2)
    c.add_argument("--tag", default="", help="appended to each run's folder name, for runs with other flags")
    args, extra = p.parse_known_args()
    if args.what == "lengths":
        if extra:
            p.error(f"unknown arguments: {' '.join(extra)}")
        lengths(args)
    else:
        compare(args, extra)


if __name__ == "__main__":
    main()
