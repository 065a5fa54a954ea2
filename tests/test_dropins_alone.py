"""The drop-ins stand alone: each integrations/ file, copied into a user's project that has its own `common.py` and
`dataset.py` (the names of this repository's modules), imports and runs there with nothing of this repository on
the path. CI also runs this file in a venv with only torch and trl, and in one with only verl's own dependency set
(.ci/run). Each test skips without its framework.
Run: HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python -m pytest -q tests/test_dropins_alone.py"""
import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

USERS_COMMON = '''"""The user's own common.py: a verifier of sums."""
def is_correct(completions, answer, **kwargs):
    return [c[0]["content"].strip().endswith(a) for c, a in zip(completions, answer)]

def reward(completions, answer, **kwargs):
    return [1.0 if c else -1.0 for c in is_correct(completions, answer)]
'''
USERS_DATASET = '''"""The user's own dataset.py."""
import json

def load_rows(path, first, last):
    return [json.loads(line) for line in open(path)][first:last]
'''
# Every module the run imported from a file: none may come from this repository (the user's project is elsewhere;
# the interpreter's own packages may lie under it, as CI's venvs do)
REPORT = '''
import json, os, sys
files = {name: getattr(m, "__file__", None) or "" for name, m in list(sys.modules.items())}
installed = tuple(os.path.join(p, "") for p in {sys.prefix, sys.base_prefix})
print("REPORT " + json.dumps({"common": files["common"], "dataset": files["dataset"], "from_repository": sorted(
    n for n, f in files.items() if f.startswith(REPOSITORY) and not f.startswith(installed))}))
'''


# What each drop-in may import: the standard library, torch, and its framework's own stack
ALLOWED = {"trl_da3po_daro.py": {"torch", "trl", "transformers", "accelerate"},
           "verl_da3po_daro.py": {"torch", "numpy", "verl"}}


def test_each_drop_in_imports_only_its_framework():
    """A source check (no framework needed): top-level imports only of the standard library, torch and the
    framework; no name of this repository's modules; and no file named after a package it imports (a `trl.py`
    would shadow trl)."""
    ours = {os.path.splitext(f)[0] for f in os.listdir(ROOT) if f.endswith(".py")} | {"integrations", "tests"}
    for name, allowed in ALLOWED.items():
        with open(os.path.join(ROOT, "integrations", name)) as f:
            tree = ast.parse(f.read())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{name}: a relative import"
                found.add(node.module.split(".")[0])
        outside = found - allowed - set(sys.stdlib_module_names)
        assert not outside and not found & ours, f"{name} imports {sorted(outside | found & ours)}"
        assert os.path.splitext(name)[0] not in found | allowed
    packages = {"trl", "verl", "torch", "transformers", "accelerate", "numpy", "peft", "datasets"}
    assert not {os.path.splitext(f)[0] for f in os.listdir(os.path.join(ROOT, "integrations"))} & packages


def project(tmp_path, drop_in: str):
    """A user's project: its own common.py and dataset.py, and the drop-in file copied in."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "common.py").write_text(USERS_COMMON)
    (folder / "dataset.py").write_text(USERS_DATASET)
    shutil.copy(os.path.join(ROOT, "integrations", drop_in), folder)
    return folder


def run_in(folder, code: str, timeout=600, **env):
    """Run `code` as a script in the user's project, this repository nowhere on the path."""
    script = folder / "run.py"
    script.write_text(f"REPOSITORY = {os.path.join(ROOT, '')!r}\n{code}\n{REPORT}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": "", **env}
    out = subprocess.run([sys.executable, str(script)], cwd=str(folder), env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("REPORT "))[7:])
    assert report["common"] == str(folder / "common.py") and report["dataset"] == str(folder / "dataset.py")
    assert report["from_repository"] == []
    return out.stdout


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is optional: pip install trl==1.16.0")
def test_trl_drop_in_in_a_users_project(tmp_path):
    folder = project(tmp_path, "trl_da3po_daro.py")
    model = os.path.join(ROOT, "demo", "arith", "model")
    out = run_in(folder, f'''
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
import common
from dataset import load_rows
from trl_da3po_daro import DA3POConfig, DA3POTrainer, DAROConfig, DAROTrainer

rows = load_rows({os.path.join(ROOT, "demo", "arith", "eval.jsonl")!r}, 80, 160)
data = Dataset.from_dict({{"prompt": [[{{"role": "user", "content": r["problem"]}}] for r in rows],
                          "answer": [r["answer"] for r in rows]}})
shared = dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=8, max_steps=2,
              learning_rate=1e-3, use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1,
              disable_tqdm=True)
for Trainer, Config in [(DA3POTrainer, DA3POConfig), (DAROTrainer, DAROConfig)]:
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained({model!r}), reward_funcs=common.reward,
                      correct_func=common.is_correct, args=Config(output_dir="out", **shared), train_dataset=data,
                      processing_class=AutoTokenizer.from_pretrained({model!r}))
    trainer.train()
    print(Trainer.__name__, "steps", trainer.state.global_step)
''')
    assert "DA3POTrainer steps 2" in out and "DAROTrainer steps 2" in out


@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is optional: see requirements/verl.txt")
def test_verl_drop_in_in_a_users_project(tmp_path):
    """As verl runs it: VERL_USE_EXTERNAL_MODULES names the copied file, which `import verl` imports; the
    estimators and the loss are in verl's registries and DARO's worker is verl's actor worker."""
    pytest.importorskip("verl.workers.engine_workers", reason="the drop-in needs verl's own install")
    folder = project(tmp_path, "verl_da3po_daro.py")
    out = run_in(folder, '''
import numpy as np
import torch
import common
import dataset
import verl
from verl.trainer.ppo import core_algos
from verl.workers import engine_workers

scores = torch.tensor([[0.0, 0.0, 0.0], [-1.0, 0.0, 0.0], [-1.0, 0.0, 0.0], [-2.0, 0.0, 0.0]]).sum(-1, keepdim=True)
kwargs = dict(token_level_rewards=scores, response_mask=torch.ones(4, 1), index=np.array(["q"] * 4, dtype=object))
advantages, _ = core_algos.get_adv_estimator_fn("da3po")(**kwargs)
_, bins = core_algos.get_adv_estimator_fn("daro")(**kwargs)
print("advantages", [round(a, 4) for a in advantages.flatten().tolist()], "bins", bins.flatten().tolist())
print("loss", core_algos.get_policy_loss_fn("daro").__name__, "worker",
      engine_workers.ActorRolloutRefWorker.actor_worker_cls.__name__)
''', VERL_USE_EXTERNAL_MODULES="verl_da3po_daro", PYTHONPATH=str(folder))
    # scores [0 (correct at the cap), -1, -1, -2]: mean -1, unbiased std sqrt(2/3), A = [1.2247, 0, 0, -1.2247];
    # p_hat 1/4 < tau: the correct one's advantage doubled; one correct: bin 1 for every row
    assert "advantages [2.4495, 0.0, 0.0, -1.2247] bins [1.0, 1.0, 1.0, 1.0]" in out
    assert "loss daro_policy_loss worker DAROTrainingWorker" in out
