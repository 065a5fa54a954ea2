"""
Math answer verifier for RL with verifiable rewards: is a model's final answer equal to the gold answer?

Pipeline, in increasing cost: extract_answer() pulls the final answer out of a completion (the last \\boxed{...},
else the last 'Answer: ...' line). Normalised string equality and plain-number equality then settle most pairs
inline, in microseconds. Only the rest get a symbolic comparison (our own LaTeX parser -> sympy objects -> exact,
high-precision and sample-point checks), which runs in a worker process with a hard deadline. An LRU cache in the
calling process remembers definite verdicts.

Public API:
  extract_answer(text, answer_format="auto") -> str | None        answer_format: "boxed" | "answer_line" | "auto"
  math_equal(pred, gold, timeout=1.0) -> bool                     one extracted answer against one gold answer
  verify_batch(completions, golds, answer_format="auto", timeout=1.0, num_workers=0) -> (list[bool], dict)
      extract and compare every pair; the dict counts what happened in this call: timeouts, symbolic (pairs sent to
      the workers), cached, inline, crashed, refused (too large to judge; logged with the reason), no_answer
  majority_vote(answers, timeout=1.0, num_workers=0) -> (index | None, votes)
      the most frequent of a problem's extracted answers, equivalent answers counted as one (maj@k); ties: the
      answer seen first
  close_verifier_pool()                                            stop the workers (also done at exit)

Safety model. Model output is untrusted input, and nothing here executes it: no eval, exec, sympify or parse_expr;
the parser builds sympy objects directly, and an answer can only reach a fixed table of functions and constants.
Sizes are bounded before sympy sees anything (answer length, bracket nesting, exponents, factorials, binomials);
an answer past one of these bounds is refused (counted and logged), never judged.
Every call returns within a time bound: extraction reads a completion of up to _MAX_TEXT characters in linear time
(each brace at most twice); an answer too long to parse is compared only if it is a plain number (of any length),
else refused, counted and logged, never mistaken for a missing answer; the symbolic step runs in a forked worker
process that is SIGKILLed at its deadline (`timeout` seconds per pair from its dispatch; a batch takes at most
about ceil(undecided pairs / workers) * timeout). Nothing raises on odd input: every doubtful case (unparseable,
refused, too slow, worker died) is "not equal", because a wrong verdict costs one noisy reward and a hang or a
crash costs the whole run.

Copying it into another project: this one file is the whole verifier. It imports only the standard library, sympy
and mpmath (`pip install sympy` brings both), and it needs the 'fork' start method (Linux; why in section 5).
Copy verifier.py next to your code and `from verifier import verify_batch, math_equal, extract_answer`.

Command line (exit 0 = equal, 1 = not equal, 2 = bad input):
  python verifier.py '\\frac{1}{2}' 0.5                         prints "equal"
  python verifier.py --extract 'so it is \\boxed{4}.' 4         PRED is a whole completion: extract its answer first
  python verifier.py --jsonl pairs.jsonl                       one {"pred" or "completion": ..., "gold": ...} per line
  python verifier.py --help                                    every flag

Sections: 1 extraction, 2 normalisation and plain numbers, 3 parser, 4 comparison, 5 worker pool, 6 public API, 7 CLI.
"""
import argparse
import atexit
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import random
import re
import signal
import sys
import threading
import time
from collections import OrderedDict, deque
from decimal import Decimal
from fractions import Fraction

import mpmath
import sympy as sp
from sympy.solvers.solveset import solveset  # imported eagerly so forked workers never import lazily

__all__ = ["extract_answer", "math_equal", "verify_batch", "close_verifier_pool"]

# ------------------------------------------------------------------------------------------------------------
# Limits and tolerances, shared by all sections.

# Safety bounds, all checked before sympy sees anything: together they cap what one hostile or degenerate
# completion can cost (megabytes of text, 9^9^9^9, ((((...)))) nesting) at about one worker timeout per pair.
_MAX_TEXT = 4_000_000     # longer completions are refused (counted, logged), never scanned: ~1M tokens
_MAX_BOXES = 1000         # only a completion's last 1000 \boxed (and 'Answer:' lines) are candidates
_MAX_BRACES = 100_000     # a first look at the last box stops after this many braces (the full pass does not)
_MAX_LEN = 1000           # answers longer than this (after normalising) are never parsed
_MAX_RAW = 4 * _MAX_LEN   # longer raw answers are compared only as plain numbers (any length), else refused
_MAX_NEST = 50            # bracket nesting limit; keeps the recursive-descent parser far from RecursionError
_MAX_EXP = 10_000         # largest exponent magnitude we will ever build (blocks 9^9^9^9, 10^{10^{10}})
_MAX_BITS = 100_000       # largest integer power we let sympy evaluate (about 30k digits)
# A decimal was rounded by whoever wrote it (3.1416 for pi is right), so it gets a relative tolerance; integers
# and fractions are exact, and a tolerance on them would accept 12000023 for 12000024 (they differ by 8e-8).
_REL_TOL = 1e-4           # relative tolerance, used only when an answer contains a decimal literal
_CACHE_SIZE = 100_000     # LRU entries keyed by the normalised (pred, gold) pair
_MAX_TASKS_PER_WORKER = 5000  # recycle workers now and then: sympy caches grow without bound
_LOG = logging.getLogger("verifier")  # one warning per call that refused an answer, with the reason


# ------------------------------------------------------------------------------------------------------------
# 1. Answer extraction: the last \boxed{...} (or \fbox) of a completion, else its last 'Answer: ...' line.
#    Python's re cannot match nested braces, so braces are paired by forward scans that jump from brace to brace
#    (_BRACE_RE); nothing here backtracks. The whole completion is searched (an answer followed by megabytes of
#    text is still found), at most twice per character, and memory stays at _MAX_BOXES candidates plus the answer.

# (?![a-zA-Z]) keeps longer macro names out; the group holds the spaces of `\boxed 5`.
_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])( *)")
_BRACE_RE = re.compile(r"\\.|[{}]", re.DOTALL)  # an escaped character (\{ \} \\: skipped) or a brace
_BOX_TOKEN_RE = re.compile(r"[^\s$]{1,200}")  # the single token of `\boxed 5`
# [^\S\n] is whitespace within the line; [>*#_] lets '**Answer:**', '> Answer:' and '## Answer:' match.
_ANSWER_LINE_RE = re.compile(r"^(?:[^\S\n]|[>*#_])*answer[^\S\n]*:[^\S\n]*(.*)$", re.IGNORECASE | re.MULTILINE)


def _closing_brace(text: str, open_pos: int, max_steps: int = -1) -> int | None:
    """Index of the '}' closing the '{' at open_pos (one forward scan); None if it never closes, or not within
    max_steps braces and escapes (-1: no limit)."""
    depth = 0
    for m in _BRACE_RE.finditer(text, open_pos):
        max_steps -= 1
        if max_steps == -1:
            return None
        brace = m.group()
        if brace == "{":
            depth += 1
        elif brace == "}":
            depth -= 1
            if depth == 0:
                return m.start()
    return None


def _closing_braces(text: str, opens: list[int]) -> dict:
    """The closing '}' of each '{' in `opens` (sorted positions), in one forward pass from the first: a
    separate scan per box would cost len(text) per unbalanced box. Boxes that never close are absent."""
    closes, pending, depth = {}, [], 0  # pending: (position, depth before it) of the open boxes
    wanted = set(opens)
    for m in _BRACE_RE.finditer(text, opens[0]):
        brace = m.group()
        if brace == "{":
            if m.start() in wanted:
                pending.append((m.start(), depth))
            depth += 1
        elif brace == "}" and depth:  # an unmatched '}' closes nothing
            depth -= 1
            if pending and pending[-1][1] == depth:
                closes[pending.pop()[0]] = m.start()
            if not pending and m.start() > opens[-1]:
                break  # every box has been seen and none is open
    return closes


