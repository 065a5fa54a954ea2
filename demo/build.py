"""
Builds the two shipped demos. The sums demo (`python da3po.py --demo arith`, daro.py the same):
  demo/arith/model/      a tiny Qwen3-style model (0.5M parameters, character-level tokenizer built with the
                         `tokenizers` library, a chat template), warm-started by a supervised pass on sums
  demo/arith/eval.jsonl  200 held-out sums in 5 difficulty levels, calibrated on that model: level = the band of its
                         pass rate at the start of RL (32 samples at temperature 1), easiest first

Run: python -m demo.build [--out demo/arith] [--sft_steps 1200]   (about 2 minutes on one CPU thread)

And, with --task reasoning, the reasoning demo, what `python da3po.py` runs with no flags (its measurements:
demo/reasoning/README.md):
  demo/reasoning/model/       the same tiny Qwen3 and tokenizer, warm-started for 1,000 steps to write a short
                              column-by-column trace with a check before the answer (demo/reasoning_task.py):
                              347+86 -> 7+6=13,4+8+1=13,3+0+1=4 so 347+86=\\boxed{433}; some warm-start traces slip,
                              and a " wait " and a redo follow, so a model that errs tends to redo and run long
  demo/reasoning/train.jsonl  4,000 RL training rows (the warm start's first rows: 1+1 up to 4+4 digits)
  demo/reasoning/eval.jsonl   200 sums, none a training row, in the same 5 levels of pass rate as arith/eval.jsonl,
                              calibrated with 16 samples of up to 72 tokens (the runs' --max_new_tokens) from a pool
                              of 8,000 sums of the same distribution
Run: python -m demo.build --task reasoning [--calibrate_only]   (about 21 minutes of CPU on one thread, of which
     16 in the warm start; --calibrate_only keeps model/ and rewrites the two data files)
Train on it: python da3po.py, which stands for python da3po.py --model demo/reasoning/model --train_data
     demo/reasoning/train.jsonl --eval_data demo/reasoning/eval.jsonl --max_new_tokens 72 --overlong_buffer 16
     --prompts_per_step 16 --steps 20 (daro.py the same). Its weights are shipped for the reason below (sha256
     79cb14fc... for its model.safetensors).

Why the weights are shipped rather than built on each machine. The warm start is chaotic: a small model learns
multi-digit addition on a plateau followed by a sudden jump, and float rounding decides where in that jump the warm
start ends. The previous recipe (800 steps, built on each machine) gave, on one machine and differing only in the CPU
kernels torch picks, a demo model at eval/acc 0.36 (ATEN_CPU_CAPABILITY=avx2), 0.49 (avx512) or 0.55 (default); on
another 2-core machine (AMD EPYC) its own kernels gave 0.17. So a model built on each machine would differ by
machine, and with it the README's numbers. Training from these shipped files, every machine starts from the same
weights, and RL from fixed weights turned out stable across kernels (README, experiments/demo_table.py). On the machine
that built them (Intel Xeon with AVX-512, torch 2.13.0+cpu, transformers 5.19.0, one thread) this script reproduces them
bit for bit; it prints the weights' sha256 to check (9d215e51... for the shipped model.safetensors).

Why calibrated levels: the papers' notion of a hard prompt is its pass rate (DA3PO amplifies correct answers where
p < tau; DARO bins by mu = #correct / G). Levels defined by pass rate make that visible: the demo model starts with
levels at about 97%, 70%, 37%, 14% and 1%, so per-level accuracy shows where each method learns
(experiments/learning.py). The sums come from the same distribution as the training rows (1+1, 2+1, 2+2 and 3+3 digits)
and none is a training row; the digit level of each is kept in the file as `digits`.
"""
import argparse
import hashlib
import json
import os
import random
import time

import torch
import torch.nn.functional as F

import common
import dataset
import engine as eng
import modeling
import ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# level -> [low, high) band of the demo model's pass rate at build time; level 1 is the easiest
LEVEL_BANDS = {1: (0.9, 1.01), 2: (0.5, 0.9), 3: (0.25, 0.5), 4: (0.05, 0.25), 5: (0.0, 0.05)}


