"""
Our DAPO step (`da3po.py --algo dapo`) side by side with TRL's GRPOTrainer (loss_type="dapo"), on the same work, on CPU.

The same on both sides: a shipped demo's model and weights, its training prompts (in the demo's prompt format), G,
max_new_tokens, temperature 1 (top_p 1, no top_k), the reward (+1/-1 from verifier.verify_batch plus DAPO's
overlong shaping, via common.shaped_reward), AdamW with the same lr / weight decay / grad clip and a constant
schedule, clip epsilons 0.2/0.28, no KL, and the same number of optimizer updates per RL step (ours:
--updates_per_step; TRL: steps_per_generation with num_iterations=1), each update one forward/backward over its
mini-batch, and pi_old for the later updates (TRL: one extra no-grad pass; ours: the rollout's own log-probs, which in
float32 are the trainer's, see common.old_logprobs; the same values to ~1e-6). How each side gets there is its own:
ours samples G completions of one prefill, and runs --logprob_path shortcuts (what a model of one's own runs by
default; the demos run the plain path), packing the rows in training (--padded: rows padded, each group's prompt
once). Dynamic sampling is off
on our side because TRL has none: both generate and train on exactly prompts_per_step groups per step. Activation
checkpointing is off on both (TRL's GRPOConfig turns it on by default, which recomputes every forward in the backward;
--grad_checkpointing turns it on for both).

Blocks alternate in one process (ours, TRL, ours, TRL, ...), each a fresh copy of the demo weights running --steps RL
steps. Reported per side: the median seconds per RL step over all blocks (ours: time/step_s of da3po.main's own loop;
TRL: the time between the optimizer steps that close consecutive RL steps, from a TrainerCallback), and the peak extra
memory of a block: the kernel's peak resident set size (VmHWM, reset through /proc/self/clear_refs before each block,
after gc and malloc_trim) minus the resident set at the block's start. It covers everything the block does (model load,
trainer set-up, the steps; for ours also the start/end eval and final checkpoint), not only the steps.
Then both compute the loss on one identical batch (same weights, token ids, advantages, old log-probs).

Two workloads (--workload): arith, the sums demo's model and prompts (completions of ~6 tokens, all about as long,
12 at most), and reasoning, the default demo's (a trace before the answer: 30-72 tokens, wrong answers longer, a
fifth truncated at 72; TRL pads each batch to its longest row, ours packs: --pack, the default). --padded adds a
third side, ours with --no-pack, run right before ours in each round: the ratio before and after, on the same
blocks.

Run:
  pip install -r requirements/bench.txt          # trl (pinned) and matplotlib; the installed torch is used as is
  python -m bench.vs_trl                          # about 2 min on a quiet 2-core CPU
  python -m bench.vs_trl --workload reasoning --padded --repeats 3  # about 10 min
  python -m bench.vs_trl --repeats 1 --steps 3    # smoke test
  python -m bench.vs_trl --profile ours           # cProfile one block of ours (or trl): the top functions
"""
import argparse
import contextlib
import cProfile
import ctypes
import gc
import io
import json
import os
import pstats
import re
import statistics
import tempfile
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported; --threads sets the count used
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is built locally
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import config  # noqa: E402
import da3po  # noqa: E402
from common import (group_advantages, loss_weights, make_batch, policy_loss, roll_groups,  # noqa: E402
                    shaped_reward, token_logprobs)
from modeling import load_model, model_path  # noqa: E402
from dataset import format_prompt, load_data, resolve_template, tokenize_problems  # noqa: E402
from ranks import DistInfo  # noqa: E402
from engine import HFRollout  # noqa: E402
from verifier import verify_batch  # noqa: E402

# -----------------------------------------------------------------------------------------------------------------
# Settings shared by both sides

# The work: a shipped demo's model, training prompts, completion cap and overlong buffer (config.DEMOS).
#   arith      sums answered directly: completions of ~6 tokens, all about as long (the first workload)
#   reasoning  the default demo: a trace before the answer, 30-72 tokens, wrong ones longer, a fifth truncated
WORKLOADS = ("arith", "reasoning")


