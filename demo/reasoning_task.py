"""The reasoning demo's task: sums solved by a short column-by-column trace, a check, then \\boxed{answer}.

Example (prompt -> the completion the warm start teaches; `<eos>` ends it):
    347+86  ->  7+6=13,4+8+1=13,3+0+1=4 so 347+86=\\boxed{433}
Each column, least significant first, writes its two digits (0 where an operand has run out), the carry in (+1)
and their sum; the check " so A+B" spells the two operands back from the columns' digits (it must match the
prompt), and the boxed answer is the last digit of every column sum read backwards, led by the last carry.
verifier.extract_answer takes the last \\boxed{}, as for any model.

Slips and redos. Some warm-start traces carry a deliberate slip, in one of two places:
  - in a column (a wrong sum, a dropped or invented carry, a digit fetched from the wrong place), caught at once by
    " wait " and redone:          7+6=13,4+8=12 wait 4+8+1=13,3+0+1=4 so 347+86=\\boxed{433}
  - a digit fetched from the wrong place that goes unnoticed until the check spells an operand that is not the
    prompt's; then " wait " and the whole pass again:
                                  7+6=13,4+8+1=13,3+8+1=12 so 347+886 wait 7+6=13,4+8+1=13,3+0+1=4 so 347+86=...
The slipped columns are shown but never taught (no loss on them): the model learns to answer a wrong column or a
failed check with " wait " and a redo, not to slip. Under sampling its slips are its own: a model that is sure of a
sum finishes in one pass; one that is not slips, waits and redoes, and a redo of a long sum runs into
--max_new_tokens (cut off before its \\boxed{}: wrong). Harder sums (more digits, more carries) need more columns
and slip more, so completion length grows with difficulty and with being wrong, as in LLM reasoning RL, and DAPO's
overlong shaping and truncation matter. demo/build.py --task reasoning builds the model and data from this file.
"""
import random

SLIP_WORD = " wait "


def digits(n: int) -> list[int]:
    """Digits of n, least significant first."""
    return [int(c) for c in reversed(str(n))]


def columns(a: int, b: int) -> list[tuple[int, int, int, int]]:
    """(x, y, carry_in, sum) of every column of a + b, least significant first; operands padded with 0."""
    da, db = digits(a), digits(b)
    out, carry = [], 0
    for i in range(max(len(da), len(db))):
        x, y = da[i] if i < len(da) else 0, db[i] if i < len(db) else 0
        out.append((x, y, carry, x + y + carry))
        carry = (x + y + carry) // 10
    return out


def column_text(x: int, y: int, c: int, s: int) -> str:
    return f"{x}+{y}" + ("+1" if c else "") + f"={s}"


def slip(a: int, b: int, i: int, col: tuple[int, int, int, int], rng: random.Random) -> str:
    """A plausible wrong version of column i: a wrong sum, a dropped (or invented) carry, or a digit taken from the
    neighbouring column of its operand."""
    x, y, c, s = col
    kind = rng.randrange(3)
    if kind == 0:  # a wrong sum
        wrong = s + rng.choice((-1, 1, 10, -10) if s >= 10 else (-1, 1, 10))
        return column_text(x, y, c, max(0, wrong) if wrong != s else s + 1)
    if kind == 1:  # the carry dropped, or invented where there was none
        return column_text(x, y, 1 - c, x + y + 1 - c)
    da, db = digits(a), digits(b)  # a digit fetched from the neighbouring column
    which = rng.randrange(2)
    ops = da if which == 0 else db
    others = [ops[j] for j in (i - 1, i + 1) if 0 <= j < len(ops) and ops[j] != (x, y)[which]]
    if not others:
        return column_text(x, y, c, s + 1 if s % 10 != 9 else s - 1)
    d = rng.choice(others)
    x2, y2 = (d, y) if which == 0 else (x, d)
    return column_text(x2, y2, c, x2 + y2 + c)


def fetch_slip(a: int, b: int, i: int, col: tuple[int, int, int, int], rng: random.Random) -> tuple[int, int]:
    """(x, y) of column i with one digit fetched from the wrong place (a neighbouring column of the same operand, or
    the other operand's digit), for a slip that goes unnoticed until the final check."""
    x, y = col[:2]
    da, db = digits(a), digits(b)
    which = rng.randrange(2)
    ops = da if which == 0 else db
    cands = {ops[j] for j in (i - 1, i + 1) if 0 <= j < len(ops)} | {(y, x)[which]}
    cands.discard((x, y)[which])
    d = rng.choice(sorted(cands)) if cands else ((x, y)[which] + 1) % 10
    return (d, y) if which == 0 else (x, d)