def _last_boxed(text: str) -> str | None:
    """Content of the last balanced, non-empty \\boxed{...} / \\fbox{...} (or `\\boxed 5`), else None."""
    # The last box wins: models box intermediate results too, and the final answer comes last (the rule of
    # last_boxed_only_string in the MATH benchmark's code, reused by lm-eval and verl). Empty boxes are passed over.
    boxes = deque(((m.end(), bool(m.group(1))) for m in _BOX_RE.finditer(text)), maxlen=_MAX_BOXES)

    def content(j: int, spaced: bool, closes: dict) -> str | None:
        if text.startswith("{", j):
            k = closes.get(j)
            return None if k is None else text[j + 1:k].replace("\x00", "").strip() or None
        if spaced:  # `\boxed 5`: a space then a single token (lm-eval / verl convention)
            token = _BOX_TOKEN_RE.match(text, j)
            return token.group(0).rstrip(".,;") or None if token else None
        return None

    if not boxes:
        return None
    # The last box nearly always holds the answer and closes soon: its own scan usually settles the completion. It
    # stops after _MAX_BRACES braces (no answer has that many), so no brace is scanned more than twice in all.
    j, spaced = boxes[-1]
    answer = content(j, spaced, {j: _closing_brace(text, j, _MAX_BRACES)} if text.startswith("{", j) else {})
    if answer is not None:
        return answer
    opens = [j for j, _ in boxes if text.startswith("{", j)]
    closes = _closing_braces(text, opens) if opens else {}
    for j, spaced in reversed(boxes):
        answer = content(j, spaced, closes)
        if answer is not None:
            return answer
    return None  # unbalanced or empty boxes do not count


def _clean_answer_value(value: str) -> str:
    """Strip markdown bold, math delimiters, a wrapping \\boxed and a trailing period from an answer line."""
    value = value.replace("\x00", "").strip().strip("*").strip().rstrip(".").strip()
    boxed = _last_boxed(value) if "\\boxed" in value or "\\fbox" in value else None
    if boxed is not None:
        return boxed
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if value.startswith(left) and value.endswith(right) and len(value) >= len(left) + len(right):
            value = value[len(left):len(value) - len(right)].strip()
    return value.rstrip(".").strip()


def extract_answer(text: str, answer_format: str = "auto") -> str | None:
    """Return the final answer in `text` (last \\boxed{} and/or last 'Answer:' line), or None."""
    # Never raises: a reward function that throws on one odd completion would stop a training step. A text over
    # _MAX_TEXT characters gives None here; verify_batch counts it as refused, not as a missing answer.
    try:
        if not isinstance(text, str) or answer_format not in ("boxed", "answer_line", "auto"):
            return None
        if len(text) > _MAX_TEXT:
            return None
        if answer_format in ("boxed", "auto"):
            boxed = _last_boxed(text)
            if boxed is not None or answer_format == "boxed":
                return boxed  # a \boxed answer takes priority over any 'Answer:' line
        # Last line first, for the same reason as the last box: earlier 'Answer:' lines may be drafts.
        for m in reversed(deque(_ANSWER_LINE_RE.finditer(text), maxlen=_MAX_BOXES)):
            value = _clean_answer_value(m.group(1))
            if value:
                return value
        return None
    except Exception:
        return None


# ------------------------------------------------------------------------------------------------------------
# 2a. String normalisation. _normalize maps the many spellings of one answer (\dfrac, 90^\circ, '10 cm', a unicode
#     minus) to one string; _quick_check (2b) then settles most pairs inline, in microseconds and without sympy:
#     string, word, clock-time and exact-number equality.
#     Everything here is plain string work on at most 4 * _MAX_LEN chars (_verify_pairs refuses longer answers) with
#     linear regexes (no nested quantifiers), so it cannot be made slow by its input.

# Unicode math that models (and some gold files) write, as the LaTeX the parser knows. U+00BA, the ordinal
# indicator, is a common stand-in for the degree sign.
_UNICODE = {"\u2212": "-", "\u2013": "-", "\u00d7": "\\times ", "\u00f7": "\\div ", "\u00b7": "\\cdot ",
            "\u03c0": "\\pi ", "\u221e": "\\infty ", "\u221a": "\\sqrt", "\u2264": "\\le ", "\u2265": "\\ge ",
            "\u2260": "\\ne ", "\u00b1": "\\pm ", "\u222a": "\\cup ", "\u2208": "\\in ", "\u00ba": "\u00b0",
            "\u2229": "\\cap ", "\u2216": "\\setminus ", "\u2205": "\\emptyset ", "\u211d": "\\Reals ",
            "\u2115": "\\Naturals ", "\u2124": "\\Integers ", "\u211a": "\\Rationals ", "\u2102": "\\Complexes "}
# Superscript digits and signs (10 and a superscript 6, x and a superscript 2) as a LaTeX exponent.
_SUPERSCRIPTS = str.maketrans("\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207a\u207b",
                              "0123456789+-")
_SUPERSCRIPT_RE = re.compile("[\u2070\u00b9\u00b2\u00b3\u2074-\u2079\u207a\u207b]+")
# Display-math delimiters around an answer (\[ ... \], equation environments); `\\[2pt]` is a line break.
_DISPLAY_RE = re.compile(r"(?<!\\)\\[\[\]]|\\(?:begin|end)\{(?:equation|displaymath|math)\*?\}")
# Named number sets, however written (\mathbb{R}, \mathbb R, \Bbb{R}, \R), as one command each. This runs before
# \mathbb's content is unwrapped, which would leave a bare R: a variable.
_NAMED_SET_RE = re.compile(r"\\(?:mathbb|Bbb)\s*(?:\{\s*([RNZQC])\s*\}|([RNZQC])(?![a-zA-Z]))"
                           r"|\\([RNZQC])(?![a-zA-Z])")
_SET_COMMANDS = {"R": "\\Reals ", "N": "\\Naturals ", "Z": "\\Integers ", "Q": "\\Rationals ",
                 "C": "\\Complexes "}
# Whole answers that name a set in words, in their canonical LaTeX (matched after normalising, ignoring case).
_SET_PHRASES = [(re.compile(p, re.IGNORECASE), latex) for p, latex in [
    (r"(?:the set of |the )?(?:all )?real numbers|all reals|(?:any|every) real number", "\\Reals"),
    (r"(?:there (?:is|are) )?no (?:real )?solutions?|(?:the )?empty set", "\\emptyset"),
    (r"(?:the set of |the )?(?:all )?integers", "\\Integers"),
    (r"(?:the set of |the )?(?:all )?positive integers", "\\Integers^+"),
    (r"(?:the set of |the )?(?:all )?non-?negative integers", "\\Integers_{\\ge 0}"),
    (r"(?:the set of |the )?(?:all )?natural numbers", "\\Naturals")]]
_SCALE_WORDS = {"thousand": 3, "million": 6, "billion": 9, "trillion": 12}  # '2.5 million' = 2.5 \times 10^{6}
# Wrappers whose content is kept: a unit ('\text{cm}'), a word ('\text{odd}') or a choice ('\textbf{(B)}').
_TEXT_CMDS = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|textup|mathrm|mathbf|mathit|mathsf|mathtt"
                        r"|mbox|operatorname|boldsymbol|mathbb|mathcal)\s*\{")
