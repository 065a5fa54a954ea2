"""da3po.py or daro.py under torchrun with a scripted rollout engine that skews the data across ranks on purpose, and
a record of every collective each rank issues. Used by test_lockstep.py:
  TORCH_FR_BUFFER_SIZE=100000 torchrun --nproc_per_node=2 -m tests.lockstep OUT SCRIPT SKEW [script flags ...]
  python -m tests.lockstep OUT SCRIPT SKEW [script flags ...]            (one process: no collectives to record)
and by test_stop.py, several runs in one process with the content skew (JOBS.json: a list of {"script", "out",
"flags", "stop_at": k (a stop request at the run's k-th check for one)} or {"script", "out", "flags",
"every_point": true} (OUT/straight uninterrupted, then OUT/stop<k> stopped at each of its checks in turn)):
  torchrun --nproc_per_node=2 -m tests.lockstep --jobs DIR/JOBS.json     (the record of all of them in DIR)

The record is torch's Flight Recorder, which logs every collective of every process group (gloo too) as the process
group runs it, whoever called it (FSDP2's all-gathers and reduce-scatters, DTensor's, ours). Each rank writes
OUT/collectives_rank<r>.json ([process group, collective, sizes, dtypes] in order) and
OUT/data_rank<r>.json (what its data looked like: micro-batches, tokens trained, ...), so that the test can check that
the ranks really saw different data and still issued the same collectives.

The scripted engine stands in for the sampler only, to control the data; the model, FSDP2, losses, optimizer, eval and
checkpoints are the real ones. It answers each sum prompt ("12+34") with G completions, the first k of them correct
(mixed groups), and SKEW decides their lengths:
  lengths    the groups at even positions in each rank's generation batch get long completions, the others short; the
             kept groups are dealt to the ranks in stride, so rank 0 trains the long ones and rank 1 the short ones
  onetoken   as lengths, and every completion of the short groups is one token (eos): T = 1 on rank 1
  cap        only 2 groups of rank 0's generation batch and 1 of rank 1's are mixed, the rest all wrong: dynamic
             sampling stops at its cap (one batch) with 3 groups, and 2 are trained (a multiple of the 2 ranks)
  nan        rank 1's loss is NaN in the step's second update: both ranks must skip it together
  content    lengths and correct counts follow each prompt's own sum, wherever it is generated: the same data on
             any number of ranks (for checkpoints resumed on another number of ranks); a sum divisible by 5 is
             answered all wrong (a group dynamic sampling drops)
  real       no script: the engine --rollout asks for (e.g. vLLM, to record its own collectives too)
"""
import json
import os
import signal
import sys

import torch

import common
import config
import modeling
import ranks

out_dir, skew = "", "content"  # set at the bottom from the command line
local = {"micro_batches": 0, "rows": 0, "tokens": 0, "widths": [], "generate_calls": 0, "root_unsharded_at_sync": 0}


class ScriptedRollout:
    """The rollout engine interface (engine.py), with completions written by a script."""

    exact_logprobs = False  # its log-probs are its own (made up): the trainer recomputes pi_old

    def __init__(self, tok, cfg, rank: int):
        self.tok, self.cfg, self.rank, self.calls = tok, cfg, rank, 0

    def calibrate(self, model):
        return 0.0

    def completion(self, answer: int, correct: bool, long: bool) -> list[int]:
        if skew == "onetoken" and not long:
            return [self.tok.eos_token_id]
        text = ("1234567" if long else "") + f"\\boxed{{{answer if correct else answer + 1}}}"
        ids = self.tok(text, add_special_tokens=False)["input_ids"][:self.cfg.max_new_tokens - 1]
        return ids + [self.tok.eos_token_id]

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, n=1, seed=None):
        self.calls += 1
        local["generate_calls"] += 1
        training = n == self.cfg.group_size
        completions = []
        for i, ids in enumerate(prompts):
            a, b = self.tok.decode(ids, skip_special_tokens=True).split("+")
            answer = int(a) + int(b)
            all_wrong = skew == "cap" and training and i >= 2 - self.rank  # 2 + 1 mixed groups in a batch
            all_wrong = all_wrong or (skew == "content" and answer % 5 == 0)
            key = answer if skew == "content" else i  # the prompt itself, or its place in this rank's batch
            k = 0 if all_wrong else 1 + key % (n - 1)  # 1 .. n-1 correct: every group mixed
            completions += [self.completion(answer, j < k, key % 2 == 0) for j in range(n)]
        truncated = [c[-1] != self.tok.eos_token_id for c in completions]
        logps = [[-0.5 - 0.01 * t for t in range(len(c))] for c in completions] if seed is None else None
        return completions, truncated, logps

    def sleep(self):
        pass

    def sync_weights(self, model):
        # after the updates and the no-grad passes, no rank may still hold the root's gathered parameters
        local["root_unsharded_at_sync"] += not hasattr(model.get_input_embeddings().weight, "full_tensor")
        for p in model.parameters():  # the same all-gathers a real engine's sync makes
            modeling.full_tensor(p)
        return {}

    def close(self):
        pass


