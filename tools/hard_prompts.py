"""Hard-prompt training sets and a calibrated hard eval set for the shipped demo model (`--model demo`), where
DA3PO's amplification has something to act on: experiments/learning.py trains on them.

Why: on the demo's own training mix dynamic sampling keeps mostly easy groups (of 32 kept a step, 16 have 7 of 8
correct) and DAA touches ~4% of the completions, so DA3PO's effect cannot show there. Here most prompts are hard but
learnable for the shipped model: start pass rate in [5%, 40%), where the demo's own levels 3-4 learned +30 points in
100 steps (experiments/results/learning.md), while its level 5 (< 5%) stayed out of reach.

What it writes (experiments/data/, small files, committed):
  hard_train.jsonl            2,000 hard prompts (calibrated start pass rate in [5%, 40%))
  mix_easy{25,50,75}_train.jsonl  the same 2,000-row size with 25 / 50 / 75% easy prompts (start pass rate in
                              [60%, 95%): above DA3PO's tau = 0.5 and still mixed at G = 8, so dynamic sampling keeps
                              them and they take a share of each update); the hard rows are the first rows of
                              hard_train.jsonl's order, so every mix's hard prompts are a subset of the hard set
  hard_eval.jsonl             320 hard problems in 4 levels of 80 by start pass rate: level 1 [30%, 40%),
                              2 [20%, 30%), 3 [12%, 20%), 4 [5%, 12%); disjoint from every training row
  manifest.json               the command, the versions and machine it ran on, the model's sha256, every file's
                              sha256, and the calibration numbers printed below
The demo's eval set (demo/arith/eval.jsonl) is evaluated alongside, to watch forgetting; nothing here overlaps it.

How: candidate sums with 3+3 and 2+2 digit operands (the demo model's own shapes that hold hard prompts: 27% of 3+3
and 9% of 2+2 sums are in [5%, 40%); 2+1 sums are mostly above 90%, and reversed or longer shapes, 1+2, 3+2, 2+3,
3+1, 4+4, 4+3, mostly below 5%: `--survey` prints them), none of them a row the demo model was warm-started on or
held out for its eval set, drawn from random.Random(seed). Each candidate's pass rate is measured through the real
rollout and verifier (common.roll_groups on engine.HFRollout, temperature 1, 64 samples, as demo/build.py's
pass_rates does), and the bands above select by it. Selecting on a measured rate regresses to the mean, so every
selected problem is measured again with fresh samples (seed + 1; 128 for the eval set, 64 for the training rows):
those are the start pass rates this script prints, and the eval levels' standard errors come from them.

Reproducibility: a rerun writes the same bytes (`--check` regenerates into a temporary folder and compares sha256s)
given the same shipped weights (demo/arith/model/model.safetensors, sha256 in the manifest), torch and transformers
versions, the same CPU kernels (ATEN_CPU_CAPABILITY) and one thread: the sampler draws from float32 softmaxes whose
rounding depends on all four, and a different draw changes a measured rate and so which candidates land in a band. The
candidate sums themselves depend only on Python's random module and the seed. Checked: three generations on this
machine (AMD EPYC, torch 2.13.0+cpu, transformers 5.19.0) wrote the same bytes.

Run: python -m tools.hard_prompts [--out experiments/data]     (about 4 CPU-minutes on one thread; 8 min of wall time on
                                                          a busy 2-core machine)
     python -m tools.hard_prompts --check                 (regenerate and compare with the committed files)
     python -m tools.hard_prompts --survey                (pass rates of other operand shapes; writes nothing)
"""
import argparse
import hashlib
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SEED = 2025
POOL = {(3, 3): 9000, (2, 2): 3000}  # operand digits -> candidate sums drawn
CAL_SAMPLES, CHECK_SAMPLES, CHECK_EVAL_SAMPLES = 64, 64, 128
HARD_BAND, EASY_BAND = (0.05, 0.40), (0.60, 0.95)  # [low, high) of the calibrated start pass rate
EVAL_LEVELS = {1: (0.30, 0.40), 2: (0.20, 0.30), 3: (0.12, 0.20), 4: (0.05, 0.12)}  # level -> [low, high)
EVAL_PER_LEVEL, TRAIN_SIZE, EASY_SHARES = 80, 2000, (25, 50, 75)
EVAL_K = 16  # samples per eval problem in experiments/learning.py: the standard errors printed assume it
FILES = ["hard_train.jsonl", *[f"mix_easy{e}_train.jsonl" for e in EASY_SHARES], "hard_eval.jsonl"]


