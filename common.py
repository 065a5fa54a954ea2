"""
Shared library of da3po.py and daro.py: everything the two RL scripts need that no paper equation of
DA3PO or DARO points at. Sections, in the order of one RL step:

  1. config -> CLI              5. verifier and reward           9. evaluation (avg@k, pass@k)
  2. distributed                6. rollout (HF generate)        10. logging
  3. model and tokenizer        7. token log-probs              11. checkpoints
  4. data (arith task, files)   8. GRPO: advantages, dynamic sampling, policy loss

Shape legend used in comments:
  B = sequences (completions) on this rank, G = group size (completions per prompt),
  P = prompt tokens (left padded), T = completion tokens (right padded), V = vocabulary size.
"""
import argparse
import dataclasses
import datetime
import glob
import hashlib
import inspect
import json
import math
import os
import random
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # transformers' load/save bars would interleave with our one line per step

# -----------------------------------------------------------------------------------------------------------------
# 1. Config -> CLI


def _field_comments(cls) -> dict[str, str]:
    """Map each dataclass field to the trailing comment on its line, so `--help` shows the same text as the code."""
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s*(\w+)\s*:\s*[\w\[\], |]+\s*=\s*.*?#\s*(.*)$", line)
        if m:
            comments[m.group(1)] = m.group(2).strip()
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
    return DistInfo(rank, local_rank, world, dev, rank == 0)


def cleanup_dist():
    """Barrier, then destroy the group: without the barrier, gloo runs sometimes abort at exit (notes/cpu-stack.md)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def print0(*args, **kwargs):
    if not is_dist() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a copy; identity in a single process)."""
    x = x.detach().clone()
    if is_dist():
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
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
DEMO_VERSION = 1  # bump when the demo recipe changes, so stale caches are rebuilt


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
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 100))
    model.train()
    acc = 0.0
    for _ in tqdm(range(steps), desc="demo warm start", leave=False, disable=not sys.stderr.isatty()):
        batch = rng.sample(problems, batch_size)
        prompts = [tok(format_prompt(tok, p["prompt"], "auto"), add_special_tokens=False)["input_ids"] for p in batch]
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
    model.eval()
    return acc


def load_model(name: str, device: torch.device, dtype: str = "float32"):
    """Load a causal LM and its tokenizer from a local Hugging Face folder or a hub id (left padding for generation)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=getattr(torch, dtype)).to(device)
    except (OSError, ValueError) as e:  # a missing folder, an unknown hub id, or offline without a cached copy
        raise SystemExit(f"error: --model {name!r}: cannot load it ({str(e).splitlines()[0]})")
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


def load_problems(path: str, prompt_key: str = "", answer_key: str = "") -> list[dict]:
    """Problem/answer rows from a .jsonl, .json or .parquet file; errors name the file and line."""
    if not os.path.isfile(path):
        raise SystemExit(f"error: data file {path!r} not found (use 'arith' for the built-in task)")
    ext = os.path.splitext(path)[1].lower()
    rows = []
    if ext == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append((i, json.loads(line)))
                    except json.JSONDecodeError as e:
                        raise SystemExit(f"error: {path}:{i}: not valid JSON ({e.msg})")
    elif ext == ".json":
        try:
            data = json.load(open(path, encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise SystemExit(f"error: {path}:{e.lineno}: not valid JSON ({e.msg})")
        rows = list(enumerate(data if isinstance(data, list) else data.get("data", []), 1))
    elif ext == ".parquet":
        import pyarrow.parquet as pq  # optional dependency, only for parquet files
        rows = list(enumerate(pq.read_table(path).to_pylist(), 1))
    else:
        raise SystemExit(f"error: data file {path!r}: unknown extension {ext!r} (use .jsonl, .json or .parquet)")
    problems = []
    for i, row in rows:
        pk = prompt_key or next((k for k in ("problem", "question", "prompt") if k in row), None)
        ak = answer_key or next((k for k in ("answer", "solution", "ground_truth") if k in row), None)
        if not isinstance(row, dict) or pk not in row or ak not in row:
            raise SystemExit(f"error: {path}:{i}: row needs a problem field (problem/question/prompt) and an answer "
                             f"field (answer/solution/ground_truth), got keys {sorted(row) if isinstance(row, dict) else type(row).__name__}")
        problems.append({"prompt": str(row[pk]), "answer": str(row[ak]), "level": int(row.get("level", 0) or 0)})
    if not problems:
        raise SystemExit(f"error: data file {path!r} holds no rows")
    return problems


def load_data(spec: str, split: str, seed: int, prompt_key: str = "", answer_key: str = "") -> list[dict]:
    """`arith` (the built-in task, split 'train' or 'eval') or a path to a problem/answer file."""
    if spec == "arith":
        train, evals = arith_problems(seed=0)  # the task itself is fixed; --seed changes the order, not the problems
        return train if split == "train" else evals
    return load_problems(spec, prompt_key, answer_key)


def format_prompt(tok, problem: str, template: str = "auto", instruction: str = "") -> str:
    """The text the model sees: the tokenizer's chat template when it has one (or template='chat'), else a plain
    'Question: ... Answer:' template that asks for the final answer in \\boxed{}."""
    content = f"{problem}\n{instruction}" if instruction else problem
    if template == "chat" or (template == "auto" and getattr(tok, "chat_template", None)):
        return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True)
    if template not in ("auto", "plain"):
        raise SystemExit(f"error: --prompt_template {template!r}: choose auto, chat or plain")
    return f"Question: {problem}\n{instruction or BOXED_INSTRUCTION}\nAnswer:"


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
# 5. Verifier and reward. extract_answer/math_equal are the interface every caller uses; a first version (exact,
#    numeric and fraction equality) that a symbolic verifier replaces behind the same names.


def extract_answer(text: str, answer_format: str = "auto") -> str | None:
    """Content of the last balanced \\boxed{...}; else the last `Answer: ...` line; else None."""
    if answer_format in ("boxed", "auto"):
        start = text.rfind("\\boxed{")
        if start >= 0:
            depth, i = 0, start + len("\\boxed")
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1:j].strip()
    if answer_format in ("answer_line", "auto"):
        lines = re.findall(r"Answer\s*:\s*(.+)", text)
        if lines:
            return lines[-1].strip().strip("$").strip()
    return None


def _to_number(s: str):
    """A Fraction for integers, decimals and a/b or \\frac{a}{b}; None otherwise."""
    from fractions import Fraction
    s = s.replace(" ", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("−", "-")
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    if m:
        return (-1 if m.group(1) else 1) * Fraction(int(m.group(2)), int(m.group(3))) if int(m.group(3)) else None
    try:
        return Fraction(s.replace(",", "")) if len(s) < 100 else None
    except (ValueError, ZeroDivisionError):
        return None


def math_equal(pred: str | None, gold: str) -> bool:
    """True when pred and gold are the same answer: equal strings after trimming, or equal numbers (exact rationals)."""
    if pred is None:
        return False
    norm = lambda s: s.strip().strip("$").rstrip(".").replace(" ", "")  # noqa: E731
    if norm(pred) == norm(gold):
        return True
    a, b = _to_number(norm(pred)), _to_number(norm(gold))
    return a is not None and b is not None and a == b


def verify_batch(completions: list[str], golds: list[str], answer_format: str = "auto") -> list[bool]:
    """Correctness of every completion against its gold answer."""
    return [math_equal(extract_answer(c, answer_format), g) for c, g in zip(completions, golds)]


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
     "answer", "level", "prompt"}. `generate_fn(prompt_ids_list) -> (completions, truncated)` is the rollout engine."""
    prompt_ids = [tok(format_prompt(tok, p["prompt"], cfg.prompt_template, cfg.instruction),
                      add_special_tokens=False)["input_ids"] for p in problems]
    completions, truncated = generate_fn([ids for ids in prompt_ids for _ in range(G)])
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
    return groups