def warm_start(model, tok, problems: list[dict], steps: int, batch_size: int = 64, lr: float = 3e-3,
               target=None, on_step=None) -> float:
    """Supervised pass on `prompt -> \\boxed{answer}<eos>` (loss on completion tokens only), on one thread (float sums
    depend on the thread count); returns the last batch's token accuracy. What makes the demo's pass rates spread
    over easy and hard prompts before RL starts. `target(problem, rng)`, if given, returns the completion text to
    teach instead (the reasoning demo's traces, demo/reasoning_task.py), drawn with a random stream of its own so
    that the arith model's batches stay exactly what they were. `on_step(i)`, if given, runs after step i (1-based);
    the learning rate is constant after its warm-up, so the model after step i is that of a run of i steps."""
    rng = random.Random(0)
    target_rng = random.Random(1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 100))
    model.train()
    acc = 0.0
    for i in range(steps):
        batch = rng.sample(problems, batch_size)
        prompts = [tok(dataset.format_prompt(tok, p["prompt"], "none"), add_special_tokens=False)["input_ids"]
                   for p in batch]
        if target is None:
            answers = [tok(f"\\boxed{{{p['answer']}}}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                       for p in batch]
            ids, attn, mask = common.pad_prompt_completion(prompts, answers, tok.pad_token_id)
        else:  # segments (text, trained): a segment not trained (a deliberate slip) is seen but never taught
            answers, taught = [], []
            for p in batch:
                segments = target(p, target_rng)
                pieces = [(tok(text, add_special_tokens=False)["input_ids"], train) for text, train in segments]
                answers.append([i for ids_, _ in pieces for i in ids_] + [tok.eos_token_id])
                taught.append([float(train) for ids_, train in pieces for _ in ids_] + [1.0])
            ids, attn, mask = common.pad_prompt_completion(prompts, answers, tok.pad_token_id)
            mask = mask * torch.tensor([t + [0.0] * (mask.shape[1] - len(t)) for t in taught])
        logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=mask.shape[1] + 1).logits[:, :-1]
        targets = ids[:, -mask.shape[1]:]
        loss = (F.cross_entropy(logits.transpose(1, 2), targets, reduction="none") * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        acc = ((logits.argmax(-1) == targets).float() * mask).sum().item() / mask.sum().item()
        if on_step:
            on_step(i + 1)
    torch.set_num_threads(threads)
    model.eval()
    return acc


def candidate_sums(train: list[dict], held_out: list[dict], seed: int = 1) -> list[dict]:
    """Sums none of which is a training row: arith_problems' held-out ones, then more 2+2 and 3+3 sums (the levels
    with room), drawn from their own seeded stream so that the training rows stay exactly those of the warm start."""
    seen = {p["prompt"] for p in train} | {p["prompt"] for p in held_out}
    rng, extra = random.Random(seed), []
    for (da, db), n in (((2, 2), 300), ((3, 3), 700)):
        while sum(p["digits"] == f"{da}+{db}" for p in extra) < n:
            a, b = rng.randrange(10 ** (da - 1), 10 ** da), rng.randrange(10 ** (db - 1), 10 ** db)
            if f"{a}+{b}" not in seen:
                seen.add(f"{a}+{b}")
                extra.append({"prompt": f"{a}+{b}", "answer": str(a + b), "digits": f"{da}+{db}"})
    digits = {level: f"{da}+{db}" for level, (da, db) in dataset.ARITH_LEVELS.items()}
    return [{**p, "digits": digits[p["level"]]} for p in held_out] + extra


def pass_rates(model, tok, problems: list[dict], samples: int, seed: int = 0,
               max_new_tokens: int = 12) -> list[float]:
    """Each problem's pass rate under the model: `samples` completions at temperature 1 of at most max_new_tokens
    tokens (the RL runs' limit), through the real rollout and verifier (common.roll_groups)."""
    cfg = argparse.Namespace(max_new_tokens=max_new_tokens, overlong_buffer=0, overlong_penalty=1.0,
                             answer_format="auto")
    problems = dataset.tokenize_problems(problems, tok, "none", 64, "calibration")
    engine = eng.HFRollout(model, tok, ranks.DistInfo(), batch_size=4096)
    torch.manual_seed(seed)
    rates = []
    for s in range(0, len(problems), 128):
        groups, _ = common.roll_groups(engine, tok, problems[s:s + 128], cfg, samples, temperature=1.0, top_p=1.0)
        rates += [sum(g["correct"]) / samples for g in groups]
    return rates


# The reasoning demo (demo/reasoning_task.py has the task): the warm start's trace mixture, and the completion limit
# its calibration samples under, which is the RL runs' --max_new_tokens (README, "The reasoning demo").
REASONING = {"sft_steps": 1000, "slip_rate": 0.15, "reslip_rate": 0.2, "late_rate": 0.2, "max_new_tokens": 72,
             "pool": 8000, "samples": 16, "train_rows": 4000}


def write_levels(pool: list[dict], rates: list[float], per_level: int, path: str, digit_names: list[str],
                 extra=lambda p: {}) -> list[dict]:
    """The calibrated eval set: per_level problems drawn from each LEVEL_BANDS band of the build-time pass rates,
    easiest level first, each row with its digits and its pass rate at build (and `extra(problem)`)."""
    rng, rows = random.Random(0), []
    for level, (low, high) in LEVEL_BANDS.items():
        band = [(p, r) for p, r in zip(pool, rates) if low <= r < high]
        picked = rng.sample(band, min(per_level, len(band)))
        rows += [{"problem": p["prompt"], "answer": p["answer"], "level": level, "digits": p["digits"], **extra(p),
                  "pass_rate_at_build": r} for p, r in sorted(picked, key=lambda x: -x[1])]
        mix = {d: sum(p["digits"] == d for p, _ in picked) for d in digit_names}
        mean = sum(r for _, r in picked) / max(1, len(picked))
        print(f"  level {level}: pass rate in [{low:.2f}, {min(high, 1):.2f}]: {len(band):4d} candidates, "
              f"{len(picked)} kept, mean {mean:.3f}, digits " + ", ".join(f"{d} {n}" for d, n in mix.items() if n))
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"eval set: {len(rows)} problems written to {path}")
    return rows


def save_model(model, tok, path: str, what: str, t0: float, acc: float):
    model.save_pretrained(path)
    tok.save_pretrained(path)
    digest = hashlib.sha256(open(os.path.join(path, "model.safetensors"), "rb").read()).hexdigest()
    print(f"model: {what} in {time.time() - t0:.0f} s (last batch token acc {acc:.3f}), saved to {path}\n"
          f"  model.safetensors sha256 {digest}")


def build_arith(args):
    t0 = time.time()
    tok = modeling.build_demo_tokenizer()
    model = modeling.build_demo_model(tok, hidden=128, layers=2, seed=0)
    train, held_out = dataset.arith_problems(seed=0)
    acc = warm_start(model, tok, train, steps=args.sft_steps)
    save_model(model, tok, os.path.join(args.out, "model"), f"{args.sft_steps} SFT steps", t0, acc)

    t0 = time.time()
    pool = candidate_sums(train, held_out)
    rates = pass_rates(model, tok, pool, args.samples)
    print(f"calibration: {len(pool)} held-out sums x {args.samples} samples in {time.time() - t0:.0f} s")
    write_levels(pool, rates, args.per_level, os.path.join(args.out, "eval.jsonl"), ["1+1", "2+1", "2+2", "3+3"])


def build_reasoning(args):
    """demo/reasoning/: model/ (warm-started on column-by-column traces with slips and redos), train.jsonl (the RL
    training rows) and eval.jsonl (calibrated as the arith eval set, sampling up to REASONING's max_new_tokens)."""
    from demo import reasoning_task as task
    cfg = REASONING
    t0 = time.time()
    tok = modeling.build_demo_tokenizer()
    model = modeling.build_demo_model(tok, hidden=128, layers=2, seed=0)
    sft, pool = task.problems(seed=0, n_pool=cfg["pool"])

    def target(p, rng):
        return task.trace_segments(*task.operands(p["prompt"]), rng, cfg["slip_rate"], cfg["reslip_rate"],
                                   cfg["late_rate"])

    if args.calibrate_only:  # the model as built before (the same weights: calibration gives the same rates)
        model, tok = modeling.load_model(os.path.join(args.out, "model"), torch.device("cpu"))
    else:
        acc = warm_start(model, tok, sft, steps=args.sft_steps, target=target)
        os.makedirs(args.out, exist_ok=True)
        save_model(model, tok, os.path.join(args.out, "model"), f"{args.sft_steps} SFT steps on traces", t0, acc)
    with open(os.path.join(args.out, "train.jsonl"), "w") as f:
        f.writelines(json.dumps({"problem": p["prompt"], "answer": p["answer"], "digits": p["digits"]}) + "\n"
                     for p in sft[:cfg["train_rows"]])
    print(f"training set: {cfg['train_rows']} rows (the warm start's first) written to "
          f"{os.path.join(args.out, 'train.jsonl')}")

    t0 = time.time()
    rates = pass_rates(model, tok, pool, args.samples, max_new_tokens=cfg["max_new_tokens"])
    print(f"calibration: {len(pool)} held-out sums x {args.samples} samples of up to {cfg['max_new_tokens']} "
          f"tokens in {time.time() - t0:.0f} s")
    write_levels(pool, rates, args.per_level, os.path.join(args.out, "eval.jsonl"),
                 [f"{da}+{db}" for da, db in task.DIGIT_MIX],
                 lambda p: {"carries": task.carries(*task.operands(p["prompt"]))})


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=("arith", "reasoning"), default="arith",
                   help="arith: demo/arith/model + demo/arith/eval.jsonl; reasoning: demo/reasoning/")
    p.add_argument("--out", default="", help="folder for the outputs (default demo/arith/, or demo/reasoning/)")
    p.add_argument("--sft_steps", type=int, default=0,
                   help=f"supervised warm-start steps (batch 64, lr 3e-3); default 1200 (arith), "
                        f"{REASONING['sft_steps']} (reasoning)")
    p.add_argument("--per_level", type=int, default=40, help="eval problems per difficulty level")
    p.add_argument("--samples", type=int, default=0,
                   help=f"completions per problem for the calibration; default 32 (arith), {REASONING['samples']} "
                        f"(reasoning)")
    p.add_argument("--calibrate_only", action="store_true",
                   help="reasoning: keep the model in --out and rewrite train.jsonl and eval.jsonl only")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.task == "arith":
        args.out, args.sft_steps = args.out or os.path.join(ROOT, "demo", "arith"), args.sft_steps or 1200
        args.samples = args.samples or 32
        build_arith(args)
    else:
        args.out = args.out or os.path.join(ROOT, "demo", "reasoning")
        args.sft_steps = args.sft_steps or REASONING["sft_steps"]
        args.samples = args.samples or REASONING["samples"]
        build_reasoning(args)


if __name__ == "__main__":
    main()