_TRIG_RE = re.compile(r"\\(?:sin|cos|tan|sec|csc|cot)")
_DEGREE_RE = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\\degree|\u00b0")
# A unit word: two or more letters, maybe a period and a small power (cm^2, sq., meters). One letter is a variable.
_UNIT_WORD = re.compile(r"[a-zA-Z]{2,}\.?(?:\^\{?\d\}?)?")
# Compound units ('km/h', 'm/s^2', 'kg\cdot m', 'J/(kg K)') are made of unit atoms. An atom is a
# unit word, or one of the letters below. Those letters are units only where an answer says so:
# inside \text{} or \mathrm{}, or joined to another atom in a bare compound. There is no e, i or d
# among them: \mathrm{e}, \mathrm{i} and \mathrm{d} are Euler's number, i and a differential.
_UNIT_LETTERS = "msghlLNJWVAK"  # metre, second, gram, hour, litre, newton ... kelvin
# Words that follow a number without being units: _normalize reads them after the units are gone.
_NOT_UNITS = r"(?:thousand|million|billion|trillion|percent|and|or)\b"
_UNIT_NAME = rf"(?:(?!{_NOT_UNITS})[a-zA-Z]{{2,}}\.?|[{_UNIT_LETTERS}])"
_UNIT_POWER = r"(?:\^\{?-?\d\}?)?"  # ^2, ^{-1}: on an atom, or on a bracket ('(kg m)^2')
_UNIT_ATOM = rf"\(*{_UNIT_NAME}{_UNIT_POWER}\)*{_UNIT_POWER}"
# The content of a \text{} or \mathrm{} that is a unit: atoms joined by '/', '\cdot', '*' or spaces.
_UNIT_JOIN = r"(?:\s*(?:/|\\cdot|\*|\\[,;: !])\s*|\s+)"
_TEXT_UNIT_RE = re.compile(rf"\s*{_UNIT_ATOM}(?:{_UNIT_JOIN}{_UNIT_ATOM})*\s*")
# The wrappers a unit is written in; the glue that may stand between and after them
# ('\text{m}/\text{s}^2', '\mathrm{kg}\,\mathrm{m}').
_UNIT_WRAPPER = re.compile(r"\\(?:text|textrm|textnormal|textup|mathrm|mbox)\s*\{")
_UNIT_GLUE = re.compile(r"(?:\s|\\[,;: !]|~|/|\\cdot|\*|[().]|\^\s*(?:\{\s*-?\d\s*\}|-?\d))*")
# A bare compound unit after a number: two atoms or more ('12 m/s', '5 kg\cdot m', normalised).
_BARE_UNIT_RE = re.compile(rf"(.*\d) ({_UNIT_ATOM}(?:(?:/|\\cdot ?){_UNIT_ATOM})+)")
# Answers made of words only ('odd', 'Evelyn', 'no solution'): compared as text, never parsed as products.
_WORDS_RE = re.compile(r"[A-Za-z]+(?: [A-Za-z]+)*")


def _unwrap_text_commands(s: str) -> str:
    """Replace \\text{X}, \\mathrm{X}, ... by X (content kept: it may be a unit, a word or a choice)."""
    for _ in range(100):  # each round removes one wrapper; real answers have a handful
        m = _TEXT_CMDS.search(s)
        if not m:
            break
        close = _closing_brace(s, m.end() - 1)  # the '}' matching the wrapper's '{'
        if close is None:
            break
        inner = s[m.end():close]
        rest = s[close + 1:]
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


def _ends_in_number(head: str) -> bool:
    """Does `head` end in a digit or a '}', its trailing spaces and spacing macros (\\, ~) aside?"""
    i = len(head)
    while i:
        if i >= 2 and head[i - 2] == "\\" and head[i - 1] in ",;:! ":
            i -= 2
        elif head[i - 1].isspace() or head[i - 1] == "~":
            i -= 1
        else:
            break
    return i > 0 and head[i - 1] in "0123456789}"


def _strip_text_units(s: str) -> str:
    """Drop a unit written as text after a number. Examples: '12 \\text{ km/h}' -> '12';
    '4\\,\\mathrm{m}/\\mathrm{s}^2' -> '4'; '5 \\text{kg}\\cdot\\text{m}' -> '5'.
    '5+2\\mathrm{i}' stays as it is: i is no unit."""
    # The chain of unit wrappers at the end is walked backwards, from the last wrapper to the first.
    # Each wrapper in the chain closes before the chain found so far, so their brace scans do not
    # overlap; only the scan that ends the walk can run further. Linear in all.
    cut = len(s)  # where the unit chain found so far begins
    for m in reversed(list(_UNIT_WRAPPER.finditer(s))):
        close = _closing_brace(s, m.end() - 1)
        if close is None or close >= cut:
            break
        if not _UNIT_GLUE.fullmatch(s, close + 1, cut):
            break
        if not _TEXT_UNIT_RE.fullmatch(s, m.end(), close):
            break
        cut = m.start()
    if cut < len(s) and _ends_in_number(s[:cut]):
        return s[:cut]
    return s


def _without_bare_unit(s: str) -> str | None:
    """A normalised answer without the bare compound unit it ends in, or None if it ends in none.
    Examples: '12 m/s' -> '12'; '5 kg\\cdot m' -> '5'; '12 x/y' -> None."""
    m = _BARE_UNIT_RE.fullmatch(s)
    return m.group(1) if m else None


def _normalize(s: str) -> str:
    """Canonical string form of an answer: the key for string equality, the cache and the parser input."""
    # The order matters: units written as text go before their wrappers do, bare unit words go after
    # whitespace is collapsed, and the spaces they needed go last.
    s = "".join(ch for ch in str(s) if ch >= " " or ch in "\t\n").strip()
    if "\\boxed" in s or "\\fbox" in s:
        s = _last_boxed(s) or s  # gold answers sometimes arrive boxed too
    s = _SUPERSCRIPT_RE.sub(lambda m: "^{" + m.group().translate(_SUPERSCRIPTS) + "}", s)
    for k, v in _UNICODE.items():
        s = s.replace(k, v)
    s = s.replace("\\$", "").replace("$", "").replace("\\(", "").replace("\\)", "")  # currency and math delimiters
    s = _DISPLAY_RE.sub("", s)
    s = _NAMED_SET_RE.sub(lambda m: _SET_COMMANDS[m.group(1) or m.group(2) or m.group(3)], s)
    s = re.sub(r"\\(?:left|right)\.", "", s)  # invisible delimiters
    s = re.sub(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big|displaystyle)(?![a-zA-Z])", "", s)
    # Display-style variants mean the same value: one spelling keeps string equality and the cache key effective.
    s = re.sub(r"\\[dtc]frac(?![a-zA-Z])", r"\\frac", s)
    s = re.sub(r"\\[dt]binom(?![a-zA-Z])", r"\\binom", s)
    s = _strip_text_units(s)  # before the wrappers go: a unit letter is only a unit inside one
    s = _unwrap_text_commands(s)
    s = s.replace("\\%", "%").replace("{,}", ",")
    s = re.sub(r"\s*\bpercent\b", "%", s)
    s = re.sub(r"(\d)\s*(thousand|million|billion|trillion)\b",
               lambda m: f"{m.group(1)}\\times10^{{{_SCALE_WORDS[m.group(2)]}}}", s)
    # Spacing macros (thin spaces, quad, ~). The alternation consumes a double backslash (matrix row break)
    # first and keeps it, so its second backslash is never mistaken for the start of a spacing macro.
    s = re.sub(r"\s*\\!\s*|\\\\|\\[,;: ]|\\q?quad(?![a-zA-Z])|~",
               lambda m: m.group(0) if m.group(0) == "\\\\" else ("" if "!" in m.group(0) else " "), s)
    # Degrees: '90^\circ' means 90 unless a trig function needs it in radians (sin(90^\circ - x) = cos x).
    s = _DEGREE_RE.sub("\u00b0" if _TRIG_RE.search(s) else "", s)
    # Lists joined by words: '19, 46, and 82', 'x = 2 or x = -3', 'x = 2 \lor x = -3'; an ellipsis in a list.
    s = re.sub(r"(?:,\s*)?(?:\b(?:and|or)\b|\\lor(?![a-zA-Z]))", ",", s)
    s = re.sub(r",\s*(?:\.\.\.|\u2026)", ",\\\\ldots ", s)
    s = re.sub(r"(?:\.\.\.|\u2026)\s*,", "\\\\ldots,", s)
    s = re.sub(r"\s+", " ", s).strip()
    s = _strip_units(s)
    s = re.sub(r"(?:\s|\\\\|\\|\.)+$", "", s)  # trailing periods and stray backslashes
    s = s.strip(" ,")
    # Spaces only matter between two alphanumerics ('2^6 3^5', '\pi r', '1 000'), and after a comma that would
    # otherwise read as a thousands separator: '7, 125' is a list, never 7125 (a \x01 holds it meanwhile).
    s = re.sub(r"(?<=\d), (?=\d{3}(?!\d))", ",\x01", s)
    s = re.sub(r" (?=[^A-Za-z0-9])|(?<=[^A-Za-z0-9]) ", "", s).replace("\x01", " ")
    s = re.sub(r"([_^])\{(\w)\}", r"\1\2", s)  # x_{7} -> x_7, x^{2} -> x^2
    for phrase, latex in _SET_PHRASES:
        if phrase.fullmatch(s):
            return latex
    return s


# ------------------------------------------------------------------------------------------------------------
# 2b. Plain-number fast paths and _quick_check, the inline verdict that most pairs never get past.

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


