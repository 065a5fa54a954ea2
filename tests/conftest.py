"""Shared fixtures. Run the whole suite with: python -m pytest -q tests"""
import os
import sys

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing in the tests may reach a hub
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

torch.set_num_threads(1)  # the machine is shared: one thread keeps tests predictable


@pytest.fixture(scope="session")
def demo_dir():
    """The shipped demo model's folder (demo/model, built by demo/build.py): what `--model demo` loads."""
    import common
    return common.model_path("demo")


def run_script(args, cwd=ROOT, timeout=300):
    """Run a script as a user would, with one thread and no hub access; returns the CompletedProcess."""
    import subprocess
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