def make_rollout(cfg, model, tok, dist_info, path):
    return ScriptedRollout(tok, cfg, dist_info.rank)


def micro_batches(batch, index, size, max_tokens=0):
    for rows, mb in common.micro_batches(batch, index, size, max_tokens):
        local["micro_batches"] += 1
        local["rows"] += len(rows)
        local["tokens"] += int(mb["mask"].sum())
        local["widths"].append(mb["mask"].shape[1])
        yield rows, mb


updates_seen = [0]


def token_losses(model, ref_model, mb, cfg, device, sums):
    token_loss = common.token_losses(model, ref_model, mb, cfg, device, sums)
    if skew == "nan" and ranks.is_dist() and ranks.dist.get_rank() == 1 and updates_seen[0] == 1:
        token_loss = token_loss * float("nan")
    return token_loss


class CountingGuard(common.UpdateGuard):
    def step(self, *args, **kwargs):
        updates_seen[0] += 1
        return super().step(*args, **kwargs)


def dump():
    """This rank's Flight Recorder record (every collective since the process started) and its data counters."""
    import pickle
    rank = ranks.dist.get_rank() if ranks.is_dist() else int(os.environ.get("RANK", "0"))
    entries = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())["entries"] if "RANK" in os.environ else []
    # a scatter's inputs exist on its source rank only: compare what every rank receives
    record = [[e["process_group"][1], e["profiling_name"], *((e["output_sizes"], e["output_dtypes"])
               if "scatter" in e["profiling_name"] else (e["input_sizes"], e["input_dtypes"]))] for e in entries]
    json.dump(record, open(os.path.join(out_dir, f"collectives_rank{rank}.json"), "w"))
    json.dump(local, open(os.path.join(out_dir, f"data_rank{rank}.json"), "w"))


def cleanup_dist(engine=None):
    """Dump this rank's record before the process group goes."""
    dump()
    ranks.cleanup_dist(engine)


def rank0_is_right(completion: str, gold: str) -> bool:
    """--verifier_crosscheck's judge here: a stub that calls every completion right on rank 0 and wrong on rank 1
    (its workers fork from their rank), so that each rank disagrees with ours in its own direction and amount."""
    return os.environ.get("RANK", "0") == "0"


if "--verifier_crosscheck" in sys.argv:
    import crosscheck
    crosscheck.use_checker(crosscheck.CrossCheck(rank0_is_right, num_workers=1))


def run(script_name: str, out: str, flags: list[str], stop_at: int = 0) -> int:
    """One run of the script with the scripted engine into `out`; with stop_at = k a stop request (as SIGTERM's
    handler sets it, on rank 0 alone: the ranks agree by an all-reduce) at its k-th check for one. Returns how many
    checks it made (tests/test_stop.py)."""
    script = __import__(script_name.removesuffix(".py"))
    if skew != "real":
        script.make_rollout = make_rollout
    script.micro_batches, script.token_losses = micro_batches, token_losses
    script.UpdateGuard, script.cleanup_dist = CountingGuard, cleanup_dist
    calls = [0]

    def stop_requested():
        calls[0] += 1
        if calls[0] == stop_at and os.environ.get("RANK", "0") == "0":
            ranks._stop_signal = signal.SIGTERM
        return ranks.stop_requested()
    common.stop_requested = script.stop_requested = stop_requested
    cfg = config.parse_config(script.Config, ["--demo", "arith", "--out_dir", out, *flags],
                                   script.PRESETS)  # the sums demo's short completions, unless the flags say otherwise
    script.main(cfg)
    return calls[0]


def a_store_of_its_own_per_run():
    """Under torchrun, each run's process group on keys of its own in torchrun's store: a default group made again
    after destroy_process_group takes the last one's name, and would meet its keys there."""
    real, runs = ranks.dist.init_process_group, [0]

    def init_process_group(backend, **kwargs):
        runs[0] += 1
        store = ranks.dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        return real(backend, store=ranks.dist.PrefixStore(f"run{runs[0]}/", store), rank=int(os.environ["RANK"]),
                    world_size=int(os.environ["WORLD_SIZE"]), **kwargs)
    ranks.dist.init_process_group = init_process_group


if sys.argv[1] == "--jobs":  # several runs in one process: JOBS.json lists them (tests/test_stop.py)
    a_store_of_its_own_per_run()
    jobs_file = sys.argv[2]
    out_dir = os.path.dirname(jobs_file)
    for job in json.load(open(jobs_file)):
        if job.get("every_point"):  # an uninterrupted run into OUT/straight, then one stopped at each check
            points = run(job["script"], os.path.join(job["out"], "straight"), job["flags"])
            for k in range(1, points + 1):
                run(job["script"], os.path.join(job["out"], f"stop{k}"), job["flags"], stop_at=k)
        else:
            run(job["script"], job["out"], job["flags"], job.get("stop_at", 0))
    dump()
else:
    out_dir, skew = sys.argv[1], sys.argv[3]
    run(sys.argv[2], out_dir, sys.argv[4:])
ranks.end_process()  # as the scripts' own __main__ ends
