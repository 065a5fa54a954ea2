"""Under torchrun every rank issues the same collectives in the same order, whatever its data: 2 gloo ranks, data
skewed on purpose (tests/lockstep.py: one rank's completions long and the other's short, one-token completions, the
sampling cap, a non-finite loss on one rank, a single update with packed micro-batches, eval, a save), across the
flags that choose code paths. Each rank's collectives come from torch's Flight Recorder.
Run: python -m pytest -q tests/test_lockstep.py        (LOCKSTEP_FULL=1: all 256 flag combinations x 2 skews)"""
import itertools
import json
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import ROOT

FACTORS = {  # the flags that choose code paths: (off, on)
    "grad_checkpointing": ([], ["--grad_checkpointing"]),
    "kl": ([], ["--kl_coef", "0.05"]),
    "packed": ([], ["--micro_batch_tokens", "120"]),
    "rollout_is": ([], ["--rollout_is", "token"]),
    "chunked": (["--logprob_chunk", "0"], ["--logprob_chunk", "8"]),
    "bf16": ([], ["--dtype", "bfloat16"]),
    "one_update": ([], ["--updates_per_step", "1"]),  # with packing and a recomputed pi_old: an empty micro-batch
    "pack": (["--no-pack"], ["--pack"]),  # packed rows, or a group's prompt once where that runs fewer positions:
    #                                       the micro-batch's layout is agreed by an all-reduce of the counts
}
# An orthogonal array: every pair of levels of any two factors appears twice in these 8 rows, plus the issue's own
# repro (checkpointing, KL and packing together, which the array never combines).
# --pack (the last factor) on in three more rows: with token-budget micro-batches, KL and chunks on skewed lengths;
# bf16 on one-token completions (nothing of theirs to pack but their prompts); checkpointing (which runs rows whole,
# so every micro-batch packs) and NaN.
ROWS = [(0, 0, 0, 0, 0, 0, 0, 0), (0, 0, 0, 1, 1, 1, 1, 0), (0, 1, 1, 0, 0, 1, 1, 0), (0, 1, 1, 1, 1, 0, 0, 0),
        (1, 0, 1, 0, 1, 0, 1, 0), (1, 0, 1, 1, 0, 1, 0, 0), (1, 1, 0, 0, 1, 1, 0, 0), (1, 1, 0, 1, 0, 0, 1, 0),
        (1, 1, 1, 0, 0, 0, 0, 0), (0, 1, 1, 1, 1, 0, 1, 1), (0, 0, 0, 0, 0, 1, 0, 1), (1, 0, 1, 0, 0, 0, 0, 1)]
SKEWS = ["onetoken", "onetoken", "lengths", "lengths", "cap", "cap", "nan", "nan", "lengths", "lengths", "onetoken",
         "nan"]
SCRIPTS = ["da3po.py", "daro.py"] * 4 + ["da3po.py", "da3po.py", "daro.py", "da3po.py"]
CASES = [(SCRIPTS[i], SKEWS[i], row) for i, row in enumerate(ROWS)]
if os.environ.get("LOCKSTEP_FULL"):
    CASES = [(script, skew, row) for row in itertools.product((0, 1), repeat=len(FACTORS))
             for script, skew in (("da3po.py", "lengths"), ("daro.py", "onetoken"))]
SMALL = ["--prompts_per_step", "8", "--group_size", "4", "--steps", "3", "--eval_every", "2", "--eval_size", "8",
         "--eval_samples", "2", "--save_every", "2", "--max_new_tokens", "16", "--updates_per_step", "2"]


