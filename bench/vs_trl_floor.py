"""
How low ours/TRL can go on bench/vs_trl.py's work: each side's step split into its matrix products (the FLOPs
the work needs, run by the BLAS kernels), its attention kernels, and the rest (every other op, autograd and
Python), then the ratio each target would need and the ratio left if the rest cost nothing.

  python -m bench.vs_trl_floor --workload arith                # about 4 min
  python -m bench.vs_trl_floor --workload reasoning --compile  # about 10 min, with torch.compile's figures

Each side runs vs_trl.py's blocks (the same configs): a warm-up block, --repeats timed blocks alternating with
the other side's (the median s/step of all their steps, no profiler), then one block under torch.profiler for
the self times of the GEMM ops (aten::mm, addmm, bmm, baddbmm) and of sdpa's kernels, and one more with
with_flops for the GEMMs' FLOPs (recording shapes slows the ops it times, so its times are not used), each
divided by the block's steps. The profiler's own cost lands mostly outside the kernels it times (a few percent
on a GEMM of the decode's size), so those seconds are close to, and if anything above, an unprofiled run's;
ours' blocks also hold their start and end evaluation (8 completions each, under 1% of a 6-step block's work),
also counted against ours. The rest is the timed step minus the kernels. On a shared machine figures drift by
~10-20% between runs; vs_trl.py's ratio is the one of record. The GEMM rate printed next to each side
(GFLOP/s) is what the BLAS kernels reach on that side's shapes; a 1024^3 product on the same thread count
shows this CPU's best.

--compile: forward and backward of one micro-batch (32 completions of the workload's longest length, the whole
logits' log-softmax) on the workload's model, eager against torch.compile(dynamic=True): the first call's
seconds (compiling) and the steady-state seconds of each, to show what fused kernels would buy at this model
size.
"""
import argparse
import contextlib
import io
import os
import statistics
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench import vs_trl  # noqa: E402
from modeling import load_model, model_path  # noqa: E402

GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
ATTENTION = "scaled_dot_product"  # sdpa's kernels, forward and backward (their names hold it)
TARGETS = {"arith": 0.35, "reasoning": 0.30}  # the ours/TRL ratios this floor is measured against


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="arith", choices=list(vs_trl.WORKLOADS))
    p.add_argument("--steps", type=int, default=6, help="RL steps per block")
    p.add_argument("--repeats", type=int, default=3, help="timed blocks per side, alternating")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile", action="store_true", help="also time torch.compile on one micro-batch")
    a = p.parse_args()
    args = vs_trl.parse_args(["--workload", a.workload, "--steps", str(a.steps), "--threads", str(a.threads)])
    return args, a.repeats, a.compile


def kernel_seconds(prof, steps: int) -> dict:
    """Per-step self seconds of the GEMMs and of attention, and the GEMMs' GFLOP (0 unless the block was
    profiled with_flops), from a profiled block."""
    out = {"gemm_s": 0.0, "attention_s": 0.0, "gflop": 0.0}
    for e in prof.key_averages():
        if e.key in GEMMS:
            out["gemm_s"] += e.self_cpu_time_total / 1e6 / steps
            out["gflop"] += (e.flops or 0) / 1e9 / steps
        elif ATTENTION in e.key and e.key.startswith("aten::_"):  # the kernels, not their dispatchers
            out["attention_s"] += e.self_cpu_time_total / 1e6 / steps
    return out


def measure(args, sides: dict, repeats: int) -> dict:
    """Per side: a warm-up block; then `repeats` timed blocks, alternating sides (median s/step of them all);
    then one profiled block each for the kernels' seconds, then one each with_flops for their FLOPs (counting
    FLOPs records every op's shapes, which slowed a GEMM 1.6x and more in a check: its times are not used)."""
    out = {side: {"steps": []} for side in sides}
    with contextlib.redirect_stdout(io.StringIO()):
        for run in sides.values():
            run(argparse.Namespace(**{**vars(args), "steps": 2}), 0)
        for r in range(repeats):
            for side, run in sides.items():
                out[side]["steps"] += run(args, 1 + r)
        for with_flops in (False, True):
            for side, run in sides.items():
                with profile(activities=[ProfilerActivity.CPU], with_flops=with_flops) as prof:
                    run(args, 1)
                kernels = kernel_seconds(prof, args.steps)
                out[side].update({"gflop": kernels["gflop"]} if with_flops else kernels)
        for side in sides:
            out[side]["step_s"] = statistics.median(out[side]["steps"])
    return out


