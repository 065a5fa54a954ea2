"""The layout by role: common.py holds the step, the files that keep a run going hold the rest, and
imports point one way. Source checks only (no torch needed); tools/layout.py prints the size figures."""
import ast
import difflib
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Lower first: a file may import only the files before it (verifier.py stands alone: anyone may import it).
ORDER = ["ranks", "modeling", "dataset", "crosscheck", "entropy_control", "config", "lora", "shortcuts", "common",
         "neighbours", "entropy_update", "partial", "vllm_engine", "engine", "bookkeeping", "da3po", "daro"]
STEP_FILES = ("common.py", "da3po.py", "daro.py")  # what a reader opens to see one step
# What keeps a run going, defined only in its own file: stop signals, process groups, the output-layer table,
# the start-up probes, sharding, checkpoints, trackers.
RUN_KEEPING = {"handle_stop_signals": "ranks", "stop_requested": "ranks", "setup_dist": "ranks",
               "cleanup_dist": "ranks", "_LOGIT_TRANSFORMS": "shortcuts", "check_chunked_logprobs": "shortcuts",
               "check_logprob_paths": "shortcuts", "shard_model": "modeling", "save_checkpoint": "bookkeeping",
               "load_checkpoint": "bookkeeping", "Tracker": "bookkeeping", "Logger": "bookkeeping",
               "TrainConfig": "config", "parse_config": "config", "check_config": "config", "add_lora": "lora",
               "VLLMRollout": "vllm_engine"}
# Calls that set up processes, shard, install signal handlers or read and write checkpoint files.
RUN_KEEPING_CALLS = {"init_process_group", "destroy_process_group", "fully_shard", "signal", "save", "load"}


def tree(name: str) -> ast.Module:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return ast.parse(f.read())


def core() -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py"))
                  if os.path.basename(p) != "verifier.py")


