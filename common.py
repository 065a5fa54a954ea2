"""
What da3po.py and daro.py share: everything no equation of DA3PO or DARO points at. The answer verifier is a file of
its own (verifier.py), the rollout engines too (engine.py). Sections follow one run: the config, then one RL step in
the order the loop takes it, then evaluation, logging and checkpoints; each section uses only earlier ones.

   1. distributed (FSDP2), stop requests                      7. the step's batch (its contract), advantages
   2. config: the shared knobs, the baseline presets, flags   8. log-probs (pi, pi_old), chunked, for any model
   3. model and tokenizer (+ the demo model)                  9. micro-batches, the token losses, the update
   4. data and prompts                                       10. evaluation (avg@k, pass@k)
   5. the step's record (sums over micro-batches and ranks)  11. logging
   6. rollout: groups, rewards, dynamic sampling, the plan   12. checkpoints

Shapes in comments: B = completions on this rank, G = group size, N = groups (B = N * G), P = prompt tokens (left
padded), T = completion tokens (right padded), V = vocabulary size, H = hidden size.
"""
import argparse
import atexit
import contextlib
import datetime
import glob
import inspect
import json
import math
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from tqdm import tqdm
from transformers.utils import logging as hf_logging

from verifier import extract_answer, majority_vote, verify_batch

hf_logging.disable_progress_bar()  # transformers' load/save bars would interleave with our one line per step
# torch.distributed.checkpoint warns on every save and load of a plain run that it works in one process: it should
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


# -----------------------------------------------------------------------------------------------------------------
# 1. Distributed. A plain `python` run is world size 1 and none of this does anything; under torchrun the process
#    group comes from the environment (NCCL on GPUs, gloo on CPU) and the model is sharded with FSDP2. Lockstep rule:
#    every rank issues the same collectives in the same order, so a choice that changes them is made from the config
#    or agreed by an all-reduce (tests/test_lockstep.py records each rank's collectives to check it).
@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    is_main: bool = True


_launched = False  # set by setup_dist under torchrun (vLLM may open a 1-rank group of its own in a plain run)


def setup_dist(device: str = "") -> DistInfo:
    """Initialise torch.distributed when launched by torchrun; pick the device ("" = cuda if available, else cpu)."""
    global _launched
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return DistInfo(device=torch.device(device))
    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    # on GPUs NCCL for CUDA tensors and gloo for the CPU tensors of metrics and flags (NCCL rejects CPU tensors)
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    _launched = True
    return DistInfo(rank, local_rank, world, dev, rank == 0)


