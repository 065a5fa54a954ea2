"""Stops and resumes: a stop request (SIGTERM, Ctrl-C) between generation batches, between updates or where an
evaluation is due checkpoints at once and resumes exactly; a real torchrun sent SIGTERM; checkpoints saved on 2 ranks
resumed on 1 and the other way round.
Run: python -m pytest -q tests/test_stop.py"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import common
import engine as eng
import da3po
import daro
from conftest import ROOT

SMALL = ["--prompts_per_step", "8", "--updates_per_step", "2", "--eval_size", "16", "--eval_samples", "2",
         "--sample_every", "1"]


def records(path):
    """metrics.jsonl without wall-clock fields (the only thing allowed to differ between runs)."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")} for line in open(path)]


def run(script, out, *flags):
    script.main(common.parse_config(script.Config, ["--out_dir", str(out), *SMALL, *flags], script.PRESETS))


def stop_when(monkeypatch, obj, name, when):
    """Wrap obj.name so that a stop request arrives (as SIGTERM's handler would set it) when when(calls) is true."""
    real, calls = getattr(obj, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if when(calls[0]):
            common._stop_signal = signal.SIGTERM
        return real(*args, **kwargs)
    monkeypatch.setattr(obj, name, wrapper)


@pytest.mark.parametrize("where", ["rollout", "updates", "eval_due"])
@pytest.mark.parametrize("script", [da3po, daro], ids=["da3po", "daro"])
def test_a_stop_checkpoints_at_once_and_resumes_exactly(tmp_path, monkeypatch, capsys, script, where):
    """Step 2 of 3 is interrupted: during its rollout (its first generation batch: the step is redone from its
    start), during its first update (the checkpoint holds the step's remaining work), or after it when an evaluation
    is due (the evaluation runs on resume). The resumed run's metrics.jsonl equals the uninterrupted one's."""
    flags = ["--steps", "3", "--eval_every", "2", "--max_gen_batches", "4"]
    run(script, tmp_path / "straight", *flags)
    straight = records(tmp_path / "straight" / "metrics.jsonl")
    assert straight[2]["train/num_gen_batches"] > 1  # step 2 has a second generation batch to stop before
    if where == "rollout":  # the 1st generate of a run is the step-0 eval, the 2nd step 1's first batch, ...
        step1_batches = straight[1]["train/num_gen_batches"]
        stop_when(monkeypatch, eng.HFRollout, "generate", lambda n: n == 2 + step1_batches)
    elif where == "updates":  # the 3rd update of the run is step 2's first
        stop_when(monkeypatch, common.UpdateGuard, "step", lambda n: n == 3)
    else:  # the stop arrives during step 2's sync, after its updates: step 2 completes, its eval is due
        stop_when(monkeypatch, eng.HFRollout, "sync_weights", lambda n: n == 2)
    out = tmp_path / "stopped"
    run(script, out, *flags)
    said = capsys.readouterr().out
    assert {"rollout": "stopped in step 2's rollout", "updates": "stopped in step 2 before update 1",
            "eval_due": "stopped at step 2"}[where] in said
    saved = common.latest_checkpoint(str(out))
    assert saved.endswith("step_000002" if where != "rollout" else "step_000001")
    assert not os.path.exists(out / "step_000003")
    monkeypatch.undo()
    run(script, out, *flags, "--resume")
    assert records(out / "metrics.jsonl") == straight


def test_torchrun_sigterm_checkpoints_and_resumes_exactly(tmp_path):
    """A real torchrun of 2 CPU ranks sent SIGTERM (torchrun forwards it to the workers and kills them 30 s later)
    leaves a complete checkpoint; the resumed run ends with the metrics of an uninterrupted one."""
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "da3po.py",
            "--steps", "8", *SMALL]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([*base, "--out_dir", str(tmp_path / "straight")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "stopped"
    proc = subprocess.Popen([*base, "--out_dir", str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:  # wait for step 2's record, then stop it mid-run
        if (out / "metrics.jsonl").exists() and sum(1 for _ in open(out / "metrics.jsonl")) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=120)[0]
    assert "continue with --resume" in output, output[-3000:]  # (had it taken 30 s, torchrun would have killed them)
    saved = common.latest_checkpoint(str(out))
    assert saved is not None and not saved.endswith("step_000008"), "the run must have been stopped before its end"
    assert {"trainer.pt", "model.safetensors", "rank0.pt", "rank1.pt", "optimizer"} <= set(os.listdir(saved))
    r = subprocess.run([*base, "--out_dir", str(out), "--resume"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr[-3000:]
    assert records(out / "metrics.jsonl") == records(tmp_path / "straight" / "metrics.jsonl")


def harness(out, ranks, *flags):
    """tests/lockstep.py's scripted engine (the same data on any number of ranks), 1 or 2 ranks."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks > 1 else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TORCH_FR_BUFFER_SIZE": "1000"}
    r = subprocess.run([sys.executable, *launcher, "tests/lockstep.py", str(out), "da3po.py", "content",
                        "--prompts_per_step", "8", "--group_size", "4", "--updates_per_step", "1",
                        "--eval_size", "8", "--eval_samples", "2", "--eval_every", "2", "--save_every", "2",
                        "--max_new_tokens", "16", "--no-dynamic_sampling", *flags], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.mark.parametrize("first,then", [(2, 1), (1, 2)], ids=["2-ranks-then-1", "1-rank-then-2"])
def test_a_checkpoint_resumes_on_another_number_of_ranks(tmp_path, first, then):
    """Saved on `first` ranks after 2 steps, resumed on `then` ranks for 2 more: the metrics of an uninterrupted run
    on `first` ranks, within float rounding (the optimizer state is resharded; the data, scripted by content, all of
    it kept, in one update per step, make the math independent of the number of ranks)."""
    harness(tmp_path / "straight", first, "--steps", "4")
    harness(tmp_path / "moved", first, "--steps", "2")
    said = harness(tmp_path / "moved", then, "--steps", "4", "--resume")
    assert f"saved on {first} ranks, this run has {then}" in said
    a, b = records(tmp_path / "straight" / "metrics.jsonl"), records(tmp_path / "moved" / "metrics.jsonl")
    assert [x["step"] for x in a] == [x["step"] for x in b] and len(a) == 7  # 4 steps and 3 evaluations
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if not k.startswith("perf/"):  # (padding depends on how the rows are split into micro-batches)
                assert y[k] == pytest.approx(x[k], rel=1e-4, abs=1e-6), (x["step"], k)