def imports(name: str) -> set[str]:
    found = set()
    for node in ast.walk(tree(name)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def top_level_names(name: str) -> set[str]:
    names = set()
    for node in tree(name).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def test_every_core_file_has_its_place_in_the_order():
    assert sorted(f[:-3] for f in core()) == sorted(ORDER), "a new top-level file needs its place in ORDER"


def test_imports_point_one_way():
    for i, module in enumerate(ORDER):
        ours = imports(module + ".py") & set(ORDER)
        upward = ours - set(ORDER[:i])
        assert not upward, f"{module}.py imports {sorted(upward)}, which come after it in {ORDER}"


def test_what_keeps_a_run_going_is_defined_in_its_own_file():
    for name, home in RUN_KEEPING.items():
        assert name in top_level_names(home + ".py"), f"{name} should be defined in {home}.py"
        for f in STEP_FILES:
            assert name not in top_level_names(f), f"{f} defines {name}, which belongs in {home}.py"


def test_the_step_files_set_up_no_process_shard_signal_or_checkpoint_file():
    for f in STEP_FILES:
        calls = {n.func.attr for n in ast.walk(tree(f))
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
        assert not calls & RUN_KEEPING_CALLS, f"{f} calls {sorted(calls & RUN_KEEPING_CALLS)}"


def test_every_core_file_opens_with_what_it_holds_in_one_width_and_800_lines_at_most():
    for f in core():
        assert ast.get_docstring(tree(f)), f"{f} has no module docstring"
        with open(os.path.join(ROOT, f), encoding="utf-8") as fh:
            lines = fh.read().splitlines()
        long = [i + 1 for i, line in enumerate(lines) if len(line) > 100]
        assert not long, f"{f}: lines over 100 characters: {long}"
        assert len(lines) <= 800, f"{f}: {len(lines)} lines, over 800"


def test_no_comment_or_docstring_paragraph_ends_on_a_lone_word():
    """Prose is written as sentences, not wrapped to a column (tools/layout.py counts the leftovers)."""
    from tools import layout
    for f in core():
        assert not layout.widows(f), f"{f}: paragraphs ending on a one-word line at lines {layout.widows(f)}"


# ------------------------------------------------------------------------------------------------------------
# The plain step on the page: common.py opens with the hooks' protocol, holds no flags, and computes log pi
# with one padded forward a reader copies; the shortcuts live in shortcuts.py and reach it through one line.
def test_common_opens_with_the_protocol_and_holds_no_flag_definitions():
    module = tree("common.py")
    classes = [n for n in module.body if isinstance(n, ast.ClassDef)]
    assert classes and classes[0].name == "Algorithm", "common.py's first class should be the Algorithm protocol"
    dataclasses = [c.name for c in classes if any("dataclass" in ast.unparse(d) for d in c.decorator_list)]
    assert not dataclasses, f"common.py defines flags (dataclasses {dataclasses}): they belong in config.py"
    assert not {"TrainConfig", "BASELINES", "parse_config"} & top_level_names("common.py")


def test_the_plain_logprob_function_is_short_and_knows_no_shortcut():
    plain = definition(tree("common.py"), "token_logprobs")
    assert plain.end_lineno - plain.lineno + 1 <= 25, "common.token_logprobs: the plain path in 25 lines at most"
    names = {n.id for n in ast.walk(plain) if isinstance(n, ast.Name)}
    assert not names & ({"shortcuts"} | top_level_names("shortcuts.py")), names & top_level_names("shortcuts.py")
    assert "common" not in imports("shortcuts.py"), "shortcuts.py imports common: an import cycle"
    dispatch = [n for n in ast.walk(tree("common.py")) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id == "shortcuts" and n.attr == "token_logprobs"]
    assert len(dispatch) == 1, "the step reaches the shortcuts' log-probs through one line"


# What one default run executes stays within the aim: 1,500 lines and 95,000 characters for each script.
EXECUTED_BOUNDS = {"da3po.py": (1500, 95_000), "daro.py": (1500, 95_000)}


def test_what_one_default_run_executes_stays_within_its_bounds():
    """Every core function `python <script> --steps 2 --eval_every 0` calls (a profile hook records them), the
    union of their line spans (verifier.py apart): within EXECUTED_BOUNDS' lines and characters."""
    from tools import layout
    for script, (max_lines, max_chars) in EXECUTED_BOUNDS.items():
        count, lines, chars = layout.executed_figures(layout.called_functions(script))
        assert count > 50, f"{script}: the tracer saw only {count} functions"
        assert lines <= max_lines and chars <= max_chars, f"{script} executes {lines:,} lines, {chars:,} characters"


# -----------------------------------------------------------------------------------------------------------------
# Roles: bench/ (speed and memory against peers), experiments/ (science studies), tools/ (data builders and developer
# tools), each script run as a module from the root (`python -m bench.vs_trl`); the README's map matches the tree.
ROLES = ("bench", "experiments", "tools")
# Every file allowed to edit sys.path: the one conftest through which the tests import.
SYS_PATH_EDITORS = {os.path.join("tests", "conftest.py")}


def role_scripts() -> list[str]:
    """Every script of bench/, experiments/ and tools/ as a module name, e.g. bench.vs_trl."""
    return sorted(f"{role}.{os.path.basename(p)[:-3]}" for role in ROLES
                  for p in glob.glob(os.path.join(ROOT, role, "*.py")) if not p.endswith("__init__.py"))


def python_files() -> list[str]:
    """Every .py file of the project (its folders and the top level; run folders and environments left out)."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        rel = os.path.relpath(folder, ROOT)
        dirs[:] = [d for d in dirs if not d.startswith((".", "__")) and d not in ("out", "runs")
                   and not os.path.exists(os.path.join(folder, d, "pyvenv.cfg"))]
        found += [os.path.normpath(os.path.join(rel, f)) for f in files if f.endswith(".py")]
    return sorted(found)


def test_no_core_file_imports_from_bench_experiments_or_tools():
    for f in core() + ["verifier.py"]:
        assert not imports(f) & set(ROLES), f"{f} imports {sorted(imports(f) & set(ROLES))}"


def test_only_the_tests_conftest_edits_sys_path():
    from tools.layout import SYS_PATH_EDIT
    editors = set()
    for f in python_files():
        with open(os.path.join(ROOT, f), encoding="utf-8") as fh:
            if SYS_PATH_EDIT.search(fh.read()):
                editors.add(f)
    assert editors <= SYS_PATH_EDITORS, f"files that edit sys.path: {sorted(editors - SYS_PATH_EDITORS)}"


def test_no_script_is_named_after_a_project_module_and_each_folder_is_a_package():
    ours = {f[:-3] for f in core()} | {"verifier", "demo", "tests", "integrations", *ROLES}
    for name in role_scripts():
        assert name.split(".")[1] not in ours, f"{name} is named after the project's {name.split('.')[1]}"
    for role in ROLES:
        assert os.path.isfile(os.path.join(ROOT, role, "__init__.py")), f"{role}/ is not a package"


# Each script as `python -m <name> --help` runs it, all in one interpreter (the imports are shared, so it takes
# seconds): argparse's --help exits 0. A script whose optional package is missing (matplotlib, trl) is skipped;
# one that cannot find a module of the project (a module run by path, or an import that needs sys.path edited) fails.
HELP_RUNNER = r"""
import contextlib, io, json, runpy, sys
ours = set(sys.argv[2].split(","))
results = {}
for name in sys.argv[1].split(","):
    sys.argv[:] = [name, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        results[name] = "no exit"
    except SystemExit as e:
        results[name] = "ok" if e.code in (0, None) and "usage" in out.getvalue().lower() else f"exit {e.code}"
    except ModuleNotFoundError as e:
        missing = (e.name or "").split(".")[0]
        results[name] = f"cannot import {e.name}" if missing in ours else "optional: " + missing
    except Exception as e:
        results[name] = f"{type(e).__name__}: {e}"
print(json.dumps(results))
"""


def test_every_script_runs_as_a_module():
    import json
    import subprocess
    import sys
    scripts = [s for s in role_scripts() if "argparse" in open(os.path.join(ROOT, *s.split(".")) + ".py").read()]
    assert len(scripts) >= 20, scripts  # the argparse scripts: every one but tools.layout
    ours = {f[:-3] for f in core()} | {"verifier", "demo", "tests", "integrations", *ROLES}
    ours |= {os.path.basename(f)[:-3] for f in python_files()}  # a sibling imported by its bare name is ours too
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", HELP_RUNNER, ",".join(scripts), ",".join(sorted(ours))], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    bad = {k: v for k, v in results.items() if v != "ok" and not v.startswith("optional: ")}
    assert not bad, bad


def readme_map() -> tuple[list[str], str]:
    """The README's file map (the names at the start of its lines) and its reading-order paragraph."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Files, and where to start reading", 1)[1]
    block = section.split("```", 2)[1]
    names = [line.split()[0] for line in block.splitlines() if line and not line[0].isspace()]
    reading = section.split("Reading order", 1)[1].split("\n\n", 1)[0]
    return names, reading


def test_the_readme_file_map_and_reading_order_match_the_tree():
    names, reading = readme_map()
    missing = [n for n in names if not os.path.exists(os.path.join(ROOT, n))]
    assert not missing, f"the README's file map names what is not in the tree: {missing}"
    top_py = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py")))
    assert not set(top_py) - set(names), f"top-level files the README's map leaves out: {set(top_py) - set(names)}"
    packages = {os.path.basename(os.path.dirname(p)) + "/" for p in glob.glob(os.path.join(ROOT, "*", "__init__.py"))}
    assert not packages - set(names), f"folders the README's map leaves out: {packages - set(names)}"
    cited = set(re.findall(r"`(\w+\.py)`", reading))
    assert cited and not cited - set(top_py), f"the reading order names files not at the top: {cited - set(top_py)}"


def test_the_readme_is_short_and_explains_the_algorithm_before_any_integration():
    """The README in 250 lines at most, its sections in a newcomer's order: Quick start, the algorithm, the files and
    reading order, before the TRL and verl section."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= 250, f"README.md: {len(lines)} lines, over 250"
    headings = [line[3:] for line in lines if line.startswith("## ")]
    order = ["Quick start", "The algorithm, one RL step", "Files, and where to start reading", "In TRL and verl"]
    assert all(h in headings for h in order), f"README.md's sections: {headings}"
    assert [headings.index(h) for h in order] == sorted(headings.index(h) for h in order), headings


# ------------------------------------------------------------------------------------------------------------
# One loop protocol: the two main()s are the same loop, written twice on purpose (each script reads top to
# bottom), and every hook that loop calls on the algorithm is written down once, on common.Algorithm.
SCRIPTS = ("da3po.py", "daro.py")
# The only lines of main() that may differ between the two scripts: each names its own algorithm class.
MAIN_MAY_DIFFER = {"da3po.py": ["algo = NEIGHBOURS.get(cfg.algo, DAA)(cfg, device, state)"],
                   "daro.py": ["algo = DARO(cfg, device, state)"]}


def definition(module: ast.Module, name: str) -> ast.FunctionDef | ast.ClassDef:
    return next(n for n in module.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name)


def main_lines(script: str) -> list[str]:
    """main()'s source lines, stripped of indentation, comments included (the loops' prose matches too)."""
    node = definition(tree(script), "main")
    with open(os.path.join(ROOT, script), encoding="utf-8") as f:
        lines = f.read().splitlines()[node.lineno - 1:node.end_lineno]
    return [line.strip() for line in lines]


def calls_on(node: ast.AST, name: str) -> set[str]:
    """The methods called on the variable `name` anywhere inside `node` (`algo.loss(...)` -> "loss")."""
    return {n.func.attr for n in ast.walk(node)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name) and n.func.value.id == name}


def hooks() -> set[str]:
    base = definition(tree("common.py"), "Algorithm")
    return {n.name for n in base.body if isinstance(n, ast.FunctionDef)}


def test_the_two_main_loops_differ_only_in_the_lines_that_name_their_algorithm():
    first, second = (main_lines(s) for s in SCRIPTS)
    differing = {script: [] for script in SCRIPTS}
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=first, b=second, autojunk=False).get_opcodes():
        if op != "equal":
            differing[SCRIPTS[0]] += first[i1:i2]
            differing[SCRIPTS[1]] += second[j1:j2]
    for script, lines in zip(SCRIPTS, (first, second)):
        allowed = MAIN_MAY_DIFFER[script]
        unexpected = [line for line in differing[script] if not line.startswith(tuple(allowed))]
        assert not unexpected, f"{script}'s main() differs from the other script's in: {unexpected}"
        for prefix in allowed:  # the allowed lines exist: the list cannot go stale unnoticed
            assert sum(line.startswith(prefix) for line in lines) == 1, f"{script}: no line {prefix!r}"


def test_every_hook_the_loop_calls_is_on_the_algorithm_base():
    documented = hooks()
    for script in SCRIPTS:
        module = tree(script)
        called = calls_on(definition(module, "main"), "algo")
        assert {"advantages", "start_update", "loss", "after_update", "end_step"} <= called, f"{script}: {called}"
        assert not called - documented, f"{script}'s loop calls {sorted(called - documented)}: not on Algorithm"
        classes = [n for n in module.body if isinstance(n, ast.ClassDef)
                   and any(isinstance(b, ast.Name) and b.id == "Algorithm" for b in n.bases)]
        assert len(classes) == 1, f"{script} should define one subclass of common.Algorithm"
    for name in ("common.py", "bookkeeping.py"):  # the step's functions that are handed the algorithm
        for fn in ast.walk(tree(name)):
            if isinstance(fn, ast.FunctionDef) and "algo" in {a.arg for a in fn.args.args}:
                called = calls_on(fn, "algo")
                assert not called - documented, f"{name}:{fn.name} calls {sorted(called - documented)}"