def workload(name: str) -> dict:
    """The Config values of a shipped demo (model, train_data, max_new_tokens, overlong_buffer, ...)."""
    return vars(da3po.Config()) | config.DEMOS[name]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", default="arith", choices=list(WORKLOADS), help="whose model, prompts and lengths")
    p.add_argument("--padded", action="store_true", help="a third side: ours with --no-pack (rows padded)")
    p.add_argument("--prompts_per_step", type=int, default=16, help="groups per RL step")
    p.add_argument("--group_size", type=int, default=8, help="G: completions per prompt")
    p.add_argument("--updates", type=int, default=4, help="optimizer updates per RL step")
    p.add_argument("--max_new_tokens", type=int, default=0, help="completion length cap; 0 = the workload's")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--steps", type=int, default=10, help="RL steps per timed block")
    p.add_argument("--repeats", type=int, default=5, help="blocks per side, alternating")
    p.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    p.add_argument("--grad_checkpointing", action=argparse.BooleanOptionalAction, default=False,
                   help="activation checkpointing, both sides (ours is off by default, TRL's GRPOConfig on)")
    p.add_argument("--max_load", type=float, default=2.0, help="wait for a 1-min load average below this ...")
    p.add_argument("--max_wait", type=float, default=60.0, help="... for at most this many seconds per block")
    p.add_argument("--profile", default="", choices=["", "ours", "trl"], help="cProfile one block of this side")
    args = p.parse_args(argv)
    assert args.prompts_per_step % args.updates == 0, "--prompts_per_step must divide by --updates"
    args.work = workload(args.workload)
    args.max_new_tokens = args.max_new_tokens or args.work["max_new_tokens"]
    return args


def our_config(args, out_dir: str, seed: int, pack: bool = True) -> da3po.Config:
    """da3po's Config for `--algo dapo`, sized like the TRL run; dynamic sampling off (TRL has none);
    --logprob_path shortcuts, what a model of one's own runs by default (the demos run plain)."""
    per_update = args.prompts_per_step // args.updates
    w = args.work
    return da3po.Config(**{**da3po.PRESETS["dapo"], "algo": "dapo", "dynamic_sampling": False}, model=w["model"],
                        train_data=w["train_data"], eval_data=w["eval_data"], overlong_buffer=w["overlong_buffer"],
                        out_dir=out_dir, seed=seed, steps=args.steps, prompts_per_step=args.prompts_per_step,
                        group_size=args.group_size, updates_per_step=args.updates,
                        micro_batch_size=per_update * args.group_size,  # one forward/backward per update
                        max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0, lr=args.lr,
                        grad_checkpointing=args.grad_checkpointing, eval_every=0, eval_size=4, eval_samples=2,
                        sample_every=0, logprob_path="shortcuts", pack=pack)


def trl_config(args, out_dir: str, seed: int, updates: int):
    from trl import GRPOConfig
    c = our_config(args, out_dir, seed)
    return GRPOConfig(
        output_dir=out_dir, use_cpu=True, report_to="none", seed=seed, save_strategy="no", disable_tqdm=True,
        max_steps=args.steps * updates, logging_steps=updates,  # a Trainer step is one optimizer update
        per_device_train_batch_size=args.prompts_per_step * args.group_size // updates, gradient_accumulation_steps=1,
        steps_per_generation=updates, num_iterations=1, num_generations=args.group_size,
        max_completion_length=c.max_new_tokens, temperature=c.temperature, top_p=c.top_p, top_k=0,
        loss_type="dapo", beta=c.kl_coef, epsilon=c.clip_low, epsilon_high=c.clip_high, scale_rewards="group",
        mask_truncated_completions=False, learning_rate=c.lr, weight_decay=c.weight_decay, max_grad_norm=c.grad_clip,
        lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch", bf16=False, use_vllm=False,
        gradient_checkpointing=c.grad_checkpointing,  # TRL's default is True: it would recompute every forward
        dataloader_num_workers=0)