def best_gemm_rate() -> float:
    """GFLOP/s of a 1024 x 1024 x 1024 float32 product: what this CPU's BLAS reaches on a large shape."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    return 10 * 2 * 1024 ** 3 / (time.perf_counter() - t) / 1e9


def compile_check(args):
    """Eager against torch.compile(dynamic=True) on one micro-batch's forward and backward."""
    model, _ = load_model(model_path(args.work["model"]), torch.device("cpu"))
    model.train()
    ids = torch.randint(3, model.config.vocab_size, (32, args.max_new_tokens))

    def update(m):
        m(input_ids=ids).logits.log_softmax(-1).mean().backward()

    def steady(m, n=10):
        update(m)
        t = time.perf_counter()
        for _ in range(n):
            update(m)
        return (time.perf_counter() - t) / n

    eager = steady(model)
    compiled = torch.compile(model, dynamic=True)
    t = time.perf_counter()
    update(compiled)
    first = time.perf_counter() - t
    print(f"\ntorch.compile, one micro-batch (32 x {args.max_new_tokens} tokens) forward + backward: eager "
          f"{eager:.3f} s, compiled {steady(compiled):.3f} s after a first call of {first:.1f} s (compiling)")


def main():
    args, repeats, with_compile = parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import transformers
    transformers.logging.set_verbosity_error()
    path = model_path(args.work["model"])
    sides = measure(args, {"ours": vs_trl.run_ours, "TRL": lambda a, r: vs_trl.run_trl(a, path, r)}, repeats)
    print(f"workload {args.workload}, {args.threads} thread(s), {repeats} timed blocks of {args.steps} steps "
          f"per side, alternating; seconds per RL step")
    print(f"{'side':>5} | {'step':>6} | {'GEMMs':>6} | {'GFLOP':>6} | {'GFLOP/s':>7} | {'attention':>9} | "
          f"{'the rest':>8}")
    for side, m in sides.items():
        m["rest_s"] = m["step_s"] - m["gemm_s"] - m["attention_s"]
        print(f"{side:>5} | {m['step_s']:6.3f} | {m['gemm_s']:6.3f} | {m['gflop']:6.2f} | "
              f"{m['gflop'] / m['gemm_s']:7.1f} | {m['attention_s']:9.3f} | {m['rest_s']:8.3f}")
    print(f"this CPU's GEMM rate on a 1024^3 product: {best_gemm_rate():.1f} GFLOP/s")
    ours, trl = sides["ours"], sides["TRL"]
    target = TARGETS[args.workload]
    budget = target * trl["step_s"] - ours["gemm_s"] - ours["attention_s"]
    print(f"ratio ours/TRL now: {ours['step_s'] / trl['step_s']:.3f}")
    print(f"ratio if ours' rest cost nothing: {(ours['gemm_s'] + ours['attention_s']) / trl['step_s']:.3f} "
          f"(GEMMs alone {ours['gemm_s'] / trl['step_s']:.3f})")
    print(f"ratio of the GEMM FLOPs ours/TRL: {ours['gflop'] / trl['gflop']:.3f}")
    if budget > 0:
        print(f"target {target}: ours' rest must fit in {budget:.3f} s per step, "
              f"{budget / ours['rest_s']:.2f} of its {ours['rest_s']:.3f} s now")
    else:
        print(f"target {target}: out of reach on these kernels: ours' GEMMs and attention alone take "
              f"{(ours['gemm_s'] + ours['attention_s']) / trl['step_s']:.3f} of TRL's step")
    if with_compile:
        compile_check(args)


if __name__ == "__main__":
    main()
