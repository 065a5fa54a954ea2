"""
Builds what `python da3po.py` (and daro.py) trains and evaluates by default, both shipped in this folder:
  demo/model/            a tiny Qwen3-style model (0.5M parameters, character-level tokenizer built with the
                         `tokenizers` library, a chat template), warm-started by a supervised pass on sums
  demo/arith_eval.jsonl  200 held-out sums in 5 difficulty levels, calibrated on that model: level = the band of its
                         pass rate at the start of RL (32 samples at temperature 1), easiest first

Run: python demo/build.py [--out demo] [--sft_steps 1200]      (about 2 minutes on one CPU thread)

Why the weights are shipped rather than built on each machine. The warm start is chaotic: a small model learns
multi-digit addition on a plateau followed by a sudden jump, and float rounding decides where in that jump the warm
start ends. The previous recipe (800 steps, built on each machine) gave, on one machine and differing only in the CPU
kernels torch picks, a demo model at eval/acc 0.36 (ATEN_CPU_CAPABILITY=avx2), 0.49 (avx512) or 0.55 (default); on
another 2-core machine (AMD EPYC) its own kernels gave 0.17. So a model built on each machine would differ by
machine, and with it the README's numbers. Training from these shipped files, every machine starts from the same
weights, and RL from fixed weights turned out stable across kernels (README, bench/demo.py). On the machine that
built them (Intel Xeon with AVX-512, torch 2.13.0+cpu, transformers 5.19.0, one thread) this script reproduces them
bit for bit; it prints the weights' sha256 to check (9d215e51... for the shipped model.safetensors).

Why calibrated levels: the papers' notion of a hard prompt is its pass rate (DA3PO amplifies correct answers where
p < tau; DARO bins by mu = #correct / G). Levels defined by pass rate make that visible: the demo model starts with
levels at about 97%, 70%, 37%, 14% and 1%, so per-level accuracy shows where each method learns (bench/learning.py).
The sums come from the same distribution as the training rows (1+1, 2+1, 2+2 and 3+3 digits) and none is a training
row; the digit level of each is kept in the file as `digits`.
"""
import argparse
import hashlib
import json
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402

# level -> [low, high) band of the demo model's pass rate at build time; level 1 is the easiest
LEVEL_BANDS = {1: (0.9, 1.01), 2: (0.5, 0.9), 3: (0.25, 0.5), 4: (0.05, 0.25), 5: (0.0, 0.05)}


def warm_start(model, tok, problems: list[dict], steps: int, batch_size: int = 64, lr: float = 3e-3) -> float:
    """Supervised pass on `prompt -> \\boxed{answer}<eos>` (loss on completion tokens only), on one thread (float sums
    depend on the thread count); returns the last batch's token accuracy. What makes the demo's pass rates spread
    over easy and hard prompts before RL starts."""
    rng = random.Random(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 100))
    model.train()
    acc = 0.0
    for _ in range(steps):
        batch = rng.sample(problems, batch_size)
        prompts = [tok(common.format_prompt(tok, p["prompt"], "none"), add_special_tokens=False)["input_ids"]
                   for p in batch]
        answers = [tok(f"\\boxed{{{p['answer']}}}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                   for p in batch]
        ids, attn, mask = common.pad_prompt_completion(prompts, answers, tok.pad_token_id)
        logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=mask.shape[1] + 1).logits[:, :-1]
        targets = ids[:, -mask.shape[1]:]
        loss = (F.cross_entropy(logits.transpose(1, 2), targets, reduction="none") * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        acc = ((logits.argmax(-1) == targets).float() * mask).sum().item() / mask.sum().item()
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
    digits = {level: f"{da}+{db}" for level, (da, db) in common.ARITH_LEVELS.items()}
    return [{**p, "digits": digits[p["level"]]} for p in held_out] + extra


def pass_rates(model, tok, problems: list[dict], samples: int, seed: int = 0) -> list[float]:
    """Each problem's pass rate under the model: `samples` completions at temperature 1, through the real rollout
    and verifier (common.roll_groups)."""
    cfg = argparse.Namespace(max_new_tokens=12, overlong_buffer=0, overlong_penalty=1.0, answer_format="auto")
    problems = common.tokenize_problems(problems, tok, "none", 64, "calibration")
    engine = common.HFRollout(model, tok, common.DistInfo(), batch_size=4096)
    torch.manual_seed(seed)
    rates = []
    for s in range(0, len(problems), 128):
        groups, _ = common.roll_groups(engine, tok, problems[s:s + 128], cfg, samples, temperature=1.0, top_p=1.0)
        rates += [sum(g["correct"]) / samples for g in groups]
    return rates


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "demo"), help="folder for model/ and arith_eval.jsonl")
    p.add_argument("--sft_steps", type=int, default=1200, help="supervised warm-start steps (batch 64, lr 3e-3)")
    p.add_argument("--per_level", type=int, default=40, help="eval problems per difficulty level")
    p.add_argument("--samples", type=int, default=32, help="completions per problem for the calibration")
    args = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    tok = common.build_demo_tokenizer()
    model = common.build_demo_model(tok, hidden=128, layers=2, seed=0)
    train, held_out = common.arith_problems(seed=0)
    acc = warm_start(model, tok, train, steps=args.sft_steps)
    path = os.path.join(args.out, "model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    digest = hashlib.sha256(open(os.path.join(path, "model.safetensors"), "rb").read()).hexdigest()
    print(f"model: {args.sft_steps} SFT steps in {time.time() - t0:.0f} s (last batch token acc {acc:.3f}), "
          f"saved to {path}\n  model.safetensors sha256 {digest}")

    t0 = time.time()
    pool = candidate_sums(train, held_out)
    rates = pass_rates(model, tok, pool, args.samples)
    rng, rows = random.Random(0), []
    print(f"calibration: {len(pool)} held-out sums x {args.samples} samples in {time.time() - t0:.0f} s")
    for level, (low, high) in LEVEL_BANDS.items():
        band = [(p, r) for p, r in zip(pool, rates) if low <= r < high]
        picked = rng.sample(band, min(args.per_level, len(band)))
        rows += [{"problem": p["prompt"], "answer": p["answer"], "level": level, "digits": p["digits"],
                  "pass_rate_at_build": r} for p, r in sorted(picked, key=lambda x: -x[1])]
        mix = {d: sum(p["digits"] == d for p, _ in picked) for d in ("1+1", "2+1", "2+2", "3+3")}
        mean = sum(r for _, r in picked) / max(1, len(picked))
        print(f"  level {level}: pass rate in [{low:.2f}, {min(high, 1):.2f}]: {len(band):4d} candidates, "
              f"{len(picked)} kept, mean {mean:.3f}, digits " + ", ".join(f"{d} {n}" for d, n in mix.items() if n))
    with open(os.path.join(args.out, "arith_eval.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"eval set: {len(rows)} problems written to {os.path.join(args.out, 'arith_eval.jsonl')}")


if __name__ == "__main__":
    main()
