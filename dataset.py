"""
Look up when needed: the data.
Problems (the built-in arith task, or files in the schemas docs/data.md lists), prompt templates,
eval sets and their samples per problem (--eval_data set@k), the seeded training stream.
"""
import json
import os
import random
import re

from modeling import DEMO_CHAT_TEMPLATE
from ranks import die, print0


# --------------------------------------------------------------------------------------------------
# Problems. A problem is a dict {"prompt": str, "answer": str, "level": int}
# (level 0 = unknown difficulty); the built-in task makes its own.
# The demo's eval set: 200 held-out sums in 5 levels of its own
# (the demo model's pass rate at start: 97% to 1%).
DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")
DEMO_EVAL = os.path.join(DEMO_DIR, "arith", "eval.jsonl")
ARITH_LEVELS = {1: (1, 1), 2: (2, 1), 3: (2, 2), 4: (3, 3)}  # level -> digits of the two operands


def arith_problems(seed: int, eval_per_level: int = 50,
                   train_per_level: int = 4000) -> tuple[list[dict], list[dict]]:
    """The built-in task, fixed by `seed`: (training rows, held-out rows disjoint from them).

    Each level of ARITH_LEVELS gives `train_per_level` training rows (levels 1 and 2 hold only
    100 and 900 distinct sums, so they repeat) and up to `eval_per_level` held-out ones, the pool
    demo/build.py calibrates DEMO_EVAL from.
    Example row: {"prompt": "47+3", "answer": "50", "level": 2}.
    """
    rng = random.Random(seed)
    train = []
    evals = []
    for level, (digits_a, digits_b) in ARITH_LEVELS.items():
        low_a = 10 ** (digits_a - 1) if digits_a > 1 else 0
        low_b = 10 ** (digits_b - 1) if digits_b > 1 else 0
        high_a = 10 ** digits_a
        high_b = 10 ** digits_b
        if (high_a - low_a) * (high_b - low_b) <= 10_000:  # small levels: every pair
            pairs = [(a, b) for a in range(low_a, high_a) for b in range(low_b, high_b)]
            rng.shuffle(pairs)
        else:  # large levels: distinct random pairs
            seen = set()
            pairs = []
            while len(pairs) < train_per_level + eval_per_level:
                pair = (rng.randrange(low_a, high_a), rng.randrange(low_b, high_b))
                if pair not in seen:
                    seen.add(pair)
                    pairs.append(pair)
        rows = [{"prompt": f"{a}+{b}", "answer": str(a + b), "level": level} for a, b in pairs]
        # level 1 has only 100 sums: hold out 20, learn from 80
        n_eval = min(eval_per_level, len(rows) // 5)
        evals += rows[:n_eval]
        train += [rows[n_eval + i % (len(rows) - n_eval)] for i in range(train_per_level)]
    rng.shuffle(train)
    return train, evals


# --------------------------------------------------------------------------------------------------
# Data files: rows in the schemas of docs/data.md, read into problems.
def _field(row: dict, key: str):
    """row["a"]["b"] for key "a.b"; None when any part is missing."""
    for part in key.split("."):
        if not isinstance(row, dict) or part not in row:
            return None
        row = row[part]
    return row


EMPTY = (None, "", [])
PROMPT_KEYS = ("problem", "question", "prompt")  # tried in order when --prompt_key is not given
ANSWER_KEYS = ("answer", "final_answer", "reward_model.ground_truth", "ground_truth")


def problem_from_row(row, where: str, prompt_key: str = "", answer_key: str = "") -> dict:
    """One problem from a data row; errors name `where`, the row's file and line. The problem and
    answer are read from `prompt_key` and `answer_key` ("a.b" for nested fields), or else from the
    first of PROMPT_KEYS and ANSWER_KEYS that the row fills (docs/data.md: the schemas)."""
    if not isinstance(row, dict):
        die(f"{where}: expected a JSON object per row, got {type(row).__name__}")
    prompt_keys = [prompt_key] if prompt_key else PROMPT_KEYS
    answer_keys = [answer_key] if answer_key else ANSWER_KEYS
    prompt = next((v for k in prompt_keys if (v := _field(row, k)) not in EMPTY), None)
    answer = next((v for k in answer_keys if (v := _field(row, k)) not in EMPTY), None)
    if prompt is None:
        die(f"{where}: no problem text (looked for {', '.join(prompt_keys)}; row keys: "
            f"{', '.join(sorted(row))}; set --prompt_key)")
    if answer is None:
        die(f"{where}: no answer (looked for {', '.join(answer_keys)}; row keys: "
            f"{', '.join(sorted(row))}; set --answer_key)")
    templated = isinstance(prompt, list)  # a chat-format prompt (DAPO-Math-17k), used as written
    if templated or not isinstance(answer, str) or "####" in answer:
        prompt, answer = _plain_text(prompt, answer)
    level = row.get("level", 0)
    level = int(level) if isinstance(level, int) or str(level).isdigit() else 0
    return {"prompt": str(prompt), "answer": answer, "level": level, "templated": templated}


def _plain_text(prompt, answer) -> tuple[str, str]:
    """The schemas' other forms, as text: a chat-format prompt's last user turn (DAPO-Math-17k), a
    list of final answers joined (OlympiadBench), GSM8K's final number after '####'."""
    if isinstance(prompt, list):
        turns = [m for m in prompt if isinstance(m, dict)]
        user_turns = [m.get("content", "") for m in turns if m.get("role") == "user"]
        prompt = user_turns[-1] if user_turns else ""
    if isinstance(answer, list):
        answer = ", ".join(map(str, answer))
    answer = str(answer)
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1].strip()
    return prompt, answer


