"""
Look up when needed: what keeps a run going around the step. Flags and their checks, records (metrics.jsonl,
samples.jsonl, config.json, trackers), checkpoints: atomic, resumed exactly on any number of ranks.
"""
import argparse
import ast
import atexit
import glob
import inspect
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import textwrap
import warnings
from dataclasses import asdict, dataclass, fields, is_dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import crosscheck
from common import evaluate_sets
from dataset import PromptStream, parse_eval_data
from modeling import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_state_dict, full_state_dict, is_lora,
                      save_adapter)
from ranks import DistInfo, all_reduce_max, die, is_dist, print0

# torch.distributed.checkpoint warns at each save/load of a plain run that it works in one process: it should
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


# ------------------------------------------------------------------------------------------------------------
# Flags from a script's Config (the docstring under each field is its --help), and checks of their combinations.
# --demo: a shipped demo as the flags it stands for. On the command line the default is `reasoning`
# (demo/reasoning/README.md); `arith` is the dataclass defaults, which is also what Config() in code runs.
# A demo applies before the --algo preset (GRPO's preset turns its overlong shaping off); explicit flags
# override both. A --model of the user's own is no demo's: no demo applies unless --demo is given (and then a
# note says which of its values the model runs on), and the knobs the defaults size for a demo (DEMO_SIZED)
# must be set, by flags or the --algo preset, or the run stops naming them.
DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")  # shipped demos (demo/build.py)
_REASONING = os.path.join(DEMO_DIR, "reasoning")
COMMAND_LINE_DEMO = "reasoning"  # what `python da3po.py` with no flags runs
DEMOS = {"arith": {},
         "reasoning": {"model": os.path.join(_REASONING, "model"),
                       "train_data": os.path.join(_REASONING, "train.jsonl"),
                       "eval_data": os.path.join(_REASONING, "eval.jsonl"),
                       "max_new_tokens": 72, "overlong_buffer": 16, "prompts_per_step": 16, "steps": 20}}
DEMO_MODELS = ("demo", os.path.join(DEMO_DIR, "arith", "model"), os.path.join(_REASONING, "model"))
# The knobs whose defaults are a demo's (the data, the token budget, the run's length and batch, the tiny
# model's learning rate): a real run sets each (docs/gpu.md's recipes do); an --eval_only run the first two.
DEMO_SIZED = ("train_data", "eval_data", "max_new_tokens", "overlong_buffer", "steps", "prompts_per_step",
              "lr")
EVAL_ONLY_SIZED = ("eval_data", "max_new_tokens")


def is_demo_model(name: str) -> bool:
    """--model names a shipped demo's model ('demo', or one of the demo folders)."""
    return any(name == m or os.path.realpath(name) == os.path.realpath(m) for m in DEMO_MODELS)


def _demo_sized(given: dict, demo: str, cfg, argv_model: str) -> dict:
    """The demo-sized knobs a --model of the user's own would get from no flag: with --demo, the demo's (said
    in one note); without, none (the run stops, naming the flags to set)."""
    needed = EVAL_ONLY_SIZED if given.get("eval_only") else DEMO_SIZED
    missing = [k for k in needed if k not in given]
    if not missing:
        return {}
    if not demo:
        die(f"--model {argv_model} is not a demo's model: set {', '.join('--' + k for k in missing)} (their "
            f"defaults are sized for the CPU demos; docs/gpu.md has the papers' recipes), or --demo "
            f"{'|'.join(DEMOS)} for a demo's values")
    values = {k: DEMOS[demo].get(k, getattr(cfg, k)) for k in missing}
    if os.environ.get("RANK", "0") == "0":
        print(f"note: --model {argv_model} runs on --demo {demo}'s "
              + ", ".join(f"{k} {v}" for k, v in values.items()), flush=True)
    return values