def launch(out, script, skew, flags, timeout=240):
    """torchrun with 2 ranks; a hang is killed at the timeout (the whole process group) and reported as one."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TORCH_FR_BUFFER_SIZE": "200000"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "tests.lockstep", str(out), script, skew, *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"hang: no exit within {timeout} s\n{stderr[-3000:]}")
    return proc.returncode, stdout, stderr


@pytest.mark.parametrize("script,skew,row", CASES, ids=[f"{s[:-3]}-{k}-{''.join(map(str, r))}" for s, k, r in CASES])
def test_ranks_issue_the_same_collectives_whatever_their_data(tmp_path, script, skew, row):
    flags = [*SMALL]
    for (name, levels), on in zip(FACTORS.items(), row):
        flags += levels[on]
    if skew == "onetoken":
        flags += ["--no-dynamic_sampling"]  # the short groups are all wrong: kept only without the filter
    if skew == "cap":
        flags += ["--max_gen_batches", "1", "--oversample", "1"]
    code, stdout, stderr = launch(tmp_path, script, skew, flags)
    assert code == 0, stderr[-3000:]
    traces = [json.load(open(tmp_path / f"collectives_rank{r}.json")) for r in (0, 1)]
    data = [json.load(open(tmp_path / f"data_rank{r}.json")) for r in (0, 1)]
    assert len(traces[0]) > 50
    first = next((i for i, (a, b) in enumerate(zip(*traces)) if a != b), None)
    assert first is None and len(traces[0]) == len(traces[1]), (
        f"rank 0 and rank 1 diverge at collective {first}: {traces[0][first - 2:first + 2] if first else ''} vs "
        f"{traces[1][first - 2:first + 2] if first else ''} ({len(traces[0])} vs {len(traces[1])} in all)")
    # the data really differed between the ranks, and no rank kept the root's gathered copy into the rollout
    if skew in ("lengths", "onetoken") and not row[2]:  # (packing deals the long groups out evenly on purpose)
        assert data[0]["tokens"] > 1.5 * data[1]["tokens"], data
    if skew == "onetoken":  # T = 1, padded to 2 columns; DARO does not train the all-wrong groups (bin 0)
        assert data[1]["tokens"] == (0 if script == "daro.py" else data[1]["rows"]) and min(data[1]["widths"]) == 2
    assert data[0]["root_unsharded_at_sync"] == data[1]["root_unsharded_at_sync"] == 0
    records = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    train = [m for m in records if "train/loss" in m]
    assert [m["step"] for m in train] == [1, 2, 3] and (tmp_path / "step_000003").is_dir()
    assert sum("eval/acc" in m for m in records) == 3  # steps 0, 2 and the end
    if skew == "cap":
        assert all(m["train/num_groups"] == 2 for m in train), "3 groups kept at the cap: 2 trained (2 ranks)"
    if skew == "nan":
        assert sum(m["train/skipped_updates"] for m in train) == 1, "both ranks skip the update rank 1 found NaN"


def test_crosscheck_ranks_issue_the_same_collectives(tmp_path):
    """--verifier_crosscheck on 2 ranks whose checks differ: the stub judge (tests/lockstep.py) calls everything
    right on rank 0 and wrong on rank 1, so rank 0 disagrees only where ours says wrong and rank 1 only where ours
    says right, with as many disagreeing rows as each rank's data makes. The counts are summed over ranks with the
    same collectives, and both ranks' disagreements reach the file."""
    code, _, stderr = launch(tmp_path, "da3po.py", "lengths", [*SMALL, "--verifier_crosscheck",
                                                                 "--crosscheck_train", "6"])
    assert code == 0, stderr[-3000:]
    traces = [json.load(open(tmp_path / f"collectives_rank{r}.json")) for r in (0, 1)]
    assert len(traces[0]) > 50 and traces[0] == traces[1]
    records = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    train = [m for m in records if "train/loss" in m]
    evals = [m for m in records if "eval/acc" in m]
    assert [m["crosscheck/checked"] for m in train] == [6.0, 6.0, 6.0]  # 3 of each rank's completions, 3 steps
    assert [m["eval/crosscheck/checked"] for m in evals] == [16.0] * 3  # 8 problems x 2 samples, all ranks
    # both directions occur over the run, and every disagreement is a row of the file
    rows = [json.loads(x) for x in open(tmp_path / "crosscheck.jsonl")]
    assert {(r["ours"], r["theirs"]) for r in rows} == {(True, False), (False, True)}
    assert {r["where"] for r in rows} == {"train", "eval/arith"}
    expected = sum(round((m["crosscheck/ours_only"] + m["crosscheck/theirs_only"]) * 6) for m in train)
    expected += sum(round((m["eval/crosscheck/ours_only"] + m["eval/crosscheck/theirs_only"]) * 16) for m in evals)
    assert len(rows) == expected


def test_vllm_ranks_issue_the_same_collectives(tmp_path):
    """The real vLLM engine on both ranks (external launcher), sampled data, uneven evaluation batches (9 problems in
    batches of 4: 3 and 2 generate calls), packed micro-batches: vLLM's own process groups are recorded too."""
    pytest.importorskip("vllm")
    import torch

    import vllm_engine
    if vllm_engine.vllm_usable(torch.device("cpu")):
        pytest.skip(vllm_engine.vllm_usable(torch.device("cpu")))
    code, _, stderr = launch(tmp_path, "da3po.py", "real", [*SMALL, "--rollout", "vllm", "--eval_size", "9",
                                                              "--eval_batch_size", "4", "--micro_batch_tokens", "120",
                                                              "--rollout_is", "token"])
    assert code == 0, stderr[-3000:]
    traces = [json.load(open(tmp_path / f"collectives_rank{r}.json")) for r in (0, 1)]
    assert len(traces[0]) > 50 and traces[0] == traces[1]
    records = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in records if "train/loss" in m] == [1, 2, 3]