def cpu_name() -> str:
    """The CPU model (its kernels decide float rounding, hence the sampled draws), from /proc/cpuinfo where there is
    one."""
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def sha256(path: str) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def candidates(seed: int, pool: dict) -> list[dict]:
    """Distinct sums of the pool's operand shapes, none of them a demo warm-start row, demo held-out sum or demo eval
    problem, in the order drawn."""
    import dataset
    train, held_out = dataset.arith_problems(seed=0)
    seen = {p["prompt"] for p in train} | {p["prompt"] for p in held_out}
    seen |= {json.loads(x)["problem"] for x in open(dataset.DEMO_EVAL)}
    rng, out = random.Random(seed), []
    for (da, db), n in pool.items():
        lo_a, lo_b = (10 ** (da - 1) if da > 1 else 0), (10 ** (db - 1) if db > 1 else 0)
        got = 0
        while got < n:
            a, b = rng.randrange(lo_a, 10 ** da), rng.randrange(lo_b, 10 ** db)
            if f"{a}+{b}" not in seen:
                seen.add(f"{a}+{b}")
                out.append({"prompt": f"{a}+{b}", "answer": str(a + b), "digits": f"{da}+{db}"})
                got += 1
    return out


def pass_rates(model, tok, problems: list[dict], samples: int, seed: int) -> list[float]:
    """Each problem's pass rate: demo/build.py's calibration (`samples` completions at temperature 1 through the real
    rollout and verifier, the demo's 12-token limit, 128 problems per call, seeded once)."""
    from demo import build
    return build.pass_rates(model, tok, [{**p, "level": 0} for p in problems], samples, seed)


def in_band(rate: float, band: tuple[float, float]) -> bool:
    return band[0] <= rate < band[1]


def level_stats(rates: list[float], k: int) -> dict:
    """A level's start pass rate (mean of its problems' fresh rates) and the standard errors of its score:
    `sampling` = the spread a score over these fixed problems has from k samples each (what separates two methods
    evaluated on the same problems), sqrt(sum_i p_i (1 - p_i) / k) / n; `problems` = sd(p_i) / sqrt(n), the extra
    spread if the level's problems were drawn again."""
    n = len(rates)
    return {"n": n, "start": statistics.mean(rates),
            "se_sampling": math.sqrt(sum(p * (1 - p) for p in rates) / k) / n,
            "se_problems": statistics.stdev(rates) / math.sqrt(n)}


def write_jsonl(path: str, rows: list[dict]):
    with open(path, "w") as f:
        f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rows)


def survey(model, tok, seed: int):
    """Pass rates of 128 random sums per operand shape (writes nothing): why the pool is 3+3 and 2+2 sums."""
    rng = random.Random(seed)
    for da, db in [(1, 2), (2, 1), (2, 2), (3, 3), (3, 2), (2, 3), (3, 1), (4, 4), (4, 3)]:
        probs = []
        for _ in range(128):
            a = rng.randrange(10 ** (da - 1) if da > 1 else 0, 10 ** da)
            b = rng.randrange(10 ** (db - 1) if db > 1 else 0, 10 ** db)
            probs.append({"prompt": f"{a}+{b}", "answer": str(a + b)})
        r = pass_rates(model, tok, probs, 32, seed)
        bands = [sum(lo <= x < hi for x in r) for lo, hi in ((0, .05), (.05, .4), (.4, .9), (.9, 1.1))]
        print(f"  {da}+{db}: mean pass rate {statistics.mean(r):.3f}; problems <5%, 5-40%, 40-90%, >=90%: {bands}")