def field_help(cls) -> dict[str, str]:
    """Each Config field's --help text: the docstring under the field (as cleanrl's Args), read from
    the source of the class and its bases. Returns {field name: text}."""
    helps = {}
    for klass in reversed(cls.__mro__):
        if not is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for statement, after in zip(body, body[1:]):
            if not isinstance(statement, ast.AnnAssign):
                continue
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                helps[statement.target.id] = " ".join(str(after.value.value).split())
    return helps


def parse_config(cls, argv: list[str] | None = None, presets: dict[str, dict] | None = None):
    """Precedence: dataclass defaults < --demo (reasoning unless given; none for a --model of the user's own)
    < preset of --algo < explicit flags (`--lr 1e-5`, `--lr=1e-5`, `--x`/`--no-x`). An unknown or abbreviated
    flag exits 2 naming it; overriding a preset prints a note; a model of the user's own missing a DEMO_SIZED
    knob exits 2 naming them all (with --demo: a note naming the demo's values it gets)."""
    helps = field_help(cls)
    repo = os.path.dirname(DEMO_DIR)
    demo_flags = [f"--{k} {os.path.relpath(v, repo) if isinstance(v, str) else v}"
                  for k, v in DEMOS[COMMAND_LINE_DEMO].items()]
    sized = ", ".join("--" + k for k in DEMO_SIZED)
    epilog = (f"--demo {COMMAND_LINE_DEMO} (the default) sets {', '.join(demo_flags)}; the defaults above "
              f"are --demo arith's. A --model of your own runs on no demo's values: it needs {sized} "
              f"(docs/gpu.md's recipes set them).")
    parser = argparse.ArgumentParser(prog=os.path.basename(sys.argv[0]),
                                     description=(cls.__doc__ or "").strip(),
                                     epilog=epilog,
                                     allow_abbrev=False)
    for f in fields(cls):
        default = COMMAND_LINE_DEMO if f.name == "demo" else f.default
        help_text = f"{helps.get(f.name, '')} (default: {default!r})".replace("%", "%%")
        kw = dict(dest=f.name, default=argparse.SUPPRESS, help=help_text)  # SUPPRESS: only flags given
        kind = type(f.default)
        if kind is bool:
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, **kw)
        else:
            parser.add_argument(f"--{f.name}", type=kind, metavar=kind.__name__.upper(), **kw)
    given = vars(parser.parse_args(argv))
    cfg = cls()
    own_model = "model" in given and not is_demo_model(given["model"])  # a model of the user's own
    demo = given.setdefault("demo", "" if own_model else COMMAND_LINE_DEMO)  # "": no demo applies
    if demo not in DEMOS and not (own_model and demo == ""):
        parser.error(f"argument --demo: invalid choice {demo!r} (choose from {', '.join(DEMOS)})")
    if presets is not None:
        algo = given.get("algo", cfg.algo)
        if algo not in presets:
            parser.error(f"argument --algo: invalid choice {algo!r} (choose from {', '.join(presets)})")
        for k, v in presets[algo].items():  # a recipe knob changed by hand is allowed, but never silently
            if k in given and given[k] != v and os.environ.get("RANK", "0") == "0":
                print(f"note: --{k} {given[k]} overrides the {algo} preset's {k} = {v}", flush=True)
        given = {**presets[algo], **given}
    if own_model:
        given = {**_demo_sized(given, demo, cfg, given["model"]), **given}
    given = {**DEMOS.get(demo, {}), **given}
    for k, v in given.items():
        setattr(cfg, k, v)
    return cfg


def config_dict(cfg, world_size: int = 1) -> dict:
    """The config used, plus what reproducing a run needs: world size, versions, git commit."""
    import transformers
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, timeout=5,
                             capture_output=True, text=True)
        commit = git.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {**asdict(cfg),
            "_world_size": world_size,
            "_torch": torch.__version__,
            "_transformers": transformers.__version__,
            "_git_commit": commit}


