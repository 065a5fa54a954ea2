"""torchrun + FSDP2 on CPU (gloo): the same update as one process, and runs/checkpoints of the real script.
Run: python -m pytest -q tests/test_dist.py"""
import glob
import json
import os

import pytest
import torch

from tests.conftest import ROOT, run_script

TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


@pytest.mark.parametrize("chunk", ["0", "10"])
def test_two_ranks_match_one_process(demo_dir, tmp_path, chunk):
    """One update on 2 FSDP2 ranks equals it in one process; with chunk 10 the two ranks compute their log-probs a
    chunk of positions at a time (the output layer's weight used after the root module's forward) while the single
    process takes the whole logits at once. Both run each group's prompt once (two forwards of the sharded model per
    micro-batch before its backward)."""
    single, double = tmp_path / "one.pt", tmp_path / "two.pt"
    for args, out in [(["-m", "tests.dist_update", demo_dir, str(single)], single),
                      ([*TORCHRUN, "-m", "tests.dist_update", demo_dir, str(double), chunk], double)]:
        r = run_script(args)
        assert r.returncode == 0, r.stderr[-3000:]
    a, b = torch.load(single), torch.load(double)  # float64 throughout: 1e-10 measures the method
    assert abs(a["loss"] - b["loss"]) < 1e-10 * max(1.0, abs(a["loss"]))
    assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-10 * max(1.0, a["grad_norm"])
    assert a["params"].keys() == b["params"].keys()
    moved = 0.0
    for k in a["params"]:
        assert a["params"][k].dtype == torch.float64
        assert torch.allclose(a["params"][k], b["params"][k], rtol=0, atol=1e-10), k
        # under FSDP the rollout copy is a separate module: it must hold exactly the updated weights
        assert torch.equal(b["rollout"][k], b["params"][k]), k
        moved = max(moved, (a["params"][k] - a["rollout"][k]).abs().max().item())
    assert moved == 0.0  # in one process the rollout model is the trained model itself


def test_torchrun_da3po_checkpoint_loads_and_resumes(demo_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    out = tmp_path / "run"
    args = [*TORCHRUN, "da3po.py", "--demo", "arith", "--out_dir", str(out), "--prompts_per_step", "8",
            "--updates_per_step", "2", "--eval_size", "8", "--eval_samples", "2", "--save_every", "1"]
    r = run_script([*args, "--steps", "1"])
    assert r.returncode == 0, r.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out / "step_000001")
    assert torch.isfinite(model(torch.tensor([[4, 10, 11, 5]])).logits).all()
    r = run_script([*args, "--steps", "2", "--resume", "--micro_batch_tokens", "150"])  # packed, balanced ranks
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout
    steps = [json.loads(x)["step"] for x in open(out / "metrics.jsonl") if "train/loss" in x]
    assert steps == [1, 2]
    assert json.load(open(out / "config.json"))["_world_size"] == 2


END_OF_RUN = """
import atexit, os, sys
import torch
import ranks
d = ranks.setup_dist("cpu")
atexit.register(lambda: open(os.path.join(sys.argv[1], f"atexit{d.rank}"), "w").close())
total = ranks.all_reduce_sum(torch.tensor(float(d.rank + 1))).item()
print(f"rank {d.rank} total {total}", end="")  # no newline: block-buffered, a file or pipe sees it on a flush
ranks.cleanup_dist()
ranks.end_process(int(sys.argv[2]))
raise SystemExit(7)  # reached in a plain process only
"""


@pytest.mark.parametrize("status", [0, 3])
def test_end_process_runs_exit_handlers_flushes_and_exits_with_status(tmp_path, status):
    """ranks.end_process, a distributed rank's last call: the exit handlers run (the trackers' close), buffered
    output is written, and the process leaves with the status given, without Python's own shutdown (where gloo's
    worker threads can abort a finished rank). Under torchrun (which runs python -u), under a launcher that sets
    the environment only (a 1-rank group, stdout block-buffered: the flush is what writes it), and in a plain
    process, where it returns."""
    import socket
    import subprocess
    import sys
    script = tmp_path / "end.py"
    script.write_text(END_OF_RUN)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    args = [str(script), str(tmp_path), str(status)]
    r = subprocess.run([sys.executable, *TORCHRUN, "--redirects", "3", "--log_dir", str(tmp_path / "logs"), *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert (r.returncode == 0) == (status == 0), r.stderr[-3000:]
    outs = sorted(glob.glob(str(tmp_path / "logs" / "**" / "stdout.log"), recursive=True))
    assert [open(f).read() for f in outs] == ["rank 0 total 3.0", "rank 1 total 3.0"], outs
    assert {p.name for p in tmp_path.glob("atexit*")} == {"atexit0", "atexit1"}
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    one = {**env, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    for launched, code in [(one, status), (env, 7)]:
        r = subprocess.run([sys.executable, *args], cwd=ROOT, env=launched, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == code and r.stdout == "rank 0 total 1.0", r.stderr[-3000:]