def generate(out: str, seed: int) -> dict:
    """Calibrate, select and write every file into `out`; returns the manifest (also written there)."""
    import torch
    import transformers

    import config
    import modeling
    torch.set_num_threads(1)  # float sums depend on the thread count
    model, tok = modeling.load_model(config.ARITH_MODEL, torch.device("cpu"))
    model.eval()
    t0 = time.time()
    pool = candidates(seed, POOL)
    rates = pass_rates(model, tok, pool, CAL_SAMPLES, seed)
    print(f"calibration: {len(pool):,} candidate sums x {CAL_SAMPLES} samples in {time.time() - t0:.0f} s")
    for digits in sorted({p["digits"] for p in pool}):
        rs = [r for p, r in zip(pool, rates) if p["digits"] == digits]
        n_hard, n_easy = sum(in_band(r, HARD_BAND) for r in rs), sum(in_band(r, EASY_BAND) for r in rs)
        print(f"  {digits}: {len(rs):,} sums, mean {statistics.mean(rs):.3f}; in the hard band {n_hard:,}, in the "
              f"easy band {n_easy:,}")
    rng = random.Random(seed + 1)
    hard = [(p, r) for p, r in zip(pool, rates) if in_band(r, HARD_BAND)]
    easy = [(p, r) for p, r in zip(pool, rates) if in_band(r, EASY_BAND)]
    rng.shuffle(hard)
    rng.shuffle(easy)
    eval_rows, used = [], set()
    for level, band in EVAL_LEVELS.items():
        picked = [(p, r) for p, r in hard if in_band(r, band)][:EVAL_PER_LEVEL]
        if len(picked) < EVAL_PER_LEVEL:
            raise SystemExit(f"level {level}: only {len(picked)} candidates in {band}; raise POOL")
        used |= {p["prompt"] for p, _ in picked}
        eval_rows += [{"problem": p["prompt"], "answer": p["answer"], "level": level, "digits": p["digits"],
                       "pass_rate_at_build": r} for p, r in picked]
    hard_train = [(p, r) for p, r in hard if p["prompt"] not in used][:TRAIN_SIZE]
    n_easy = TRAIN_SIZE * max(EASY_SHARES) // 100
    if len(hard_train) < TRAIN_SIZE or len(easy) < n_easy:
        raise SystemExit(f"{len(hard_train)} hard and {len(easy)} easy candidates left, need {TRAIN_SIZE} and "
                         f"{n_easy}; raise POOL")
    easy = easy[:n_easy]

    t0 = time.time()  # fresh samples: the start pass rates selection did not see
    eval_check = pass_rates(model, tok, [{"prompt": r["problem"], "answer": r["answer"]} for r in eval_rows],
                            CHECK_EVAL_SAMPLES, seed + 1)
    train_check = pass_rates(model, tok, [p for p, _ in hard_train + easy], CHECK_SAMPLES, seed + 2)
    print(f"re-measured with fresh samples in {time.time() - t0:.0f} s")
    for row, r in zip(eval_rows, eval_check):
        row["pass_rate_check"] = r
    fresh = dict(zip([p["prompt"] for p, _ in hard_train + easy], train_check))

    def train_row(p, r, kind):
        return {"problem": p["prompt"], "answer": p["answer"], "level": 0, "kind": kind, "digits": p["digits"],
                "pass_rate_at_build": r, "pass_rate_check": fresh[p["prompt"]]}
    os.makedirs(out, exist_ok=True)
    write_jsonl(os.path.join(out, "hard_train.jsonl"), [train_row(p, r, "hard") for p, r in hard_train])
    mixes = {}
    for share in EASY_SHARES:
        n_e = TRAIN_SIZE * share // 100
        rows = [train_row(p, r, "hard") for p, r in hard_train[:TRAIN_SIZE - n_e]] + \
               [train_row(p, r, "easy") for p, r in easy[:n_e]]
        random.Random(seed + share).shuffle(rows)
        write_jsonl(os.path.join(out, f"mix_easy{share}_train.jsonl"), rows)
        mixes[share] = rows
    write_jsonl(os.path.join(out, "hard_eval.jsonl"), eval_rows)

    def describe(rates_):
        rs = sorted(rates_)
        return {"n": len(rs), "mean": statistics.mean(rs), "median": statistics.median(rs),
                "below_5pct": sum(r < 0.05 for r in rs) / len(rs), "above_40pct": sum(r >= 0.4 for r in rs) / len(rs)}
    levels = {}
    for level in EVAL_LEVELS:
        check = [r["pass_rate_check"] for r in eval_rows if r["level"] == level]
        levels[level] = {"band": EVAL_LEVELS[level], "at_build": statistics.mean(
            r["pass_rate_at_build"] for r in eval_rows if r["level"] == level), **level_stats(check, EVAL_K)}
    manifest = {
        "command": "python -m tools.hard_prompts", "seed": seed, "pool": {f"{a}+{b}": n for (a, b), n in POOL.items()},
        "samples": {"calibration": CAL_SAMPLES, "check_train": CHECK_SAMPLES, "check_eval": CHECK_EVAL_SAMPLES},
        "bands": {"hard": HARD_BAND, "easy": EASY_BAND, "eval_levels": EVAL_LEVELS},
        "depends_on": {"model.safetensors sha256": sha256(os.path.join(config.ARITH_MODEL, "model.safetensors")),
                       "torch": torch.__version__, "transformers": transformers.__version__,
                       "python": platform.python_version(), "cpu": cpu_name(),
                       "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY", "(default)"), "threads": 1},
        "train": {"hard": describe([fresh[p["prompt"]] for p, _ in hard_train]),
                  "easy": describe([fresh[p["prompt"]] for p, _ in easy]),
                  **{f"mix_easy{s}": {"hard_rows": sum(r["kind"] == "hard" for r in rows),
                                      "mean_check": statistics.mean(r["pass_rate_check"] for r in rows)}
                     for s, rows in mixes.items()}},
        "eval_levels": levels, "eval_k": EVAL_K,
        "files": {name: sha256(os.path.join(out, name)) for name in FILES}}
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    print_summary(manifest)
    return manifest


