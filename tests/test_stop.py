"""Stops and resumes: a stop request (SIGTERM, Ctrl-C) between generation batches, between updates or where an
evaluation is due checkpoints at once and resumes exactly; a real torchrun sent SIGTERM; checkpoints saved on 2 ranks
resumed on 1 and the other way round.
Run: python -m pytest -q tests/test_stop.py"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from unittest import mock

import pytest
import torch

import common
import config
import bookkeeping
import modeling
import dataset
import ranks
import engine as eng
import da3po
import daro
from tests.conftest import ROOT

SMALL = ["--demo", "arith", "--prompts_per_step", "8", "--updates_per_step", "2", "--eval_size", "16",
         "--eval_samples", "2", "--sample_every", "1"]


def records(path):
    """metrics.jsonl without wall-clock fields (the only thing allowed to differ between runs)."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")} for line in open(path)]


def run(script, out, *flags):
    script.main(config.parse_config(script.Config, ["--out_dir", str(out), *SMALL, *flags], script.PRESETS))


# What a run stopped in step 2 says, by where the stop came (the tests that stop and resume).
STOPPED_AT = {"rollout": "stopped in step 2's rollout", "updates": "stopped in step 2 before update 1",
              "eval_due": "stopped at step 2"}


def stop_when(monkeypatch, obj, name, when):
    """Wrap obj.name so that a stop request arrives (as SIGTERM's handler would set it) when when(calls) is true."""
    real, calls = getattr(obj, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if when(calls[0]):
            ranks._stop_signal = signal.SIGTERM
        return real(*args, **kwargs)
    monkeypatch.setattr(obj, name, wrapper)


@pytest.mark.parametrize("where", ["rollout", "updates", "eval_due"])
@pytest.mark.parametrize("script,algo", [(da3po, []), (daro, []), (da3po, ["--algo", "hadw", "--dynamic_sampling"])],
                         ids=["da3po", "daro", "hadw"])
def test_a_stop_checkpoints_at_once_and_resumes_exactly(tmp_path, monkeypatch, capsys, script, algo, where):
    """Step 2 of 3 is interrupted: during its rollout (its first generation batch: the step is redone from its
    start), during its first update (the checkpoint holds the step's remaining work), or after it when an evaluation
    is due (the evaluation runs on resume). The resumed run's metrics.jsonl equals the uninterrupted one's; with
    --algo hadw, whose anchor carries each step's accuracy into the next, its hadw/* records too."""
    flags = ["--steps", "3", "--eval_every", "2", "--max_gen_batches", "4", *algo]
    run(script, tmp_path / "straight", *flags)
    straight = records(tmp_path / "straight" / "metrics.jsonl")
    assert straight[2]["train/num_gen_batches"] > 1  # step 2 has a second generation batch to stop before
    assert ("hadw/anchor" in straight[2]) == bool(algo)
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
    assert STOPPED_AT[where] in said
    saved = bookkeeping.latest_checkpoint(str(out))
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
    saved = bookkeeping.latest_checkpoint(str(out))
    assert saved is not None and not saved.endswith("step_000008"), "the run must have been stopped before its end"
    assert {"trainer.pt", "model.safetensors", "rank0.pt", "rank1.pt", "optimizer"} <= set(os.listdir(saved))
    r = subprocess.run([*base, "--out_dir", str(out), "--resume"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr[-3000:]
    assert records(out / "metrics.jsonl") == records(tmp_path / "straight" / "metrics.jsonl")


# -----------------------------------------------------------------------------------------------------------------
# Resumed on another number of ranks: tests/lockstep.py's scripted engine with its content skew (the same data on any
# number of ranks), its runs batched into three launches (2 ranks, 1, 2 again) for the tests below.
def lockstep_jobs(folder, ranks, jobs):
    """tests/lockstep.py's runs in one process per rank; with 2 ranks, both issued the same collectives in the same
    order across all of them. Returns the printed output."""
    os.makedirs(folder, exist_ok=True)
    json.dump(jobs, open(folder / "jobs.json", "w"))
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks > 1 else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TORCH_FR_BUFFER_SIZE": "200000"}
    cmd = [sys.executable, *launcher, "-m", "tests.lockstep", "--jobs", str(folder / "jobs.json")]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    if ranks > 1:
        traces = [json.load(open(folder / f"collectives_rank{r}.json")) for r in range(ranks)]
        assert len(traces[0]) > 100 and all(t == traces[0] for t in traces), "the ranks' collectives differ"
    return r.stdout


# 2 steps of 6 groups in 2 updates (on 2 ranks 2 + 1 groups per rank, on 1 rank 3 + 3: the second update's 3 groups
# split 2 + 1 on 2 ranks, a padding copy beside the 1), an eval after each step, dynamic sampling refilling the groups
# the content skew answers all wrong: a stop between generation batches, between updates and after each step.
ANYWHERE = ["--prompts_per_step", "6", "--group_size", "4", "--updates_per_step", "2", "--steps", "2",
            "--eval_every", "1", "--eval_size", "8", "--eval_samples", "2", "--max_new_tokens", "16",
            "--oversample", "1", "--max_gen_batches", "3", "--sample_every", "1"]
# A checkpoint between steps, the data all kept in one update per step: the math of every later step is the same on
# any number of ranks.
BETWEEN_STEPS = ["--prompts_per_step", "8", "--group_size", "4", "--updates_per_step", "1", "--eval_size", "8",
                 "--eval_samples", "2", "--eval_every", "2", "--save_every", "2", "--max_new_tokens", "16",
                 "--no-dynamic_sampling"]
SCRIPTS = ("da3po.py", "daro.py")


def stopped_runs(folder) -> list:
    """The runs of tests/lockstep.py's every_point job, stopped at the 1st, 2nd, ... check; DARO's only where a stop
    between updates left a step's work (elsewhere it is da3po.py's loop, which the test runs at every check: the
    resumes cost CI time)."""
    runs = sorted(folder.glob("stop*"), key=lambda d: int(d.name[4:]))
    return [d for d in runs if folder.name == "da3po.py" or saved_at(d)[1]]


def saved_at(run_dir) -> tuple[int, int]:
    """(the last step a stopped run's checkpoint finished, the step a stop between two updates interrupted or 0)."""
    ckpt = bookkeeping.latest_checkpoint(str(run_dir))
    pending = torch.load(os.path.join(ckpt, "rank0.pt"))["pending"]
    return torch.load(os.path.join(ckpt, "trainer.pt"))["step"], pending["step"] if pending else 0


def saved_step(rank, world, groups, next_update=1):
    """What rank `rank` of `world` saves when stopped before update `next_update` of a step whose kept groups are
    `groups` (plan_updates' split into 2 updates, make_batch's batch with the entries the loop adds)."""
    mine, update_rows = common.plan_updates(groups, 2, ranks.DistInfo(rank=rank, world_size=world))
    batch = common.make_batch(mine, 0)
    batch["old_logp"] = -batch["input_ids"][:, -batch["mask"].shape[1]:].float() * batch["mask"]  # row-specific
    batch["rejected"] = torch.zeros_like(batch["mask"], dtype=torch.bool)
    batch["rejected"][:, 0] = True  # (as --rollout_is_mask leaves it)
    batch["mask"][:, 0] = 0
    sums = {"loss": 1.0 + rank, "tokens": 10.0}
    return bookkeeping.PendingStep(3, {"train/acc": 0.5}, mine[:1], update_rows, batch, next_update, sums,
                                   {"bins": torch.ones(3, 5)})


def rows_of(pending, u):
    """The rows of update u that train something, each as (prompt, completion, old_logp, mask) in plain numbers."""
    b, T = pending.batch, pending.batch["mask"].shape[1]
    out = []
    for i in pending.update_rows[u].tolist():
        if b["mask"][i].any() or b["rejected"][i].any():
            ids, attn = b["input_ids"][i].tolist(), b["attention_mask"][i].tolist()
            prompt = [t for t, a in zip(ids[:-T], attn[:-T]) if a]
            n = sum(attn[-T:])
            out.append((tuple(prompt), tuple(ids[-T:][:n]), tuple(b["old_logp"][i][:n].tolist()),
                        tuple(b["mask"][i][:n].tolist()), tuple(b["rejected"][i][:n].tolist())))
    return sorted(out)


@pytest.mark.parametrize("first,then", [(1, 2), (2, 1), (2, 3), (3, 2)])
def test_a_stopped_step_splits_anew_for_any_number_of_ranks(first, then):
    """reshard_pending on hand-made groups of different prompt and completion lengths (each rank's batch of its own
    width): every row of every update left is trained exactly once on the new ranks, with its prompt, completion,
    log-probs, mask and rejected tokens; each rank gets as many rows per update (copies with nothing to train fill
    a share one group short), a group keeps its prompt, the step's sums keep their total."""
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(10, 40, (n,), generator=g).tolist()  # noqa: E731
    groups = [{"prompt_ids": rand(2 + i % 5), "completions": [rand(1 + (i * 3 + j) % 9) for j in range(2)],
               "reward": [1.0, -1.0], "correct": [True, False], "prompt_len": 2 + i % 5, "lengths": [1, 1]}
              for i in range(6 * first)]  # 6 groups per old rank: 2 updates of 3 (or 4 + 2 on 3 ranks, ...)
    old = [saved_step(r, first, groups) for r in range(first)]
    new = [bookkeeping.reshard_pending(old, r, then, 0) for r in range(then)]
    for u in range(len(old[0].update_rows)):
        if u < old[0].next_update:
            assert all(len(p.update_rows[u]) == 0 for p in new)
            continue
        assert len({len(p.update_rows[u]) for p in new}) == 1  # as many rows on every rank
        assert sorted(r for p in new for r in rows_of(p, u)) == sorted(r for p in old for r in rows_of(p, u))
    for p in new:
        b = p.batch
        for i in set(b["group"].tolist()):  # one prompt per group (a group's prompt is run once)
            rows = (b["group"] == i).nonzero().flatten()
            assert len({tuple(b["input_ids"][r, :-b["mask"].shape[1]].tolist()) for r in rows}) == 1
        assert p.algo is old[0].algo and p.record is old[0].record and p.next_update == 1
    assert sum(p.sums["loss"] for p in new) == sum(p.sums["loss"] for p in old)
    assert new[0].groups == old[0].groups and all(p.groups == [] for p in new[1:])


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """On 2 ranks: each script uninterrupted and stopped at each check in turn (OUT/two/<script>/straight, stop<k>),
    and a run saved after 2 of 4 steps (between/2). On 1 rank: the same (OUT/one/...), and each 2-rank run resumed on
    1 (copies: <run>_on1). On 2 ranks again: each stopped run resumed. Returns (OUT, the stopped runs per script,
    their saved_at before the resumes, the printed output of the resumes)."""
    out = tmp_path_factory.mktemp("resumed")
    two, one = out / "two", out / "one"
    every = [{"script": s, "out": str(two / s), "flags": ANYWHERE, "every_point": True} for s in SCRIPTS]
    between = [{"script": "da3po.py", "out": str(two / "between" / n), "flags": [*BETWEEN_STEPS, "--steps", k]}
               for n, k in (("straight", "4"), ("moved", "2"))]
    lockstep_jobs(two, 2, every + between)
    stops = {s: stopped_runs(two / s) for s in SCRIPTS}
    for d in [d for s in SCRIPTS for d in stops[s]] + [two / "between" / "moved"]:
        shutil.copytree(d, f"{d}_on1")
    every = [{**job, "out": job["out"].replace(str(two), str(one))} for job in every]
    between = [{**job, "out": job["out"].replace(str(two), str(one))} for job in between]
    on1 = [{"script": s, "out": f"{d}_on1", "flags": [*ANYWHERE, "--resume"]} for s in SCRIPTS for d in stops[s]]
    on1 += [{"script": "da3po.py", "out": f"{two / 'between' / 'moved'}_on1",
             "flags": [*BETWEEN_STEPS, "--steps", "4", "--resume"]}]
    said = lockstep_jobs(one, 1, every + between + on1)
    for s in SCRIPTS:
        stops[s] += stopped_runs(one / s)
    saved = {str(d): saved_at(d) for s in SCRIPTS for d in stops[s]}  # before the resumes change them
    on2 = [{"script": s, "out": str(d), "flags": [*ANYWHERE, "--resume"]} for s in SCRIPTS for d in stops[s]]
    on2 += [{"script": "da3po.py", "out": str(one / "between" / "moved"),
             "flags": [*BETWEEN_STEPS, "--steps", "4", "--resume"]}]
    said += lockstep_jobs(out / "again", 2, on2)
    return out, stops, saved, said


def test_a_stop_anywhere_resumes_on_any_number_of_ranks(resumed):
    """da3po.py and daro.py stopped at every check for a stop in turn, on 2 gloo ranks (torchrun) and on 1; each
    stopped run resumed on 2 ranks and on 1 (2 -> 2, 2 -> 1, 1 -> 2). Each resumed run continues with exactly one
    record per step and per evaluation, those before the stop unchanged; 2 -> 2 equals the uninterrupted run. A
    stop between updates leaves the step's remaining groups and sums, split anew over the new ranks: that step's
    record equals the uninterrupted one's within float rounding (the loss denominators are global), DARO's per-bin
    sums too (DARO: those stops only; its loop is da3po.py's). (Later steps differ by design: N ranks deal a step's
    groups to its updates in another order.)"""
    out, stops, saved, said = resumed
    mid_step = [d for d, (_, stopped) in saved.items() if stopped]  # each resumed on another number of ranks once
    assert said.count("the stopped step's remaining work is split anew") == len(mid_step)
    for s in SCRIPTS:
        assert sum(str(d) in mid_step for d in stops[s]) == 4  # one in each step, on 2 ranks and on 1
        assert len(stops[s]) == (12 if s == "da3po.py" else 4)  # 6 checks a run (da3po.py: each one)
        for d in stops[s]:
            first = 1 if d.parent.parent.name == "one" else 2
            straight = records(d.parent / "straight" / "metrics.jsonl")
            assert [(r["step"], "train/loss" in r) for r in straight] == [
                (0, False), (1, True), (1, False), (2, True), (2, False)]
            assert any(r.get("train/num_gen_batches", 0) > 1 for r in straight)  # a stop between generation batches
            ckpt_step, stopped = saved[str(d)]
            for run, ranks_then in ((d, 2), (f"{d}_on1", 1)) if first == 2 else ((d, 2),):
                got = records(os.path.join(run, "metrics.jsonl"))
                assert [(r["step"], "train/loss" in r) for r in got] == [
                    (r["step"], "train/loss" in r) for r in straight], (s, run)
                if ranks_then == first:
                    assert got == straight, (s, run)
                    continue
                for x, y in zip(straight, got):
                    if x["step"] <= ckpt_step:
                        assert y == x, (s, run, x["step"])
                    elif x["step"] == stopped and "train/loss" in x:
                        assert x.keys() == y.keys(), (s, run)
                        for k in x:
                            if not k.startswith("perf/"):  # (padding: another split into micro-batches)
                                assert y[k] == pytest.approx(x[k], rel=1e-4, abs=1e-6), (s, run, k)


@pytest.mark.parametrize("first", [2, 1], ids=["2-ranks-then-1", "1-rank-then-2"])
def test_a_checkpoint_resumes_on_another_number_of_ranks(resumed, first):
    """Saved on `first` ranks after 2 steps, resumed on the other number for 2 more: the metrics of an uninterrupted
    run on `first` ranks, within float rounding (the optimizer state is resharded; the data, scripted by content, all
    of it kept, in one update per step, make the math independent of the number of ranks)."""
    out, _, _, said = resumed
    folder = out / ("two" if first == 2 else "one") / "between"
    assert f"saved on {first} ranks, this run has {3 - first}" in said
    a = records(folder / "straight" / "metrics.jsonl")
    b = records(folder / ("moved_on1" if first == 2 else "moved") / "metrics.jsonl")
    assert [x["step"] for x in a] == [x["step"] for x in b] and len(a) == 7  # 4 steps and 3 evaluations
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if not k.startswith("perf/"):  # (padding depends on how the rows are split into micro-batches)
                assert y[k] == pytest.approx(x[k], rel=1e-4, abs=1e-6), (x["step"], k)


# -----------------------------------------------------------------------------------------------------------------
# Stops everywhere: every point where the loop can stop is a call of stop_requested(); a run is stopped at
# each call in turn and resumed, so a stop point added later is covered without a new test.
EVERYWHERE = ["--demo", "arith", "--steps", "2", "--eval_every", "1", "--max_gen_batches", "3",
              "--updates_per_step", "3", "--prompts_per_step", "6", "--eval_size", "8", "--eval_samples", "2",
              "--sample_every", "1"]


def stop_at_call(monkeypatch, script, k):
    """A stop request (as SIGTERM's handler sets it) at the k-th call of stop_requested, wherever it is called (the
    loop in the script, dynamic sampling in common). Returns the call counter."""
    real, calls = ranks.stop_requested, [0]

    def counted():
        calls[0] += 1
        if calls[0] == k:
            ranks._stop_signal = signal.SIGTERM
        return real()
    monkeypatch.setattr(common, "stop_requested", counted)
    monkeypatch.setattr(script, "stop_requested", counted)
    return calls


@pytest.mark.parametrize("script", [da3po, daro], ids=["da3po", "daro"])
def test_a_stop_at_every_point_resumes_exactly(tmp_path, monkeypatch, script):
    """2 steps (up to 3 generation batches and 3 updates each; an eval due at step 1; the last step): the run is
    stopped at each point it checks for a stop (between generation batches and updates, after each step; in step 1
    and later ones), then resumed. Each resumed run's metrics.jsonl equals the uninterrupted one's: every step and
    every evaluation exactly once, with the same numbers (a stop in step 1 once repeated the step-0 evaluation)."""
    def run(out, *flags):
        script.main(config.parse_config(script.Config, ["--out_dir", str(out), *EVERYWHERE, *flags], script.PRESETS))

    with monkeypatch.context() as m:
        calls = stop_at_call(m, script, 0)  # counts the checks of an uninterrupted run
        run(tmp_path / "straight")
    straight = records(tmp_path / "straight" / "metrics.jsonl")
    points = calls[0]
    assert [r["step"] for r in straight] == [0, 1, 1, 2, 2] and points >= 6  # 3 per step at least
    assert any(r.get("train/num_gen_batches", 0) > 1 for r in straight)  # a stop between generation batches
    for k in range(1, points + 1):
        out = tmp_path / f"stop{k}"
        with monkeypatch.context() as m:
            stop_at_call(m, script, k)
            run(out)
        assert bookkeeping.latest_checkpoint(str(out)) is not None, k
        ranks._stop_signal = None
        run(out, "--resume")
        assert records(out / "metrics.jsonl") == straight, f"stopped at check {k} of {points}"


def test_resume_without_a_checkpoint_starts_the_records_over(tmp_path, monkeypatch):
    """A run killed before its first checkpoint leaves metrics.jsonl with its step-0 evaluation; --resume finds no
    checkpoint and starts over: one step-0 evaluation in the file, not two."""
    flags = ["--steps", "1", "--eval_size", "8", "--eval_samples", "2"]
    run(da3po, tmp_path / "straight", *flags)
    out = tmp_path / "killed"
    with monkeypatch.context() as m:  # killed (no checkpoint, no clean exit) in step 1's updates
        m.setattr(common.UpdateGuard, "step", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            run(da3po, out, *flags)
    assert [r["step"] for r in records(out / "metrics.jsonl")] == [0] and bookkeeping.latest_checkpoint(str(out)) is None
    run(da3po, out, *flags, "--resume")
    assert records(out / "metrics.jsonl") == records(tmp_path / "straight" / "metrics.jsonl")


@pytest.mark.parametrize("script", [da3po, daro], ids=["da3po", "daro"])
def test_resuming_a_finished_run_adds_nothing_and_says_so(tmp_path, capsys, script):
    """--resume of a run that finished: metrics.jsonl and samples.jsonl stay as they were (the final evaluation is not
    run and logged a second time), and a line says that the run is done."""
    flags = ["--steps", "1", "--eval_size", "8", "--eval_samples", "2"]
    run(script, tmp_path, *flags)
    files = {name: open(tmp_path / name).read() for name in ("metrics.jsonl", "samples.jsonl")}
    assert [r["step"] for r in records(tmp_path / "metrics.jsonl")] == [0, 1, 1]
    capsys.readouterr()
    run(script, tmp_path, *flags, "--resume")
    assert {name: open(tmp_path / name).read() for name in files} == files
    assert "--resume: the run is done (step 1 of 1" in capsys.readouterr().out


def tagged_cuda(path):
    """Rewrite a checkpoint's .pt file as a run on a GPU writes it: every tensor's storage tagged cuda:0."""
    saved = torch.load(path, weights_only=True)
    tagged = []
    with mock.patch.object(torch.serialization, "location_tag", lambda storage: tagged.append(1) or "cuda:0"):
        torch.save(saved, path)
    if tagged:  # (a file with no tensor has nothing to tag)
        with pytest.raises(RuntimeError, match="deserialize object on a CUDA device"):
            torch.load(path, weights_only=True)  # loaded where it was saved, it needs that GPU
    return len(tagged)


@pytest.mark.parametrize("script", [da3po, daro], ids=["da3po", "daro"])
def test_a_checkpoint_from_a_gpu_resumes_here_and_loads_onto_the_training_device(tmp_path, monkeypatch, script):
    """A checkpoint taken between two updates of step 1 (the step's batch in it; DARO's weights and their Adam state,
    DA3PO's running pass counts), every tensor in its .pt files tagged cuda:0 as a GPU run writes them: resumed on
    this CPU, the run ends as an uninterrupted one. Loaded for another training device (the meta device stands in for
    a GPU): the batch and DARO's weights and moments go to that device; the data rows, the per-bin sums (added to on
    the CPU) and Adam's step counts stay on the CPU."""
    flags = ["--steps", "2", *(["--p_estimate", "running"] if script is da3po else [])]
    run(script, tmp_path / "straight", *flags)
    out = tmp_path / "stopped"
    with monkeypatch.context() as m:
        stop_when(m, common.UpdateGuard, "step", lambda n: n == 1)  # after step 1's first update
        run(script, out, *flags)
    ckpt = bookkeeping.latest_checkpoint(str(out))
    tagged = {name: tagged_cuda(os.path.join(ckpt, name)) for name in ("trainer.pt", "rank0.pt")}
    assert tagged["rank0.pt"] and bool(tagged["trainer.pt"]) == (script is daro)  # DARO's weights, moments

    model, _ = modeling.load_model(ckpt)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    meta = ranks.DistInfo(device=torch.device("meta"))
    _, state = bookkeeping.load_checkpoint(ckpt, model, opt, sched, dataset.PromptStream([], 0), 0, meta)
    pending = state["pending"]
    assert pending is not None and pending.step == 1 and pending.next_update == 1
    assert {v.device.type for v in pending.batch.values()} == {"meta"}
    assert all(r.device.type == "cpu" for r in pending.update_rows)
    cfg = config.parse_config(script.Config, ["--device", "meta", *flags], script.PRESETS)
    if script is daro:
        algo = daro.DARO(cfg, torch.device("meta"), state)
        algo.load_step_state(pending.algo)
        algo.start_update(pending.batch, pending.update_rows[pending.next_update])  # the update left
        assert all(s.device.type == "meta" for s in [*algo.neg_log_w, algo.w, algo.bin_loss, algo.bin_tokens])
        moments = [v for s in algo.weight_opt.state.values() for k, v in s.items() if k != "step"]
        steps = [s["step"] for s in algo.weight_opt.state.values()]
        assert moments and all(v.device.type == "meta" for v in moments)
        assert steps and all(v.device.type == "cpu" for v in steps)  # where Adam keeps them (not capturable)
        assert algo.bins.device.type == "cpu"
        algo.bins[0] += torch.ones(cfg.group_size + 1).cpu()  # what after_update does
    else:
        counts = da3po.DAA(cfg, torch.device("meta"), state).pass_counts
        assert counts and all(type(n) is int for c in counts.values() for n in c)  # plain numbers, no device

    run(script, out, *flags, "--resume")  # on this CPU, for real
    assert records(out / "metrics.jsonl") == records(tmp_path / "straight" / "metrics.jsonl")


class RunsCode:
    """Unpickling this runs a shell command (what a malicious checkpoint would carry)."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("name", ["trainer.pt", "rank0.pt"])
def test_a_checkpoint_that_would_run_code_is_refused(tmp_path, capsys, name):
    """trainer.pt and rank<r>.pt are read with torch's safe loader; a crafted one that would run
    code when unpickled is refused with one line naming the file (exit 2), and its code does not run."""
    run(da3po, tmp_path, "--steps", "1", "--eval_size", "8", "--eval_samples", "2")
    path = os.path.join(bookkeeping.latest_checkpoint(str(tmp_path)), name)
    saved = torch.load(path, weights_only=True)  # a real checkpoint loads safely (tensors and plain types)
    marker = tmp_path / "ran"
    torch.save({**saved, "extra": RunsCode(marker)}, path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run(da3po, tmp_path, "--steps", "2", "--eval_size", "8", "--eval_samples", "2", "--resume")
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and name in err[0] and "not loaded" in err[0], err
    assert not marker.exists()