def _jsonl_rows(path: str) -> list[tuple[str, object]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append((f"{path}:{i}", json.loads(line)))
            except json.JSONDecodeError as e:
                die(f"{path}:{i}: not valid JSON ({e.msg})")
    return rows


def _json_rows(path: str) -> list[tuple[str, object]]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        die(f"{path}:{e.lineno}: not valid JSON ({e.msg})")
    if isinstance(data, list):
        rows = data
    elif isinstance(data, dict):
        rows = data.get("data")
    else:
        rows = None
    if not isinstance(rows, list):
        die(f"{path}: expected a list of rows (or {{\"data\": [...]}})")
    return [(f"{path}: row {i}", r) for i, r in enumerate(rows, 1)]


def _parquet_rows(path: str) -> list[tuple[str, object]]:
    try:
        import pyarrow.parquet as pq  # optional dependency, only for parquet files
    except ImportError:
        die(f"{path}: reading parquet needs pyarrow (pip install pyarrow)")
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... on a corrupt file
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        die(f"{path}: not a readable parquet file ({first_line})")
    return [(f"{path}: row {i}", r) for i, r in enumerate(rows, 1)]


READERS = {".jsonl": _jsonl_rows, ".json": _json_rows, ".parquet": _parquet_rows}


def _rows(path: str) -> list[tuple[str, object]]:
    """(where, row) pairs of a .jsonl, .json or .parquet file; a bad file dies naming its line."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in READERS:
        die(f"data file {path!r}: unknown extension {ext!r} (use .jsonl, .json or .parquet)")
    return READERS[ext](path)


def load_problems(path: str, prompt_key: str = "", answer_key: str = "") -> list[dict]:
    """Problems from a .jsonl, .json or .parquet file; each error names the file and line."""
    if not os.path.isfile(path):
        die(f"data file {path!r} not found (use 'reasoning' or 'arith' for a demo's task)")
    problems = [problem_from_row(row, where, prompt_key, answer_key) for where, row in _rows(path)]
    if not problems:
        die(f"data file {path!r} holds no rows")
    return problems


def load_data(spec: str, split: str, prompt_key: str = "", answer_key: str = "") -> list[dict]:
    """Problems of `spec`: `arith` or `reasoning` (the demos' tasks), a .jsonl/.json/.parquet file,
    or a hub dataset `name` or `name:split`."""
    # the task is fixed; --seed changes the order of the training rows, not the rows
    if spec == "arith" and split == "train":
        return arith_problems(seed=0)[0]
    if spec == "arith":
        return load_problems(DEMO_EVAL)
    if spec == "reasoning":  # the reasoning demo's sums (demo/reasoning/README.md)
        return load_problems(os.path.join(DEMO_DIR, "reasoning", f"{split}.jsonl"))
    if os.path.exists(spec) or spec.endswith((".jsonl", ".json", ".parquet")):
        return load_problems(spec, prompt_key, answer_key)
    return hub_problems(spec, prompt_key, answer_key)


def hub_problems(spec: str, prompt_key: str = "", answer_key: str = "") -> list[dict]:
    """Problems of a hub dataset `name` or `name:split` (the `datasets` package; online)."""
    name, _, hub_split = spec.partition(":")
    try:
        import datasets
    except ImportError:
        die(f"data {spec!r}: no such file, and loading hub datasets needs `pip install datasets`")
    try:
        rows = datasets.load_dataset(name, split=hub_split or "train")
    except Exception as e:  # many types (offline, missing, bad split); the message says which
        die(f"data {spec!r}: cannot load it from the hub ({str(e).splitlines()[0]})")
    return [problem_from_row(row, f"{spec}: row {i}", prompt_key, answer_key)
            for i, row in enumerate(rows, 1)]


# --------------------------------------------------------------------------------------------------
# Prompts (formatted and tokenized once, at load), eval sets with unique names,
# the seeded training stream.
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# The text the model sees, by --prompt_template, in the tokenizer's chat template if any:
#   chat   the problem + "put your final answer within \\boxed{}"
#   plain  'Question: ... <boxed request> Answer:', never in a chat template (base models)
#   dapo   DAPO-Math-17k's wording (final line 'Answer: ...')
#   none   the problem text alone (the demo model; pre-templated rows)
TEMPLATES = {
    "chat": "{problem}\n" + BOXED_INSTRUCTION,
    "plain": "Question: {problem}\n" + BOXED_INSTRUCTION + "\nAnswer:",
    "dapo": ("Solve the following math problem step by step. The last line of your response "
             "should be of the form Answer: $Answer (without quotes) where $Answer is the "
             "answer to the problem."
             "\n\n{problem}\n\n"
             "Remember to put your answer on its own line after \"Answer:\"."),
    "none": "{problem}",
}


def format_prompt(tok, problem: str, template: str = "chat") -> str:
    """The problem in --prompt_template's wording (TEMPLATES), in the tokenizer's chat template
    unless the template is plain or the tokenizer has none."""
    text = TEMPLATES[template].replace("{problem}", problem)
    if template == "plain" or not getattr(tok, "chat_template", None):
        return text
    messages = [{"role": "user", "content": text}]
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def resolve_template(template: str, tok) -> str:
    """--prompt_template auto, resolved: none for the demo model and its checkpoints,
    else chat or plain."""
    if template != "auto":
        return template
    chat = getattr(tok, "chat_template", None)
    if chat == DEMO_CHAT_TEMPLATE:
        return "none"
    return "chat" if chat else "plain"


def tokenize_problems(problems: list[dict], tok, template: str, max_prompt_length: int,
                      name: str) -> list[dict]:
    """The problems with "prompt_ids" added, those over max_prompt_length tokens dropped with a
    warning (as verl does): one 6,000-token problem would pad a whole generation batch."""
    kept = []
    for p in problems:
        text = format_prompt(tok, p["prompt"], "none" if p.get("templated") else template)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= max_prompt_length:
            kept.append({**p, "prompt_ids": ids})
    if not kept:
        die(f"{name}: every one of its {len(problems)} prompts is longer than "
            f"--max_prompt_length {max_prompt_length}")
    dropped = len(problems) - len(kept)
    if dropped:
        print0(f"warning: {name}: dropped {dropped} of {len(problems)} problems whose prompt "
               f"is longer than --max_prompt_length {max_prompt_length} tokens")
    return kept


def parse_eval_data(eval_data: str, eval_samples: int) -> list[tuple[str, int]]:
    """--eval_data as (set, k) pairs, k its samples per problem (for avg@k, pass@k, maj@k). Sets
    are comma-separated, each with `@k` or else --eval_samples; a '/' or a file extension after the
    last '@' means no k.
    Example: 'aime24.jsonl@32,x@y.jsonl', 4 -> [('aime24.jsonl', 32), ('x@y.jsonl', 4)]."""
    out = []
    for item in (i.strip() for i in eval_data.split(",")):
        spec, at, suffix = item.rpartition("@")
        if not at or "/" in suffix or re.search(r"\.[A-Za-z]", suffix):
            spec, at, suffix = item, "", ""
        if not spec:
            die(f"--eval_data {eval_data!r}: an empty set name (write sets as a.jsonl,b.jsonl@32)")
        if at and not (suffix.isdigit() and int(suffix) >= 1):
            die(f"--eval_data {item!r}: the k after '@' must be a whole number >= 1 "
                f"(e.g. aime24.jsonl@32)")
        out.append((spec, int(suffix) if at else eval_samples))
    return out


def eval_set_names(specs: list[str]) -> list[str]:
    """A unique name per eval set, for its eval/<name>/... keys: the file's stem, unless two sets
    share it (distinct_names)."""
    stems = [os.path.splitext(os.path.basename(os.path.normpath(s)))[0] for s in specs]
    return stems if len(set(stems)) == len(stems) else distinct_names(specs)


def distinct_names(specs: list[str]) -> list[str]:
    """Names for sets that share a stem: the shortest tail of each path that tells it apart.
    Example: a/x.jsonl, b/x.jsonl -> a-x, b-x.
    """
    parts = [os.path.splitext(os.path.normpath(s))[0].split(os.sep) for s in specs]
    names = []
    for i, p in enumerate(parts):
        others = [q for j, q in enumerate(parts) if j != i]
        depth = 1
        while depth < len(p) and any(q[-depth:] == p[-depth:] for q in others):
            depth += 1
        names.append("-".join(p[-depth:]))
    # a path given twice gets its position
    return [n if names.count(n) == 1 else f"{n}-{i}" for i, n in enumerate(names)]


def spread(problems: list[dict], n: int) -> list[dict]:
    """n problems spread evenly over the list (files may be sorted by level);
    all of them when n is 0 or too large."""
    if not n or n >= len(problems):
        return problems
    return [problems[i * len(problems) // n] for i in range(n)]


def load_datasets(cfg) -> tuple[list[dict], dict[str, list[dict]]]:
    """(training set, {name: eval set}), untokenized: a bad file fails here in a second,
    before any model is loaded."""
    train = load_data(cfg.train_data, "train", cfg.prompt_key, cfg.answer_key)
    # the sets' names leave out their @k
    specs = [spec for spec, _ in parse_eval_data(cfg.eval_data, cfg.eval_samples)]
    evals = {}
    for name, spec in zip(eval_set_names(specs), specs):
        problems = load_data(spec, "eval", cfg.prompt_key, cfg.answer_key)
        evals[name] = spread(problems, cfg.eval_size)
    return train, evals


def tokenize_datasets(train: list[dict], evals: dict[str, list[dict]], tok, cfg):
    """load_datasets' sets, tokenized with --prompt_template (resolved by resolve_template)."""
    template = cfg.prompt_template
    train = tokenize_problems(train, tok, template, cfg.max_prompt_length, cfg.train_data)
    specs = [spec for spec, _ in parse_eval_data(cfg.eval_data, cfg.eval_samples)]
    tokenized = {}
    for (name, problems), spec in zip(evals.items(), specs):
        tokenized[name] = tokenize_problems(problems, tok, template, cfg.max_prompt_length, spec)
    return train, tokenized


def resolve_max_model_len(cfg, train: list[dict], evals: dict[str, list[dict]]) -> int:
    """--max_model_len, 0 resolved: the longest tokenized prompt of all sets + --max_new_tokens."""
    longest = max(len(p["prompt_ids"]) for problems in (train, *evals.values()) for p in problems)
    return cfg.max_model_len or longest + cfg.max_new_tokens


class PromptStream:
    """Endless, seeded stream of training problems, reshuffled each epoch.
    A resume needs only `position`."""

    def __init__(self, problems: list[dict], seed: int, position: int = 0):
        self.problems = problems
        self.seed = seed
        self.position = position  # problems drawn so far, over all epochs
        self._epoch = None  # the epoch whose order _order holds
        self._order = []

    def next(self, n: int) -> list[dict]:
        """The next n problems (the same on every rank; each rank then takes its stride)."""
        out = []
        for _ in range(n):
            epoch, i = divmod(self.position, len(self.problems))
            if self._epoch != epoch:  # a fresh permutation, seeded by (seed, epoch)
                self._order = list(range(len(self.problems)))
                random.Random(self.seed * 100_003 + epoch).shuffle(self._order)
                self._epoch = epoch
            out.append(self.problems[self._order[i]])
            self.position += 1
        return out