def check_config(cfg, world_size: int, check_algorithm=None):
    """Flag combinations that cannot work stop here, naming the flag (exit 2), before anything is loaded; the
    script's own last (check_algorithm(cfg))."""
    choices = {"loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
               "dtype": ("float32", "bfloat16", "float16"),
               "prompt_template": ("auto", "chat", "plain", "dapo", "none"),
               "answer_format": ("boxed", "answer_line", "auto"),
               "rollout": ("hf", "vllm", "auto"),
               "rollout_is": ("none", "token", "sequence"),
               "report_to": ("none", "tensorboard", "wandb")}
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            die(f"--{name} {getattr(cfg, name)!r}: choose one of {', '.join(allowed)}")
    for name in ("steps", "eval_every", "save_every", "sample_every", "eval_size", "overlong_buffer",
                 "micro_batch_tokens", "logprob_chunk", "crosscheck_train"):
        if getattr(cfg, name) < 0:
            die(f"--{name} must be >= 0, got {getattr(cfg, name)}")
    for name in ("prompts_per_step", "updates_per_step", "micro_batch_size", "max_new_tokens",
                 "max_prompt_length", "eval_samples", "max_gen_batches", "rollout_batch_size",
                 "eval_batch_size", "keep_last", "max_bad_updates"):
        if getattr(cfg, name) < 1:
            die(f"--{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.group_size < 2:
        die(f"--group_size must be >= 2 (advantages are relative to the group), got {cfg.group_size}")
    if cfg.cpu_offload and not is_dist():
        die("--cpu_offload needs FSDP2, which runs under torchrun: launch with torchrun --standalone "
            "--nproc_per_node=1 (one GPU) or more")
    if cfg.dtype == "float16" and not cfg.eval_only:
        die("--dtype float16 trains without loss scaling (small gradients underflow): use bfloat16, "
            "or float16 only with --eval_only")
    if cfg.prompts_per_step % world_size:
        die(f"--prompts_per_step {cfg.prompts_per_step} does not divide over {world_size} ranks")
    if cfg.updates_per_step > cfg.prompts_per_step // world_size:
        die(f"--updates_per_step {cfg.updates_per_step} is more than the "
            f"{cfg.prompts_per_step // world_size} prompts per rank "
            f"(--prompts_per_step {cfg.prompts_per_step} over {world_size} ranks): an update needs a group")
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
    if cfg.crosscheck_train and not cfg.verifier_crosscheck:
        die(f"--crosscheck_train {cfg.crosscheck_train} needs --verifier_crosscheck")
    if cfg.verifier_crosscheck and crosscheck.missing():
        die(f"--verifier_crosscheck: {crosscheck.missing()}")
    parse_eval_data(cfg.eval_data, cfg.eval_samples)  # a bad set@k stops here, before anything is loaded
    check_lora_config(cfg)
    if check_algorithm is not None:
        check_algorithm(cfg)


def check_lora_config(cfg):
    """The --lora_* flags: a rank >= 1 turns LoRA on; the others only tune it, so setting them without a rank
    is a mistake, not a silent full fine-tune."""
    tuned = [f"--{f.name}" for f in fields(cfg)
             if f.name.startswith("lora_") and f.name != "lora_rank" and getattr(cfg, f.name) != f.default]
    if cfg.lora_rank < 0 or (cfg.lora_rank == 0 and tuned):
        die(f"--lora_rank {cfg.lora_rank}: LoRA needs a rank >= 1" +
            (f" ({', '.join(tuned)} set: they only apply to LoRA)" if tuned else ""))
    if cfg.lora_alpha <= 0 or not 0 <= cfg.lora_dropout < 1:
        die(f"--lora_alpha must be > 0 and --lora_dropout in [0, 1), "
            f"got {cfg.lora_alpha} and {cfg.lora_dropout}")
    if cfg.lora_sync not in ("auto", "adapter", "merged"):
        die(f"--lora_sync {cfg.lora_sync!r}: choose one of auto, adapter, merged")


# ------------------------------------------------------------------------------------------------------------
# Records, by rank 0: metrics.jsonl (a record per step and evaluation, the source of truth), samples.jsonl,
# config.json, a console line per step (tqdm.write keeps a bar intact); --report_to: TensorBoard or wandb too.
class Logger:
    """--resume drops records after step `resumed_step` (all at -1: no checkpoint); the run rewrites them."""

    def __init__(self, cfg, dist_info: DistInfo, resumed_step: int = -1):
        self.enabled = dist_info.is_main  # rank 0 writes
        self.out_dir = cfg.out_dir
        self.tracker = None
        self.sample_every = cfg.sample_every
        if self.enabled:
            os.makedirs(cfg.out_dir, exist_ok=True)
            if cfg.resume:
                for name in ("metrics.jsonl", "samples.jsonl", "crosscheck.jsonl"):
                    _truncate_jsonl(os.path.join(cfg.out_dir, name), resumed_step)
            config = config_dict(cfg, dist_info.world_size)
            print0("config: " + " ".join(f"{k}={v}" for k, v in config.items()))
            with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
                json.dump(config, f, indent=1)
            if cfg.report_to != "none":
                self.tracker = Tracker(cfg.report_to, cfg.out_dir, config, cfg.wandb_project)

    def log(self, record: dict, name: str = "metrics.jsonl"):
        rows = record.get("crosscheck_samples")  # --verifier_crosscheck's disagreements: a file of their own
        if rows is not None:
            record = {k: v for k, v in record.items() if k != "crosscheck_samples"}
            for row in rows:
                self.log({"step": record["step"], **row}, "crosscheck.jsonl")
        if self.enabled:
            with open(os.path.join(self.out_dir, name), "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            if self.tracker is not None and name == "metrics.jsonl":
                self.tracker.log(record)

    def line(self, text: str):
        if self.enabled:
            tqdm.write(text)

    def samples(self, step: int, groups: list[dict], n: int = 4):
        """Every --sample_every steps: a few completions of the step's first group to samples.jsonl, one of
        them to the console."""
        if not (self.sample_every and step % self.sample_every == 0 and groups):
            return
        group = groups[0]
        for text, reward in list(zip(group["texts"], group["reward"]))[:n]:
            row = {"step": step, "prompt": group["prompt"], "answer": group["answer"],
                   "completion": text, "reward": reward}
            self.log(row, "samples.jsonl")
        self.line(f"sample: {group['prompt'][-60:]!r} -> {group['texts'][0][-80:]!r} "
                  f"(answer {group['answer']}, reward {group['reward'][0]:+.2f})")


class Tracker:
    """--report_to tensorboard (event files in out_dir/tensorboard) or wandb (project --wandb_project, run
    files in out_dir/wandb, offline with WANDB_MODE=offline), imported only when chosen: the config, then
    every record's numbers under their metrics.jsonl names."""

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
            die(f"--report_to {kind}: {e.name} is not installed (pip install -r requirements/tracking.txt)")
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
        keep = [ln for ln in open(path, encoding="utf-8")
                if ln.strip() and json.loads(ln).get("step", 0) <= last_step]
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(keep)
        os.replace(path + ".tmp", path)


def format_step(step: int, steps: int, record: dict) -> str:
    """The one printed line per step: fixed keys, fixed widths, `|` separators."""
    parts = [f"step {step:4d}/{steps}",
             f"reward {record['train/reward']:+.3f}",
             f"acc {record['train/acc']:.3f}",
             f"keep {record['train/keep_rate']:.2f}",
             f"len {record['train/response_len']:5.1f}",
             f"loss {record['train/loss']:+.4f}",
             f"ent {record['train/entropy']:.3f}",
             f"gnorm {record['train/grad_norm']:.3f}",
             f"{record['time/step_s']:.1f}s"]
    return " | ".join(parts)


def evaluate_and_log(engine, tok, eval_sets: dict, cfg, dist_info: DistInfo, logger: Logger, step: int,
                     before: dict | None = None) -> dict:
    """evaluate_sets at `step`: a metrics.jsonl record, a line per eval set (acc, pass@k, maj@k, levels); at
    the last step, with `before`, the step-0 evaluation's record, the run's gain too."""
    scores = evaluate_sets(engine, tok, eval_sets, cfg, dist_info.rank, dist_info.world_size)
    record = {"step": step, **scores}
    logger.log(record)
    for name in eval_sets:
        prefix = f"eval/{name}/"
        scores = {k[len(prefix):]: v for k, v in record.items() if k.startswith(prefix)}
        passes = " | ".join(f"{k} {v:.3f}" for k, v in scores.items() if k.startswith(("pass@", "maj@")))
        levels = " ".join(f"L{k[9:]} {v:.2f}" for k, v in scores.items()
                          if k.startswith("acc_level") and k != "acc_level0")
        label = f" [{name}]" if len(eval_sets) > 1 else ""
        logger.line(f"eval step {step}{label}: acc {scores['acc']:.3f} | {passes}"
                    + (f" | {levels}" if levels else ""))
    if before is not None and before["step"] == 0 and step == cfg.steps:
        print0(f"eval/acc before {before['eval/acc']:.3f} -> after {record['eval/acc']:.3f}")
    return record


def step_bar(start_step: int, cfg, dist_info: DistInfo):
    """The loop's steps, those after start_step up to --steps (none with --eval_only), with a progress bar on
    rank 0 in a terminal (none in a log file). A --resume with none left says that the run is done."""
    steps = range(start_step + 1, 0 if cfg.eval_only else cfg.steps + 1)
    if cfg.resume and not steps and not cfg.eval_only:
        print0(f"--resume: the run is done (step {start_step} of {cfg.steps}, its evaluation too): "
               f"nothing to add (a larger --steps trains on)")
    return tqdm(steps, desc="steps", leave=False, disable=not dist_info.is_main or not sys.stderr.isatty())


# ------------------------------------------------------------------------------------------------------------
# Checkpoints, what they hold. out_dir/step_XXXXXX/: a Hugging Face model folder (from_pretrained, vLLM);
# optimizer/, sharded by torch.distributed.checkpoint (dcp), resumable on any number of ranks; trainer.pt
# (step, scheduler, data position, the algorithm's state); rank<r>.pt per rank (RNG states and, after a stop
# mid-step, that step's remaining work: a PendingStep). The .pt files hold only tensors and plain types, for
# torch's safe loader: a checkpoint from elsewhere cannot run code on --resume (dcp's metadata is a pickle).
def rng_state() -> dict:
    """This rank's RNG states, as tensors and plain types: Python's, numpy's, torch's (CPU and GPUs)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)  # no ndarray
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
    """What a stop mid-step leaves on this rank; only `batch` is on the training device, the rest on CPU."""
    step: int  # the unfinished step
    record: dict  # its metrics record so far (rollout, advantages, pi_old); rank 0's is the one logged
    groups: list  # its first group on this rank (samples.jsonl)
    update_rows: list  # the rows of each of its updates (tensors)
    batch: dict  # the batch's tensors (common: the batch contract)
    next_update: int  # the first update not yet applied
    sums: dict  # Sums.values of its updates so far on this rank (summed over ranks when logged)
    algo: dict  # the algorithm's own sums over the step, the same on every rank (algo.step_state(): DARO's
    #             per-bin sums)

    def plain(self) -> dict:
        """Tensors and plain types on the CPU, for torch's safe loader."""
        return _to(asdict(self), "cpu")

    def resume(self, sums, algo) -> tuple:
        """Put the step's sums back (the loop's Sums, the algorithm's own); returns where the loop goes on."""
        sums.values = self.sums
        algo.load_step_state(self.algo)
        return self.record, self.groups, self.update_rows, self.batch, self.next_update


def _group_rows(pending: PendingStep, rows: torch.Tensor) -> list[torch.Tensor]:
    """An update's rows on one rank, cut into its groups (make_batch lays a group's rows out together)."""
    counts = torch.unique_consecutive(pending.batch["group"][rows], return_counts=True)[1]
    return list(rows.split(counts.tolist()))


def _repadded(pending: PendingStep, key: str, rows: torch.Tensor, width: tuple, pad_id: int) -> torch.Tensor:
    """pending.batch[key][rows] in a batch of `width` (P, T): prompts left-padded to P, completions
    right-padded to T (common.make_batch's layout), with pad_id (input_ids) or 0."""
    x = pending.batch[key][rows]
    if x.dim() == 1:
        return x
    T = pending.batch["mask"].shape[1]
    if key not in ("input_ids", "attention_mask"):  # (B, T): completion columns only
        return F.pad(x, (0, width[1] - T))
    value = pad_id if key == "input_ids" else 0
    P = x.shape[1] - T
    return F.pad(F.pad(x, (width[0] - P, 0), value=value), (0, width[1] - T), value=value)


def reshard_pending(pendings: list[PendingStep], rank: int, world: int, pad_id: int) -> PendingStep:
    """This rank's share of a step a stop interrupted on len(pendings) ranks, for a run on `world` ranks (each
    rank computes it from all the saved ones, no collective). Each remaining update's groups, in old-rank
    order, are cut into `world` contiguous shares of one size, so that every rank trains as many rows and
    issues the same collectives; a share a group short gets a copy of one with its mask zeroed (it adds to no
    loss, count or sum). The loss denominators are global: the update is the one the old ranks would have
    made. The step's sums so far go to rank 0 (they are summed over ranks when logged); every rank takes old
    rank 0's record (the one logged) and the algorithm's step state (the same on every rank).
    Example: 3 groups left on 1 rank, for 2 ranks -> rank 0 takes groups 0 and 1, rank 1 group 2 and a zeroed
    copy of group 0."""
    head = pendings[0]
    prompt_width = max(p.batch["input_ids"].shape[1] - p.batch["mask"].shape[1] for p in pendings)
    width = (prompt_width, max(p.batch["mask"].shape[1] for p in pendings))  # (P, T) of the new batch
    pieces = []  # this rank's groups: (the pending step holding it, its rows there, trained or a copy)
    update_rows = []
    for u in range(len(head.update_rows)):
        if u < head.next_update:  # applied before the stop
            update_rows.append(torch.arange(0))
            continue
        groups = [(p, rows, True) for p in pendings for rows in _group_rows(p, p.update_rows[u])]
        share = -(-len(groups) // world)  # groups per rank, rounded up
        mine = groups[rank * share:(rank + 1) * share]
        mine += [(groups[0][0], groups[0][1], False)] * (share - len(mine))  # copies to train nothing
        start = sum(len(rows) for _, rows, _ in pieces)
        pieces += mine
        update_rows.append(torch.arange(start, start + sum(len(rows) for _, rows, _ in mine)))
    batch = {k: torch.cat([_repadded(p, k, rows, width, pad_id) for p, rows, _ in pieces])
             for k in head.batch}
    batch["group"] = torch.cat([torch.full((len(rows),), i) for i, (_, rows, _) in enumerate(pieces)])
    trained = torch.cat([torch.full((len(rows),), t) for _, rows, t in pieces]).unsqueeze(-1)  # (B, 1)
    for key in ("mask", "rejected"):  # what the losses and sums count (common.token_losses)
        if key in batch:
            batch[key] = batch[key] * trained
    sums = {k: sum(p.sums[k] for p in pendings) if rank == 0 else 0.0 for k in head.sums}
    groups = head.groups if rank == 0 else []  # (samples.jsonl, written by rank 0)
    return PendingStep(head.step, head.record, groups, update_rows, batch, head.next_update, sums, head.algo)


def _load_plain(path: str):
    """torch.load with the safe loader, onto the CPU whatever device a tensor was saved from (a GPU run's
    checkpoint resumes anywhere; under torchrun no rank loads onto GPU 0); a file with more than tensors and
    plain types dies with one line."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        die(f"--resume: {path} holds more than tensors and plain types, so it is not loaded: unpickling it "
            f"could run code (a checkpoint written before this format, by an older version of this code, "
            f"lands here too: resume it with that version, or start from its model with --model). "
            f"torch: {str(e).splitlines()[0][:80]}")


def seed_everything(seed: int):
    """Seed this rank's sampling RNGs: torch (our sampler), numpy (vLLM seeds requests from it), random."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------------------------------
# Checkpoints, written and read: atomically, by every rank, on any number of ranks; --resume's choice of one.
def save_checkpoint(out_dir: str, step: int, model, tok, opt, sched, stream: PromptStream, extra: dict,
                    keep: int = 2, pending: PendingStep | None = None) -> str:
    """Write step_<step>/ atomically and keep the newest `keep`. `step` is the last finished step; with
    `pending` the folder takes the unfinished step's number. The model goes through an empty (meta-device)
    copy of its architecture, so no second full copy exists under FSDP; the optimizer through dcp, each rank
    its shards, keyed by parameter name; `extra` is the algorithm's state (the same on every rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from transformers import AutoModelForCausalLM
    rank = dist.get_rank() if is_dist() else 0
    world = dist.get_world_size() if is_dist() else 1
    path = os.path.join(out_dir, f"step_{pending.step if pending else step:06d}")  # unfinished: its own step
    tmp = path + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if is_dist():
        dist.barrier()
    os.makedirs(tmp, exist_ok=True)
    lora = is_lora(model)
    state_dict = adapter_state_dict(model) if lora else full_state_dict(model)  # LoRA: the adapter alone
    # An optimizer that has not stepped yet (a stop in step 1) has no state; torch's optimizer state dict
    # gives it one with a zero-lr step of its own (Adam's step count 1): saved as "fresh" and undone below, so
    # that the first real update, resumed or not, is Adam's step 1. (Every rank agrees: they step together.)
    fresh = not opt.state
    if rank == 0 and lora:
        save_adapter(model, state_dict, tmp)  # peft's format: the base is --model's
    elif rank == 0:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(model.config)
        skeleton.generation_config = model.generation_config
        skeleton.save_pretrained(tmp, state_dict=state_dict)
    if rank == 0:
        tok.save_pretrained(tmp)
        torch.save({"step": step, "world_size": world, "scheduler": sched.state_dict(),
                    "optimizer_fresh": fresh, "data_position": stream.position,
                    "pad_token_id": tok.pad_token_id, **extra},  # (a stopped step's batch, split anew)
                   os.path.join(tmp, "trainer.pt"))
    dcp.save({"optimizer": get_optimizer_state_dict(model, opt)},
             checkpoint_id=os.path.join(tmp, "optimizer"), no_dist=not is_dist())
    if fresh:
        opt.state.clear()  # the zero-lr step's state, gone: the optimizer is as it was
    torch.save({"rng": rng_state(), "pending": pending and pending.plain()},
               os.path.join(tmp, f"rank{rank}.pt"))
    if is_dist():
        dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)  # the atomic step: a checkpoint folder without .tmp is always complete
        for old in sorted(glob.glob(os.path.join(out_dir, "step_??????")))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    if is_dist():
        dist.barrier()
    weights = ADAPTER_WEIGHTS if lora else "model.safetensors"
    files = ["trainer.pt", weights, os.path.join("optimizer", ".metadata")] + [
        f"rank{r}.pt" for r in range(world)]
    missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
    if all_reduce_max(torch.tensor(float(len(missing)))).item():
        die(f"checkpoint {path}: a rank does not see {', '.join(missing) or 'all of it'}; "
            f"with several nodes, --out_dir must be on a filesystem every node shares")
    return path


def latest_checkpoint(out_dir: str) -> str | None:
    """The newest complete checkpoint folder in out_dir (an interrupted write's .tmp folder is ignored)."""
    found = sorted(glob.glob(os.path.join(out_dir, "step_??????")))
    return found[-1] if found else None


def find_checkpoint(cfg) -> str | None:
    """The checkpoint --resume continues from (rank 0's choice, on every rank; said if none), else None."""
    if not cfg.resume:
        return None
    ckpt = [latest_checkpoint(cfg.out_dir)]
    if is_dist():
        dist.broadcast_object_list(ckpt, src=0)
    if ckpt[0] is None:
        print0(f"--resume: no checkpoint in {cfg.out_dir!r}; starting from step 0")
    else:
        check_checkpoint_kind(ckpt[0], cfg.lora_rank)
    return ckpt[0]


def check_checkpoint_kind(ckpt: str, lora_rank: int):
    """A LoRA run resumes an adapter checkpoint, a full fine-tune a whole model's, never the other's."""
    adapter = os.path.exists(os.path.join(ckpt, ADAPTER_CONFIG))
    if lora_rank and not adapter:
        die(f"--resume: {ckpt} was written without LoRA (a whole model, no adapter): resume it without "
            f"--lora_rank, or start LoRA from its model (--model {ckpt}) in a new --out_dir")
    if not lora_rank and adapter:
        rank = json.load(open(os.path.join(ckpt, ADAPTER_CONFIG)))["r"]
        die(f"--resume: {ckpt} holds a LoRA adapter of rank {rank}: resume it with its --lora_* flags, or "
            f"merge it (python -m tools.merge_lora {ckpt} <folder>) and start from that with --model")


def load_checkpoint(ckpt: str | None, model, opt, sched, stream: PromptStream, seed: int,
                    dist_info: DistInfo):
    """Inverse of save_checkpoint for the trainer's state: the optimizer (resharded to this run's ranks),
    scheduler, data position, this rank's RNGs (a fresh run seeds them instead; so does a run on another
    number of ranks: the saved streams belong to the old ranks; a stopped step's work is then split anew,
    reshard_pending). Returns (the step to continue after, the
    saved state: the algorithm's entries, "eval_due", and "pending": this rank's PendingStep or None)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    if ckpt is None:
        seed_everything(seed + dist_info.rank)
        return 0, {"pending": None}
    state = _load_plain(os.path.join(ckpt, "trainer.pt"))
    if not state.get("optimizer_fresh"):  # (a fresh one stays as it is: see save_checkpoint)
        optim = {"optimizer": get_optimizer_state_dict(model, opt)}  # this run's layout: the state to fill
        dcp.load(optim, checkpoint_id=os.path.join(ckpt, "optimizer"), no_dist=not is_dist())
        set_optimizer_state_dict(model, opt, optim["optimizer"])
    sched.load_state_dict(state["scheduler"])
    stream.position = state["data_position"]
    if state["world_size"] == dist_info.world_size:
        mine = _load_plain(os.path.join(ckpt, f"rank{dist_info.rank}.pt"))
        set_rng_state(mine["rng"])
        state["pending"] = mine["pending"] and PendingStep(**mine["pending"])
    else:
        files = [os.path.join(ckpt, f"rank{r}.pt") for r in range(state["world_size"])]
        saved = [_load_plain(f)["pending"] for f in files]  # every old rank's: the step's rows, split anew
        print0(f"note: {ckpt} was saved on {state['world_size']} ranks, this run has {dist_info.world_size}: "
               f"the optimizer state is resharded, the sampling RNGs are seeded afresh"
               + (", the stopped step's remaining work is split anew" if saved[0] else ""))
        seed_everything(seed + dist_info.rank + 1_000_003 * state["step"])
        state["pending"] = saved[0] and reshard_pending([PendingStep(**p) for p in saved], dist_info.rank,
                                                        dist_info.world_size, state.get("pad_token_id", 0))
    if state["pending"]:  # its batch to the training device (see PendingStep)
        state["pending"].batch = _to(state["pending"].batch, dist_info.device)
    print0(f"resumed from {ckpt} (step {state['step']})")
    return state["step"], state
