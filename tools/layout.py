"""How the code reads, in figures: line widths, the reading path of one step, and the house's hygiene.

  python -m tools.layout            # the figures for the tree as it is (runs each script for 2 steps)

Every figure is counted from the files as they are:
  - per core file (every top-level .py but verifier.py): lines, the mean non-blank line, the share of
    lines of 100 characters or more, the longest section (`# ----` rule to rule), its project imports;
  - the reading path: the definitions one step reaches from a script's loop, found by following calls
    through the project's modules (each definition counted once), with their lines and characters;
  - what one default run executes: every core function that `python <script> --steps 2 --eval_every 0`
    calls at least once (a profile hook records them), the union of their line spans, lines and characters;
  - main()'s length in each script, and how many lines the two main()s differ in;
  - comment and docstring paragraphs that end on a one-word line (prose wrapped to a column);
  - files that edit sys.path, and public files that cite an internal issue number.
"""
import ast
import difflib
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("da3po.py", "daro.py")
ISSUE_REF = re.compile(r"\b[Ii]ssues? #?\d+\b")
SYS_PATH_EDIT = re.compile(r"sys\.path\.(insert|append|extend)\(|sys\.path(\[[^\]]*\])?\s*\+?=")


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def core_files() -> list[str]:
    names = [os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py"))]
    return sorted(n for n in names if n != "verifier.py")


def tracked(*patterns: str) -> list[str]:
    """The repository's files matching the patterns (build and run folders left out)."""
    found = set()
    for pattern in patterns:
        for path in glob.glob(os.path.join(ROOT, "**", pattern), recursive=True):
            rel = os.path.relpath(path, ROOT)
            if not rel.startswith((".git", "out", "venv", ".venv")):
                found.add(rel)
    return sorted(found)


def widths(lines: list[str]) -> tuple[float, float]:
    """(mean width of the non-blank lines, share of all lines 100 characters or wider)."""
    nonblank = [len(line) for line in lines if line.strip()]
    wide = sum(len(line) >= 100 for line in lines)
    return sum(nonblank) / max(1, len(nonblank)), wide / max(1, len(lines))


def longest_section(lines: list[str]) -> int:
    rules = [i for i, line in enumerate(lines) if line.startswith("# ----")]
    bounds = rules + [len(lines)]
    return max((b - a for a, b in zip(bounds, bounds[1:])), default=0)


def project_imports(name: str, ours: set[str]) -> list[str]:
    """The project modules a file imports (at module level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(read(name))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return sorted(found & ours - {name[:-3]})


# ------------------------------------------------------------------------------------------------------------
# The reading path: the definitions one step reaches from a script's main(), following calls through the
# project's modules (verifier.py left out: it stands alone, and the step only calls verify_batch).
class Module:
    """A project module's top-level functions and classes, and the project names it imports."""

    def __init__(self, name: str, modules: set[str]):
        self.name = name
        self.defs = {}  # name -> node
        self.imported = {}  # local name -> (module, its name there; None for the module itself)
        for node in ast.parse(read(name + ".py")).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
            elif isinstance(node, ast.ImportFrom) and node.module in modules:
                for a in node.names:
                    self.imported[a.asname or a.name] = (node.module, a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in modules:
                        self.imported[a.asname or a.name] = (a.name, None)


def references(node: ast.AST) -> tuple[set[str], set[tuple[str, str]], set[str]]:
    """What a definition refers to: plain names, `name.attr` pairs, and every attribute name."""
    names, pairs, attrs = set(), set(), set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            names.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            attrs.add(sub.attr)
            if isinstance(sub.value, ast.Name):
                pairs.add((sub.value.id, sub.attr))
    return names, pairs, attrs


def reading_path(script: str, modules: dict[str, "Module"]) -> list[tuple[str, ast.AST]]:
    """(module, function node) for every function one step can reach: the functions its code names, and
    of each class it names the dunder methods and the methods some reached code calls by name (an upper
    bound: `engine.generate` reaches both engines' generate)."""
    reached, classes, todo = {}, [], [(script[:-3], modules[script[:-3]].defs["main"])]
    called = set()
    while todo:
        mod, node = todo.pop()
        if (mod, id(node)) in reached:
            pass  # seen: still look for class methods below once the list runs dry
        elif isinstance(node, ast.ClassDef):
            classes.append((mod, node))
            reached[(mod, id(node))] = None  # a class: its methods are counted, not its whole body
        else:
            reached[(mod, id(node))] = (mod, node)
            names, pairs, attrs = references(node)
            called |= attrs
            here = modules[mod]
            for name in names:
                todo += resolve_name(name, here, modules)
            for base, attr in pairs:
                if base in here.imported and here.imported[base][1] is None:
                    target = modules[here.imported[base][0]]
                    if attr in target.defs:
                        todo.append((target.name, target.defs[attr]))
        if not todo:  # methods of the reached classes that reached code calls by name
            for cmod, cls in classes:
                for item in cls.body:
                    dunder = item.name.startswith("__") if isinstance(item, ast.FunctionDef) else False
                    if isinstance(item, ast.FunctionDef) and (dunder or item.name in called):
                        if (cmod, id(item)) not in reached:
                            todo.append((cmod, item))
    return [v for v in reached.values() if v is not None]


def resolve_name(name: str, here: "Module", modules: dict[str, "Module"]) -> list:
    if name in here.defs:
        return [(here.name, here.defs[name])]
    if name in here.imported:
        mod, obj = here.imported[name]
        if obj and obj in modules[mod].defs:
            return [(mod, modules[mod].defs[obj])]
    return []


def path_figures(script: str, modules: dict[str, "Module"]) -> tuple[int, int, int]:
    """(functions reached, their lines, their characters), each counted once."""
    found = reading_path(script, modules)
    lines = sum(n.end_lineno - n.lineno + 1 for _, n in found)
    chars = sum(len("\n".join(read(m + ".py").splitlines()[n.lineno - 1:n.end_lineno])) for m, n in found)
    return len(found), lines, chars



# ------------------------------------------------------------------------------------------------------------
# What one default run executes: the core functions a short run calls, found by a profile hook, not by reading.
DEFAULT_RUN = ["--steps", "2", "--eval_every", "0"]
# Runs the script under a profile hook that records the (file, first line) of every call into a core file.
TRACER = """
import json, os, runpy, sys, threading
out, script, core = sys.argv[1], sys.argv[2], set(json.loads(sys.argv[3]))
seen = set()
def hook(frame, event, arg):
    if event == "call" and frame.f_code.co_filename in core:
        seen.add((frame.f_code.co_filename, frame.f_code.co_firstlineno))
def dump():
    with open(out, "w") as f:
        json.dump(sorted(seen), f)
import atexit; atexit.register(dump)
sys.setprofile(hook); threading.setprofile(hook)
sys.argv = [script] + sys.argv[4:]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    sys.setprofile(None)
    dump()
"""


def called_functions(script: str, args: list[str] | None = None) -> list[tuple[str, int]]:
    """(core file, first line) of every function `python <script> <args>` calls at least once."""
    core = [os.path.join(ROOT, f) for f in core_files()]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "called.json")
        argv = [*DEFAULT_RUN, "--out_dir", os.path.join(tmp, "run")] if args is None else args
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        path = os.path.join(ROOT, script)  # (runpy names the script's code by the path it is given)
        subprocess.run([sys.executable, "-c", TRACER, out, path, json.dumps(core), *argv], cwd=ROOT,
                       env=env, check=True, capture_output=True)
        with open(out) as f:
            return [(os.path.relpath(path, ROOT), line) for path, line in json.load(f)]


def executed_figures(called: list[tuple[str, int]]) -> tuple[int, int, int]:
    """(functions, lines, characters): the union of the called functions' line spans (decorators included),
    a nested function inside its parent's span; lambdas, comprehensions and module code are not functions."""
    spans = {}  # file -> set of line numbers
    count = 0
    for name in sorted({f for f, _ in called}):
        starts = {line for f, line in called if f == name}
        for node in ast.walk(ast.parse(read(name))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if first in starts:
                    count += 1
                    spans.setdefault(name, set()).update(range(first, node.end_lineno + 1))
    lines = sum(len(s) for s in spans.values())
    chars = sum(len(read(f).splitlines()[i - 1]) + 1 for f, s in spans.items() for i in s)
    return count, lines, chars


# ------------------------------------------------------------------------------------------------------------
# Prose wrapped to a column: a comment block or docstring paragraph whose last line is a single word.
def widows(name: str) -> list[int]:
    """The lines that end a comment or docstring paragraph with a lone word (a wrapped sentence's leftover)."""
    src = read(name)
    found = []
    comments = []  # the current run of full-line comments: (line number, text)

    def close_comments():
        if len(comments) > 1 and len(comments[-1][1].split()) == 1:
            found.append(comments[-1][0])
        comments.clear()

    for tok in tokenize.generate_tokens(iter(src.splitlines(keepends=True)).__next__):
        if tok.type == tokenize.COMMENT and tok.line.strip().startswith("#"):
            text = tok.string.lstrip("#").strip()
            if not text or set(text) <= set("-="):
                close_comments()
            elif comments and comments[-1][0] != tok.start[0] - 1:
                close_comments()
                comments.append((tok.start[0], text))
            else:
                comments.append((tok.start[0], text))
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            close_comments()
            if tok.type == tokenize.STRING and tok.string.startswith(('"""', "'''")):
                paragraph = []
                for i, line in enumerate(tok.string.splitlines()):
                    words = line.strip().strip('"').strip("'").split()
                    if words:
                        paragraph.append((tok.start[0] + i, words))
                        continue
                    if len(paragraph) > 1 and len(paragraph[-1][1]) == 1:
                        found.append(paragraph[-1][0])
                    paragraph = []
                if len(paragraph) > 1 and len(paragraph[-1][1]) == 1:
                    found.append(paragraph[-1][0])
    close_comments()
    return found


def main_lines(name: str) -> list[str]:
    src = read(name)
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    return src.splitlines()[fn.lineno - 1:fn.end_lineno]


def hygiene() -> tuple[list[str], list[str]]:
    """(the .py files that edit sys.path, the public files that cite an internal issue number)."""
    edits = [f for f in tracked("*.py") if SYS_PATH_EDIT.search(read(f))]
    refs = [f for f in tracked("*.py", "*.md", "*.txt", "*.json") if ISSUE_REF.search(read(f))]
    return edits, refs


def main():
    files = core_files()
    ours = {f[:-3] for f in files} | {"verifier"}
    print(f"{'file':<16} {'lines':>6} {'mean':>5} {'>=100':>6} {'section':>8}  imports")
    everything = []
    for f in files:
        lines = read(f).splitlines()
        everything += lines
        mean, wide = widths(lines)
        imports = ", ".join(project_imports(f, ours)) or "-"
        print(f"{f:<16} {len(lines):>6} {mean:>5.1f} {wide:>6.1%} {longest_section(lines):>8}  {imports}")
    mean, wide = widths(everything)
    print(f"{'core':<16} {len(everything):>6} {mean:>5.1f} {wide:>6.1%}")
    step = ours - {"verifier"}
    modules = {name: Module(name, step) for name in sorted(step)}
    for s in SCRIPTS:
        count, lines, chars = path_figures(s, modules)
        print(f"reading path of {s}: {count} functions, {lines} lines, {chars:,} characters; "
              f"main() {len(main_lines(s))} lines")
    for s in SCRIPTS:
        count, lines, chars = executed_figures(called_functions(s))
        print(f"what `python {s} {' '.join(DEFAULT_RUN)}` executes: {count} functions, {lines:,} lines, "
              f"{chars:,} characters")
    lone = {f: widows(f) for f in files}
    print(f"paragraphs ending on a lone word: {sum(map(len, lone.values()))}"
          + "".join(f" {f}:{','.join(map(str, v))}" for f, v in lone.items() if v))
    a, b = main_lines(SCRIPTS[0]), main_lines(SCRIPTS[1])
    differ = sum(1 for line in difflib.ndiff(a, b) if line.startswith(("- ", "+ ")))
    print(f"the two main()s differ in {differ} lines")
    edits, refs = hygiene()
    print(f"files that edit sys.path: {len(edits)}" + (f" ({' '.join(edits)})" if edits else ""))
    print(f"public files citing an internal issue number: {len(refs)}" + (f" ({' '.join(refs)})" if refs else ""))


if __name__ == "__main__":
    main()
