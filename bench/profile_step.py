"""Where the seconds of an RL step go: generate, verify, old log-probs, forward, backward, optimizer, weight sync,
logging and the rest, as seconds per step and shares, plus cProfile's top functions, for these workloads:
  reasoning  the default demo (`python da3po.py`: a trace before the answer, ~45-60 tokens)
  demo   the sums demo (`python da3po.py --demo arith`: 32 prompts x 8, dynamic sampling, completions of ~6 tokens)
  vs_trl bench/vs_trl.py's first workload on our side (the sums demo's model, 16 prompts x 8, no dynamic
         sampling, 4 updates)
  25M    a 25M-parameter Qwen3-shaped model built in code (hidden 512, 8 layers, the demo's tokenizer, untrained, so
         its completions run to the 128-token cap), 16 prompts x 8, no dynamic sampling, 4 updates per step
Usage: python -m bench.profile_step [--workloads reasoning,demo,vs_trl,25M] [--steps 8] [--threads 2] [--out FILE]
       [--flags=--no-pack]  (extra flags for every workload)

da3po.main runs in this process with the phases' functions wrapped by timers (nothing in the training code is
changed for this); the first step of each workload is a warm-up and is not counted, nor are set-up and evaluation.
Writes a markdown report (bench/results/profile.md by default)."""
import argparse
import cProfile
import contextlib
import io
import os
import pstats
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import common  # noqa: E402
import config
import bookkeeping  # noqa: E402
import modeling  # noqa: E402
import engine as eng  # noqa: E402
import da3po  # noqa: E402

PHASES = ("generate", "verify", "old log-probs", "forward", "backward", "optimizer", "sync", "logging")


class Clock:
    """Seconds per phase, counted only while `counting` is on."""

    def __init__(self):
        self.seconds, self.counting, self.steps = dict.fromkeys(PHASES, 0.0), False, 0

    def wrap(self, phase, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.counting:
                    self.seconds[phase] += time.perf_counter() - t0
        return timed


def build_25m(folder: str) -> str:
    tok = modeling.build_demo_tokenizer()
    model = modeling.build_demo_model(tok, hidden=512, layers=8)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def run(workload: str, steps: int, tmp: str, extra: list[str] = ()):
    """One workload: (per-phase seconds per counted step, the step seconds, cProfile stats of the counted steps)."""
    flags = ["--steps", str(steps + 1), "--out_dir", os.path.join(tmp, workload), "--eval_every", "0",
             "--eval_size", "5", "--eval_samples", "1", "--sample_every", "0"]
    if workload == "vs_trl":  # bench/vs_trl.py's work: 16 prompts x 8, 4 updates of one forward/backward each
        flags += ["--algo", "dapo", "--prompts_per_step", "16", "--updates_per_step", "4", "--micro_batch_size", "32",
                  "--no-dynamic_sampling"]
    flags += ["--demo", "reasoning" if workload == "reasoning" else "arith"]
    if workload == "25M":
        flags += ["--model", build_25m(os.path.join(tmp, "model25m")), "--prompt_template", "none",
                  "--prompts_per_step", "16", "--updates_per_step", "4", "--max_new_tokens", "128",
                  "--overlong_buffer", "32", "--no-dynamic_sampling"]
    cfg = config.parse_config(da3po.Config, [*flags, *extra], da3po.PRESETS)
    clock, prof, marks = Clock(), cProfile.Profile(), []
    patches = [(eng.HFRollout, "generate", "generate"), (common, "verify_batch", "verify"),
               (da3po, "old_logprobs", "old log-probs"), (da3po, "token_losses", "forward"),
               (torch.Tensor, "backward", "backward"), (common.UpdateGuard, "step", "optimizer"),
               (eng.HFRollout, "sync_weights", "sync"), (bookkeeping.Logger, "log", "logging"),
               (bookkeeping.Logger, "line", "logging")]
    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    real_eval, real_timer = da3po.evaluate_and_log, common.StepTimer.metrics

    def step_done(timer):  # StepTimer.metrics is called once per step, at its end: start counting after step 1
        out = real_timer(timer)
        marks.append(time.perf_counter())
        if len(marks) == 1:
            clock.counting = True
            prof.enable()
        else:
            clock.steps += 1
        return out

    def evaluation(*args, **kwargs):  # not part of a step
        counting = clock.counting
        clock.counting = False
        prof.disable()
        try:
            return real_eval(*args, **kwargs)
        finally:
            clock.counting = counting
            if counting:
                prof.enable()
    try:
        for obj, name, phase in patches:
            setattr(obj, name, clock.wrap(phase, getattr(obj, name)))
        common.StepTimer.metrics, da3po.evaluate_and_log = step_done, evaluation
        with contextlib.redirect_stdout(io.StringIO()):
            da3po.main(cfg)
    finally:
        prof.disable()
        for obj, name, fn in originals:
            setattr(obj, name, fn)
        common.StepTimer.metrics, da3po.evaluate_and_log = real_timer, real_eval
    step_s = (marks[-1] - marks[0]) / clock.steps
    # forward includes the loss; backward is torch.Tensor.backward on the loss; the verifier runs inside generate's
    # caller (roll_groups), not inside generate
    return {k: v / clock.steps for k, v in clock.seconds.items()}, step_s, prof


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", default="reasoning,demo,vs_trl,25M")
    p.add_argument("--steps", type=int, default=8, help="counted steps per workload (after one warm-up step)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--flags", default="", help="extra flags for every workload, space-separated (e.g. --no-pack)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "profile.md"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lines = [f"Seconds per RL step by phase (`{' '.join(['python -m bench.profile_step', *sys.argv[1:]])}`), "
             f"torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} CPUs, load "
             f"{os.getloadavg()[0]:.1f} at the start.", ""]
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workloads.split(","):
            phases, step_s, prof = run(workload, args.steps, tmp, args.flags.split())
            other = step_s - sum(phases.values())
            lines += [f"### {workload}: {step_s:.3f} s per step ({args.steps} steps)", "",
                      "| phase | s per step | share |", "|---|---|---|"]
            for name, seconds in [*phases.items(), ("other", other)]:
                lines.append(f"| {name} | {seconds:.4f} | {100 * seconds / step_s:.1f}% |")
            s = io.StringIO()
            pstats.Stats(prof, stream=s).strip_dirs().sort_stats("tottime").print_stats(args.top)
            top = [ln for ln in s.getvalue().splitlines() if ln.strip()][-args.top - 1:]
            lines += ["", f"Top {args.top} functions by own time over the counted steps (cProfile):", "", "```",
                      *top, "```", ""]
            print("\n".join(lines[-(len(phases) + args.top + 12):]), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    open(args.out, "w").write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