def dynamic_sampling(stream: "PromptStream", roll_fn, num_groups: int, gen_groups: int, max_gen_batches: int,
                     rank: int = 0, world_size: int = 1, enabled: bool = True) -> tuple[list[dict], dict]:
    """DAPO dynamic sampling: roll out batches of `gen_groups` fresh prompts (each rank its stride), keep the groups
    whose correctness is mixed (0 < #correct < G, judged on correctness, never the shaped reward), and repeat until
    `num_groups` groups are kept across all ranks or `max_gen_batches` batches were generated. Then truncate to exactly
    `num_groups` and hand each rank its stride. When the cap is hit it warns and returns what was kept (a multiple of
    the world size, possibly none): it never raises and never loops forever.

    Returns (this rank's kept groups, stats over every group generated on every rank)."""
    kept, generated, n_batches = [], [], 0
    while len(kept) < num_groups and n_batches < max_gen_batches:
        groups = all_gather_list(roll_fn(stream.next(gen_groups)[rank::world_size]))  # every rank sees every group
        n_batches += 1
        generated += groups
        kept += [g for g in groups if not enabled or 0 < sum(g["correct"]) < len(g["correct"])]
    if len(kept) < num_groups:
        print0(f"warning: dynamic sampling kept {len(kept)}/{num_groups} groups after {n_batches} generation batches "
               f"(--max_gen_batches); training on what was kept")
    kept = kept[:min(num_groups, len(kept) - len(kept) % world_size)]  # equal share per rank keeps FSDP in lockstep
    flat = lambda key: [x for g in generated for x in g[key]]  # noqa: E731
    stats = {"train/reward": sum(flat("reward")) / len(flat("reward")),
             "train/acc": sum(flat("correct")) / len(flat("correct")),
             "train/keep_rate": sum(0 < sum(g["correct"]) < len(g["correct"]) for g in generated) / len(generated),
             "train/num_gen_batches": n_batches, "train/num_groups": len(kept),
             "train/response_len": sum(map(len, flat("completions"))) / len(flat("completions")),
             "train/truncated_frac": sum(flat("truncated")) / len(flat("truncated"))}
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
    return {"input_ids": ids, "attention_mask": attn, "mask": mask,
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
        for s in range(0, len(problems[rank::world_size]), cfg.eval_batch_size):
            groups += roll_groups(generate_fn, tok, problems[rank::world_size][s:s + cfg.eval_batch_size], cfg,
                                  cfg.eval_samples)
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


def save_checkpoint(out_dir: str, step: int, model, tok, rank_state: dict, keep: int = 2):
    """Write step_<step>/ atomically: the model (rank 0) and one trainer-state file per rank; keep the newest `keep`."""
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
        model.save_pretrained(tmp, state_dict=state_dict)
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
    """The full (unsharded) model state dict; a plain state_dict outside FSDP."""
    return model.state_dict()
