"""
Look up when needed: the data. Problems (the built-in arith task, or files in the schemas docs/data.md lists),
prompt templates, eval sets and their samples per problem (--eval_data set@k), the seeded training stream.
"""
import json
import os
import random
import re

from modeling import DEMO_CHAT_TEMPLATE
from ranks import die, print0


# ------------------------------------------------------------------------------------------------------------
# Data files. A problem is a dict {"prompt": str, "answer": str, "level": int} (level 0 = unknown difficulty).
# the demo's eval set: 200 held-out sums, 5 levels of its own (the demo model's pass rate at start: 97% to 1%)
DEMO_EVAL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo", "arith", "eval.jsonl")
ARITH_LEVELS = {1: (1, 1), 2: (2, 1), 3: (2, 2), 4: (3, 3)}  # level -> digits of the two operands of a sum


def arith_problems(seed: int, eval_per_level: int = 50,
                   train_per_level: int = 4000) -> tuple[list[dict], list[dict]]:
    """The built-in task: training rows (sums at ARITH_LEVELS, fixed by `seed`; `train_per_level` a level,
    so levels 1 and 2, of only 100 and 900 distinct sums, repeat) and held-out sums disjoint from them, the
    pool demo/build.py calibrates DEMO_EVAL from. A row: {"prompt": "47+3", "answer": "50", "level": 2}."""
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
    """One problem from a row (errors name `where`, its file:line); keys tried in order unless given by flag:
      plain, MATH-500, AIME, OpenR1-Math-220k: problem | question, answer | final_answer
      DAPO-Math-17k: prompt (chat list, instruction included), reward_model.ground_truth
      GSM8K: question, answer ending in '#### <number>'"""
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
        die(f"{where}: no answer (looked for "
            f"{answer_key or 'answer, final_answer, reward_model.ground_truth'}; "
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
            die(f"{path}: not a readable parquet file "
                f"({str(e).splitlines()[0] if str(e) else type(e).__name__})")
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
    """`arith` (the built-in task), a .jsonl/.json/.parquet file, or a hub dataset `name` or `name:split`."""
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


# ------------------------------------------------------------------------------------------------------------
# Prompts (formatted and tokenized once, at load), eval sets with unique names, the seeded training stream.
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
DAPO_TEMPLATE = ("Solve the following math problem step by step. The last line of your response should be "
                 "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
                 "\n\n{problem}\n\nRemember to put your answer on its own line after \"Answer:\".")


def format_prompt(tok, problem: str, template: str = "chat") -> str:
    """The text the model sees, by --prompt_template, in the tokenizer's chat template if it has one:
      chat   the problem + "put your final answer within \\boxed{}"
      plain  'Question: ... <boxed request> Answer:', never in a chat template (base models)
      dapo   DAPO-Math-17k's wording (final line 'Answer: ...')
      none   the problem text alone (the demo model; pre-templated rows)"""
    text = {"chat": f"{problem}\n{BOXED_INSTRUCTION}",
            "plain": f"Question: {problem}\n{BOXED_INSTRUCTION}\nAnswer:",
            "dapo": DAPO_TEMPLATE.format(problem=problem), "none": problem}[template]
    if template != "plain" and getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
    return text


def resolve_template(template: str, tok) -> str:
    """--prompt_template auto, resolved: none for the demo model and its checkpoints, else chat or plain."""
    if template != "auto":
        return template
    chat = getattr(tok, "chat_template", None)
    return "none" if chat == DEMO_CHAT_TEMPLATE else "chat" if chat else "plain"


def tokenize_problems(problems: list[dict], tok, template: str, max_prompt_length: int,
                      name: str) -> list[dict]:
    """Add "prompt_ids" to each problem; drop, with a warning (as verl does), those whose prompt is over
    max_prompt_length tokens: one 6,000-token problem would pad a whole generation batch to its length."""
    kept = []
    for p in problems:
        text = format_prompt(tok, p["prompt"], "none" if p.get("templated") else template)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= max_prompt_length:
            kept.append({**p, "prompt_ids": ids})
    if not kept:
        die(f"{name}: every one of its {len(problems)} prompts is longer than "
            f"--max_prompt_length {max_prompt_length}")
    if len(kept) < len(problems):
        print0(f"warning: {name}: dropped {len(problems) - len(kept)} of {len(problems)} problems whose "
               f"prompt is longer than --max_prompt_length {max_prompt_length} tokens")
    return kept


def parse_eval_data(eval_data: str, eval_samples: int) -> list[tuple[str, int]]:
    """--eval_data as (set, k) pairs: comma-separated sets, each with `@k` its own samples per problem (for
    avg@k, pass@k, maj@k), else --eval_samples; a '/' or file extension after the last '@' means no k.
    Example: 'aime24.jsonl@32,x@y.jsonl', 4 -> [('aime24.jsonl', 32), ('x@y.jsonl', 4)]."""
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


def eval_set_names(specs: list[str]) -> list[str]:
    """A unique name per eval set, for its eval/<name>/... keys: the file's stem, or, when two sets share a
    stem, the shortest tail of their paths that tells them apart. E.g. a/x.jsonl, b/x.jsonl -> a-x, b-x."""
    parts = [os.path.splitext(os.path.normpath(s))[0].split(os.sep) for s in specs]
    names = []
    for i, p in enumerate(parts):
        depth = 1
        while depth < len(p) and any(q[-depth:] == p[-depth:] for j, q in enumerate(parts) if j != i):
            depth += 1
        names.append("-".join(p[-depth:]))
    return [n if names.count(n) == 1 else f"{n}-{i}" for i, n in enumerate(names)]  # a path given twice


def spread(problems: list[dict], n: int) -> list[dict]:
    """n problems spread evenly over the list (files may be sorted by level); all when n is 0 or too large."""
    if not n or n >= len(problems):
        return problems
    return [problems[i * len(problems) // n] for i in range(n)]


def load_datasets(cfg) -> tuple[list[dict], dict[str, list[dict]]]:
    """Training and eval sets, untokenized: a bad file fails here in a second, before any model is loaded."""
    train = load_data(cfg.train_data, "train", cfg.prompt_key, cfg.answer_key)
    specs = [spec for spec, _ in parse_eval_data(cfg.eval_data, cfg.eval_samples)]  # names leave out the @k
    evals = {name: spread(load_data(spec, "eval", cfg.prompt_key, cfg.answer_key), cfg.eval_size)
             for name, spec in zip(eval_set_names(specs), specs)}
    return train, evals


def tokenize_datasets(train: list[dict], evals: dict[str, list[dict]], tok, cfg):
    """Tokenize every set with --prompt_template (auto resolved for `tok`); resolve --max_model_len 0."""
    cfg.prompt_template = resolve_template(cfg.prompt_template, tok)
    train = tokenize_problems(train, tok, cfg.prompt_template, cfg.max_prompt_length, cfg.train_data)
    specs = [spec for spec, _ in parse_eval_data(cfg.eval_data, cfg.eval_samples)]
    evals = {name: tokenize_problems(problems, tok, cfg.prompt_template, cfg.max_prompt_length, spec)
             for (name, problems), spec in zip(evals.items(), specs)}
    longest = max(len(p["prompt_ids"]) for problems in (train, *evals.values()) for p in problems)
    cfg.max_model_len = cfg.max_model_len or longest + cfg.max_new_tokens
    return train, evals


class PromptStream:
    """Endless, seeded stream of training problems, reshuffled each epoch; a resume needs only `position`."""

    def __init__(self, problems: list[dict], seed: int, position: int = 0):
        self.problems, self.seed, self.position = problems, seed, position

    def next(self, n: int) -> list[dict]:
        """The next n problems (the same on every rank; each rank then takes its stride)."""
        out = []
        for _ in range(n):
            epoch, i = divmod(self.position, len(self.problems))
            if getattr(self, "_epoch", None) != epoch:  # a fresh permutation, seeded by (seed, epoch)
                self._order = list(range(len(self.problems)))
                random.Random(self.seed * 100_003 + epoch).shuffle(self._order)
                self._epoch = epoch
            out.append(self.problems[self._order[i]])
            self.position += 1
        return out