def cleanup_dist(engine=None):
    """Barrier (else gloo sometimes aborts at exit), close the engine (vLLM may destroy the group), destroy it."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    if engine is not None:
        engine.close()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_dist() -> bool:
    """True under torchrun (any world size, so one GPU still takes the FSDP2 path)."""
    return _launched and dist.is_available() and dist.is_initialized()


def print0(*args, **kwargs):
    if not is_dist() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a copy; identity in a single process)."""
    x = x.detach().clone()
    if is_dist():
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Maximum over ranks (a copy; identity in a single process)."""
    x = x.detach().clone().float()
    if is_dist():
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def all_gather_list(items: list) -> list:
    """Concatenate a picklable list from every rank, in rank order (identity in a single process)."""
    if not is_dist():
        return list(items)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, items)
    return [x for part in out for x in part]


_stop_signal = None  # set by the handler of SIGTERM / SIGINT


def handle_stop_signals():
    """SIGTERM (preemption; torchrun forwards it to every worker and kills them 30 s later) or Ctrl-C: the loop checks
    between generation batches, between updates and after each step, checkpoints at once and exits. A second Ctrl-C
    aborts."""
    global _stop_signal
    _stop_signal = None

    def handler(signum, frame):
        global _stop_signal
        if _stop_signal == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        _stop_signal = signum
        print(f"\nsignal {signal.Signals(signum).name}: checkpointing and stopping", flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def stop_requested() -> bool:
    """True on every rank once any rank got a stop signal (ranks leave the loop together)."""
    return all_reduce_sum(torch.tensor(float(_stop_signal is not None))).item() > 0


def shard_model(model, dist_info: DistInfo, dtype: str = "float32", grad_checkpointing: bool = False,
                cpu_offload: bool = False):
    """The model as the trainer uses it, on the device, in training mode (checkpointing only recomputes there;
    dropout is 0), with gradient checkpointing if asked; under torchrun sharded with FSDP2 (`fully_shard` per decoder
    layer and at the root). Weights stay float32 (the optimizer's master copy); with dtype bfloat16 FSDP gathers
    them as bf16 and reduces gradients in float32. Gradients are SUMMED over ranks: the loss weights already divide
    by the global token and sequence counts."""
    model.train()
    if grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not is_dist():
        return model.to(dist_info.device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    mesh = init_device_mesh(dist_info.device.type, (dist_info.world_size,))
    param_dtype = getattr(torch, dtype)  # gradients are reduced in float32, or in float64 for a float64 model
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.promote_types(param_dtype, torch.float32))
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    units = list(model.model.layers) + [model]  # one all-gather per layer keeps peak memory at about one layer
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp, offload_policy=offload)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM collectives: gloo has no pre-multiplied sum
    return model


def full_tensor(x: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a DTensor; every rank must call this), or the tensor itself."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def reshard(model):
    """Free the gathered copy of an FSDP2 root's parameters, which FSDP2 keeps after a forward for the backward that
    usually follows; after a no-grad forward none does. Local (no collective); a no-op without FSDP."""
    if hasattr(model, "reshard"):
        model.reshard()


def autocast(dtype: str, device: torch.device):
    """The compute-dtype context of the trainer's forward passes (a no-op in float32 and float64)."""
    return torch.autocast(device.type, getattr(torch, dtype), enabled=dtype in ("bfloat16", "float16"))


# -----------------------------------------------------------------------------------------------------------------
# 2a. The knobs both scripts share, written once; each script's Config adds its paper's own. Defaults run the CPU
#     demo; the papers' scale is in docs/gpu.md.
@dataclass
class TrainConfig:
    # run
    algo: str = ""  # preset (the script's PRESETS); explicit flags override the preset
    demo: str = "arith"  # the shipped demo the defaults run: arith (sums, answer only) | reasoning (a trace before
    #   the answer, wrong answers run long; sets --model, --train_data, --eval_data and 4 more flags: common.DEMOS)
    model: str = "demo"  # local Hugging Face folder, hub id, or 'demo' (the tiny shipped model, see demo/build.py)
    train_data: str = "arith"  # 'arith' (built-in sums) or a .jsonl/.json/.parquet file of problem/answer rows
    eval_data: str = "arith"  # same choices, comma-separated for several sets, each with its own k as set@k
    #   (aime24.jsonl@32,math500.jsonl@8; a set without @k gets --eval_samples); 'arith': 200 held-out sums
    out_dir: str = ""  # config.json, metrics.jsonl, samples.jsonl, checkpoints
    seed: int = 0  # init seed (same on every rank); sampling uses seed + rank
    steps: int = 60  # RL steps (one rollout batch each)
    device: str = ""  # '' = cuda if available, else cpu
    dtype: str = "float32"  # compute dtype: float32 | bfloat16 (weights and optimizer state stay float32)
    grad_checkpointing: bool = False  # recompute activations in backward (less memory, ~30% more compute)
    cpu_offload: bool = False  # FSDP2 (under torchrun): sharded parameters and optimizer state on the CPU
    # rollout
    prompts_per_step: int = 32  # groups trained on per step, across all ranks (train batch size in DAPO)
    group_size: int = 8  # G (K in DARO): completions per prompt
    dynamic_sampling: bool = True  # DAPO: keep only groups with 0 < #correct < G, refill from fresh prompts
    oversample: float = 1.5  # prompts generated per dynamic-sampling batch, as a multiple of prompts_per_step
    max_gen_batches: int = 4  # cap on generation batches per step; at the cap, warn and train on what was kept
    max_new_tokens: int = 12  # L_max: hard limit on completion length
    max_prompt_length: int = 1024  # prompts longer than this (tokens, template included) are dropped at load
    temperature: float = 1.0  # rollout sampling temperature
    top_p: float = 1.0  # rollout nucleus sampling
    rollout_batch_size: int = 512  # sequences per forward of our sampler (memory knob)
    rollout: str = "hf"  # rollout engine: hf (our sampler on the HF model) | vllm | auto (vLLM if usable)
    vllm_gpu_memory: float = 0.0  # vLLM's share of GPU memory; 0 = the most the trainer leaves (bench/memory.py)
    max_model_len: int = 0  # longest sequence vLLM keeps KV cache for; 0 = longest prompt + max_new_tokens
    vllm_cpu_kv_gb: float = 0.5  # vLLM on CPU: KV cache size in GiB
    rollout_is: str = "none"  # correct the engine/trainer mismatch: none | token | sequence (docs/gpu.md)
    rollout_is_cap: float = 2.0  # C: the weight pi_old / pi_rollout is truncated at C
    rollout_is_mask: bool = False  # reject tokens (sequences) whose weight is outside [1/C, C] instead
    prompt_template: str = "auto"  # chat | plain | dapo | none | auto (none for the demo, else chat if any)
    answer_format: str = "auto"  # where the verifier looks: boxed | answer_line | auto
    prompt_key: str = ""  # data field holding the problem ('' = try problem, question, prompt; dots for nested)
    answer_key: str = ""  # data field holding the answer ('' = try answer, final_answer, reward_model.ground_truth)
    # reward (DAPO)
    overlong_buffer: int = 4  # L_cache: penalty ramps from 0 at L_max - L_cache tokens to -1 at L_max; 0 = off
    overlong_penalty: float = 1.0  # penalty factor of the overlong shaping
    # advantages and loss
    std_norm: bool = True  # GRPO z-score advantage; off = Dr. GRPO (mean-centred only)
    loss_agg: str = "token-mean"  # token-mean (DAPO) | seq-mean-token-mean (GRPO) | seq-mean-token-sum-norm
    seq_ratio: bool = False  # GSPO: length-normalised sequence-level importance ratio
    clip_low: float = 0.2  # epsilon_low: ratio clipped below at 1 - clip_low
    clip_high: float = 0.28  # epsilon_high: ratio clipped above at 1 + clip_high (clip-higher)
    clip_ratio_c: float = 0.0  # dual clip for negative advantages (verl uses 3.0); 0 = off
    kl_coef: float = 0.0  # beta: k3 KL penalty to the initial model; 0 = none, as in DAPO
    # optimisation
    lr: float = 1e-4  # AdamW learning rate (the papers: 1e-6)
    weight_decay: float = 0.1  # AdamW weight decay (DAPO recipe)
    warmup_steps: int = 0  # linear learning-rate warm-up over this many RL steps (not optimizer updates), as verl
    grad_clip: float = 1.0  # max global gradient norm
    updates_per_step: int = 2  # optimizer updates (mini-batches) per RL step; the step's groups are split evenly
    micro_batch_size: int = 64  # sequences per forward/backward on one rank (memory knob; not the math)
    micro_batch_tokens: int = 0  # > 0: micro-batches packed by length up to this many tokens, ranks balanced
    logprob_chunk: int = 1024  # positions x rows whose logits exist at once (recomputed in backward); 0 = all
    # evaluation, logging, checkpoints
    eval_every: int = 10  # evaluate every N steps (also at step 0 and at the end); 0 = only at start and end
    eval_samples: int = 4  # k: completions per eval problem (avg@k, pass@k, maj@k) of the sets without @k
    eval_size: int = 0  # eval problems to use, spread evenly over each set (its mix of levels kept); 0 = all
    eval_temperature: float = 1.0  # eval sampling temperature
    eval_top_p: float = 1.0  # eval nucleus sampling (DAPO reports top_p 0.7)
    eval_batch_size: int = 128  # eval problems per generate call
    sample_every: int = 10  # write a few completions to samples.jsonl every N steps
    save_every: int = 0  # checkpoint every N steps (and at the end, and on a stop request); 0 = only at the end
    keep_last: int = 2  # checkpoints kept on disk (older ones are deleted)
    resume: bool = False  # continue from the latest checkpoint in out_dir
    max_bad_updates: int = 3  # stop the run after this many non-finite losses/gradients in a row (each is skipped)
    eval_only: bool = False  # evaluate --model on --eval_data and exit
    report_to: str = "none"  # also log to: none | tensorboard | wandb (requirements-tracking.txt)
    wandb_project: str = ""  # wandb project of --report_to wandb


# The baselines both papers compare against, each its paper's recipe written out for every knob that defines the
# algorithm; the scale (model, lr, batch sizes, lengths, overlong_buffer where shaping is on) comes from the flags.
_DAPO = {"dynamic_sampling": True, "std_norm": True, "loss_agg": "token-mean", "seq_ratio": False, "clip_low": 0.2,
         "clip_high": 0.28}  # clip-higher, token-mean, dynamic sampling (and overlong shaping: the default buffer)


BASELINES = {
    "dapo": _DAPO,
    # GRPO: z-scored advantages, per-sequence token mean, symmetric clip, no shaping, no dynamic sampling. No KL
    # term, as in DAPO, Dr. GRPO and GSPO, so that GRPO vs DAPO changes nothing else; verl's GRPO examples add a k3
    # KL loss to the initial model (--kl_coef 0.001 runs that), DeepSeekMath's beta was 0.04
    "grpo": {**_DAPO, "dynamic_sampling": False, "loss_agg": "seq-mean-token-mean", "clip_high": 0.2,
             "overlong_buffer": 0},
    # Dr. GRPO: mean-centred advantages, token sums over the constant L_max
    "dr_grpo": {**_DAPO, "dynamic_sampling": False, "std_norm": False, "loss_agg": "seq-mean-token-sum-norm",
                "clip_high": 0.2, "overlong_buffer": 0},
    # GSPO: the sequence ratio, its tiny clip range, and the rollout batch split into 4 mini-batches
    "gspo": {**_DAPO, "dynamic_sampling": False, "seq_ratio": True, "loss_agg": "seq-mean-token-mean",
             "clip_low": 3e-4, "clip_high": 4e-4, "overlong_buffer": 0, "updates_per_step": 4},
}


# --demo reasoning: the second shipped demo (demo/reasoning/README.md), as the flags it stands for. It applies before
# the --algo preset (GRPO's preset turns its overlong shaping off) and explicit flags override both.
DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")  # the shipped demos (demo/build.py)
_REASONING = os.path.join(DEMO_DIR, "reasoning")
DEMOS = {"arith": {},
         "reasoning": {"model": os.path.join(_REASONING, "model"),
                       "train_data": os.path.join(_REASONING, "train.jsonl"),
                       "eval_data": os.path.join(_REASONING, "eval.jsonl"),
                       "max_new_tokens": 72, "overlong_buffer": 16, "prompts_per_step": 16, "steps": 20}}


def presets(own: dict[str, dict], off: dict) -> dict[str, dict]:
    """A script's --algo presets: its own, then the baselines with its own algorithm switched off (`off`)."""
    return {**own, **{name: {**off, **recipe} for name, recipe in BASELINES.items()}}


# -----------------------------------------------------------------------------------------------------------------
# 2b. Flags from the Config; every user error (bad flag, file, data) ends in die(): one line naming the flag, file
#     or line, exit status 2, no traceback.
def die(message: str):
    """A user error: one line on stderr and exit status 2, no traceback."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _field_comments(cls) -> dict[str, str]:
    """Each Config field's trailing comment (and '#   more text' lines right below it), over the class and its bases,
    so that --help shows the text the code shows."""
    comments = {}
    for klass in reversed([c for c in cls.__mro__ if hasattr(c, "__dataclass_fields__")]):
        last = None
        for line in inspect.getsource(klass).splitlines():
            m = re.match(r"\s*(\w+)\s*:\s*[\w\[\], |]+\s*=\s*.*?#\s*(.*)$", line)
            if m:
                last = m.group(1)
                comments[last] = m.group(2).strip()
            elif last and re.match(r"\s*#\s{2,}\S", line):
                comments[last] += " " + line.strip().lstrip("#").strip()
            else:
                last = None
    return comments


def parse_config(cls, argv: list[str] | None = None, presets: dict[str, dict] | None = None):
    """Flags generated from a Config dataclass. Precedence: dataclass defaults < --demo < preset of --algo < explicit
    flags.

    Example: `--lr 1e-5`, `--lr=1e-5`, `--grad_checkpointing/--no-grad_checkpointing`; an unknown flag (or a prefix of
    one) exits with status 2 naming it. An explicit flag that changes a value its preset defines prints a note."""
    comments = _field_comments(cls)
    parser = argparse.ArgumentParser(
        prog=os.path.basename(sys.argv[0]), description=(cls.__doc__ or "").strip(), allow_abbrev=False)
    for f in fields(cls):
        help_text = f"{comments.get(f.name, '')} (default: {f.default!r})".replace("%", "%%")
        kw = dict(dest=f.name, default=argparse.SUPPRESS, help=help_text)  # SUPPRESS: only flags actually given
        if isinstance(f.default, bool):
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, **kw)
        else:
            parser.add_argument(f"--{f.name}", type=type(f.default), metavar=type(f.default).__name__.upper(), **kw)
    given = vars(parser.parse_args(argv))
    cfg = cls()
    demo = given.get("demo", cfg.demo)
    if demo not in DEMOS:
        parser.error(f"argument --demo: invalid choice {demo!r} (choose from {', '.join(DEMOS)})")
    if presets is not None:
        algo = given.get("algo", cfg.algo)
        if algo not in presets:
            parser.error(f"argument --algo: invalid choice {algo!r} (choose from {', '.join(presets)})")
        for k, v in presets[algo].items():  # a recipe knob changed by hand is allowed, but never silently
            if k in given and given[k] != v and os.environ.get("RANK", "0") == "0":
                print(f"note: --{k} {given[k]} overrides the {algo} preset's {k} = {v}", flush=True)
        given = {**presets[algo], **given}
    given = {**DEMOS[demo], **given}
    for k, v in given.items():
        setattr(cfg, k, v)
    return cfg


def config_dict(cfg, world_size: int = 1) -> dict:
    """The config actually used, plus the facts needed to reproduce a run (world size, versions, git commit)."""
    import transformers
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__)), timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {**asdict(cfg), "_world_size": world_size, "_torch": torch.__version__,
            "_transformers": transformers.__version__, "_git_commit": commit}


def parse_eval_data(eval_data: str, eval_samples: int) -> list[tuple[str, int]]:
    """--eval_data as (set, k) pairs: comma-separated sets, each optionally `@k`, its own samples per problem (avg@k,
    pass@k, maj@k); a set without `@k` gets --eval_samples. What follows the last '@' is a k unless it holds a '/' or
    a file extension ('x@y.jsonl' is a file). Example: 'aime24.jsonl@32,math500.jsonl', 4 -> [('aime24.jsonl', 32),
    ('math500.jsonl', 4)]."""
    out = []
    for item in (i.strip() for i in eval_data.split(",")):
        spec, at, suffix = item.rpartition("@")
        if not at or "/" in suffix or re.search(r"\.[A-Za-z]", suffix):
            spec, at, suffix = item, "", ""
        if not spec:
            die(f"--eval_data {eval_data!r}: an empty set name (write sets as a.jsonl,b.jsonl@32)")
        if at and not (suffix.isdigit() and int(suffix) >= 1):
            die(f"--eval_data {item!r}: the k after '@' must be a whole number >= 1 (e.g. aime24.jsonl@32)")
        out.append((spec, int(suffix) if at else eval_samples))
    return out


def check_config(cfg, world_size: int):
    """Flag combinations that cannot work stop here, naming the flag (exit 2), before anything is loaded."""
    choices = {"loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
               "dtype": ("float32", "bfloat16", "float16"),
               "prompt_template": ("auto", "chat", "plain", "dapo", "none"),
               "answer_format": ("boxed", "answer_line", "auto"), "rollout": ("hf", "vllm", "auto"),
               "rollout_is": ("none", "token", "sequence"), "report_to": ("none", "tensorboard", "wandb")}
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            die(f"--{name} {getattr(cfg, name)!r}: choose one of {', '.join(allowed)}")
    for name in ("steps", "eval_every", "save_every", "sample_every", "eval_size", "overlong_buffer",
                 "micro_batch_tokens", "logprob_chunk"):
        if getattr(cfg, name) < 0:
            die(f"--{name} must be >= 0, got {getattr(cfg, name)}")
    for name in ("prompts_per_step", "updates_per_step", "micro_batch_size", "max_new_tokens", "max_prompt_length",
                 "eval_samples", "max_gen_batches", "rollout_batch_size", "eval_batch_size", "keep_last",
                 "max_bad_updates"):
        if getattr(cfg, name) < 1:
            die(f"--{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.group_size < 2:
        die(f"--group_size must be >= 2 (advantages are relative to the group), got {cfg.group_size}")
    if cfg.cpu_offload and not is_dist():
        die("--cpu_offload needs FSDP2, which runs under torchrun: launch with torchrun --standalone "
            "--nproc_per_node=1 (one GPU) or more")
    if cfg.dtype == "float16" and not cfg.eval_only:
        die("--dtype float16 trains without loss scaling (small gradients underflow): use bfloat16, or float16 only "
            "with --eval_only")
    if cfg.prompts_per_step % world_size:
        die(f"--prompts_per_step {cfg.prompts_per_step} does not divide over {world_size} ranks")
    if cfg.updates_per_step > cfg.prompts_per_step // world_size:
        die(f"--updates_per_step {cfg.updates_per_step} is more than the {cfg.prompts_per_step // world_size} prompts "
            f"per rank (--prompts_per_step {cfg.prompts_per_step} over {world_size} ranks): an update needs a group")
    if os.path.exists(cfg.out_dir) and not os.path.isdir(cfg.out_dir):
        die(f"--out_dir {cfg.out_dir!r} is an existing file, not a folder")
    if cfg.overlong_buffer >= cfg.max_new_tokens:
        die(f"--overlong_buffer {cfg.overlong_buffer} must be below --max_new_tokens {cfg.max_new_tokens}")
    if cfg.rollout_is_cap <= 1:
        die(f"--rollout_is_cap must be > 1 (weights are kept in [1/cap, cap]), got {cfg.rollout_is_cap}")
    if cfg.oversample < 1:
        die(f"--oversample must be >= 1, got {cfg.oversample}")
    if not (cfg.temperature > 0 and 0 < cfg.top_p <= 1):
        die(f"--temperature must be > 0 and --top_p in (0, 1], got {cfg.temperature} and {cfg.top_p}")
    parse_eval_data(cfg.eval_data, cfg.eval_samples)  # a bad set@k stops here, before anything is loaded


# -----------------------------------------------------------------------------------------------------------------
# 3. Model and tokenizer. `--model demo` is a tiny Qwen3-style model with a character-level tokenizer, built in code,
#    warm-started on the arith task by demo/build.py (which says why its weights are shipped) and loaded through the
#    path a hub model takes, so the demo exercises the real code.
DEMO_MODEL = os.path.join(DEMO_DIR, "model")  # the warm-started demo model, shipped (demo/build.py makes it)
DEMO_EVAL = os.path.join(DEMO_DIR, "arith_eval.jsonl")  # 200 held-out sums in 5 calibrated difficulty levels
DEMO_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|user|>", "<|assistant|>"]
DEMO_CHARS = "0123456789+-*/=()[]., ?:;!'{}\\$^_|<>abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n"
DEMO_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<eos>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_demo_tokenizer():
    """One token per character, plus `\\boxed{` as one token (completions stay ~6 tokens while the model writes the
    final-answer format a real one does, so the demo goes through the real verifier); a fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(DEMO_SPECIALS)}
    for c in DEMO_CHARS:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")  # isolate every character
    tok.decoder = decoders.Fuse()  # decode by concatenation, no spaces inserted
    tok.add_special_tokens(DEMO_SPECIALS)
    tok.add_tokens([AddedToken("\\boxed{", normalized=False)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                 unk_token="<unk>", padding_side="left")
    hf.chat_template = DEMO_CHAT_TEMPLATE
    return hf


def build_demo_model(tok, hidden: int = 128, layers: int = 2, seed: int = 0):
    """A tiny Qwen3 (0.5M parameters at hidden 128, 2 layers); head_dim 32 is one vLLM's CPU backend accepts."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 64), head_dim=32,
                      max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


def model_path(name: str) -> str:
    """--model as a path or hub id; 'demo' is the shipped demo model (demo/model/)."""
    if name != "demo":
        return name
    if not os.path.isfile(os.path.join(DEMO_MODEL, "model.safetensors")):
        die(f"the demo model is missing from {DEMO_MODEL} (restore it from git, or rebuild it: python demo/build.py)")
    return DEMO_MODEL


def load_model(name: str, device: torch.device = torch.device("cpu"), dtype: str = "float32"):
    """A causal LM and its tokenizer (left padding) from a local Hugging Face folder or a hub id, with every dropout
    probability set to 0: the trainer runs in training mode, and a dropout mask would make its log-probs a random
    draw of another distribution than the one the rollout sampled from."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(name)
        config = AutoConfig.from_pretrained(name)
        for key, value in vars(config).items():  # attention_dropout, hidden_dropout, resid_pdrop, ...
            if re.search(r"(dropout|pdrop)$", key) and isinstance(value, float):
                setattr(config, key, 0.0)
        model = AutoModelForCausalLM.from_pretrained(name, config=config, dtype=getattr(torch, dtype)).to(device)
    except (OSError, ValueError) as e:  # a missing folder, an unknown hub id, or offline without a cached copy
        die(f"--model {name!r}: cannot load it ({str(e).splitlines()[0]})")
    for module in model.modules():  # dropout layers built with a hard-coded p
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    tok.padding_side = "left"
    if tok.pad_token_id is None:  # many base models ship no pad token; any id works since padding is masked out
        tok.pad_token = tok.eos_token
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


# -----------------------------------------------------------------------------------------------------------------
# 4a. Data files. A problem is a dict {"prompt": str, "answer": str, "level": int} (level 0 = unknown difficulty),
#     from the built-in arith task or from a .jsonl / .json / .parquet file in any of the schemas below.
ARITH_LEVELS = {1: (1, 1), 2: (2, 1), 3: (2, 2), 4: (3, 3)}  # level -> digits of the two operands of a sum


def arith_problems(seed: int, eval_per_level: int = 50, train_per_level: int = 4000) -> tuple[list[dict], list[dict]]:
    """The built-in task's training rows: sums whose operands have 1+1, 2+1, 2+2 and 3+3 digits (`level` 1-4 here),
    fixed by `seed`, and held-out sums disjoint from them (the pool demo/build.py calibrates the eval set from).
    Example: level 2 -> {"prompt": "47+3", "answer": "50", "level": 2}. Each level gives `train_per_level` rows
    (levels 1 and 2 have only 100 and 900 distinct sums, so theirs repeat). The eval set (demo/arith_eval.jsonl) has
    levels of its own: the demo model's pass-rate bands at the start, from about 97% (level 1) down to 1% (level 5)."""
    rng = random.Random(seed)
    train, evals = [], []
    for level, (da, db) in ARITH_LEVELS.items():
        lo_a, lo_b = (10 ** (da - 1) if da > 1 else 0), (10 ** (db - 1) if db > 1 else 0)
        if (10 ** da - lo_a) * (10 ** db - lo_b) <= 10_000:  # small levels: enumerate every pair
            pairs = [(a, b) for a in range(lo_a, 10 ** da) for b in range(lo_b, 10 ** db)]
            rng.shuffle(pairs)
        else:  # large levels: distinct random pairs
            seen, pairs = set(), []
            while len(pairs) < train_per_level + eval_per_level:
                ab = (rng.randrange(lo_a, 10 ** da), rng.randrange(lo_b, 10 ** db))
                if ab not in seen:
                    seen.add(ab)
                    pairs.append(ab)
        make = [{"prompt": f"{a}+{b}", "answer": str(a + b), "level": level} for a, b in pairs]
        n_eval = min(eval_per_level, len(make) // 5)  # level 1 has only 100 sums: hold out 20, learn from 80
        evals += make[:n_eval]
        train += [make[n_eval + i % (len(make) - n_eval)] for i in range(train_per_level)]
    rng.shuffle(train)
    return train, evals


def _field(row: dict, key: str):
    """row["a"]["b"] for key "a.b"; None when any part is missing."""
    for part in key.split("."):
        if not isinstance(row, dict) or part not in row:
            return None
        row = row[part]
    return row


def problem_from_row(row, where: str, prompt_key: str = "", answer_key: str = "") -> dict:
    """One problem from a row of any supported schema (keys tried in order unless given by flag):
      plain / MATH-500 / AIME / OpenR1-Math-220k   problem | question, answer | final_answer
      DAPO-Math-17k                                prompt (chat list, instruction included), reward_model.ground_truth
      GSM8K                                        question, answer ending in '#### <number>'
    `where` (file:line) goes into every error message."""
    if not isinstance(row, dict):
        die(f"{where}: expected a JSON object per row, got {type(row).__name__}")
    prompt = _field(row, prompt_key) if prompt_key else next(
        (row[k] for k in ("problem", "question", "prompt") if row.get(k) not in (None, "", [])), None)
    answer = _field(row, answer_key) if answer_key else next(
        (v for k in ("answer", "final_answer", "reward_model.ground_truth", "ground_truth")
         if (v := _field(row, k)) not in (None, "", [])), None)
    if prompt in (None, "", []):
        die(f"{where}: no problem text (looked for {prompt_key or 'problem, question, prompt'}; "
            f"row keys: {', '.join(sorted(row))}; set --prompt_key)")
    if answer in (None, "", []):
        die(f"{where}: no answer (looked for {answer_key or 'answer, final_answer, reward_model.ground_truth'}; "
            f"row keys: {', '.join(sorted(row))}; set --answer_key)")
    templated = isinstance(prompt, list)  # chat-format prompt (DAPO-Math-17k): use the user turn as written
    if templated:
        prompt = next((m.get("content", "") for m in reversed(prompt) if isinstance(m, dict)
                       and m.get("role") == "user"), "")
    if isinstance(answer, list):  # OlympiadBench stores final answers as a list
        answer = ", ".join(map(str, answer))
    answer = str(answer)
    if "####" in answer:  # GSM8K: the final number follows '####'
        answer = answer.rsplit("####", 1)[1].strip()
    level = row.get("level", 0)
    level = int(level) if isinstance(level, int) or (isinstance(level, str) and level.isdigit()) else 0
    return {"prompt": str(prompt), "answer": answer, "level": level, "templated": templated}


def _rows(path: str) -> list[tuple[str, object]]:
    """(where, row) pairs of a .jsonl, .json or .parquet file; a bad file dies naming the file and line."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".jsonl":
        rows = []
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append((f"{path}:{i}", json.loads(line)))
                    except json.JSONDecodeError as e:
                        die(f"{path}:{i}: not valid JSON ({e.msg})")
        return rows
    if ext == ".json":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            die(f"{path}:{e.lineno}: not valid JSON ({e.msg})")
        rows = data if isinstance(data, list) else data.get("data") if isinstance(data, dict) else None
        if not isinstance(rows, list):
            die(f"{path}: expected a list of rows (or {{\"data\": [...]}})")
        return [(f"{path}: row {i}", r) for i, r in enumerate(rows, 1)]
    if ext == ".parquet":
        try:
            import pyarrow.parquet as pq  # optional dependency, only for parquet files
        except ImportError:
            die(f"{path}: reading parquet needs pyarrow (pip install pyarrow)")
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a corrupt or truncated file
            die(f"{path}: not a readable parquet file ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
        return [(f"{path}: row {i}", r) for i, r in enumerate(rows, 1)]
    die(f"data file {path!r}: unknown extension {ext!r} (use .jsonl, .json or .parquet)")


def load_problems(path: str, prompt_key: str = "", answer_key: str = "") -> list[dict]:
    """Problem records from a .jsonl, .json or .parquet file; every error names the file and line (row)."""
    if not os.path.isfile(path):
        die(f"data file {path!r} not found (use 'arith' for the built-in task)")
    problems = [problem_from_row(row, where, prompt_key, answer_key) for where, row in _rows(path)]
    if not problems:
        die(f"data file {path!r} holds no rows")
    return problems


def load_data(spec: str, split: str, prompt_key: str = "", answer_key: str = "") -> list[dict]:
    """`arith` (the built-in task, split 'train' or 'eval'), a local .jsonl/.json/.parquet file, or a hub dataset
    name (`name` or `name:split`) when the optional `datasets` package is installed and the machine is online."""
    if spec == "arith":  # the task is fixed; --seed changes the order of the training rows, not the rows
        return arith_problems(seed=0)[0] if split == "train" else load_problems(DEMO_EVAL)
    if os.path.exists(spec) or spec.endswith((".jsonl", ".json", ".parquet")):
        return load_problems(spec, prompt_key, answer_key)
    name, _, hub_split = spec.partition(":")
    try:
        import datasets
    except ImportError:
        die(f"data {spec!r}: no such file, and loading hub datasets needs `pip install datasets`")
    try:
        rows = datasets.load_dataset(name, split=hub_split or "train")
    except Exception as e:  # datasets raises many types (offline, missing, bad split); the message says which
        die(f"data {spec!r}: cannot load it from the hub ({str(e).splitlines()[0]})")
    return [problem_from_row(r, f"{spec}: row {i}", prompt_key, answer_key) for i, r in enumerate(rows, 1)]


# -----------------------------------------------------------------------------------------------------------------
# 4b. Prompts: the template that turns a problem into the text the model sees, tokenized once at load; eval sets
#     with unique names; the seeded stream of training prompts.
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


DAPO_TEMPLATE = ("Solve the following math problem step by step. The last line of your response should be of the form "
                 "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
                 "Remember to put your answer on its own line after \"Answer:\".")  # DAPO-Math-17k's own wording


def format_prompt(tok, problem: str, template: str = "chat") -> str:
    """The text the model sees, by --prompt_template:
      chat   the problem + "put your final answer within \\boxed{}", in the tokenizer's chat template (if it has one)
      plain  'Question: ... <boxed request> Answer:' without chat markup (base models without a chat template)
      dapo   DAPO-Math-17k's wording (final line 'Answer: ...'), in the chat template if there is one
      none   the problem text alone, in the chat template if there is one (the demo model; pre-templated rows)"""
    text = {"chat": f"{problem}\n{BOXED_INSTRUCTION}", "plain": f"Question: {problem}\n{BOXED_INSTRUCTION}\nAnswer:",
            "dapo": DAPO_TEMPLATE.format(problem=problem), "none": problem}[template]
    if template != "plain" and getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return text


def resolve_template(template: str, tok) -> str:
    """--prompt_template auto: none for the demo model and its checkpoints (recognised by their chat template), chat
    when the tokenizer has a chat template, else plain."""
    if template != "auto":
        return template
    chat = getattr(tok, "chat_template", None)
    return "none" if chat == DEMO_CHAT_TEMPLATE else "chat" if chat else "plain"


def tokenize_problems(problems: list[dict], tok, template: str, max_prompt_length: int, name: str) -> list[dict]:
    """Format and tokenize every prompt once, at load, adding "prompt_ids"; drop the problems whose prompt is longer
    than max_prompt_length tokens, with a warning (as verl does): one 6,000-token problem would pad a whole generation
    batch to its length."""
    kept = []
    for p in problems:
        text = format_prompt(tok, p["prompt"], "none" if p.get("templated") else template)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= max_prompt_length:
            kept.append({**p, "prompt_ids": ids})
    if not kept:
        die(f"{name}: every one of its {len(problems)} prompts is longer than --max_prompt_length {max_prompt_length}")
    if len(kept) < len(problems):
        print0(f"warning: {name}: dropped {len(problems) - len(kept)} of {len(problems)} problems whose prompt is "
               f"longer than --max_prompt_length {max_prompt_length} tokens")
    return kept


def eval_set_names(specs: list[str]) -> list[str]:
    """A unique name per eval set, for its eval/<name>/... keys: the file's stem, or, when two sets share a stem, the
    shortest tail of their paths that tells them apart. Example: a/x.jsonl, b/x.jsonl -> a-x, b-x."""
    parts = [os.path.splitext(os.path.normpath(s))[0].split(os.sep) for s in specs]
    names = []
    for i, p in enumerate(parts):
        depth = 1
        while depth < len(p) and any(q[-depth:] == p[-depth:] for j, q in enumerate(parts) if j != i):
            depth += 1
        names.append("-".join(p[-depth:]))
    return [n if names.count(n) == 1 else f"{n}-{i}" for i, n in enumerate(names)]  # identical paths given twice


def spread(problems: list[dict], n: int) -> list[dict]:
    """n problems spread evenly over the list, so that a smaller eval set keeps the whole set's mix of levels (files
    such as demo/arith_eval.jsonl are sorted by level); all of them when n is 0 or too large."""
    if not n or n >= len(problems):
        return problems
    return [problems[i * len(problems) // n] for i in range(n)]


def load_datasets(cfg) -> tuple[list[dict], dict[str, list[dict]]]:
    """--train_data and every --eval_data set (named by eval_set_names, --eval_size of them spread over the set), not
    yet tokenized: a bad file fails here, in a second, before any model is loaded."""
    train = load_data(cfg.train_data, "train", cfg.prompt_key, cfg.answer_key)
    specs = [spec for spec, _ in parse_eval_data(cfg.eval_data, cfg.eval_samples)]  # names leave out the @k
    evals = {name: spread(load_data(spec, "eval", cfg.prompt_key, cfg.answer_key), cfg.eval_size)
             for name, spec in zip(eval_set_names(specs), specs)}
    return train, evals


def tokenize_datasets(train: list[dict], evals: dict[str, list[dict]], tok, cfg):
    """tokenize_problems on the training set and every eval set with --prompt_template (auto resolved for `tok`);
    resolves --max_model_len 0 to the longest prompt + --max_new_tokens."""
    cfg.prompt_template = resolve_template(cfg.prompt_template, tok)
    train = tokenize_problems(train, tok, cfg.prompt_template, cfg.max_prompt_length, cfg.train_data)
    specs = [spec for spec, _ in parse_eval_data(cfg.eval_data, cfg.eval_samples)]
    evals = {name: tokenize_problems(problems, tok, cfg.prompt_template, cfg.max_prompt_length, spec)
             for (name, problems), spec in zip(evals.items(), specs)}
    longest = max(len(p["prompt_ids"]) for problems in (train, *evals.values()) for p in problems)
    cfg.max_model_len = cfg.max_model_len or longest + cfg.max_new_tokens
    return train, evals


class PromptStream:
    """Endless, seeded stream of training problems: reshuffled every epoch; `position` is all a resume needs."""

    def __init__(self, problems: list[dict], seed: int, position: int = 0):
        self.problems, self.seed, self.position = problems, seed, position

    def next(self, n: int) -> list[dict]:
        """The next n problems (the same on every rank; each rank then takes its stride)."""
        out = []
        for _ in range(n):
            epoch, i = divmod(self.position, len(self.problems))
            if getattr(self, "_epoch", None) != epoch:  # new epoch: a fresh permutation, seeded by (seed, epoch)
                self._order = list(range(len(self.problems)))
                random.Random(self.seed * 100_003 + epoch).shuffle(self._order)
                self._epoch = epoch
            out.append(self.problems[self._order[i]])
            self.position += 1
        return out


# -----------------------------------------------------------------------------------------------------------------
# 5. The step's record: numbers summed over micro-batches and updates on each rank, then over ranks in one
#    all-reduce (Sums), and the seconds of each phase (StepTimer). The loop turns them into one metrics.jsonl record.
class Sums:
    """Named sums of per-micro-batch and per-update numbers on this rank; reduce() sums each over all ranks in one
    all-reduce (every rank holds the same names: the fixed list given at creation)."""

    def __init__(self, *names: str):
        self.sums = dict.fromkeys(names, 0.0)

    def add(self, **values: float):
        for name, value in values.items():
            self.sums[name] += float(value)

    def reduce(self) -> dict:
        totals = all_reduce_sum(torch.tensor(list(self.sums.values())))  # float32, like every logged sum
        return dict(zip(self.sums, totals.tolist()))


TRAIN_SUMS = ("loss", "entropy", "clip_low", "clip_high", "grad_norm", "tokens", "skipped", "logprob_diff", "kl_k1",
              "kl_k3", "compared", "boundary", "forward_tokens", "real_tokens")


class StepTimer:
    """Seconds spent in each phase of a step: `with timer("rollout"): ...`; metrics() gives time/<phase>_s and
    time/step_s (the whole step so far)."""

    def __init__(self):
        self.start, self.seconds = time.time(), {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.time()
        yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.time() - t0

    def metrics(self) -> dict:
        return {**{f"time/{k}_s": v for k, v in self.seconds.items()}, "time/step_s": time.time() - self.start}


# -----------------------------------------------------------------------------------------------------------------
# 6. Rollout: G completions per prompt from the engine (engine.py), verified (verifier.py) and rewarded (DAPO's
#    shaped reward); DAPO's dynamic sampling keeps the groups whose correctness is mixed and refills from fresh
#    prompts, up to a cap.
def pad_prompt_completion(prompts: list[list[int]], completions: list[list[int]], pad_id: int, min_width: int = 1):
    """Left-pad prompts to P and right-pad completions to T >= min_width; returns input_ids (B, P+T), attention_mask
    (B, P+T) and the completion mask (B, T) (1 = a real completion token, the final eos included)."""
    P, T = max(map(len, prompts)), max(min_width, max(map(len, completions)))
    ids = torch.tensor([[pad_id] * (P - len(p)) + p + c + [pad_id] * (T - len(c))
                        for p, c in zip(prompts, completions)], dtype=torch.long)  # (B, P+T), one tensor built
    attn = torch.tensor([[0] * (P - len(p)) + [1] * (len(p) + len(c)) + [0] * (T - len(c))
                         for p, c in zip(prompts, completions)], dtype=torch.long)  # (B, P+T)
    return ids, attn, attn[:, P:].clone()


def shaped_reward(correct: bool, length: int, max_new_tokens: int, overlong_buffer: int,
                  overlong_penalty: float = 1.0) -> float:
    """DAPO's reward: +1 correct, -1 otherwise, plus the soft overlong punishment, which falls linearly from 0 at
    `max_new_tokens - overlong_buffer` tokens to -overlong_penalty at `max_new_tokens` (DAPO, Sec. 3.4)."""
    reward = 1.0 if correct else -1.0
    expected = max_new_tokens - overlong_buffer
    if overlong_buffer > 0 and length > expected:
        reward += max(-(length - expected) / overlong_buffer, -1.0) * overlong_penalty
    return reward


def roll_groups(engine, tok, problems: list[dict], cfg, G: int, temperature: float, top_p: float,
                seed: int | None = None):
    """G completions for each problem, verified and rewarded. One group = one prompt: {"prompt_ids", "completions" (G
    lists of ids), "texts", "truncated", "correct" (G bools), "reward" (G floats), "answer", "level", "prompt",
    "rollout_logp" (G lists: the engine's log-probs of its samples, or None)}. `seed`: evaluation (the engine seeds
    each request). Returns (groups, the verifier's info: timeouts, symbolic comparisons, cache hits, its seconds)."""
    prompt_ids = [p["prompt_ids"] for p in problems]  # tokenized once at load (tokenize_problems)
    completions, truncated, logps = engine.generate(prompt_ids, cfg.max_new_tokens, temperature, top_p, G, seed)
    texts = tok.batch_decode(completions, skip_special_tokens=True)
    t0 = time.perf_counter()
    correct, info = verify_batch(texts, [p["answer"] for p in problems for _ in range(G)], cfg.answer_format)
    info["seconds"] = time.perf_counter() - t0
    groups = []
    for i, p in enumerate(problems):
        s = slice(i * G, (i + 1) * G)
        rewards = [shaped_reward(c, len(ids), cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
                   for c, ids in zip(correct[s], completions[s])]
        groups.append({"prompt": p["prompt"], "answer": p["answer"], "level": p.get("level", 0),
                       "prompt_ids": prompt_ids[i], "completions": completions[s], "texts": texts[s],
                       "truncated": truncated[s], "correct": correct[s], "reward": rewards,
                       "rollout_logp": None if logps is None else logps[s]})
    return groups, info


def _mixed(group: dict) -> bool:
    """The groups DAPO keeps: 0 < #correct < G (correctness, never the shaped reward)."""
    return 0 < sum(group["correct"]) < len(group["correct"])


def _summary(group: dict, rank: int, index: int) -> dict:
    """What the other ranks need of a group to filter, count and plan it (no token ids, texts or log-probs), and where
    it lives: (the rank that generated it, its index there)."""
    return {"origin": (rank, index), "prompt": group["prompt"], "answer": group["answer"],
            "correct": group["correct"], "reward": group["reward"], "truncated": group["truncated"],
            "lengths": [len(c) for c in group["completions"]], "prompt_len": len(group["prompt_ids"])}


def dynamic_sampling(engine, tok, stream: PromptStream, cfg, dist_info: DistInfo):
    """DAPO's dynamic sampling: roll out batches of fresh prompts (oversample x prompts_per_step, each rank its stride),
    keep the groups whose correctness is mixed, until prompts_per_step are kept across all ranks or max_gen_batches
    batches were generated; then keep exactly prompts_per_step (at the cap: what was kept, a multiple of the world size,
    possibly none, with a warning; it never raises and never loops forever). --no-dynamic_sampling: one batch, all kept.
    Each group stays on the rank that generated it; every rank gets every group's _summary. A stop request between
    batches ends the rollout: it then returns None.
    Returns (the kept groups' summaries, every generated group's summary, the step's rollout metrics); the kept
    summaries of this rank's groups carry the group itself under "group"."""
    rank, world = dist_info.rank, dist_info.world_size
    oversample = cfg.oversample if cfg.dynamic_sampling else 1
    batch_groups = math.ceil(cfg.prompts_per_step * oversample / world) * world  # prompts per generation batch
    max_batches = cfg.max_gen_batches if cfg.dynamic_sampling else 1
    local, kept, generated, n_batches, timeouts, verify_s = [], [], [], 0, 0, 0.0
    while len(kept) < cfg.prompts_per_step and n_batches < max_batches:
        if n_batches and stop_requested():
            return None
        mine, info = roll_groups(engine, tok, stream.next(batch_groups)[rank::world], cfg, cfg.group_size,
                                 cfg.temperature, cfg.top_p)
        summaries = all_gather_list([_summary(g, rank, len(local) + i) for i, g in enumerate(mine)])
        local += mine
        timeouts, verify_s = timeouts + info["timeouts"], verify_s + info["seconds"]
        n_batches += 1
        generated += summaries
        kept += [g for g in summaries if not cfg.dynamic_sampling or _mixed(g)]
    if len(kept) < cfg.prompts_per_step:
        usable = len(kept) - len(kept) % world  # an equal share per rank keeps FSDP's collectives in lockstep
        print0(f"warning: dynamic sampling kept {len(kept)}/{cfg.prompts_per_step} groups after {n_batches} generation "
               f"batches (--max_gen_batches); training on " + (f"all {usable}" if usable == len(kept) else
                                                              f"{usable} (a multiple of the {world} ranks)"))
    kept = kept[:min(cfg.prompts_per_step, len(kept) - len(kept) % world)]
    for g in kept:
        if g["origin"][0] == rank:
            g["group"] = local[g["origin"][1]]
    rewards = [r for g in generated for r in g["reward"]]
    correct = [c for g in generated for c in g["correct"]]
    truncated = [t for g in generated for t in g["truncated"]]
    lengths = [n for g in generated for n in g["lengths"]]
    stats = {"train/reward": sum(rewards) / len(rewards), "train/acc": sum(correct) / len(correct),
             "train/keep_rate": sum(map(_mixed, generated)) / len(generated),
             "train/num_gen_batches": n_batches, "train/num_groups": len(kept), "train/num_completions": len(lengths),
             "train/response_len": sum(lengths) / len(lengths), "train/truncated_frac": sum(truncated) / len(truncated),
             "verify/timeouts": all_reduce_sum(torch.tensor(float(timeouts))).item(),
             "time/verify_s": verify_s}  # this rank's; it is part of time/rollout_s
    return kept, generated, stats


# -----------------------------------------------------------------------------------------------------------------
# 7. The step's batch: plan_updates splits the kept groups into the step's updates and brings each rank its own;
#    make_batch makes them padded tensors, the one dict the update reads; its advantages; its micro-batches. Its
#    contract, every key with its shape (B rows: this rank's groups x G) and who writes it:
#      input_ids, attention_mask  (B, P+T)  make_batch          prompt (left padded) + completion (right padded)
#      mask                       (B, T)    make_batch          1 = a completion token the loss counts; zeroed for
#                                                               tokens rollout_correction rejects, and in daro.py for
#                                                               the groups of bins 0 and G
#      reward, correct            (B,)      make_batch          DAPO's shaped reward; the verifier's verdict
#      group                      (B,)      make_batch          which of this rank's groups (prompts) a row belongs to
#      rollout_logp               (B, T)    make_batch          the engine's log-probs, when they are not pi_old
#      advantage                  (B,)      the script          GRPO advantage (group_advantages) [x DAA]
#      old_logp                   (B, T)    old_logprobs        pi_old [+ old_logp_nucleus with top_p < 1]
#      is_weight                  (B, T)    rollout_correction  the truncated pi_old / pi_rollout (--rollout_is)
#      weight                     (B, T)    the script          each token's share of its update's loss
#      bin                        (B,)      daro.py             #correct of the row's group (mu = bin / G)
def group_tokens(group: dict) -> int:
    """Tokens a group (or its _summary) puts through the trainer: its G prompt + completion rows."""
    return sum(group["prompt_len"] + n for n in group["lengths"])


def plan_updates(kept: list[dict], num_updates: int, dist_info: DistInfo, balance: bool = False):
    """Which groups this rank trains in each optimizer update of the step, brought to it. The kept groups (the same
    summaries on every rank, a multiple of the world size) are cut into min(num_updates, groups / world) contiguous
    updates whose sizes are multiples of the world size and differ by at most one group per rank: every group is
    trained once and no update is empty, also at the sampling cap. Inside an update every rank takes as many groups:
    every world-th one, or with `balance` the heaviest first, each to the rank with the fewest tokens so far. Every
    rank computes the whole plan from the summaries; each rank then sends the others the groups it generated that
    they train (one scatter per rank).
    Returns (this rank's groups in update order, the row indices of each update into make_batch of those groups).
    Example, one rank, G = 8: 13 groups, 2 updates -> rows 0-55 (7 groups) and 56-103 (6)."""
    world, rank, G = dist_info.world_size, dist_info.rank, len(kept[0]["correct"])
    blocks = len(kept) // world  # groups per rank
    n = min(num_updates, blocks)
    plan, start = [[] for _ in range(world)], 0  # plan[r]: the kept indices rank r trains, in update order
    sizes = []
    for i in range(n):
        size = (blocks // n + (i < blocks % n)) * world
        part, start = list(range(start, start + size)), start + size
        if balance and world > 1:
            shares, load = [[] for _ in range(world)], [0] * world
            for j in sorted(part, key=lambda j: group_tokens(kept[j]), reverse=True):  # stable: the same on all ranks
                r = min((r for r in range(world) if len(shares[r]) < size // world), key=lambda r: load[r])
                shares[r].append(j)
                load[r] += group_tokens(kept[j])
        else:
            shares = [part[r::world] for r in range(world)]
        for r in range(world):
            plan[r] += shares[r]
        sizes.append(size // world)
    mine = [kept[j].get("group", kept[j]) for j in plan[rank]]  # (a test may plan whole groups, for any rank)
    if is_dist():  # from each rank in turn, the groups it generated to the ranks that train them
        for src in range(world):
            send = None  # what src sends each rank: the groups src generated that the rank trains
            if rank == src:
                send = [[kept[j]["group"] for j in plan[r] if kept[j]["origin"][0] == src] for r in range(world)]
            got = [None]
            dist.scatter_object_list(got, send, src=src)
            arrived = iter(got[0])
            mine = [next(arrived) if kept[j]["origin"][0] == src else g for j, g in zip(plan[rank], mine)]
    bounds = [0] + [sum(sizes[:i + 1]) * G for i in range(len(sizes))]
    return mine, [torch.arange(a, b) for a, b in zip(bounds, bounds[1:])]


def make_batch(groups: list[dict], pad_id: int, device: torch.device = torch.device("cpu")) -> dict:
    """Flatten groups into the padded tensors of the batch's contract (above) on `device`."""
    prompts = [g["prompt_ids"] for g in groups for _ in g["completions"]]
    completions = [c for g in groups for c in g["completions"]]
    ids, attn, mask = pad_prompt_completion(prompts, completions, pad_id, min_width=2)  # 2: see _predicting_outputs
    batch = {"input_ids": ids, "attention_mask": attn, "mask": mask,
             "reward": torch.tensor([r for g in groups for r in g["reward"]]),
             "correct": torch.tensor([c for g in groups for c in g["correct"]], dtype=torch.bool),
             "group": torch.tensor([i for i, g in enumerate(groups) for _ in g["completions"]])}
    if groups[0].get("rollout_logp") is not None:  # padded to T
        batch["rollout_logp"] = torch.tensor([lp + [0.0] * (mask.shape[1] - len(lp)) for g in groups
                                              for lp in g["rollout_logp"]])
    return {k: v.to(device) for k, v in batch.items()}


def group_advantages(rewards: torch.Tensor, std_norm: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's advantage of each completion from its group's rewards (N, G): (r - mean) / (std + eps), the unbiased
    std as verl computes it; Dr. GRPO drops the std (std_norm=False). Example: [1, -1, -1, 1] -> [0.866, -0.866,
    -0.866, 0.866]."""
    assert rewards.shape[-1] > 1, "group_size must be > 1 for group-relative advantages"
    centered = rewards - rewards.mean(-1, keepdim=True)
    return centered / (rewards.std(-1, keepdim=True) + eps) if std_norm else centered


def completion_lengths(batch: dict, rows: torch.Tensor) -> torch.Tensor:
    """Each row's completion length (len(rows),): its real tokens, counted on the attention mask. Not on the loss
    mask: the tokens rollout_correction rejects (and DARO's bins 0 and G) are holes in it, but still in the sequence,
    and a trained token after a hole must stay in the micro-batch."""
    P = batch["input_ids"].shape[1] - batch["mask"].shape[1]
    return batch["attention_mask"][rows, P:].sum(-1)


def _packed_rows(batch: dict, index: torch.Tensor, size: int, max_tokens: int) -> list[torch.Tensor]:
    """The rows `index` cut into micro-batches. max_tokens = 0: chunks of `size` rows in order. Otherwise packed by
    length: rows sorted longest first, each micro-batch filled while its padded size (rows x (longest prompt + longest
    completion)) stays within max_tokens and it has at most `size` rows; then every rank splits its largest
    micro-batches until all make as many as the busiest one (FSDP's collectives must match; the ranks' row counts are
    equal, so it is always possible)."""
    if max_tokens <= 0:
        return [index[s:s + size] for s in range(0, len(index), size)]
    P = batch["input_ids"].shape[1] - batch["mask"].shape[1]
    prompt_len = batch["attention_mask"][index, :P].sum(-1).tolist()
    completion_len = completion_lengths(batch, index).tolist()
    order = sorted(range(len(index)), key=lambda i: -(prompt_len[i] + completion_len[i]))
    chunks, width = [], (0, 0)  # width: the longest prompt and completion of the current chunk
    for i in order:
        wider = (max(width[0], prompt_len[i]), max(width[1], completion_len[i]))
        if not chunks or (len(chunks[-1]) + 1) * sum(wider) > max_tokens or len(chunks[-1]) >= size:
            chunks.append([])
            wider = (prompt_len[i], completion_len[i])
        chunks[-1].append(i)
        width = wider
    count = int(all_reduce_max(torch.tensor(float(len(chunks)))).item())  # no rows (all ranks alike): 0
    assert chunks or not count, "a rank with no rows where another has some: plan_updates gives every rank as many"
    while len(chunks) < count:
        k = max(range(len(chunks)), key=lambda j: len(chunks[j]))
        chunks[k:k + 1] = [chunks[k][:len(chunks[k]) // 2], chunks[k][len(chunks[k]) // 2:]]
    return [index[torch.tensor(c, dtype=torch.long)] for c in chunks]


def micro_batches(batch: dict, index: torch.Tensor, size: int, max_tokens: int = 0):
    """The rows `index` of `batch` in micro-batches (_packed_rows), each with the padding columns empty in it trimmed
    away (the loss weights are global, so results are unchanged). Yields (rows, micro-batch)."""
    for rows in _packed_rows(batch, index, size, max_tokens):
        mb = {k: v[rows] for k, v in batch.items()}
        T = int(completion_lengths(batch, rows).max().clamp(min=2))  # longest completion, >= 2 (_predicting_outputs)
        P = batch["input_ids"].shape[1] - batch["mask"].shape[1]
        first = int((mb["attention_mask"][:, :P].cumsum(-1) == 0).sum(-1).min())  # left padding shared by all rows
        for k in ("input_ids", "attention_mask"):
            mb[k] = mb[k][:, first:P + T]
        for k, v in mb.items():
            if v.dim() == 2 and k not in ("input_ids", "attention_mask"):
                mb[k] = v[:, :T]
        yield rows, mb


# -----------------------------------------------------------------------------------------------------------------
# 8a. Any model's output layer: what a family's forward does to the result of its output layer, so that log-probs
#     computed a chunk of positions at a time (token_logprobs) are that forward's own.
def nucleus(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Log-probs (..., V) with the tokens outside the top_p nucleus set to -inf (not renormalised): the tokens whose
    cumulative probability from the least likely up stays <= 1 - top_p are dropped, the most likely always kept."""
    sorted_logp, order = logp.sort(-1)  # ascending
    drop = sorted_logp.exp().cumsum(-1) <= 1 - top_p
    drop[..., -1] = False
    return logp.scatter(-1, order, sorted_logp.masked_fill(drop, float("-inf")))


OUTSIDE_NUCLEUS = -1e4  # the nucleus log-prob of a token outside the nucleus: not -inf, so that a masked-out
#   padding token multiplies to 0, not NaN; mismatch_sums leaves such tokens out of the engine/trainer gap


def _logprobs_of_logits(logits, targets, temperature: float, with_entropy: bool, top_p: float = 1.0):
    """Logits (B, t, V) -> log-probs (B, t) of the targets at this temperature, and a second (B, t) output (no grad):
    the token entropy with with_entropy, else with top_p < 1 the targets' log-probs renormalised over the top_p
    nucleus (what a sampler returns for what it drew from it: sample_token, vLLM), else None."""
    if logits.dtype in (torch.float16, torch.bfloat16):  # softmax in float32 at least (float64 stays float64)
        logits = logits.float()
    if temperature != 1.0:  # the sampling distribution was at this temperature (as verl does)
        logits = logits / temperature
    lse = logits.logsumexp(-1)  # (B, t)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # (B, t)
    entropy_or_nucleus_logp = None
    if with_entropy:  # H = lse - sum_v p_v logit_v, the sum as a batched dot: one (B, t, V) tensor less than p * logits
        with torch.no_grad():
            entropy_or_nucleus_logp = lse - (logits.softmax(-1).unsqueeze(-2) @ logits.unsqueeze(-1))[..., 0, 0]
    elif top_p < 1:  # a target outside the nucleus gets OUTSIDE_NUCLEUS
        with torch.no_grad():
            nucleus_logp = nucleus(logits.log_softmax(-1), top_p).log_softmax(-1)  # (B, t, V)
            entropy_or_nucleus_logp = nucleus_logp.gather(-1, targets[..., None])[..., 0].clamp(min=OUTSIDE_NUCLEUS)
    return logp, entropy_or_nucleus_logp


def _softcap(logits, cap):
    """Gemma's final logit soft-capping, as its forwards write it (cap None: none)."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _vocab_cut(logits, size):
    """Inkling's cut of its padded vocabulary (size None: none)."""
    return logits if size is None or size >= logits.shape[-1] else logits[..., :size]


# What a family's forward does to its output layer's result before returning it as logits, by config.model_type: a
# survey of every ...ForCausalLM in transformers 5.19 (tests/test_heads.py checks each family). By family, not by
# config attribute: Granite divides its logits by `logits_scaling`, HyperCLOVAX multiplies them by it, MiniCPM3
# divides the hidden state before its output layer by it. What a forward does before its output layer needs no
# entry (_head_inputs_as_logits records the layer's input); a family that does something else after it is refused
# at start-up (check_chunked_logprobs).
_LOGIT_TRANSFORMS = {
    **dict.fromkeys(["gemma2", "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text", "vaultgemma",
                     "nanochat"], lambda model, x: _softcap(x, model.config.final_logit_softcapping)),
    **dict.fromkeys(["gemma3n", "gemma4", "gemma4_unified"],  # their multimodal ...ForConditionalGeneration
                    lambda model, x: _softcap(x, model.config.get_text_config().final_logit_softcapping)),
    "recurrent_gemma": lambda model, x: _softcap(x, model.config.logits_soft_cap),
    **dict.fromkeys(["cohere", "cohere2", "cohere2_moe", "cohere_compass_text", "cohere_compass"],
                    lambda model, x: x if model.logit_scale is None else x * model.logit_scale),
    **dict.fromkeys(["granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared", "granitemoehybrid"],
                    lambda model, x: x / model.config.logits_scaling),
    "hyperclovax": lambda model, x: x * model.config.logits_scaling,
    "falcon_h1": lambda model, x: x * model.model.lm_head_multiplier,
    "inkling_text": lambda model, x: _vocab_cut(x, model.config.unpadded_vocab_size),
    **dict.fromkeys(["blt", "mllama_text_model", "nemotron_h"], lambda model, x: x.float()),
}


def head_logits(model, head, hidden):
    """The logits `model`'s forward returns for `hidden` (B, t, H), the input of its output layer `head`: the layer
    itself (the module, so a wrapped or LoRA'd head works too), then what the family's forward does to its result."""
    transform = _LOGIT_TRANSFORMS.get(getattr(model.config, "model_type", None))
    logits = head(hidden)
    return logits if transform is None else transform(model, logits)


def _chunk_logprobs(model, head, hidden, targets, temperature: float, with_entropy: bool, top_p: float):
    """head_logits and _logprobs_of_logits on a chunk of positions: hidden (B, t, H) -> (B, t)."""
    return _logprobs_of_logits(head_logits(model, head, hidden), targets, temperature, with_entropy, top_p)


def _model_name(model) -> str:
    """The model's class name (FSDP2 makes the module an instance of its subclass FSDP<name>)."""
    return next(c.__name__ for c in type(model).__mro__ if not c.__module__.startswith("torch."))


@contextlib.contextmanager
def _head_forward(head, forward):
    """Inside, head(x) runs forward(x) (an instance attribute shadows the class's forward; one already there is put
    back after)."""
    saved = head.__dict__.get("forward")
    head.forward = forward
    try:
        yield
    finally:
        if saved is None:
            del head.forward
        else:
            head.forward = saved


@contextlib.contextmanager
def _head_inputs_as_logits(model, head):
    """Inside, the model's forward returns, where its logits would be, the input of its output layer: the hidden state
    (B, t, H) as the forward feeds its head, for token_logprobs to apply head_logits a chunk at a time. The head records
    its input and returns an empty (B, t, 0) placeholder, which whatever the forward does after the head runs on at no
    cost; a forward hook (run before FSDP2's own, which then hooks its pre-backward on it) puts the recorded input in
    the output's `logits`. A forward that does not call its head exactly once raises RuntimeError."""
    inputs = []

    def record(hidden):
        inputs.append(hidden)
        return hidden.new_empty((*hidden.shape[:-1], 0))

    def swap(module, args, output):
        n = len(inputs)
        if n != 1:
            inputs.clear()
            raise RuntimeError(f"{_model_name(model)}'s forward called its output layer {n} times, not once: its "
                               f"log-probs cannot be computed in chunks (--logprob_chunk 0 computes them whole)")
        output.logits = inputs.pop()
        return output

    handle = model.register_forward_hook(swap, prepend=True)
    try:
        with _head_forward(head, record):
            yield
    finally:
        handle.remove()


# -----------------------------------------------------------------------------------------------------------------
# 8b. Log-probs of completion tokens under a model, pi (trained) and pi_old: a group's prompt runs once, and the
#     output layer runs in chunks of positions, so the logits of a long completion never exist all at once.
def _predicting_outputs(model, input_ids, attention_mask, T: int, groups=None):
    """The model's outputs (logits, or hidden states while the output layer is captured) at the T positions that
    predict the last T tokens of each row: (B, T, .), position_ids following the attention mask (left padding does not
    shift positions). With `groups` (B,) each group's prompt runs once and its KV cache is indexed out to its rows (an
    autograd op: every row's gradient flows back into the one prompt forward), then the completions run on top of it:
    the same values and gradients as the rows run whole, the prompt's compute spent once per group. A checkpointed model
    runs rows whole (its layers drop the cache in training mode), and so does one whose cache cannot be indexed out
    (model.shares_prompts, set by check_logprob_paths).
    Lockstep: the path decides how many forwards of the sharded model a micro-batch makes, so it depends only on the
    model and the config, never on the data; micro-batches are at least 2 completion columns wide (make_batch,
    micro_batches), so the completion forward always has a token to run."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    if groups is None or not getattr(model, "shares_prompts", True) or (
            model.training and getattr(model, "is_gradient_checkpointing", False)):
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     logits_to_keep=T + 1).logits[:, :-1]
    assert T >= 2, "shared-prompt forwards need T >= 2 completion columns (make_batch pads to 2)"
    P = input_ids.shape[1] - T
    unique, inverse = torch.unique(groups, return_inverse=True)
    first = torch.zeros(len(unique), dtype=torch.long, device=groups.device).scatter_(
        0, inverse, torch.arange(len(groups), device=groups.device))  # a row of each prompt
    prompt = model(input_ids=input_ids[first, :P], attention_mask=attention_mask[first, :P],
                   position_ids=position_ids[first, :P], use_cache=True, logits_to_keep=1)  # (U, 1, .)
    cache = prompt.past_key_values
    cache.batch_select_indices(inverse)  # (U, ...) -> (B, ...): each row gets its prompt's keys and values
    rest = model(input_ids=input_ids[:, P:-1], attention_mask=attention_mask[:, :-1],  # completion tokens 1..T-1
                 position_ids=position_ids[:, P:-1], past_key_values=cache, use_cache=True).logits  # (B, T - 1, .)
    return torch.cat([prompt.logits[inverse], rest], 1)  # (B, T, .)


def token_logprobs(model, input_ids, attention_mask, num_completion_tokens: int, temperature: float = 1.0,
                   with_entropy: bool = False, chunk_tokens: int = 0, groups=None, top_p: float = 1.0):
    """log pi(token) (B, T) for the last T tokens of each row, and a second (B, T) output (no grad): the entropy with
    with_entropy, else with top_p < 1 the log-probs renormalised over the nucleus, else None; `groups` (B,) lets rows
    that share a prompt run it once (_predicting_outputs).
    Memory: the logits of a micro-batch are (B, T, V) floats, 25 GB in float32 for B x T = 2 x 20,480 at V = 151,936,
    and the log-softmax, entropy and backward make several. With chunk_tokens > 0 (and B x T above it) the model returns
    its output layer's input instead, and head_logits, the log-softmax and the entropy run on chunks of chunk_tokens
    tokens, each recomputed in the backward: peak memory grows with chunk_tokens x V, values and gradients are the same
    (tests/test_heads.py, every family, to 1e-10 in float64; bench/logprob_memory.py measures the memory)."""
    T = num_completion_tokens
    targets = input_ids[:, -T:]  # (B, T)
    if chunk_tokens <= 0 or input_ids.shape[0] * T <= chunk_tokens:  # small enough: the whole logits at once
        logits = _predicting_outputs(model, input_ids, attention_mask, T, groups)  # (B, T, V)
        return _logprobs_of_logits(logits, targets, temperature, with_entropy, top_p)
    head = model.get_output_embeddings()
    with _head_inputs_as_logits(model, head):
        hidden = _predicting_outputs(model, input_ids, attention_mask, T, groups)  # (B, T, H)
    step = max(1, chunk_tokens // input_ids.shape[0])  # positions per chunk
    logps, seconds = [], []  # seconds: the chunks' entropies, or nucleus log-probs, or Nones
    for s in range(0, T, step):
        args = (model, head, hidden[:, s:s + step], targets[:, s:s + step], temperature, with_entropy, top_p)
        if torch.is_grad_enabled():  # recompute this chunk's logits in the backward instead of keeping them
            logp, second = torch.utils.checkpoint.checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            logp, second = _chunk_logprobs(*args)
        logps.append(logp)
        seconds.append(second)
    return torch.cat(logps, 1), torch.cat(seconds, 1) if with_entropy or top_p < 1 else None


def batch_logprobs(model, mb: dict, cfg, with_entropy: bool = False, with_nucleus: bool = False):
    """token_logprobs of a micro-batch's completion tokens at the rollout temperature, in chunks of --logprob_chunk
    tokens, each group's prompt run once: (logp (B, T), the entropy with with_entropy, or the log-probs renormalised
    over the --top_p nucleus with with_nucleus, or None)."""
    return token_logprobs(model, mb["input_ids"], mb["attention_mask"], mb["mask"].shape[1], cfg.temperature,
                          with_entropy, cfg.logprob_chunk, mb.get("group"), cfg.top_p if with_nucleus else 1.0)


@torch.no_grad()
def old_logprobs(model, batch: dict, cfg, device: torch.device, exact: bool) -> dict:
    """pi_old of the clipped ratio, by one rule: the engine's log-probs when they are exactly the trainer's (`exact`:
    our sampler in float32 at top_p = 1, the trainer's own weights and arithmetic), else recomputed by the trainer for
    every row before the step's first update (no grad). Returns the batch's new entries: old_logp (B, T) [and
    old_logp_nucleus (B, T) with top_p < 1: pi_old renormalised over its own nucleus, what the engine's log-probs of
    its nucleus samples compare with]; an exact engine's rollout_logp becomes old_logp, an inexact one's stays."""
    if exact:
        return {"old_logp": batch.pop("rollout_logp")}
    out = {"old_logp": torch.zeros_like(batch["mask"], dtype=torch.float)}  # (B, T)
    if cfg.top_p < 1:
        out["old_logp_nucleus"] = torch.zeros_like(out["old_logp"])
    for rows, mb in micro_batches(batch, torch.arange(len(batch["mask"])), cfg.micro_batch_size,
                                  cfg.micro_batch_tokens):
        with autocast(cfg.dtype, device):
            logp, nucleus_logp = batch_logprobs(model, mb, cfg, with_nucleus=cfg.top_p < 1)
        out["old_logp"][rows, :logp.shape[1]] = logp.float()
        if cfg.top_p < 1:
            out["old_logp_nucleus"][rows, :logp.shape[1]] = nucleus_logp.float()
    reshard(model)
    return out


# -----------------------------------------------------------------------------------------------------------------
# 8c. The models as the trainer uses them: the start-up checks of token_logprobs' two shortcuts (chunks, a shared
#     prompt) on the model still unsharded, then FSDP2, then the rollout engine's calibration; the KL anchor.
@torch.no_grad()
def check_chunked_logprobs(model, dtype: str = "float32"):
    """Exit 2 with one line (naming the model's class, saying to use --logprob_chunk 0) unless token_logprobs'
    chunks compute what the model's own forward computes: a probe of one row of 8 tokens, no grad, under the trainer's
    autocast. (1) The model's forward with its output layer spied on: head_logits of the layer's recorded input must
    give back the forward's logits (the same elementwise operations on the same numbers: one rounding of the compute
    dtype apart; a missing soft-cap or scale is far more). (2) token_logprobs in chunks of one position must run and
    match those logits' log-probs (to 1e-3 of the logits' scale: a log-softmax over a large vocabulary rounds to a few
    1e-4 in float32 depending on the batch's shape; a wrong chunking is off by far more). The same on every rank."""
    head = model.get_output_embeddings()

    def refuse(why: str):
        die(f"--logprob_chunk: the chunked log-probs of {_model_name(model)} would not be its own ({why}); run with "
            f"--logprob_chunk 0")

    if head is None:
        refuse("it has no output layer")
    embeddings = model.get_input_embeddings()
    ids = 3 + torch.arange(8, device=embeddings.weight.device)[None] * 7 % (min(embeddings.num_embeddings, 64) - 3)
    attn, inputs, forward = torch.ones_like(ids), [], head.forward  # ids (1, 8): 4 prompt + 4 completion tokens

    def spy(hidden):
        inputs.append(hidden)
        return forward(hidden)

    with autocast(dtype, ids.device):
        with _head_forward(head, spy):
            logits = model(input_ids=ids, attention_mask=attn).logits  # (1, 8, V)
        if len(inputs) != 1:
            refuse(f"its forward called its output layer {len(inputs)} times, not once")
        ours = head_logits(model, head, inputs[0])
        try:
            logp = token_logprobs(model, ids, attn, 4, 1.0, False, chunk_tokens=1)[0]  # chunks of 1 position
        except Exception as e:  # e.g. a forward that needs its output layer's result to be logits
            refuse(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    eps = max(torch.finfo(t).eps for t in (logits.dtype, ours.dtype, head.weight.dtype, getattr(torch, dtype)))
    scale = 1.0 + logits.abs().max().item()
    if ours.shape != logits.shape or not (ours - logits).abs().max().item() <= eps * scale:  # (NaN fails too)
        refuse("its forward changes its output layer's result in a way common.head_logits does not know")
    gap = (logp - _logprobs_of_logits(logits[:, 3:7], ids[:, 4:], 1.0, False)[0]).abs().max().item()
    if not gap <= max(1e-3, 8 * eps) * scale:
        refuse(f"chunked log-probs off by {gap:.3g}")


@torch.no_grad()
def check_logprob_paths(model, cfg):
    """Start-up checks of token_logprobs' two shortcuts on a model still on the CPU and unsharded (a failure costs no
    collective): with --logprob_chunk > 0, check_chunked_logprobs; and whether a group's rows can share its prompt's KV
    cache, recorded as model.shares_prompts (two rows with one prompt, whole and shared, must agree; the hybrid and
    recurrent caches of some families cannot be indexed out, and their rows run whole)."""
    if cfg.logprob_chunk > 0:
        check_chunked_logprobs(model, cfg.dtype)
    ids = 3 + torch.arange(12).view(2, 6) % 5  # (2, 6): a shared prompt of 3 tokens, then 3 different ones each
    ids[:, :3] = ids[0, :3]
    attn, groups = torch.ones_like(ids), torch.zeros(2, dtype=torch.long)
    was_training = model.training
    model.eval()
    try:
        whole = token_logprobs(model, ids, attn, 3)[0]
        model.shares_prompts = True
        shared = token_logprobs(model, ids, attn, 3, groups=groups)[0]
        model.shares_prompts = bool(torch.allclose(shared, whole, rtol=1e-4, atol=1e-4))
    except (RuntimeError, AttributeError, TypeError, ValueError, IndexError):  # the cache cannot be indexed out
        model.shares_prompts = False
    model.train(was_training)
    if not model.shares_prompts:
        print0(f"note: {_model_name(model)}'s KV cache cannot be shared by a group's rows: each row runs its prompt")


def prepare_models(model, engine, base_path: str, cfg, dist_info: DistInfo):
    """The trained model, checked (check_logprob_paths), sharded and on the device, with the rollout engine
    calibrated against it (vLLM: the weight-sync probe's start-up gap); and the KL anchor (the initial model, also
    after a resume, frozen, checked and sharded alike; None without --kl_coef). Returns (model, ref_model)."""
    check_logprob_paths(model, cfg)
    model = shard_model(model, dist_info, cfg.dtype, cfg.grad_checkpointing, cfg.cpu_offload)
    engine.calibrate(model)
    if cfg.kl_coef <= 0:
        return model, None
    ref_model = load_model(base_path)[0].requires_grad_(False)
    check_logprob_paths(ref_model, cfg)
    return model, shard_model(ref_model, dist_info, cfg.dtype, cpu_offload=cfg.cpu_offload).eval()


# -----------------------------------------------------------------------------------------------------------------
# 9. The update: each token's clipped surrogate (the papers agree on it), which each script weighs and sums its own
#    way (DAPO's token mean, GRPO's per-sequence mean, Dr. GRPO's constant: loss_weights; DARO's per-bin means times
#    w_mu), one micro-batch's forward, and the guarded optimizer step.
def loss_weights(mask: torch.Tensor, loss_agg: str, max_new_tokens: int) -> torch.Tensor:
    """Per-token weights (B, T) that turn the sum of an update's token losses into the chosen aggregation over the
    WHOLE update: the denominators are summed over every micro-batch and rank before the micro-batch loop, so the loss
    and gradient do not depend on how the update is split (verl passes the global token count for this).
      token-mean               1 / (#completion tokens)                     DAPO
      seq-mean-token-mean      1 / (#sequences * |o_i|)                     GRPO, GSPO
      seq-mean-token-sum-norm  1 / (#sequences * max_new_tokens)            Dr. GRPO (a constant, not batch lengths)
    A floating-point mask keeps its dtype (float64 tests), an integer one becomes float32."""
    mask = mask if mask.is_floating_point() else mask.float()
    if loss_agg == "token-mean":
        return mask / all_reduce_sum(mask.sum()).clamp(min=1)
    # sequences with a token to train on: a sequence the rollout correction rejected whole leaves the mean (verl #3915)
    num_seqs = all_reduce_sum((mask.sum(-1) > 0).sum().to(mask.dtype)).clamp(min=1)
    if loss_agg == "seq-mean-token-mean":
        return mask / (mask.sum(-1, keepdim=True).clamp(min=1) * num_seqs)
    if loss_agg == "seq-mean-token-sum-norm":
        return mask / (max_new_tokens * num_seqs)
    raise ValueError(f"unknown loss_agg {loss_agg!r}")


def policy_loss(logp, old_logp, advantages, mask, clip_low: float, clip_high: float, *, clip_ratio_c: float = 0.0,
                seq_ratio: bool = False, ref_logp=None, kl_coef: float = 0.0, is_weight=None):
    """Each token's loss (B, T): the clipped surrogate, in the inputs' dtype; the caller weighs and sums it.
      max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))          PPO/GRPO, DAPO's decoupled clip
      clip_ratio_c > 1 (dual clip): for A < 0 the loss is capped at -A * clip_ratio_c
      seq_ratio (GSPO): r_t = sg[s_i] * pi_t / sg[pi_t], s_i = exp(mean_t log(pi_t / pi_old_t)): every token of a
        completion shares the length-normalised sequence ratio, and the whole sequence is clipped together
      is_weight (B, T): rollout_correction's pi_old / pi_rollout, on the surrogate only (as verl and TRL apply it)
      kl_coef > 0: + kl_coef * the k3 estimate of KL(pi || pi_ref)
    Returns (token losses (B, T), the counts of clipped tokens among `mask`'s, below and above, for logging)."""
    mask = mask.to(logp.dtype)
    log_ratio = logp - old_logp  # (B, T)
    if seq_ratio:
        seq = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
        log_ratio = seq.detach() + logp - logp.detach()
    ratio = torch.exp(log_ratio.clamp(max=20.0))  # clamp only guards exp overflow; such a ratio is clipped anyway
    adv = advantages.unsqueeze(-1)  # (B, 1)
    token_loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_low, 1 + clip_high))
    if clip_ratio_c > 1:
        token_loss = torch.where(adv < 0, torch.minimum(token_loss, -adv * clip_ratio_c), token_loss)
    if is_weight is not None:
        token_loss = token_loss * is_weight
    if kl_coef > 0:
        delta = ref_logp - logp
        token_loss = token_loss + kl_coef * (torch.exp(delta) - delta - 1)  # k3 estimator, >= 0
    with torch.no_grad():
        stats = {"clip_low": (((ratio < 1 - clip_low) & (adv < 0)).float() * mask).sum(),
                 "clip_high": (((ratio > 1 + clip_high) & (adv > 0)).float() * mask).sum()}
    return token_loss, stats


def mismatch_sums(mb: dict) -> dict:
    """The engine/trainer gap on a micro-batch's trained tokens, log r = log pi_old - log pi_rollout: sums of |log r|
    and of the k1 and k3 estimates of KL(rollout || old) over the tokens both samplers could draw (`compared`), and
    the count of `boundary` tokens: in the engine's top_p nucleus (it drew them) but outside pi_old's own, where pi_old
    puts no mass and log r is OUTSIDE_NUCLEUS. Those are a share of their own (rollout/nucleus_boundary_frac), not
    a ~1e4 term in the mean: 0.1% of them would read kl_k3 10.5 where the rest give 1.8e-4."""
    old = mb.get("old_logp_nucleus", mb["old_logp"])
    mask = mb["mask"].to(old.dtype)
    boundary = mask * (old <= OUTSIDE_NUCLEUS)
    compared = mask - boundary
    log_r = (old - mb["rollout_logp"]) * compared
    return {"logprob_diff": log_r.abs().sum().item(), "kl_k1": -log_r.sum().item(),
            "kl_k3": ((torch.exp(log_r) - 1 - log_r) * compared).sum().item(),
            "compared": compared.sum().item(), "boundary": boundary.sum().item()}


def token_losses(model, ref_model, mb: dict, cfg, device: torch.device, sums: Sums):
    """Forward one micro-batch: each token's loss (B, T) (policy_loss, with the KL anchor's log-probs and
    --rollout_is's weights when asked), for the script to weigh and sum; its entropy, clipped-token counts, tokens,
    padding and (an engine whose log-probs are not pi_old) the engine/trainer log-prob gap go to `sums`."""
    with autocast(cfg.dtype, device):
        logp, entropy = batch_logprobs(model, mb, cfg, with_entropy=True)
        ref_logp = None
        if ref_model is not None:
            with torch.no_grad():
                ref_logp = batch_logprobs(ref_model, mb, cfg)[0]
            reshard(ref_model)
    if "rollout_logp" in mb:  # the engine vs the trainer, same weights
        sums.add(**mismatch_sums(mb))
    token_loss, clipped = policy_loss(logp, mb["old_logp"], mb["advantage"], mb["mask"], cfg.clip_low, cfg.clip_high,
                                      clip_ratio_c=cfg.clip_ratio_c, seq_ratio=cfg.seq_ratio, ref_logp=ref_logp,
                                      kl_coef=cfg.kl_coef, is_weight=mb.get("is_weight"))
    sums.add(entropy=(entropy * mb["mask"]).sum().item(), clip_low=clipped["clip_low"].item(),
             clip_high=clipped["clip_high"].item(), tokens=mb["mask"].sum().item(),
             forward_tokens=mb["attention_mask"].numel(), real_tokens=mb["attention_mask"].sum().item())
    return token_loss


class UpdateGuard:
    """The optimizer step of one update, guarded: clip the global gradient norm and step, unless the loss or the
    gradient is not finite on some rank; then the update is skipped (every rank agrees), so one bad batch cannot poison
    the weights. After max_bad_updates skipped in a row the run stops (exit 1) with a hint. Either way the gradients
    are freed after the step, so none lives through the next rollout."""

    def __init__(self, max_bad_updates: int):
        self.max_bad, self.in_a_row = max_bad_updates, 0

    def step(self, model, opt, grad_clip: float, loss_value: float, sums: Sums, where: str) -> bool:
        """Returns whether the update was applied; adds loss, grad_norm (or skipped) to `sums`."""
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        grad_norm = full_tensor(norm)  # the same global norm on every rank
        world = dist.get_world_size() if is_dist() else 1
        finite = all_reduce_sum(torch.tensor(float(math.isfinite(loss_value)))).item() == world
        applied = finite and bool(torch.isfinite(grad_norm))
        if applied:
            opt.step()
        opt.zero_grad(set_to_none=True)  # freed at once: no gradient lives through the next rollout
        if applied:
            sums.add(loss=loss_value, grad_norm=grad_norm.item() / world)
            self.in_a_row = 0
            return True
        sums.add(skipped=1.0 / world)
        self.in_a_row += 1
        print0(f"warning: {where}: non-finite loss or gradient; update skipped")
        if self.in_a_row >= self.max_bad:
            print0(f"error: {self.in_a_row} non-finite updates in a row (--max_bad_updates); stopping. "
                   f"Try a lower --lr, --dtype float32, or check the data.")
            raise SystemExit(1)
        return False


# -----------------------------------------------------------------------------------------------------------------
# 10. Evaluation: avg@k (mean accuracy over k samples per problem), unbiased pass@k and maj@k (the majority answer's
#     accuracy), per difficulty level too; each --eval_data set with its own k (set@k).
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k), a stable product (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def majority_correct(group: dict, answer_format: str) -> bool:
    """maj@k of one group: is the answer most of its samples give (equivalent answers counted as one; ties: the
    first seen, verifier.majority_vote) correct? The winner's own verdict answers it, so nothing is verified twice."""
    index, _ = majority_vote([extract_answer(t, answer_format) for t in group["texts"]])
    return index is not None and bool(group["correct"][index])


@torch.no_grad()
def evaluate(engine, tok, problems: list[dict], cfg, rank: int = 0, world_size: int = 1, k: int = 0) -> dict:
    """k completions per problem (0: cfg.eval_samples; each rank its stride) from a private seeded stream: the same
    weights always get the same score, and the training stream is untouched (our sampler: torch's RNG, forked; vLLM:
    seeded requests). Returns eval/acc (avg@k), eval/pass@j for j = 1, 2, 4, ... up to k, eval/maj@k and
    eval/acc_level<l>."""
    n = k or cfg.eval_samples
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    seed = cfg.seed + 7919 * (rank + 1)
    with torch.random.fork_rng(devices=devices):  # our sampler draws from torch's RNG; vLLM seeds each request
        torch.manual_seed(seed)
        groups = []
        mine = problems[rank::world_size]  # this rank's stride of the eval set
        for s in range(0, len(mine), cfg.eval_batch_size):
            groups += roll_groups(engine, tok, mine[s:s + cfg.eval_batch_size], cfg, n,
                                  cfg.eval_temperature, cfg.eval_top_p, seed=1_000_003 * seed + s)[0]
    results = all_gather_list([(len(g["correct"]), sum(g["correct"]), g["level"],
                                majority_correct(g, cfg.answer_format)) for g in groups])
    out = {"eval/acc": sum(c for _, c, _, _ in results) / sum(m for m, _, _, _ in results)}
    j = 1
    while j <= n:
        out[f"eval/pass@{j}"] = sum(pass_at_k(m, c, j) for m, c, _, _ in results) / len(results)
        j *= 2
    out[f"eval/maj@{n}"] = sum(maj for *_, maj in results) / len(results)
    for level in sorted({lv for _, _, lv, _ in results}):
        sel = [(m, c) for m, c, lv, _ in results if lv == level]
        out[f"eval/acc_level{level}"] = sum(c for _, c in sel) / sum(m for m, _ in sel)
    return out


def evaluate_sets(engine, tok, eval_sets: dict[str, list[dict]], cfg, rank: int = 0, world_size: int = 1) -> dict:
    """evaluate() on each named eval set, with its own k (--eval_data set@k, else --eval_samples): keys
    eval/<set>/acc, eval/<set>/pass@j, eval/<set>/maj@k, ...; and the run's headline: eval/acc, eval/pass@j,
    eval/maj@k and eval/acc_level<l>, each the mean over the sets that have it (a set with another k does not enter
    eval/maj@k)."""
    ks = [k for _, k in parse_eval_data(cfg.eval_data, cfg.eval_samples)]
    out, per_set = {}, []
    for (name, problems), k in zip(eval_sets.items(), ks):
        scores = evaluate(engine, tok, problems, cfg, rank, world_size, k)
        per_set.append(scores)
        out.update({key.replace("eval/", f"eval/{name}/", 1): v for key, v in scores.items()})
    for key in dict.fromkeys(key for scores in per_set for key in scores):  # every key, in first-seen order
        values = [s[key] for s in per_set if key in s]
        out[key] = sum(values) / len(values)
    return out


# -----------------------------------------------------------------------------------------------------------------
# 11. Logging: one fixed-format line per step (through tqdm.write, so a bar stays intact) and one JSON record per step
#     and per evaluation in metrics.jsonl, the source of truth; samples.jsonl holds a few completions now and then,
#     config.json the config used; --report_to sends the same records to TensorBoard or wandb.
def train_metrics(totals: dict, num_updates: int, lr: float, mismatch: bool) -> dict:
    """The step's train/* record from the reduced TRAIN_SUMS: means per token the loss counts (rejected ones left out)
    or per applied update; `mismatch` (an engine whose log-probs are not pi_old): the rollout/* gap too."""
    tokens, applied = max(totals["tokens"], 1.0), max(num_updates - totals["skipped"], 1.0)
    record = {"train/loss": totals["loss"] / applied, "train/entropy": totals["entropy"] / tokens,
              "train/clipfrac_low": totals["clip_low"] / tokens, "train/clipfrac_high": totals["clip_high"] / tokens,
              "train/grad_norm": totals["grad_norm"] / applied, "train/skipped_updates": totals["skipped"],
              "train/num_updates": num_updates, "train/lr": lr,
              "perf/pad_frac": 1 - totals["real_tokens"] / max(totals["forward_tokens"], 1.0)}  # of the forwards
    if mismatch:  # the engine vs the trainer on the trained tokens both could draw (mismatch_sums): mean |log r|,
        compared = max(totals["compared"], 1.0)  # KL(rollout || old); and the share outside pi_old's nucleus
        record.update({"rollout/logprob_diff": totals["logprob_diff"] / compared,
                       "rollout/kl_k1": totals["kl_k1"] / compared, "rollout/kl_k3": totals["kl_k3"] / compared,
                       "rollout/nucleus_boundary_frac": totals["boundary"] / tokens})
    return record


class Logger:
    """metrics.jsonl, samples.jsonl, config.json and the console lines of rank 0, and with --report_to a tracker with
    the same records under the same names. On --resume the records after the checkpoint's step `resumed_step` are
    dropped (the run writes them again), all of them when --resume found no checkpoint (resumed_step -1: the run
    starts over), so every step and evaluation has exactly one record."""

    def __init__(self, cfg, dist_info: DistInfo, resumed_step: int = -1):
        self.enabled, self.out_dir, self.tracker = dist_info.is_main, cfg.out_dir, None
        if self.enabled:
            os.makedirs(cfg.out_dir, exist_ok=True)
            if cfg.resume:
                for name in ("metrics.jsonl", "samples.jsonl"):
                    _truncate_jsonl(os.path.join(cfg.out_dir, name), resumed_step)
            config = config_dict(cfg, dist_info.world_size)
            print0("config: " + " ".join(f"{k}={v}" for k, v in config.items()))
            with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
                json.dump(config, f, indent=1)
            if cfg.report_to != "none":
                self.tracker = Tracker(cfg.report_to, cfg.out_dir, config, cfg.wandb_project)

    def log(self, record: dict, name: str = "metrics.jsonl"):
        if self.enabled:
            with open(os.path.join(self.out_dir, name), "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            if self.tracker is not None and name == "metrics.jsonl":
                self.tracker.log(record)

    def line(self, text: str):
        if self.enabled:
            tqdm.write(text)

    def samples(self, step: int, group: dict, n: int = 4):
        """A few completions of one group to samples.jsonl, and one of them to the console."""
        for text, reward in list(zip(group["texts"], group["reward"]))[:n]:
            self.log({"step": step, "prompt": group["prompt"], "answer": group["answer"], "completion": text,
                      "reward": reward}, "samples.jsonl")
        self.line(f"sample: {group['prompt'][-60:]!r} -> {group['texts'][0][-80:]!r} (answer {group['answer']}, "
                  f"reward {group['reward'][0]:+.2f})")


class Tracker:
    """--report_to tensorboard (event files in out_dir/tensorboard) or wandb (project --wandb_project, run files in
    out_dir/wandb; offline with WANDB_MODE=offline), imported only when chosen: the config once, every record's numbers
    at its step under the metrics.jsonl names; closed at exit."""

    def __init__(self, kind: str, out_dir: str, config: dict, wandb_project: str):
        self.kind = kind
        try:
            if kind == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(os.path.join(out_dir, "tensorboard"))
                self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", 0)
            else:
                import wandb
                self.run = wandb.init(project=wandb_project, dir=out_dir, config=config,
                                      name=os.path.basename(os.path.normpath(out_dir)))
        except ImportError as e:
            die(f"--report_to {kind}: {e.name} is not installed (pip install -r requirements-tracking.txt)")
        atexit.register(self.close)

    def log(self, record: dict):
        numbers = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if self.kind == "tensorboard":
            for key, value in numbers.items():
                self.writer.add_scalar(key, value, record["step"])
            self.writer.flush()
        else:
            self.run.log(numbers, step=record["step"])

    def close(self):
        if self.kind == "tensorboard":
            self.writer.close()
        else:
            self.run.finish()


def _truncate_jsonl(path: str, last_step: int):
    """Keep the records with step <= last_step (the run after a resume rewrites the rest)."""
    if os.path.exists(path):
        keep = [ln for ln in open(path, encoding="utf-8") if ln.strip() and json.loads(ln).get("step", 0) <= last_step]
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(keep)
        os.replace(path + ".tmp", path)


def format_step(step: int, steps: int, record: dict) -> str:
    """The one printed line per step: fixed keys, fixed widths, `|` separators."""
    return (f"step {step:4d}/{steps} | reward {record['train/reward']:+.3f} | acc {record['train/acc']:.3f} | "
            f"keep {record['train/keep_rate']:.2f} | len {record['train/response_len']:5.1f} | "
            f"loss {record['train/loss']:+.4f} | "
            f"ent {record['train/entropy']:.3f} | gnorm {record['train/grad_norm']:.3f} | {record['time/step_s']:.1f}s")


def evaluate_and_log(engine, tok, eval_sets: dict, cfg, dist_info: DistInfo, logger: Logger, step: int) -> dict:
    """evaluate_sets at `step`: one metrics.jsonl record, and avg@k, pass@1..k, maj@k and per-level accuracy printed,
    a line per eval set."""
    record = {"step": step, **evaluate_sets(engine, tok, eval_sets, cfg, dist_info.rank, dist_info.world_size)}
    logger.log(record)
    for name in eval_sets:
        prefix = f"eval/{name}/"
        scores = {k[len(prefix):]: v for k, v in record.items() if k.startswith(prefix)}
        passes = " | ".join(f"{k} {v:.3f}" for k, v in scores.items() if k.startswith(("pass@", "maj@")))
        levels = " ".join(f"L{k[9:]} {v:.2f}" for k, v in scores.items()
                          if k.startswith("acc_level") and k != "acc_level0")
        label = f" [{name}]" if len(eval_sets) > 1 else ""
        logger.line(f"eval step {step}{label}: acc {scores['acc']:.3f} | {passes}" + (f" | {levels}" if levels else ""))
    return record


# -----------------------------------------------------------------------------------------------------------------
# 12a. Checkpoints, what they hold: out_dir/step_XXXXXX/ = a Hugging Face model folder (loadable by from_pretrained and vLLM), the
#     optimizer in torch.distributed.checkpoint's sharded format (resumable on any number of ranks), trainer.pt (the
#     step, scheduler, data position, the algorithm's state) and one rank<r>.pt per rank (its RNG states and, after a
#     stop in the middle of a step, that step's remaining work: a PendingStep). Written under a temporary name, then
#     renamed. trainer.pt and rank<r>.pt hold tensors and plain types only and are read with torch's safe loader, so
#     a checkpoint from elsewhere cannot run code on --resume (the optimizer's metadata is still a pickle: dcp's own).
def rng_state() -> dict:
    """This rank's RNG states, as tensors and plain types: Python's, numpy's, torch's (CPU and GPUs)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)  # no ndarray in a safe load
    return {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict):
    """Inverse of rng_state."""
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to(obj, device):
    """Every tensor in nested dicts, lists and tuples moved to `device`."""
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return obj.to(device) if torch.is_tensor(obj) else obj


@dataclass
class PendingStep:
    """What a stop between two updates leaves of its step on this rank; the resumed run finishes the step from it.
    Only `batch` lives on the training device; everything else stays where the loop keeps it (the CPU)."""
    step: int  # the unfinished step
    record: dict  # its metrics record so far (rollout, advantages, pi_old)
    groups: list  # its first group on this rank (samples.jsonl)
    update_rows: list  # the rows of each of its updates (tensors)
    batch: dict  # the batch's tensors (common section 7)
    next_update: int  # the first update not yet applied
    sums: dict  # Sums.sums of its updates so far
    algo: dict  # the algorithm's own sums over the step (algo.step_state(): DARO's per-bin sums)

    def plain(self) -> dict:
        """Tensors and plain types on the CPU, for torch's safe loader."""
        return _to(asdict(self), "cpu")

    def resume(self, sums, algo) -> tuple:
        """Put the step's sums back (the loop's Sums, the algorithm's own); returns (record, groups, update_rows,
        batch, next_update), where the loop goes on."""
        sums.sums = self.sums
        algo.load_step_state(self.algo)
        return self.record, self.groups, self.update_rows, self.batch, self.next_update


def _load_plain(path: str):
    """torch.load with torch's safe loader (tensors and plain types only): a file that holds anything else (a pickled
    object, which could run code when unpickled) is refused with one line."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        die(f"--resume: {path} holds more than tensors and plain types, so it is not loaded: unpickling it could "
            f"run code (a checkpoint written before this format, by an older version of this code, lands here too: "
            f"resume it with that version, or start from its model with --model). torch: {str(e).splitlines()[0][:80]}")


def seed_everything(seed: int):
    """Seed this rank's sampling RNGs: torch (our sampler), numpy (vLLM's GPU runner seeds requests from it), random."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def full_state_dict(model) -> dict:
    """The full (unsharded) model state dict, on CPU; under FSDP every rank must call it and rank 0 gets the tensors."""
    if not is_dist():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# -----------------------------------------------------------------------------------------------------------------
# 12b. Checkpoints, written and read: atomically, by every rank, on any number of ranks; --resume's choice of one.
def save_checkpoint(out_dir: str, step: int, model, tok, opt, sched, stream: PromptStream, extra: dict,
                    keep: int = 2, pending: PendingStep | None = None) -> str:
    """Write step_<step>/ atomically and keep the newest `keep`. `step` is the last finished step; with `pending`
    (what remains of an unfinished step on this rank) the folder takes the unfinished step's number. The model goes
    through an empty (meta-device) copy of its architecture, so no second full copy exists under FSDP; the optimizer
    through torch.distributed.checkpoint, each rank its shards, keyed by parameter name (a run saved on N ranks
    resumes on M); `extra` is the algorithm's state (the same on every rank). Every rank then checks that it sees the
    whole checkpoint: several nodes need an --out_dir they all share."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from transformers import AutoModelForCausalLM
    rank, world = (dist.get_rank(), dist.get_world_size()) if is_dist() else (0, 1)
    path = os.path.join(out_dir, f"step_{pending.step if pending else step:06d}")  # unfinished: its own step
    tmp = path + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if is_dist():
        dist.barrier()
    os.makedirs(tmp, exist_ok=True)
    state_dict = full_state_dict(model)
    # An optimizer that has not stepped yet (a stop in step 1) has no state; torch's optimizer state dict gives it
    # one with a zero-lr step of its own (Adam's step count 1): saved as "fresh" and undone below, so that the first
    # real update, resumed or not, is Adam's step 1. (Every rank agrees: they step together.)
    fresh = not opt.state
    if rank == 0:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(model.config)
        skeleton.generation_config = model.generation_config
        skeleton.save_pretrained(tmp, state_dict=state_dict)
        tok.save_pretrained(tmp)
        torch.save({"step": step, "world_size": world, "scheduler": sched.state_dict(), "optimizer_fresh": fresh,
                    "data_position": stream.position, **extra}, os.path.join(tmp, "trainer.pt"))
    dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=os.path.join(tmp, "optimizer"),
             no_dist=not is_dist())
    if fresh:
        opt.state.clear()  # the zero-lr step's state, gone: the optimizer is as it was
    torch.save({"rng": rng_state(), "pending": pending and pending.plain()}, os.path.join(tmp, f"rank{rank}.pt"))
    if is_dist():
        dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)  # the atomic step: a checkpoint folder without .tmp is always complete
        for old in sorted(glob.glob(os.path.join(out_dir, "step_??????")))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    if is_dist():
        dist.barrier()
    files = ["trainer.pt", "model.safetensors", os.path.join("optimizer", ".metadata")] + [
        f"rank{r}.pt" for r in range(world)]
    missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
    if all_reduce_max(torch.tensor(float(len(missing)))).item():
        die(f"checkpoint {path}: a rank does not see {', '.join(missing) or 'all of it'}; with several nodes, "
            f"--out_dir must be on a filesystem every node shares")
    return path


def latest_checkpoint(out_dir: str) -> str | None:
    """The newest complete checkpoint folder in out_dir (temporary folders of interrupted writes are ignored)."""
    found = sorted(glob.glob(os.path.join(out_dir, "step_??????")))
    return found[-1] if found else None


def stop_run(engine, where: str):
    """The end of a run that a stop request (SIGTERM, Ctrl-C) interrupted, after its checkpoint."""
    print0(f"stopped {where}; continue with --resume")
    cleanup_dist(engine)


def find_checkpoint(cfg) -> str | None:
    """The checkpoint --resume continues from (rank 0's choice, on every rank; said when there is none), else None."""
    if not cfg.resume:
        return None
    ckpt = [latest_checkpoint(cfg.out_dir)]
    if is_dist():
        dist.broadcast_object_list(ckpt, src=0)
    if ckpt[0] is None:
        print0(f"--resume: no checkpoint in {cfg.out_dir!r}; starting from step 0")
    return ckpt[0]


def load_checkpoint(ckpt: str | None, model, opt, sched, stream: PromptStream, seed: int, dist_info: DistInfo):
    """Inverse of save_checkpoint for the trainer's state: the optimizer (resharded to this run's ranks), scheduler,
    data position and this rank's RNGs; a fresh run seeds the sampling RNGs instead (seed + rank). On another number
    of ranks than the checkpoint's, the RNGs are seeded afresh from (seed, rank, step) (the saved streams belong to
    the old ranks), and a checkpoint of an unfinished step is refused (its work is split by rank). Returns (the step to
    continue after, the saved state: the algorithm's entries, "eval_due", and "pending": this rank's unfinished step
    (a PendingStep) or None)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    if ckpt is None:
        seed_everything(seed + dist_info.rank)
        return 0, {"pending": None}
    state = _load_plain(os.path.join(ckpt, "trainer.pt"))
    if not state.get("optimizer_fresh"):  # (a fresh one stays as it is: see save_checkpoint)
        optim = {"optimizer": get_optimizer_state_dict(model, opt)}  # this run's layout (creates the state to fill)
        dcp.load(optim, checkpoint_id=os.path.join(ckpt, "optimizer"), no_dist=not is_dist())
        set_optimizer_state_dict(model, opt, optim["optimizer"])
    sched.load_state_dict(state["scheduler"])
    stream.position = state["data_position"]
    if state["world_size"] == dist_info.world_size:
        mine = _load_plain(os.path.join(ckpt, f"rank{dist_info.rank}.pt"))
        set_rng_state(mine["rng"])
        state["pending"] = mine["pending"] and PendingStep(**mine["pending"])
        if state["pending"]:  # its batch to the training device; the rest stays on the CPU, where the loop keeps it
            state["pending"].batch = _to(state["pending"].batch, dist_info.device)
    else:
        if any(_load_plain(f)["pending"] is not None
               for f in glob.glob(os.path.join(ckpt, "rank*.pt"))):
            die(f"--resume: {ckpt} was saved in the middle of a step on {state['world_size']} ranks; resume it on "
                f"{state['world_size']} ranks (the step's work is split by rank), then change")
        print0(f"note: {ckpt} was saved on {state['world_size']} ranks, this run has {dist_info.world_size}: the "
               f"optimizer state is resharded, the sampling RNGs are seeded afresh")
        seed_everything(seed + dist_info.rank + 1_000_003 * state["step"])
        state["pending"] = None
    print0(f"resumed from {ckpt} (step {state['step']})")
    return state["step"], state