def pass_segments(a: int, b: int, rng: random.Random | None, slip_rate: float, reslip_rate: float,
                  late: int = -1) -> tuple[list[tuple[str, bool]], int, int]:
    """One pass of columns. Column `late` (if >= 0) takes a wrong digit that goes unnoticed (not taught); the columns
    after it carry on correctly from what was written. Returns (segments, the operands the columns spell back)."""
    segments, xs, ys, carry = [], [], [], 0
    n = len(columns(a, b))
    da, db = digits(a), digits(b)
    for i in range(n):
        x, y = da[i] if i < len(da) else 0, db[i] if i < len(db) else 0
        col = (x, y, carry, x + y + carry)
        if i:
            segments.append((",", True))
        if i == late:
            x, y = fetch_slip(a, b, i, col, rng)
            col = (x, y, carry, x + y + carry)
            segments.append((column_text(*col), False))
        else:
            if rng is not None and rng.random() < slip_rate:
                segments += [(slip(a, b, i, col, rng), False), (SLIP_WORD, True)]
                while rng.random() < reslip_rate:
                    segments += [(slip(a, b, i, col, rng), False), (SLIP_WORD, True)]
            segments.append((column_text(*col), True))
        xs.append(x)
        ys.append(y)
        carry = col[3] // 10
    spell = lambda ds: int("".join(map(str, reversed(ds))))  # noqa: E731
    return segments, spell(xs), spell(ys)


def trace_segments(a: int, b: int, rng: random.Random | None = None, slip_rate: float = 0.0,
                   reslip_rate: float = 0.0, late_rate: float = 0.0) -> list[tuple[str, bool]]:
    """The completion for a + b as (text, taught) segments: a pass of columns, the check " so A+B" that spells the
    operands back from the columns' digits, and "=\\boxed{a + b}". With rng: each column slips with probability
    slip_rate (a redo slips again with probability reslip_rate), and the slip is followed by " wait " and the redo;
    with probability late_rate one column takes a wrong digit that goes unnoticed, the check then spells an operand
    that differs from the prompt, and " wait " starts the whole pass again. Slipped columns are not taught (taught
    False): the model sees them in context and learns to answer a wrong column, or a check that does not match the
    prompt, with " wait " and a redo, but it is never taught to slip; its slips under sampling are its own."""
    segments = []
    if rng is not None and rng.random() < late_rate:
        wrong, x2, y2 = pass_segments(a, b, rng, slip_rate, reslip_rate, late=rng.randrange(len(columns(a, b))))
        segments += wrong + [(f" so {x2}+{y2}", True), (SLIP_WORD, True)]
    right, _, _ = pass_segments(a, b, rng, slip_rate, reslip_rate)
    return segments + right + [(f" so {a}+{b}=\\boxed{{{a + b}}}", True)]


def trace(a: int, b: int, rng: random.Random | None = None, slip_rate: float = 0.0, reslip_rate: float = 0.0,
          late_rate: float = 0.0) -> str:
    """The completion text for a + b (trace_segments joined)."""
    return "".join(text for text, _ in trace_segments(a, b, rng, slip_rate, reslip_rate, late_rate))


# digits of the two operands -> share of the problems; the larger operand first, as in the arith task
DIGIT_MIX = {(1, 1): 1, (2, 1): 1, (2, 2): 2, (3, 2): 2, (3, 3): 3, (4, 3): 2, (4, 4): 2}


def random_sum(rng: random.Random, mix: dict = DIGIT_MIX) -> dict:
    """One problem {"prompt": "a+b", "answer", "digits": "da+db"} drawn from the mix (a, b uniform over their
    digit counts; 1-digit operands include 0)."""
    (da, db), = rng.choices(list(mix), weights=list(mix.values()))
    a = rng.randrange(10 ** (da - 1) if da > 1 else 0, 10 ** da)
    b = rng.randrange(10 ** (db - 1) if db > 1 else 0, 10 ** db)
    return {"prompt": f"{a}+{b}", "answer": str(a + b), "digits": f"{da}+{db}"}


def operands(prompt: str) -> tuple[int, int]:
    a, b = prompt.split("+")
    return int(a), int(b)


def problems(seed: int = 0, n_sft: int = 20_000, n_pool: int = 3_000) -> tuple[list[dict], list[dict]]:
    """The warm start's rows (n_sft draws from DIGIT_MIX; the small digit levels repeat, as in the arith task) and a
    pool of n_pool distinct sums none of which is a warm-start row, from which the eval set is calibrated. The RL
    training rows (train.jsonl) are the first rows of the warm start's, so no eval problem is a training row."""
    rng = random.Random(seed)
    sft = [random_sum(rng) for _ in range(n_sft)]
    seen, pool = {p["prompt"] for p in sft}, []
    while len(pool) < n_pool:
        p = random_sum(rng)
        if p["prompt"] not in seen:
            seen.add(p["prompt"])
            pool.append(p)
    return sft, pool


def carries(a: int, b: int) -> int:
    """Columns of a + b that carry."""
    return sum(s >= 10 for _, _, _, s in columns(a, b))
