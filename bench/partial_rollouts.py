"""Partial rollouts (--max_staleness, partial.py) against today's dynamic sampling, on the reasoning demo (lengths
there depend on correctness) with --oversample 3 as the GPU recipes use it: generated tokens per trained token, wall
time per step and the rollout's share, the mean length of trained completions against all generated ones, and the
accuracy at equal steps. S = 0 and S = 1 alternate run by run in one process (one thread, the same seeds), so that
the machine's load falls on both alike.
Usage: python -m bench.partial_rollouts [--steps 8] [--seeds 0,1] [--oversample 3] [--chunk 0]
Numbers are wall times on a possibly shared CPU: read them, never assert them (bench/results/partial_rollouts.txt).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

import config
import da3po

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--seeds", default="0,1")
parser.add_argument("--oversample", default="3")
parser.add_argument("--chunk", default="0", help="--partial_chunk of the S = 1 runs (0: a quarter of max_new_tokens)")
args = parser.parse_args()
torch.set_num_threads(1)

trained = {"tokens": 0, "completions": 0}  # what the updates saw, counted from the step's batch


def counting_make_batch(groups, pad_id, device=torch.device("cpu")):
    batch = real_make_batch(groups, pad_id, device)
    trained["tokens"] += int(batch["mask"].sum())
    trained["completions"] += len(batch["mask"])
    return batch


real_make_batch = da3po.make_batch
da3po.make_batch = counting_make_batch


def one_run(staleness: int, seed: int, out: str) -> dict:
    trained.update(tokens=0, completions=0)
    flags = ["--steps", str(args.steps), "--seed", str(seed), "--eval_every", "0", "--oversample", args.oversample,
             "--rollout_is", "token", "--out_dir", out]
    if staleness:
        flags += ["--max_staleness", str(staleness), "--partial_chunk", args.chunk]
    sys.stdout = open(os.devnull, "w")
    try:
        da3po.main(config.parse_config(da3po.Config, flags, da3po.PRESETS))
    finally:
        sys.stdout = sys.__stdout__
    recs = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r for r in recs if "train/loss" in r]
    if staleness:
        generated = sum(r["partial/generated_tokens"] for r in steps)
    else:  # every generated completion finished in its step
        generated = sum(r["train/response_len"] * r["train/num_completions"] for r in steps)
    return {"step_s": statistics.mean(r["time/step_s"] for r in steps),
            "rollout_s": statistics.mean(r["time/rollout_s"] for r in steps),
            "gen_per_trained": generated / trained["tokens"],
            "trained_len": trained["tokens"] / trained["completions"],
            "generated_len": statistics.mean(r["train/response_len"] for r in steps),
            "acc_before": recs[0]["eval/acc"], "acc_after": recs[-1]["eval/acc"],
            "staleness": statistics.mean(r.get("partial/staleness_mean", 0.0) for r in steps),
            "dropped": sum(r.get("partial/dropped_groups", 0.0) for r in steps)}


results = {0: [], 1: []}
with tempfile.TemporaryDirectory() as tmp:
    for seed in map(int, args.seeds.split(",")):
        for s in (0, 1):  # alternate: the same seed, back to back
            results[s].append(one_run(s, seed, os.path.join(tmp, f"s{s}_seed{seed}")))
            r = results[s][-1]
            print(f"seed {seed} S={s}: step {r['step_s']:.2f}s (rollout {r['rollout_s']:.2f}s), generated/trained "
                  f"{r['gen_per_trained']:.2f}, trained len {r['trained_len']:.1f} vs generated "
                  f"{r['generated_len']:.1f}, acc {r['acc_before']:.3f} -> {r['acc_after']:.3f}", flush=True)

print(f"\nreasoning demo, --oversample {args.oversample}, {args.steps} steps, seeds {args.seeds}, one thread; S = 1: "
      f"--max_staleness 1 --partial_chunk {args.chunk} (both --rollout_is token)")
print(f"{'':24}{'S = 0':>10}{'S = 1':>10}{'ratio':>8}")
for key, label in [("step_s", "wall per step (s)"), ("rollout_s", "rollout per step (s)"),
                   ("gen_per_trained", "generated/trained tok"), ("trained_len", "trained completion len"),
                   ("generated_len", "finished completion len"), ("acc_after", "eval acc after")]:
    a = statistics.mean(r[key] for r in results[0])
    b = statistics.mean(r[key] for r in results[1])
    print(f"{label:24}{a:10.3f}{b:10.3f}{b / a:8.2f}")
print(f"{'eval acc before':24}{statistics.mean(r['acc_before'] for r in results[0]):10.3f}")
print(f"S = 1: mean staleness of trained tokens {statistics.mean(r['staleness'] for r in results[1]):.3f}, groups "
      f"dropped {sum(r['dropped'] for r in results[1]):.0f}")
