"""verifier.py as a program (`python verifier.py PRED GOLD`, --extract, --jsonl, exit codes 0 / 1 / 2), and as the
self-contained file it claims to be: test_verifier.py passes with torch (and numpy) made unimportable."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERIFIER = str(ROOT / "verifier.py")

# An import blocker loaded at interpreter start (sitecustomize on PYTHONPATH): `import torch` raises ImportError,
# as it would on a machine without torch. numpy is blocked too: nothing in verifier.py needs it.
BLOCKER = """import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "numpy"):
            raise ImportError(f"{name} is blocked by this test")
sys.meta_path.insert(0, _Block())
"""


def run_cli(*args, cwd=ROOT, env=None):
    """`python verifier.py ARGS` as a user runs it; returns the CompletedProcess."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, VERIFIER, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_equal_and_not_equal():
    r = run_cli("\\frac{1}{2}", "0.5")
    assert (r.returncode, r.stdout, r.stderr) == (0, "equal\n", "")
    r = run_cli("(1,2)", "[1,2]")
    assert (r.returncode, r.stdout) == (1, "not equal\n")
    r = run_cli("--", "-x", "-1*x")  # answers starting with '-' go after '--'
    assert (r.returncode, r.stdout) == (0, "equal\n")


def test_extract_and_options(tmp_path):
    completion = "Reasoning...\nso the answer is $\\boxed{\\frac{4}{2}}$.\nAnswer: 3"
    assert run_cli("--extract", completion, "2").returncode == 0  # the box wins in auto
    assert run_cli("1 + 2 is\nAnswer: 3", "3").returncode == 1  # without --extract the whole text is the answer
    assert run_cli("--extract", "1 + 2 is\nAnswer: 3", "3").returncode == 0
    r = run_cli("--extract", "--answer_format", "answer_line", "--timeout", "5", completion, "3")
    assert (r.returncode, r.stdout) == (0, "equal\n")
    # from another directory, by path: the file needs nothing next to it
    assert run_cli("x^2-1", "(x-1)(x+1)", cwd=tmp_path).returncode == 0


def test_jsonl_mixed(tmp_path):
    rows = [{"pred": "1/2", "gold": "0.5"}, {"completion": "so \\boxed{3}.", "gold": 4}, None,
            {"pred": 7, "gold": "7"}, {"completion": "no answer here", "gold": "1"}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join("" if r is None else json.dumps(r) for r in rows) + "\n")
    r = run_cli("--jsonl", str(path), "--num_workers", "1")
    assert r.returncode == 1, r.stderr
    assert r.stdout.splitlines() == ["1: equal", "2: not equal", "4: equal", "5: not equal", "2 equal of 4"]
    path.write_text(json.dumps({"pred": "2\\sqrt2", "gold": "\\sqrt8"}) + "\n")
    r = run_cli("--jsonl", str(path))
    assert (r.returncode, r.stdout.splitlines()) == (0, ["1: equal", "1 equal of 1"])


def test_jsonl_refused_rows_are_counted_and_explained(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [{"pred": "x+" * 3000 + "1", "gold": "1"}, {"pred": "7" * 5000, "gold": "7" * 5000}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    r = run_cli("--jsonl", str(path), "--num_workers", "1")
    assert r.returncode == 1
    assert r.stdout.splitlines() == ["1: not equal", "2: equal", "1 equal of 2 (1 refused)"]
    assert "refused 1 of 2 pairs as too large to judge, the first an answer of 6,001 characters" in r.stderr


def test_bad_input_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    cases = [('{"pred": "1", "gold": "1"}\n{oops\n', ":2: invalid JSON"),
             ('{"pred": "1", "gold": "1"}\n\n{"pred": "1"}\n', ':3: expected an object with "gold"'),
             ('{"pred": "1", "completion": "x", "gold": "1"}\n', ":1: expected"),
             ('[1, 2]\n', ":1: expected"),
             ('{"pred": [1], "gold": "1"}\n', ":1: answers must be strings or numbers")]
    for text, message in cases:
        bad.write_text(text)
        r = run_cli("--jsonl", str(bad))
        assert r.returncode == 2 and r.stdout == "", (text, r.stdout)
        assert r.stderr.startswith(f"error: {bad}{message}") and len(r.stderr.splitlines()) == 1, r.stderr
    r = run_cli("--jsonl", str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.splitlines()) == 1
    assert "Traceback" not in r.stderr
    assert run_cli("only_pred").returncode == 2  # usage errors exit 2 as well (argparse)


def test_help_documents_everything():
    r = run_cli("--help")
    assert r.returncode == 0
    for word in ("PRED", "GOLD", "--extract", "--answer_format", "--timeout", "--jsonl", "completion", "exit"):
        assert word.lower() in r.stdout.lower(), word


def test_verifier_tests_pass_without_torch(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1",
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # third-party pytest plugins are not what this checks
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "blocked by this test" in probe.stderr  # the blocker works
    probe = subprocess.run([sys.executable, "-c", "import sys, verifier; print(sorted(m for m in sys.modules "
                            "if m.split('.')[0] in ('torch', 'numpy', 'common')))"], env=env, capture_output=True,
                           text=True, cwd=tmp_path)
    assert (probe.returncode, probe.stdout) == (0, "[]\n"), probe.stderr
    # conftest.py imports torch, hence --noconftest: test_verifier.py must stand on its own
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider",
                        str(ROOT / "tests" / "test_verifier.py")], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = r.stdout.strip().splitlines()[-1]  # e.g. "451 passed in 9.1s"
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
