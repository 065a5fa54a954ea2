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


DEMO_SFT_STEPS = 300  # enough that level-1 sums are sometimes right, so dynamic sampling keeps groups


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """A demo model built, warm-started (300 SFT steps, ~15 s) and saved through the real code path, once per session.
    Returns (model folder, cache folder); scripts reuse it with --cache_dir and --demo_sft_steps DEMO_SFT_STEPS."""
    import common
    from da3po import Config
    cache = str(tmp_path_factory.mktemp("cache"))
    cfg = Config(cache_dir=cache, demo_sft_steps=DEMO_SFT_STEPS)
    return common.demo_model_path(cfg, common.DistInfo()), cache


def run_script(args, cwd=ROOT, timeout=300):
    """Run a script as a user would, with one thread and no hub access; returns the CompletedProcess."""
    import subprocess
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