# A number whose commas may be thousands separators: every group after the first has three digits. Spaces between
# such groups ('1 000', LaTeX's thin space) can only be thousands separators.
_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_SPACED_RE = re.compile(r"[-+]?\d{1,3}(?: \d{3})+(?:\.\d+)?")


def _parse_number(s: str) -> tuple[Fraction, bool, bool] | None:
    """Parse a plain number -> (value, has_decimal_point, is_percent); None if `s` is anything else."""
    pct = s.endswith("%")
    s = s[:-1] if pct else s
    # Only well-formed groups of three digits are separators, so the list '1,2' never reads as 12.
    if _THOUSANDS_RE.fullmatch(s) or _SPACED_RE.fullmatch(s):
        s = s.replace(",", "").replace(" ", "")  # thousands separators: 7,425,000 / 1 000
    m = _NUM_RE.fullmatch(s) or _SCI_RE.fullmatch(s.replace(" ", ""))  # '2.5\times 10^6': a space is kept there
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


# ------------------------------------------------------------------------------------------------------------
# 3a. Parser: normalised answer -> tokens -> sympy objects, built by hand. sympify/parse_expr run Python's eval on
#     their input (sympy's docs warn against using them on unsanitised strings), so they are never called here.
#     Anything that could explode (powers, factorials, binomials, sums) is size-checked before sympy evaluates it,
#     and anything not understood raises _ParseError, which every caller reads as "not equal".
#     3a: containers, tokens and guarded arithmetic; 3b: the _Parser class; 3c: _parse_answer, its entry point.


class _ParseError(Exception):
    """An answer the parser does not understand or refuses to build; callers turn it into 'not equal'."""
    pass


class _Refused(_ParseError):
    """An answer over a size bound: an exponent, power, factorial, binomial or nesting. It equals
    nothing, and it is counted as refused (info["refused"]), apart from answers the parser cannot
    read. Its message is the reason, as the log line gives it."""
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


class _SetOp:
    """A set difference or intersection, 'A \\setminus B' (also 'A - B' of sets) or 'A \\cap B'."""
    def __init__(self, op, left, right):
        self.op, self.left, self.right = op, left, right


class _Ellipsis:
    """The list item '\\ldots' (or \\dots, \\cdots, '...'): the list goes on (_progression)."""
    pass


_ELLIPSIS = _Ellipsis()
_ELLIPSES = {"\\ldots", "\\dots", "\\cdots", "\\dotsc", "\\dotsb"}
# Named sets (_normalize writes every spelling as one of these commands). \\Naturals alone is read both as
# {1, 2, ...} and as {0, 1, 2, ...}: texts disagree on whether 0 is a natural number (see _parse_answer).
_NAMED_SETS = {"Reals": sp.Reals, "Integers": sp.Integers, "Rationals": sp.Rationals, "Complexes": sp.Complexes,
               "Naturals": sp.Naturals}


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
_NOT_ATOM = {"cdot", "times", "div", "pm", "mp", "cup", "cap", "setminus", "right", "end", "rfloor", "rceil",
             "rvert", "\\", "{", "}", "&"} | {k[1:] for k in _RELOPS if k.startswith("\\")}


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


def _is_set(x) -> bool:
    """Sets: named or built (sympy Set, _SetOp), braces, unions; their '-' is a set difference."""
    return isinstance(x, (sp.Set, _SetOp)) or (isinstance(x, _Coll) and x.kind in ("set", "union"))


def _progression(items: list) -> sp.Set:
    """A list or set with an ellipsis, of integers in steps of one size, as a sympy set. Examples:
    '1, 2, 3, \\ldots' -> Range(1, oo) (the positive integers); '\\ldots, -1, 0, 1, \\ldots' -> the integers;
    '1, 3, \\ldots, 9' -> {1, 3, 5, 7, 9}; '\\ldots, -2, -1' -> Range(-oo, 0). Anything else: _ParseError."""
    dots = [i for i, x in enumerate(items) if x is _ELLIPSIS]
    values = [x for x in items if x is not _ELLIPSIS]
    if not all(isinstance(x, sp.Integer) for x in values) or len(dots) > 2:
        raise _ParseError("a progression of integers only")
    known = values if dots in ([0], [len(items) - 1], [0, len(items) - 1]) else items[:dots[0]]
    steps = {b - a for a, b in zip(known, known[1:])}
    if len(known) < 2 or len(steps) != 1 or 0 in steps:
        raise _ParseError("no common step")
    step = steps.pop()
    if dots == [0, len(items) - 1]:  # infinite both ways: only all the integers
        if abs(step) != 1:
            raise _ParseError("unsupported progression")
        return sp.Integers
    # Infinite ones are written with a positive step, so that one set has one form: {-1, -2, ...} is Range(-oo, 0).
    if dots == [len(items) - 1]:
        return sp.Range(values[0], sp.oo, step) if step > 0 else sp.Range(-sp.oo, values[0] - step, -step)
    if dots == [0]:
        return sp.Range(-sp.oo, values[-1] + step, step) if step > 0 else sp.Range(values[-1], sp.oo, -step)
    # one ellipsis inside: '1, 2, \\ldots, 10'; every item after it must lie on the same progression
    tail = items[dots[0] + 1:]
    if len(dots) != 1 or any((x - values[0]) % step or (x - values[0]) / step < len(known) for x in tail):
        raise _ParseError("items after the ellipsis are off the progression")
    if any(b - a != step for a, b in zip(tail, tail[1:])):
        raise _ParseError("no common step")
    return sp.Range(values[0], tail[-1] + step, step)


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
            raise _Refused(f"an answer with an exponent over {_MAX_EXP:,}")
        if base.is_Rational and abs(base) not in (0, 1):  # estimate the size of the exact result first
            # an upper bound on the bits of base^exp, without computing it: 3^100 is put at 200 bits (really 159)
            bits = max(int(base.p).bit_length(), int(base.q).bit_length()) * float(abs(exp))
            if bits > _MAX_BITS:
                raise _Refused(f"an answer with a power of over {_MAX_BITS:,} bits")
    elif exp.is_number and not exp.free_symbols and base.is_number:
        if abs(complex(exp.evalf(15))) > _MAX_EXP:  # e.g. 2^{10^5 \pi}
            raise _Refused(f"an answer with an exponent over {_MAX_EXP:,}")
    try:
        return base ** exp
    except Exception as e:
        raise _ParseError(str(e))


# ------------------------------------------------------------------------------------------------------------
# 3b. The parser class. Its sub-banners: token cursor, precedence levels, atoms, commands.