def make_reward_fn(cfg):
    """TRL reward function with our reward: +1/-1 from the verifier plus DAPO's overlong shaping."""
    def dapo_reward(completions, completion_ids, answer, **kwargs):
        correct, _ = verify_batch(completions, answer, cfg.answer_format)
        return [shaped_reward(c, len(ids), cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
                for c, ids in zip(correct, completion_ids)]
    return dapo_reward


def trl_trainer(args, path: str, out_dir: str, seed: int, updates: int, callbacks=()):
    """A GRPOTrainer on a fresh copy of the workload's weights and prompts, formatted exactly as ours are."""
    from datasets import Dataset
    from trl import GRPOTrainer
    model, tok = load_model(path, torch.device("cpu"))
    template = resolve_template("auto", tok)
    problems = load_data(args.work["train_data"], "train")[:4096]
    ds = Dataset.from_dict({"prompt": [format_prompt(tok, p["prompt"], template) for p in problems],
                            "answer": [p["answer"] for p in problems]})
    cfg = our_config(args, out_dir, seed)
    return GRPOTrainer(model=model, reward_funcs=make_reward_fn(cfg), args=trl_config(args, out_dir, seed, updates),
                       train_dataset=ds, processing_class=tok, callbacks=list(callbacks))

# -----------------------------------------------------------------------------------------------------------------
# Timed blocks


def wait_for_quiet(max_load: float, max_wait: float) -> tuple:
    """Wait (at most max_wait s) for the 1-minute load average to drop below max_load; returns the load averages."""
    t0 = time.time()
    while os.getloadavg()[0] >= max_load and time.time() - t0 < max_wait:
        time.sleep(5)
    return os.getloadavg()


def rss_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read()).group(1))


def measured(fn):
    """Run fn(); return (its result, peak resident set during it minus the resident set before it, in MiB)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so the previous block's leftovers do not count
    base = rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (the peak RSS) to the current RSS
    out = fn()
    return out, (rss_kib("VmHWM") - base) / 1024


def run_ours(args, seed: int, pack: bool = True) -> list[float]:
    """da3po.main with --algo dapo, in this process; returns the seconds of each RL step (its own time/step_s)."""
    with tempfile.TemporaryDirectory() as out_dir:
        da3po.main(our_config(args, out_dir, seed, pack))
        records = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return [r["time/step_s"] for r in records if "time/step_s" in r]


def run_trl(args, path: str, seed: int) -> list[float]:
    """GRPOTrainer.train() for args.steps RL steps; returns the seconds of each RL step."""
    from transformers import PrinterCallback, TrainerCallback

    class StepClock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.t = [time.perf_counter()]

        def on_step_end(self, *a, **k):  # after each optimizer update
            self.t.append(time.perf_counter())

    clock = StepClock()
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = trl_trainer(args, path, out_dir, seed, args.updates, [clock])
        trainer.remove_callback(PrinterCallback)  # its per-step dict goes to the log, not the console
        torch.set_num_threads(args.threads)
        trainer.train()
    t = clock.t[::args.updates]  # the clock after every `updates` optimizer steps closes one RL step
    return [b - a for a, b in zip(t, t[1:])]


def profile_block(args, path: str):
    """One block of one side under cProfile (after an unprofiled warm-up block, so imports and one-time set-up do not
    dominate); prints the top functions by cumulative and by own time."""
    warm = argparse.Namespace(**{**vars(args), "steps": 2})
    with contextlib.redirect_stdout(io.StringIO()):
        run_ours(warm, 0) if args.profile == "ours" else run_trl(warm, path, 0)
    prof = cProfile.Profile()
    prof.enable()
    run_ours(args, 0) if args.profile == "ours" else run_trl(args, path, 0)
    prof.disable()
    for key in ("cumulative", "tottime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).strip_dirs().sort_stats(key).print_stats(30)
        print(s.getvalue())

# -----------------------------------------------------------------------------------------------------------------
# The loss on one identical batch


def trl_loss(trainer, inputs: dict) -> torch.Tensor:
    """TRL's own _compute_loss (train mode) on inputs we built."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); gradient_accumulation_steps=1 here
    return trainer.compute_loss(trainer.model, inputs)


