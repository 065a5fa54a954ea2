"""The reading path's figures (issue 31): what a reader opens to see one step, and how the rest is laid out.

  python bench/layout.py            # prints the table below for the current tree

Figures, each counted from the files as they are:
  - lines of each top-level file, and of the core (every top-level .py file but verifier.py, which stands alone);
  - a script + common.py: what a reader opens to see one step of either paper;
  - lines over 110 and over 120 characters, in all and as a share of the core;
  - main()'s length in each script, and how many lines the two main()s differ in (difflib, ignoring nothing);
  - the prose share of each script: comment and docstring lines over non-blank lines;
  - the longest section of each file (a section runs from one `# ----` rule to the next);
  - the project imports of each file, which must point one way (tests/test_layout.py checks the order).
"""
import ast
import difflib
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("da3po.py", "daro.py")


def core_files() -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py"))
                  if os.path.basename(p) != "verifier.py")


def read(name: str) -> list[str]:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read().splitlines()


def main_lines(name: str) -> list[str]:
    """The source lines of a script's main()."""
    lines = read(name)
    fn = next(n for n in ast.parse("\n".join(lines)).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    return lines[fn.lineno - 1:fn.end_lineno]


def prose_share(name: str) -> float:
    """Comment and docstring lines (a code line with a trailing comment counts as code) over non-blank lines."""
    lines = read(name)
    prose = set()
    for node in ast.walk(ast.parse("\n".join(lines))):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            prose.update(range(body[0].lineno - 1, body[0].end_lineno))
    prose.update(i for i, line in enumerate(lines) if line.strip().startswith("#"))
    nonblank = [i for i, line in enumerate(lines) if line.strip()]
    return len(prose & set(nonblank)) / len(nonblank)


def longest_section(name: str) -> int:
    rules = [i for i, line in enumerate(read(name)) if line.startswith("# ----")]
    bounds = rules + [len(read(name))]
    return max((b - a for a, b in zip(bounds, bounds[1:])), default=0)


def project_imports(name: str) -> list[str]:
    """The top-level project modules a file imports (at module level or inside functions)."""
    ours = {f[:-3] for f in core_files()} | {"verifier"}
    found = set()
    for node in ast.walk(ast.parse("\n".join(read(name)))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return sorted(found & ours - {name[:-3]})


def main():
    files = core_files()
    counts = {f: len(read(f)) for f in files}
    long110 = {f: sum(len(line) > 110 for line in read(f)) for f in files}
    long120 = {f: sum(len(line) > 120 for line in read(f)) for f in files}
    core = sum(counts.values())
    print(f"{'file':<16} {'lines':>6} {'>110':>5} {'>120':>5} {'longest section':>16}  imports")
    for f in files:
        print(f"{f:<16} {counts[f]:>6} {long110[f]:>5} {long120[f]:>5} {longest_section(f):>16}  "
              f"{', '.join(project_imports(f)) or '-'}")
    share = sum(long110.values()) / core
    print(f"{'core':<16} {core:>6} {sum(long110.values()):>5} {sum(long120.values()):>5}   "
          f"({share:.1%} of the core's lines over 110)")
    for s in SCRIPTS:
        print(f"{s} + common.py: {counts[s] + counts['common.py']} lines | main(): {len(main_lines(s))} lines | "
              f"prose {prose_share(s):.0%}")
    a, b = main_lines(SCRIPTS[0]), main_lines(SCRIPTS[1])
    differ = sum(1 for line in difflib.ndiff(a, b) if line.startswith(("- ", "+ ")))
    print(f"the two main()s differ in {differ} lines (lines only in one or the other)")
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        print(f"README.md: {len(f.read().splitlines())} lines")


if __name__ == "__main__":
    sys.exit(main())