# Grammar of _Parser, lowest precedence first ({x}: zero or more, [x]: optional). One method per rule.
#   groups   := list {';' list}                                  'p=5,q=2;p=7,q=2': a list of tuples
#   list     := relation {',' relation} [',']                    an unordered answer list
#   relation := union {RELOP union}                              =, <, \le, \ne, \approx, \in; chains allowed
#   union    := additive {('\cup' | '\cap' | '\setminus') additive}   sets; '-' between sets is \setminus too
#   additive := term {('+' | '-') term}
#   term     := unary {('*' | \cdot | \times | '/' | \div | ':') unary | power}   a bare power: implicit product
#   unary    := ('-' | '+') unary | power                        so -x^2 is -(x^2)
#   power    := postfix ['^' exponent];   exponent := '-' exponent | power       (right-associative)
#   postfix  := atom {'!' | '%' | '°' | "'"}
#   atom     := number | letter ['_' group] | ('(' | '[') relation {(',' | ';') relation} (')' | ']')
#             | '{' groups '}' | '|' additive '|' | command           '(1;5)' is the point (1, 5)
#   command  := \frac arg arg | \sqrt ['[' additive ']'] arg | \binom arg arg | \{ item {(',' | ';') item} \}
#             | NAMED [('^' | '_') group]                              \Reals, \Integers^+, \Naturals_0 ...
#             | FUNC ['_' arg] ['^' arg] (bracket | arg | product)      \sin^2 x, \log_2 8, \max(a, b)
#             | (\sum | \prod) '_{' letter '=' additive '}^' arg product   kept unevaluated
#             | \begin{env} cells \end{env} | \lfloor additive \rfloor | \lceil ... | \lvert additive \rvert
#             | \emptyset | \pi | \infty | any other name (\alpha, \angle): a Symbol
#   item     := \ldots | relation     in a list or a set: '1, 2, 3, \ldots' is a progression (_progression)
# Every rule returns a sympy object or one of the containers above; arithmetic on containers is a _ParseError.
# Implicit products read left to right, like the explicit ones: 1/2x is (1/2)x.
class _Parser:
    """Recursive descent / precedence climbing over the token list. Lowest to highest precedence:
    ';' groups, ',' lists, relations, \\cup, + -, * / implicit-multiplication, unary -, ^, postfix ! % '."""

    # ----- token cursor -------------------------------------------------------------------------------------------

    def __init__(self, text: str, naturals0: bool = False):
        self.toks = _tokenize(text)
        self.pos = 0
        self.abs_open = 0       # inside |...| a '|' closes instead of opening a new absolute value
        self.inexact = False    # set when a decimal literal is seen -> comparisons use _REL_TOL
        self.naturals0 = naturals0  # read \Naturals as {0, 1, 2, ...} (else {1, 2, ...})
        self.saw_naturals = False   # \Naturals was read: _parse_answer tries the other reading too

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

    # ----- precedence levels, lowest first (groups ... postfix) ---------------------------------------------------

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
        items = [self.item()]
        while self.accept(","):
            if self.peek()[1] in (";", "", "}"):
                break  # tolerate a trailing comma
            items.append(self.item())
        if any(x is _ELLIPSIS for x in items):
            return _progression(items)
        return items[0] if len(items) == 1 else _Coll("list", items)

    def item(self):
        """A list or set item: a relation, or an ellipsis that stands alone between commas."""
        if self.peek()[1] in _ELLIPSES:
            after = self.toks[self.pos + 1][1] if self.pos + 1 < len(self.toks) else ""
            if after in (",", ";", "}", "\\}", ""):
                self.take()
                return _ELLIPSIS
        return self.relation()

    def relation(self):
        """A chain of relations: 'x = 5', '-2 \\le x \\le 7', 'x \\in [0, 1]'."""
        parts, ops = [self.union()], []
        while self.peek()[1] in _RELOPS:
            ops.append(_RELOPS[self.take()[1]])
            parts.append(self.union())
        return _Rel(parts, ops) if ops else parts[0]

    def union(self):
        """Interval unions '(1,2) \\cup [3,4]', and \\cap, \\setminus left to right. Binds tighter than relations,
        looser than +."""
        items, ops = [self.additive()], []
        while self.peek()[1] in ("\\cup", "\\cap", "\\setminus"):
            ops.append(self.take()[1])
            items.append(self.additive())
        if not ops or set(ops) == {"\\cup"}:
            return items[0] if len(items) == 1 else _Coll("union", items)
        value = items[0]
        for op, item in zip(ops, items[1:]):
            value = _SetOp(op, value, item)
        return value

    def additive(self):
        """Sums and differences, left-associative; 'A - B' of two sets is their difference."""
        left = self.term()
        while self.peek()[1] in ("+", "-"):
            op = self.take()[1]
            right = self.term()
            left = _SetOp("\\setminus", left, right) if op == "-" and _is_set(left) else _arith(left, right, op)
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
                if isinstance(value, sp.Expr) and value.is_Integer and value > 1000:
                    raise _Refused("an answer with a factorial over 1000!")
                if not isinstance(value, sp.Expr) or (value.is_Integer and value < 0):
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

    # ----- atoms: numbers, symbols, brackets, macro arguments ------------------------------------------------------

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
        """'(' or '[' ... : grouping if one item, otherwise a tuple / interval. Items are separated by ',' or by
        ';' ('(1;5)', where a comma may be a decimal comma), never by both ('(1,5;2)' is an error)."""
        items = [self.relation()]
        separator = self.peek()[1] if self.peek()[1] in (",", ";") else ","
        while self.accept(separator):
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

    # ----- commands: \frac, \sqrt, functions, \sum, environments ---------------------------------------------------

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
            if not (isinstance(n, sp.Expr) and isinstance(k, sp.Expr)):
                raise _ParseError("bad binomial")
            if n.is_Number and abs(n) > 10_000:
                raise _Refused("an answer with a binomial over n = 10,000")
            return sp.binomial(n, k)
        if name in _FUNCS:
            return self.function(name)
        if name in ("sum", "prod"):
            return self.big_operator(name)
        if name == "{":
            items = [] if self.peek()[1] == "\\}" else [self.item()]
            separator = self.peek()[1] if self.peek()[1] in (",", ";") else ","
            while self.accept(separator):
                items.append(self.item())
            self.expect("\\}")
            return _progression(items) if any(x is _ELLIPSIS for x in items) else _Coll("set", items)
        if name in _NAMED_SETS:
            return self.named_set(name)
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

    def named_set(self, name: str):
        """\\Reals, \\Integers, ... with an optional sign part: ^+, _+, ^*, _{>0} (positive), _{\\ge 0} and _0
        (non-negative), ^-, _{<0} (negative): \\Integers^+ is {1, 2, ...}, \\Reals_{\\ge 0} is [0, oo)."""
        if name == "Naturals":
            self.saw_naturals = True
        base = sp.Naturals0 if name == "Naturals" and self.naturals0 else _NAMED_SETS[name]
        if self.peek()[1] not in ("^", "_"):
            return base
        self.take()
        part = self.raw_group().replace(" ", "")
        sign = {"+": "+", "*": "+", ">0": "+", "0": ">=", "\\ge0": ">=", "\\geq0": ">=", ">=0": ">=",
                "-": "-", "<0": "-"}.get(part)
        if sign is None or base in (sp.Complexes,) or (base is sp.Naturals0 and sign == "-"):
            raise _ParseError(f"unsupported set {name}{part}")
        if name == "Naturals":
            return sp.Naturals0 if sign == ">=" else sp.Naturals
        half = {"+": sp.Interval.open(0, sp.oo), ">=": sp.Interval(0, sp.oo), "-": sp.Interval.open(-sp.oo, 0)}
        return sp.Intersection(base, half[sign])  # Integers and (0, oo) is Range(1, oo); Reals: the interval

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


# ------------------------------------------------------------------------------------------------------------
# 3c. Entry point of the parser: size limits first, then \pm expansion and the percent reading.


def _parse_answer(s: str) -> tuple[list, bool]:
    """Parse a normalised answer into candidate values ('50%' -> [50, 1/2]; '1 \\pm 2' -> [[3, -1]];
    '12 m/s' -> [12m/s, 12]). Raises _Refused for an answer over a size bound."""
    # Size limits come before tokenizing: the parser recurses about 9 Python frames per bracket level, so 50 levels
    # use ~470 of the default limit of 1000. Deep unbracketed chains ('- - - x', 'x^x^x^...') can still raise
    # RecursionError, which the except below turns into "unparseable".
    depth = max_depth = 0
    for ch in s:
        depth += (ch in "([{") - (ch in ")]}")
        max_depth = max(max_depth, depth)
    if len(s) > _MAX_LEN:
        raise _Refused(f"an answer of {len(s):,} characters once normalised (limit {_MAX_LEN:,})")
    if max_depth > _MAX_NEST:
        raise _Refused(f"an answer nested {max_depth} brackets deep (limit {_MAX_NEST})")
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
        sci = _NUM_RE.fullmatch(body)
        if (sci and sci.group(3)) or _SPACED_RE.fullmatch(body):  # '2.5e6' is 2500000, never 2.5 * e * 6
            value, inexact, _ = _parse_number(body)
            values = [sp.Rational(value.numerator, value.denominator)]
        else:
            parser = _Parser(body)
            values, inexact = [parser.parse()], parser.inexact
            if parser.saw_naturals:  # \Naturals: {1, 2, ...} above, {0, 1, 2, ...} here
                values.append(_Parser(body, naturals0=True).parse())
            if _THOUSANDS_RE.fullmatch(body):  # '7,125': the list above, or the number 7125 (docs/data.md)
                value = Fraction(body.replace(",", ""))
                values.append(sp.Rational(value.numerator, value.denominator))
            # '12 m/s': 12 in metres per second, or 12m/s in variables m and s. Both readings count.
            if (number := _without_bare_unit(body)) is not None:
                values.append(_Parser(number).parse())
        if pct and isinstance(values[0], sp.Expr):  # gold files disagree on whether 50% is 50 or 1/2: accept both
            values.append(values[0] / 100)
        return values, inexact
    except _Refused:
        raise  # too large to judge: the caller counts it
    except Exception:  # _ParseError, RecursionError, anything sympy throws: unparseable means not equal
        return [], False


