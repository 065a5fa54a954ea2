"""Resume after kill -9, a kill in the middle of a checkpoint, bad input, non-finite updates.
Run: python -m pytest -q tests/test_reliability.py"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import common
import config
import bookkeeping
import modeling
import da3po
from tests.conftest import ROOT, run_script

SMALL = ["--demo", "arith", "--prompts_per_step", "8", "--updates_per_step", "2", "--eval_size", "16",
         "--eval_samples", "2", "--eval_every", "0"]


def records(path):
    """metrics.jsonl without wall-clock fields (the only thing allowed to differ between runs)."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")} for line in open(path)]


def test_kill_9_then_resume_reproduces_the_uninterrupted_run(demo_dir, tmp_path):
    base = ["da3po.py", "--steps", "6", "--save_every", "3", *SMALL]
    r = run_script([*base, "--out_dir", str(tmp_path / "a")])
    assert r.returncode == 0, r.stderr[-3000:]

    out = tmp_path / "b"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, *base, "--out_dir", str(out)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not (out / "step_000003").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)  # kill -9: no handler runs, nothing is flushed
    proc.wait()
    assert not (out / "step_000006").exists(), "the run finished before the kill; the test would prove nothing"
    r = run_script([*base, "--out_dir", str(out), "--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout
    a, b = records(tmp_path / "a" / "metrics.jsonl"), records(out / "metrics.jsonl")
    assert [x["step"] for x in b] == [x["step"] for x in a]
    later = lambda rs: [x for x in rs if x["step"] > 3]  # noqa: E731
    assert later(b) == later(a) and len(later(a)) == 4  # steps 4, 5, 6 and the final evaluation


def test_kill_during_checkpoint_write_keeps_the_previous_one(demo_dir, tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, torch
        import common
        import bookkeeping
        import modeling
        import dataset
        model, tok = modeling.load_model({demo_dir!r}, torch.device("cpu"))
        opt = torch.optim.AdamW(model.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
        stream = dataset.PromptStream([{{"prompt": "1+1", "answer": "2"}}], seed=0)
        bookkeeping.save_checkpoint({str(tmp_path)!r}, 1, model, tok, opt, sched, stream, {{}})
        torch.save = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # die while writing the trainer state
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        bookkeeping.save_checkpoint({str(tmp_path)!r}, 2, model, tok, opt, sched, stream, {{}})
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == -signal.SIGKILL
    assert sorted(os.listdir(tmp_path)) == ["step_000001", "step_000002.tmp"]  # the interrupted write is visible
    ckpt = bookkeeping.latest_checkpoint(str(tmp_path))
    assert ckpt.endswith("step_000001")
    model, _ = modeling.load_model(ckpt, torch.device("cpu"))
    original, _ = modeling.load_model(demo_dir, torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), original.state_dict().values()))
    assert torch.load(os.path.join(ckpt, "trainer.pt"))["step"] == 1


def write(path, text):
    path.write_text(text)
    return str(path)


BAD_INPUTS = [  # (flags, message that must appear); files are created in tmp_path by name
    (["--train_data", "{tmp}/bad.jsonl"], "bad.jsonl:2: not valid JSON"),
    (["--train_data", "{tmp}/noanswer.jsonl"], "noanswer.jsonl:1: no answer"),
    (["--train_data", "{tmp}/empty.jsonl"], "holds no rows"),
    (["--train_data", "{tmp}/missing.jsonl"], "data file '{tmp}/missing.jsonl' not found"),
    (["--eval_data", "{tmp}/rows.txt"], "unknown extension '.txt'"),
    (["--model", "{tmp}/no_such_model"], "--model '{tmp}/no_such_model': cannot load it"),
    (["--group_size", "1"], "--group_size must be >= 2"),
    (["--updates_per_step", "40"], "--updates_per_step 40 is more than the 32 prompts per rank"),
    (["--train_data", "{tmp}/corrupt.parquet"], "corrupt.parquet: not a readable parquet file"),
    (["--out_dir", "{tmp}/bad.jsonl"], "--out_dir '{tmp}/bad.jsonl' is an existing file, not a folder"),
    (["--max_prompt_length", "0"], "--max_prompt_length must be >= 1"),
    (["--tau", "0"], "--tau must be in (0, 1]"),
    (["--tau", "1.5"], "--tau must be in (0, 1]"),
    (["--lam", "-1"], "--lam must be > 0"),
    (["--loss_agg", "sum"], "--loss_agg 'sum': choose one of"),
    (["--overlong_buffer", "12"], "--overlong_buffer 12 must be below --max_new_tokens 12"),
    (["--cpu_offload"], "--cpu_offload needs FSDP2, which runs under torchrun"),  # a plain run would ignore it
    (["--dtype", "float16"], "--dtype float16 trains without loss scaling"),
    (["--max_new_tokens", "600"], "--max_model_len 609 (the longest prompt + --max_new_tokens 600, unless set) "
                                  "exceeds the 512 positions of --model "),  # the sums demo's model folder
]


@pytest.mark.parametrize("flags, message", BAD_INPUTS)
def test_bad_input_stops_with_one_line_and_exit_2(flags, message, tmp_path, capsys):
    write(tmp_path / "bad.jsonl", '{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": \n')
    write(tmp_path / "noanswer.jsonl", '{"problem": "1+1", "solution": "it is 2"}\n')
    write(tmp_path / "empty.jsonl", "\n")
    write(tmp_path / "rows.txt", "1+1 = 2\n")
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1" + bytes(range(256)) * 4)  # parquet magic, garbage inside
    flags = [f.format(tmp=tmp_path) for f in flags]
    t0 = time.time()
    with pytest.raises(SystemExit) as e:
        argv = ["--out_dir", str(tmp_path / "out"), "--demo", "arith", *flags]
        da3po.main(config.parse_config(da3po.Config, argv, da3po.PRESETS))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message.format(tmp=tmp_path) in err[0], err
    assert time.time() - t0 < 30  # "within a few seconds": generous, the machine is shared


def test_bad_input_from_the_command_line_has_no_traceback(tmp_path):
    r = run_script(["da3po.py", "--train_data", write(tmp_path / "x.jsonl", "{oops\n"), "--out_dir", str(tmp_path)])
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: {tmp_path}/x.jsonl:1: not valid JSON (Expecting property name enclosed in " \
                               f"double quotes)"


def test_nan_loss_skips_the_update_and_leaves_parameters_unchanged(demo_dir, tmp_path, monkeypatch, capsys):
    real = common.policy_loss

    def nan_loss(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(common, "policy_loss", nan_loss)
    cfg = config.parse_config(da3po.Config, ["--steps", "2", "--out_dir", str(tmp_path),
                                             "--max_bad_updates", "100", "--no-dynamic_sampling", *SMALL],
                              da3po.PRESETS)
    da3po.main(cfg)
    assert "non-finite loss or gradient; update skipped" in capsys.readouterr().out
    train = [x for x in records(tmp_path / "metrics.jsonl") if "train/loss" in x]
    assert [x["train/skipped_updates"] for x in train] == [2.0, 2.0]
    trained, _ = modeling.load_model(str(tmp_path / "step_000002"), torch.device("cpu"))
    original, _ = modeling.load_model(demo_dir, torch.device("cpu"))
    for (name, a), b in zip(trained.state_dict().items(), original.state_dict().values()):
        assert torch.equal(a, b), name
    # and when it keeps happening, the run stops with a clear message instead of training on garbage
    cfg.max_bad_updates, cfg.out_dir = 3, str(tmp_path / "stop")
    with pytest.raises(SystemExit) as e:
        da3po.main(cfg)
    assert e.value.code == 1 and "3 non-finite updates in a row" in capsys.readouterr().out