def compare_loss(args, path: str):
    """Both losses on one batch rolled out by our machinery: same weights, ids, advantages and old log-probs."""
    torch.manual_seed(0)
    G, U = args.group_size, args.updates
    with tempfile.TemporaryDirectory() as out_dir:
        cfg = our_config(args, out_dir, 0)
        model, tok = load_model(path, torch.device("cpu"))
        cfg.prompt_template = resolve_template(cfg.prompt_template, tok)
        engine = HFRollout(model, tok, DistInfo())
        problems = tokenize_problems(load_data(cfg.train_data, "train")[:args.prompts_per_step], tok,
                                     cfg.prompt_template, cfg.max_prompt_length, cfg.train_data)
        groups, _ = roll_groups(engine, tok, problems, cfg, G, 1.0, 1.0)
        batch = make_batch(groups, tok.pad_token_id)
        ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["mask"]  # (B, P+T), (B, P+T), (B, T)
        B, T = mask.shape
        adv = group_advantages(batch["reward"].view(-1, G)).flatten()  # (B,)
        model.train()
        with torch.no_grad():
            logp_now = token_logprobs(model, ids, attn, T)[0]
        # old log-probs a little off the current policy, so both clip sides are active: ratios e^(+-0.3 N(0,1))
        old = (logp_now + 0.3 * torch.randn(B, T, generator=torch.Generator().manual_seed(1))) * mask  # (B, T)
        inputs = lambda rows, n_items: {  # noqa: E731
            "prompt_ids": ids[rows, :-T], "prompt_mask": attn[rows, :-T], "completion_ids": ids[rows, -T:],
            "completion_mask": mask[rows], "advantages": adv[rows], "old_per_token_logps": old[rows],
            "num_items_in_batch": n_items}

        def ours(rows):  # the loss of one of our optimizer updates over `rows`, and its gradients
            model.zero_grad(set_to_none=True)
            logp = token_logprobs(model, ids[rows], attn[rows], T)[0]
            weights = loss_weights(mask[rows], cfg.loss_agg, cfg.max_new_tokens)
            loss = (policy_loss(logp, old[rows], adv[rows], mask[rows], cfg.clip_low, cfg.clip_high)[0] * weights).sum()
            loss.backward()
            return loss.item(), [p.grad.clone() for p in model.parameters()]

        def theirs(trainer, rows, n_items):
            trainer.model.zero_grad(set_to_none=True)
            loss = trl_loss(trainer, inputs(rows, n_items))
            loss.backward()
            return loss.item(), [p.grad.clone() for p in trainer.model.parameters()]

        all_rows, n_tokens = torch.arange(B), mask.sum()
        t1 = trl_trainer(args, path, out_dir, 0, updates=1)  # the whole batch as one update
        for p, q in zip(model.parameters(), t1.model.parameters()):
            assert torch.equal(p, q), "the two copies of the demo weights differ"
        with torch.no_grad():
            trl_logp = t1._get_per_token_logps_and_entropies(t1.model, ids, attn, T)[0]
        (a, ga), (b, gb) = ours(all_rows), theirs(t1, all_rows, n_tokens)
        gdiff = max((x - y).abs().max().item() for x, y in zip(ga, gb))
        gscale = max(x.abs().max().item() for x in ga)
        ratio = ((logp_now - old).exp() * mask)
        print(f"\nloss on one identical batch: {B} completions, {int(n_tokens)} completion tokens, advantages from "
              f"{B // G} groups, old log-probs = current + 0.3 N(0,1) (ratios {ratio[mask.bool()].min():.2f}.."
              f"{ratio[mask.bool()].max():.2f})")
        print(f"  token log-probs: max |ours - TRL| = {((logp_now - trl_logp) * mask).abs().max().item():.2e}")
        print(f"  one update over the whole batch:  ours {a:+.8f} | TRL {b:+.8f} | diff {a - b:+.2e} | "
              f"max |grad diff| {gdiff:.2e} (max |grad| {gscale:.2e})")
        # several updates per step: TRL divides each mini-batch's token-loss sum by the generation batch's tokens / U
        # (its mean tokens per mini-batch), we by the mini-batch's own token count (the token-mean of that update)
        tu = trl_trainer(args, path, out_dir, 0, updates=U)
        n = B // U
        print(f"  {U} updates of {n} completions (same rows both sides; TRL's loss in train mode with "
              f"steps_per_generation={U}):")
        for u in range(U):
            rows = torch.arange(u * n, (u + 1) * n)
            (a, _), (b, _) = ours(rows), theirs(tu, rows, n_tokens)
            share = mask[rows].sum().item() / (n_tokens.item() / U)
            print(f"    update {u}: ours {a:+.8f} | TRL {b:+.8f} | ours/TRL {a / b if b else float('nan'):.4f} | "
                  f"mini-batch tokens / (batch tokens / {U}) = {share:.4f}")