# ------------------------------------------------------------------------------------------------------------
# 4a. Comparison of parsed values: structural equality, then exact or high-precision numeric evaluation, then
#     agreement at sample points, and sympy.simplify only as the slow last resort. Tuples keep their order, answer
#     lists are multisets, equations match up to a constant factor, intervals and inequalities compare as sets.
#     4a: scalars; 4b: labels and relations; 4c: sets, collections and the dispatch (_equal, _symbolic_equal).

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


# ------------------------------------------------------------------------------------------------------------
# 4b. Labels ('x = 5' vs '5') and relations (equations and inequalities up to a constant factor).

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


# ------------------------------------------------------------------------------------------------------------
# 4c. Sets (intervals, unions, solved inequalities), unordered lists, and the dispatch over all value kinds.

# Relations with one free variable are solved over the reals (solveset, imported at the top of the file so a
# forked worker never imports), so 'x \ge 2' equals '[2, \infty)' and 'x^2 < 1' equals '(-1, 1)'.
_SYMPY_REL = {"<": sp.Lt, "<=": sp.Le, ">": sp.Gt, ">=": sp.Ge, "=": sp.Eq, "!=": sp.Ne}


def _to_set(v):
    """Interval / union / named or finite set / set difference / univariate relation -> sympy Set, or None."""
    try:
        if isinstance(v, sp.Set):
            return v
        if isinstance(v, _SetOp):
            left, right = _to_set(v.left), _to_set(v.right)
            if left is None or right is None:
                return None
            return sp.Complement(left, right) if v.op == "\\setminus" else sp.Intersection(left, right)
        if isinstance(v, _Tup) and len(v.items) == 2 and all(isinstance(x, sp.Expr) for x in v.items):
            return sp.Interval(v.items[0], v.items[1], v.open == "(", v.close == ")")
        if isinstance(v, _Coll) and v.kind == "union":
            parts = [_to_set(x) for x in v.items]
            return None if None in parts else sp.Union(*parts)
        if isinstance(v, _Coll) and v.kind in ("set", "list") and all(isinstance(x, sp.Expr) for x in v.items):
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
    """Set equality under _equal: each item of either side equals an item of the other. An answer list is the
    set of solutions, so an item listed twice counts once ('(1,5), (1,5)' = '(1,5)'), and '1, 1' != '1, 2'."""
    same = [[_equal(x, y, loose) for y in ys] for x in xs]  # lists are short: every pair once
    return all(map(any, same)) and all(any(row[j] for row in same) for j in range(len(ys)))


def _equal(a, b, loose: bool) -> bool:
    """Equality of two parsed values of any kind (expression, matrix, tuple, collection, relation, set)."""
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
    if isinstance(a, (sp.Set, _SetOp)) or isinstance(b, (sp.Set, _SetOp)):
        return _equal_sets(a, b)  # '\Reals' vs '(-\infty, \infty)', '\{1, 2, \ldots\}' vs '\Integers^+'
    if isinstance(a, sp.MatrixBase) or isinstance(b, sp.MatrixBase):
        return (isinstance(a, sp.MatrixBase) and isinstance(b, sp.MatrixBase) and a.shape == b.shape
                and all(_equal_expr(x, y, loose) for x, y in zip(a, b)))
    if isinstance(a, sp.Expr) and isinstance(b, sp.Expr):
        return _equal_expr(a, b, loose)
    if isinstance(a, _Tup) and isinstance(b, _Tup):
        return ((a.open, a.close, len(a.items)) == (b.open, b.close, len(b.items))
                and all(_equal(x, y, loose) for x, y in zip(a.items, b.items)))
    if isinstance(a, _Coll) != isinstance(b, _Coll):  # one answer listed twice: '(1,5), (1,5)' vs '(1,5)'
        many, one = (a, b) if isinstance(a, _Coll) else (b, a)
        return many.kind == "list" and _unordered_equal(many.items, [one], loose)
    if isinstance(a, _Coll) and isinstance(b, _Coll):
        # '1, 2' and '\{1, 2\}' mean the same answer; a union only matches another union here
        if a.kind == b.kind or {a.kind, b.kind} == {"list", "set"}:
            return _unordered_equal(a.items, b.items, loose)
    return False


def _symbolic_equal(pred: str, gold: str) -> bool | str:
    """Full comparison of two normalised answers: True, False, or the reason it refused the pair (an
    answer over a size bound). Can be slow: always run it under a hard timeout."""
    try:
        pred_values, pred_inexact = _parse_answer(pred)
        gold_values, gold_inexact = _parse_answer(gold)
    except _Refused as e:
        return str(e)
    loose = pred_inexact or gold_inexact  # one decimal on either side loosens the pair (see _REL_TOL)
    return any(_equal(p, g, loose) for p in pred_values for g in gold_values)


# ------------------------------------------------------------------------------------------------------------
# 5. Worker pool with hard deadlines. The symbolic step (3-4) runs in forked workers that are SIGKILLed at their
#    deadline; extraction, normalisation, plain-number checks and the cache (6) run inline in the caller.

# Why processes at all: sympy cannot be interrupted from a thread, and signal.alarm only works on the main
# thread; a separate process can always be killed. A worker that exceeds its deadline is SIGKILLed and
# replaced; its pair counts as not equal.
# Why fork, measured (Python 3.11.7, a shared 2-core machine; from Process.start() to the first reply of one trivial
# comparison, several runs):
#   fork, from a parent with torch imported and its thread pool running                              45-75 ms
#   forkserver + set_forkserver_preload([this module]):
#     main = a script that imports torch (python da3po.py, every torchrun rank)                    1400-2400 ms
#     main = a light script, this file importable from the current directory     450-650 ms first, then 45-70 ms
#     main = a light script, this file imported from another directory                          350-450 ms
#   spawn: 340-460 ms with a light main script, ~2000 ms with one that imports torch
# This file imports no torch, but a forkserver or spawn child still re-runs the *main script* (as __mp_main__)
# before it can unpickle its target, and Python 3.11's forkserver ignores the parent's sys.path, so the preload
# silently fails unless this file is importable from the current directory. Both would also make every caller
# without an `if __name__ == "__main__"` guard crash at the first worker start. A fork costs the same everywhere
# and needs nothing from the caller. Why fork is safe enough in a trainer that has threads and CUDA: the worker
# runs only pure-Python sympy code and never touches torch/CUDA, and the real hazard of forking a threaded process
# (a lock copied in its held state, which the child then waits on) can only make a worker hang or die, which the
# pool already turns into one "not equal" (counted in info["timeouts"] / info["crashed"]).
_CTX = multiprocessing.get_context("fork")


def _worker_main(conn, inherited, parent_pid: int, task=None):
    """Worker loop: receive (pred, gold), reply with task(pred, gold) as a bool, or as the str a refusal gives (task
    None: _symbolic_equal, looked up here so that a test's patch before the fork applies). Exits on None, EOF, or
    when the parent dies."""
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
            result = (task or _symbolic_equal)(*msg)
            result = result if isinstance(result, str) else bool(result)  # a str: why it refused
        except BaseException:  # RecursionError, MemoryError, anything: "not equal", and the worker lives on
            result = False
        try:
            conn.send(result)
        except (EOFError, OSError):
            return


class _Worker:
    """One forked worker: its process, the parent's end of its pipe, and the number of tasks it has run."""

    def __init__(self, proc, conn):
        self.proc, self.conn, self.tasks = proc, conn, 0