def print_summary(m: dict):
    t = m["train"]
    for kind in ("hard", "easy"):
        d = t[kind]
        print(f"{kind} training prompts: {d['n']:,}, fresh start pass rate mean {d['mean']:.3f} (median "
              f"{d['median']:.3f}); {100 * d['below_5pct']:.1f}% below 5%, {100 * d['above_40pct']:.1f}% at 40% or "
              "more")
    for s in EASY_SHARES:
        mix = t[f"mix_easy{s}"]
        print(f"mix_easy{s}: {mix['hard_rows']:,} hard rows of {TRAIN_SIZE:,}, mean fresh start pass rate "
              f"{mix['mean_check']:.3f}")
    print(f"hard eval set, start pass rate per level (fresh {m['samples']['check_eval']} samples) and the standard "
          f"error of a level's score with {m['eval_k']} eval samples per problem:")
    for level, d in m["eval_levels"].items():
        lo, hi = d["band"]
        print(f"  level {level} [{lo:.2f}, {hi:.2f}): {d['n']} problems, calibrated {d['at_build']:.3f}, fresh "
              f"{d['start']:.3f}; SE of one eval {100 * d['se_sampling']:.2f} points (mean of the last 3 evals "
              f"{100 * d['se_sampling'] / math.sqrt(3):.2f}); between-problem SE {100 * d['se_problems']:.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "experiments", "data"), help="folder for the files")
    p.add_argument("--seed", type=int, default=SEED, help="candidate draw and calibration seed")
    p.add_argument("--check", action="store_true", help="regenerate into a temporary folder and compare sha256s "
                                                        "with --out's files (exit 1 on a difference)")
    p.add_argument("--survey", action="store_true", help="print the pass rates of other operand shapes; write nothing")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.survey:
        import torch

        import config
        import modeling
        torch.set_num_threads(1)
        model, tok = modeling.load_model(config.ARITH_MODEL, torch.device("cpu"))
        return survey(model.eval(), tok, args.seed)
    if not args.check:
        generate(args.out, args.seed)
        return print(f"wrote {', '.join(FILES)} and manifest.json to {args.out}")
    tmp = tempfile.mkdtemp(prefix="hard_prompts_")
    try:
        new = generate(tmp, args.seed)["files"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    old = json.load(open(os.path.join(args.out, "manifest.json")))["files"]
    differ = [n for n in FILES if new[n] != old.get(n) or sha256(os.path.join(args.out, n)) != new[n]]
    print("check: " + ("every file reproduced byte for byte" if not differ else "differ: " + ", ".join(differ)))
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