# -----------------------------------------------------------------------------------------------------------------


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import transformers
    import trl
    transformers.logging.set_verbosity_error()
    path = model_path(args.work["model"])
    B = args.prompts_per_step * args.group_size
    print(f"trl {trl.__version__} | transformers {transformers.__version__} | torch {torch.__version__} | "
          f"threads {args.threads} | cpus {os.cpu_count()}")
    print(f"workload {args.workload}: model {os.path.relpath(path, ROOT)}, prompts {args.work['train_data']}")
    print(f"work per RL step: {args.prompts_per_step} prompts x G={args.group_size} = {B} completions of <= "
          f"{args.max_new_tokens} tokens, temperature 1, {args.updates} optimizer updates of {B // args.updates} "
          f"completions (one forward/backward each), pi_old for the later updates, lr {args.lr}, clip 0.2/0.28, no KL, "
          f"activation checkpointing {'on' if args.grad_checkpointing else 'off'}")
    if args.profile:
        return profile_block(args, path)

    def quietly(fn):  # the runs' own console lines go to a buffer (shown if the run fails), so the table stays legible
        def run():
            buf = io.StringIO()
            try:
                with contextlib.redirect_stdout(buf):
                    return fn()
            except BaseException:
                print(buf.getvalue())
                raise
        return run

    # warm-up, not timed: one short block each, so one-time costs (lazy imports, first-call kernels) hit neither side
    warm = argparse.Namespace(**{**vars(args), "steps": 2})
    sides = {"ours": lambda a, r: run_ours(a, r), "TRL": lambda a, r: run_trl(a, path, r)}
    if args.padded:  # ours padded, right before ours packed (the default): before and after in the same blocks
        sides = {"ours padded": lambda a, r: run_ours(a, r, pack=False), **sides}
    for run in sides.values():
        quietly(lambda: run(warm, 0))()
    times, peaks = {side: [] for side in sides}, {side: [] for side in sides}
    print(f"{'block':>8} | {'side':>11} | {'load 1/5/15 min':>15} | {'s/step median':>13} | {'peak MiB':>8}")
    for r in range(args.repeats):
        for side, run in sides.items():
            load = wait_for_quiet(args.max_load, args.max_wait)
            torch.set_num_threads(args.threads)
            step_s, peak = measured(quietly(lambda: run(args, r)))
            times[side] += step_s
            peaks[side].append(peak)
            print(f"{r + 1:>3}/{args.repeats:<4} | {side:>11} | {load[0]:4.1f} {load[1]:4.1f} {load[2]:4.1f}  | "
                  f"{statistics.median(step_s):13.3f} | {peak:8.0f}", flush=True)

    compare_loss(args, path)
    print(f"\n{'side':>11} | {'s/RL step (median of ' + str(len(times['ours'])) + ')':>26} | {'min':>6} | "
          f"{'max':>6} | {'peak extra RSS MiB (median of blocks)':>37}")
    for side in sides:
        print(f"{side:>11} | {statistics.median(times[side]):26.3f} | {min(times[side]):6.3f} | "
              f"{max(times[side]):6.3f} | {statistics.median(peaks[side]):37.0f}")
    print(f"load average now: {' '.join(f'{x:.1f}' for x in os.getloadavg())} (1/5/15 min, {os.cpu_count()} cpus)")
    for side in sides:
        if side == "TRL":
            continue
        blocks = [statistics.median(times[side][i:i + args.steps]) / statistics.median(times["TRL"][i:i + args.steps])
                  for i in range(0, len(times[side]), args.steps)]  # each block against the same round's TRL block
        print(f"ratio {side}/TRL per block: {' '.join(f'{b:.3f}' for b in blocks)}")
        print(f"ratio {side}/TRL: {statistics.median(times[side]) / statistics.median(times['TRL']):.3f}")


if __name__ == "__main__":
    main()