# Why not multiprocessing.Pool or concurrent.futures: a Pool task that is late cannot be stopped except by
# terminate(), which kills every worker, and ProcessPoolExecutor cannot cancel a running future at all. Here each
# task has its own deadline, and only the worker that misses it is killed and later replaced.
class _Pool:
    """A minimal process pool where every task has its own deadline. Not thread-safe: use _POOL_LOCK."""

    def __init__(self, size: int, task=None):
        self.pid = os.getpid()
        self.size = size
        self.task = task  # what the workers run on each pair: _symbolic_equal, or crosscheck.py's second verifier
        self.workers: list[_Worker] = []
        self.idle: list[_Worker] = []

    def _spawn(self) -> _Worker:
        """Fork one worker; it must not keep copies of the parent's ends of other workers' pipes."""
        parent_end, child_end = _CTX.Pipe()
        inherited = [w.conn for w in self.workers]
        proc = _CTX.Process(target=_worker_main, args=(child_end, inherited, os.getpid(), self.task), daemon=True)
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

    def run(self, tasks: list[tuple[str, str]], timeout: float, parallel: int,
            info: dict) -> list[bool | str | None]:
        """Evaluate tasks on up to `parallel` workers; each task gets `timeout` seconds from its dispatch.
        None = no answer (deadline passed or worker died): counts as not equal, but is not cached, since a loaded
        machine can push a legitimate comparison past its deadline once. A str is a refusal's reason. Adds to
        info["timeouts"] and info["crashed"], the caller's counters for this call."""
        results: list[bool | str | None] = [None] * len(tasks)
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
                        results[idx] = conn.recv()
                        self._release(worker)
                    except (EOFError, OSError):
                        self._discard(worker)  # crashed (e.g. out of memory): result stays None
                        info["crashed"] += 1
                now = time.monotonic()
                for conn, (worker, idx, deadline) in list(busy.items()):
                    if now >= deadline:
                        del busy[conn]
                        self._discard(worker)  # hard timeout: result stays None
                        info["timeouts"] += 1
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


# ------------------------------------------------------------------------------------------------------------
# 6. Public API: math_equal, verify_batch, close_verifier_pool (and extract_answer, section 1). The cheap checks and
#    an LRU cache of verdicts run inline; only undecided pairs go to the pool. verify_batch reports what happened
#    in the call as a dict of counters, so a trainer can log timeouts per step without any module-level state.

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


def _cache_put(key, value: bool | str):
    """LRU insert (a verdict, or a refusal's reason), evicting the oldest entry past _CACHE_SIZE."""
    _CACHE[key] = value
    _CACHE.move_to_end(key)
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)


def _default_workers() -> int:
    """num_workers=0 means min(4, cpu count): verification shares the CPU with training."""
    return max(1, min(4, os.cpu_count() or 1))


def _new_info() -> dict:
    """Counters of one call. Every pair is settled by exactly one of: inline (no answer, string, word, time or number
    checks, or refused), cached, or the pool; `symbolic` counts the unique pairs sent to the pool, `timeouts` and
    `crashed` those of them that got no answer (deadline passed; worker died or could not start); `refused` the
    pairs too large to judge (an answer over _MAX_RAW characters that is not a plain number, one over _MAX_LEN
    once normalised, or one that a size bound of the parser stops: an exponent, power, factorial, binomial or
    nesting; verify_batch adds completions over _MAX_TEXT), each counted "not equal" and logged."""
    return {"timeouts": 0, "symbolic": 0, "cached": 0, "inline": 0, "crashed": 0, "refused": 0}


_INT_RE = re.compile(r"-?\d{1,50}")  # a plain integer, settled by int() before any normalisation
# Plain numbers of any length (an answer of 300,000 digits), maybe with thousands separators: decimal.Decimal reads
# and compares them exactly in linear time, where int() refuses more than 4300 digits and Fraction goes through it.
_LONG_NUM_RE = re.compile(r"[-+]?(?:\d+|\d{1,3}(?:,\d{3})+)(?:\.\d+)?")


def _long_number(s: str) -> tuple[Decimal, bool] | None:
    """A plain number of any length -> (value, has a decimal point); None for anything else."""
    s = s.strip().strip("$").replace("{,}", ",").replace("\\,", "").replace("\\!", "").strip()
    return (Decimal(s.replace(",", "")), "." in s) if _LONG_NUM_RE.fullmatch(s) else None


def _compare_long(pred: str, gold: str) -> bool | None:
    """A pair with an answer over _MAX_RAW characters: equal or not when both are plain numbers (exact, or within
    _REL_TOL when one has a decimal point), else None: refused, since parsing it is what the size bounds stop."""
    a, b = _long_number(pred), _long_number(gold)
    if a is None or b is None:
        return None
    if a[1] or b[1]:
        return abs(a[0] - b[0]) <= Decimal(str(_REL_TOL)) * max(abs(a[0]), abs(b[0]))
    return a[0] == b[0]


def _refused(info: dict, reason: str):
    """Count a refused pair; the first reason of a call is logged (see _verify_pairs)."""
    info["refused"] += 1
    info.setdefault("_reason", reason)


def _verify_pairs(preds: list, golds: list, timeout: float, num_workers: int, info: dict) -> list[bool]:
    """Shared core of math_equal / verify_batch: fast paths and cache inline, the rest on the pool."""
    # Cheapest first: identical raw strings, a length gate, normalised and plain-number checks (_quick_check), the
    # cache, and only then the pool. The raw gate is _MAX_RAW = 4 * _MAX_LEN because normalising removes \text{},
    # units and spaces; past it only plain numbers are compared. The parser never sees over _MAX_LEN characters.
    results = [False] * len(preds)
    todo: dict[tuple[str, str], list[int]] = {}
    for i, (pred, gold) in enumerate(zip(preds, golds)):
        try:
            if pred is None or gold is None:
                info["inline"] += 1
                continue
            pred, gold = str(pred), str(gold)
            if pred == gold and pred.strip():
                results[i] = True
                info["inline"] += 1
                continue
            if _INT_RE.fullmatch(pred) and _INT_RE.fullmatch(gold):  # two plain integers, most RL answers: exact
                results[i] = int(pred) == int(gold)
                info["inline"] += 1
                continue
            if len(pred) > _MAX_RAW or len(gold) > _MAX_RAW:  # never normalise or parse megabytes
                info["inline"] += 1
                verdict = _compare_long(pred, gold)
                results[i] = bool(verdict)
                if verdict is None:
                    _refused(info, f"an answer of {max(len(pred), len(gold)):,} characters that is not a plain "
                                   f"number (longer than {_MAX_RAW:,}, only plain numbers are compared)")
                continue
            key, quick = _quick_check(pred, gold)
            if quick is not None:
                results[i] = quick
                info["inline"] += 1
            elif (cached := _cache_get(key)) is not None:
                results[i] = cached is True
                info["cached"] += 1
                if isinstance(cached, str):  # refused before, refused again: counted in every call
                    _refused(info, cached)
            elif len(key[0]) <= _MAX_LEN and len(key[1]) <= _MAX_LEN:
                todo.setdefault(key, []).append(i)
            else:
                info["inline"] += 1
                _refused(info, f"an answer of {max(map(len, key)):,} characters once normalised (the parser "
                               f"takes at most {_MAX_LEN:,})")
        except Exception:
            results[i] = False
            info["inline"] += 1
    # Only unique undecided pairs travel to the workers (duplicates within a batch are verified once).
    if todo:
        keys = list(todo)
        info["symbolic"] += len(keys)
        try:
            with _POOL_LOCK:
                out = _get_pool(num_workers).run(keys, timeout, min(num_workers, len(keys)), info)
        except Exception as e:  # e.g. no fork (or a daemonic caller: multiprocessing.Pool's workers cannot fork)
            out = [None] * len(keys)  # fail closed (False, uncached) rather than raise, and say so
            info["crashed"] += len(keys)
            _LOG.warning("verifier: no worker process for the symbolic step (%s: %s); %d pairs counted not equal",
                         type(e).__name__, e, len(keys))
        for key, value in zip(keys, out):
            if value is not None:  # None (deadline or crash) is not cached: a loaded machine may be the cause
                _cache_put(key, value)
            for i in todo[key]:
                results[i] = value is True
                if isinstance(value, str):  # a size bound stopped the parser: the reason
                    _refused(info, value)
    if "_reason" in info:  # refused pairs are counted "not equal", never silently: one line per call says why
        _LOG.warning("verifier: refused %d of %d pairs as too large to judge, the first %s",
                     info["refused"], len(preds), info.pop("_reason"))
    return results


def math_equal(pred: str | None, gold: str, timeout: float = 1.0) -> bool:
    """True iff `pred` is mathematically equivalent to `gold`. Never raises; returns within ~`timeout` s."""
    try:
        return _verify_pairs([pred], [gold], timeout, 1, _new_info())[0]
    except Exception:
        return False


def verify_batch(completions: list[str], golds: list[str], answer_format: str = "auto", timeout: float = 1.0,
                 num_workers: int = 0) -> tuple[list[bool], dict]:
    """Extract and compare every (completion, gold) pair -> (verdicts, info). Extraction, normalisation,
    plain-number checks and the cache run inline; only the undecided unique pairs go to the worker pool
    (num_workers; 0 means min(4, cpu count), and small batches simply use fewer workers). Worst case wall time
    is about ceil(undecided / workers) * timeout. info counts, for this call only: timeouts, symbolic (unique pairs
    sent to the workers), cached, inline, crashed, refused (see _new_info) and no_answer (completions without an
    answer; a completion over _MAX_TEXT characters is not searched: it counts as refused, not as no_answer).
    Example: verify_batch(["... \\\\boxed{4}", "no answer"], ["4", "4"]) -> ([True, False], {"timeouts": 0, ...})"""
    if len(completions) != len(golds):
        raise ValueError("completions and golds must have the same length")
    preds = [extract_answer(c, answer_format) for c in completions]
    workers = num_workers if num_workers > 0 else _default_workers()
    info = _new_info()
    verdicts = _verify_pairs(preds, list(golds), timeout, workers, info)
    too_long = [len(c) for c in completions if isinstance(c, str) and len(c) > _MAX_TEXT]
    if too_long:
        info["refused"] += len(too_long)
        _LOG.warning("verifier: refused %d completions over %s characters (the first has %s) as too large to "
                     "search", len(too_long), f"{_MAX_TEXT:,}", f"{too_long[0]:,}")
    info["no_answer"] = sum(p is None for p in preds) - len(too_long)
    return verdicts, info


def majority_vote(answers: list, timeout: float = 1.0, num_workers: int = 0) -> tuple[int | None, int]:
    """The majority answer of one problem's samples (maj@k, DAPO's cons@k): `answers` are extracted final answers
    (None, or one that normalises to nothing, never votes); answers equivalent under math_equal count as one.
    Returns (the index of the winner's first occurrence, its votes), or (None, 0) when no sample has an answer. Ties
    go to the answer seen first, a rule fixed in advance that needs no random draw (verl's maj@N keeps the first of
    equally voted answers too). Example: ["1/2", "3", "0.5", "3", None, "\\frac12"] -> (0, 3): 1/2 = 0.5 = \\frac12
    has three votes."""
    keys: dict[str, int] = {}  # normalised spelling -> its first index; one vote per sample
    votes: dict[int, int] = {}
    for i, answer in enumerate(answers):
        try:
            # an answer too long to normalise is its own key (_verify_pairs compares such answers as numbers)
            key = "" if answer is None else answer if len(str(answer)) > _MAX_RAW else _normalize(answer)
        except Exception:
            key = ""
        if key:
            first = keys.setdefault(key, i)
            votes[first] = votes.get(first, 0) + 1
    firsts = list(votes)  # in order of first occurrence
    # Spellings that normalise differently can still be equal (0.5 and \frac{1}{2}): compare every later spelling
    # with every earlier one in one batch (fast paths and cache inline, the rest on the pool); each joins the group
    # of the first earlier spelling it equals.
    pairs = [(j, i) for n, j in enumerate(firsts) for i in firsts[:n]]
    workers = num_workers if num_workers > 0 else _default_workers()
    equal = _verify_pairs([answers[j] for j, _ in pairs], [answers[i] for _, i in pairs], timeout, workers,
                          _new_info()) if pairs else []
    root = {i: i for i in firsts}
    for (j, i), same in zip(pairs, equal):
        if same and root[j] == j:
            root[j] = root[i]
    total: dict[int, int] = {}
    for i in firsts:
        total[root[i]] = total.get(root[i], 0) + votes[i]
    if not total:
        return None, 0
    best = max(total.values())
    return next(i for i in total if total[i] == best), best  # dicts keep insertion order: the first seen wins a tie


# ------------------------------------------------------------------------------------------------------------
# 7. Command line: one pair, or a JSONL file of pairs. Exit 0 = all equal, 1 = some pair not equal, 2 = bad input.

_CLI_EPILOG = """examples:
  python verifier.py '\\frac{1}{2}' 0.5                      -> equal (exit 0)
  python verifier.py '(1,2)' '[1,2]'                         -> not equal (exit 1)
  python verifier.py --extract 'so it is \\boxed{4}.' 4      -> equal
  python verifier.py --jsonl pairs.jsonl

JSONL input: one object per line, {"pred": ANSWER, "gold": ANSWER} or {"completion": TEXT, "gold": ANSWER} (the
answer is extracted from a completion first, with --answer_format); values are strings or numbers, blank lines are
skipped. Output: one line per row, "LINE: equal" or "LINE: not equal" (LINE = its line number in the file), then
"N equal of M". Exit 0 if every row is equal, 1 otherwise, 2 with one line "error: FILE:LINE: ..." on stderr for a
missing file, invalid JSON or a row without the keys. An answer that starts with '-' goes after '--':
  python verifier.py -- -x '-1*x'"""


def _read_jsonl(path: str) -> list[tuple[int, str, bool, str]]:
    """Read and check a JSONL file of pairs -> [(line number, text, text is a completion, gold)].
    Raises ValueError with 'FILE:LINE: what is wrong'."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read: {e}") from None
    rows = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(row, dict) or "gold" not in row or ("pred" in row) == ("completion" in row):
            raise ValueError(f'{path}:{lineno}: expected an object with "gold" and one of "pred" or "completion"')
        is_completion = "completion" in row
        text, gold = row["completion" if is_completion else "pred"], row["gold"]
        if not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in (text, gold)):
            raise ValueError(f"{path}:{lineno}: answers must be strings or numbers")
        rows.append((lineno, str(text), is_completion, str(gold)))
    return rows


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit status."""
    ap = argparse.ArgumentParser(
        prog="verifier.py", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_CLI_EPILOG,
        description="Is PRED mathematically equal to GOLD? Prints 'equal' (exit 0) or 'not equal' (exit 1).")
    ap.add_argument("pred", nargs="?", metavar="PRED", help="the predicted answer (a whole completion with --extract)")
    ap.add_argument("gold", nargs="?", metavar="GOLD", help="the gold answer")
    ap.add_argument("--extract", action="store_true", help="apply extract_answer to PRED first")
    ap.add_argument("--answer_format", default="auto", choices=("boxed", "answer_line", "auto"),
                    help="where extraction looks: the last \\boxed{}, the last 'Answer:' line, or both (default: auto)")
    ap.add_argument("--timeout", type=float, default=1.0, metavar="SECONDS",
                    help="seconds for the symbolic comparison of one pair (default: 1.0)")
    ap.add_argument("--jsonl", metavar="FILE", help="verify every row of a JSONL file instead of PRED GOLD")
    ap.add_argument("--num_workers", type=int, default=0, metavar="N",
                    help="worker processes for --jsonl (default: 0 = min(4, cpu count))")
    args = ap.parse_args(argv)
    given = (args.pred is not None) + (args.gold is not None)
    if given != (0 if args.jsonl is not None else 2):
        ap.error("give either PRED GOLD or --jsonl FILE")
    if args.jsonl is None:
        pred = extract_answer(args.pred, args.answer_format) if args.extract else args.pred
        equal = math_equal(pred, args.gold, timeout=args.timeout)
        print("equal" if equal else "not equal")
        return 0 if equal else 1
    try:
        rows = _read_jsonl(args.jsonl)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    preds = [extract_answer(text, args.answer_format) if is_completion else text for _, text, is_completion, _ in rows]
    workers = args.num_workers if args.num_workers > 0 else _default_workers()
    info = _new_info()
    verdicts = _verify_pairs(preds, [gold for *_, gold in rows], args.timeout, workers, info)
    for (lineno, *_), equal in zip(rows, verdicts):
        print(f"{lineno}: {'equal' if equal else 'not equal'}")
    notes = [f"{info[k]} {k.replace('timeouts', 'timed out')}" for k in ("timeouts", "refused") if info[k]]
    print(f"{sum(verdicts)} equal of {len(verdicts)}" + (f" ({', '.join(notes)})" if notes else ""))
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
