"""
Look up when needed: the processes of a run.
Ranks and their collectives (a plain `python` run is world size 1 and none of this does anything),
the stop signals the loop polls, and how a run ends early.
"""
import atexit
import datetime
import os
import signal
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


# --------------------------------------------------------------------------------------------------
# Ranks and collectives, in lockstep: every rank issues the same collectives in the same order,
# so a choice that changes them comes from the config or an all-reduce (tests/test_lockstep.py).
@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    is_main: bool = True


# Set by setup_dist under torchrun (vLLM may open a 1-rank group of its own in a plain run).
_launched = False


def setup_dist(device: str = "") -> DistInfo:
    """The process's rank and device: device "cuda", "cpu", or "" for cuda if available, else cpu;
    under torchrun, one rank of its process group (init_ranks)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return init_ranks(device)
    return DistInfo(device=torch.device(device))


def init_ranks(device: str) -> DistInfo:
    """Initialise torch.distributed from torchrun's environment; this rank's DistInfo."""
    global _launched
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    # on GPUs NCCL for CUDA tensors, gloo for the CPU tensors of metrics and flags
    # (NCCL rejects CPU tensors)
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    _launched = True
    return DistInfo(rank, local_rank, world_size, dev, rank == 0)


def cleanup_dist(engine=None):
    """Barrier (no rank leaves while another still talks), close the engine (vLLM may destroy
    the group), destroy the group."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    if engine is not None:
        engine.close()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def end_process(status: int = 0):
    """A torchrun rank's last call, after cleanup_dist: the exit handlers, the streams flushed, then
    os._exit(status), without the interpreter's shutdown that can abort a finished rank
    (docs/gpu.md, "Stops, preemption and checkpoints", says why). A plain run is untouched."""
    if not _launched:
        return
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def is_dist() -> bool:
    """True under torchrun (any world size, so one GPU still takes the FSDP2 path)."""
    return _launched and dist.is_available() and dist.is_initialized()


def print0(*args, **kwargs):
    if not is_dist() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a copy; identity in a single process)."""
    x = x.detach().clone()
    if is_dist():
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Maximum over ranks (a copy; identity in a single process)."""
    x = x.detach().clone().float()
    if is_dist():
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def all_gather_list(items: list) -> list:
    """A picklable list from every rank, concatenated in rank order (identity in one process)."""
    if not is_dist():
        return list(items)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, items)
    return [x for part in out for x in part]


# --------------------------------------------------------------------------------------------------
# Stop signals: the loop polls stop_requested() wherever it can stop (a checkpoint follows).
_stop_signal = None  # set by the handler of SIGTERM and SIGINT


def handle_stop_signals():
    """Make SIGTERM (preemption) and Ctrl-C request a stop; a second Ctrl-C aborts. torchrun
    forwards SIGTERM to every worker and kills them 30 s later (docs/gpu.md)."""
    global _stop_signal
    _stop_signal = None

    def handler(signum, frame):
        global _stop_signal
        if _stop_signal == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        _stop_signal = signum
        print(f"\nsignal {signal.Signals(signum).name}: checkpointing and stopping", flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def stop_requested() -> bool:
    """True on every rank once any rank got a stop signal (ranks leave the loop together)."""
    return all_reduce_sum(torch.tensor(float(_stop_signal is not None))).item() > 0


# --------------------------------------------------------------------------------------------------
# How a run ends early: die() on a user error (a bad flag, file or row: one line naming it),
# or stop_run() after a stop request.
def die(message: str):
    """A user error: one line on stderr and exit status 2, no traceback."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def stop_run(engine, where: str):
    """The end of a run that a stop request (SIGTERM, Ctrl-C) interrupted, after its checkpoint."""
    print0(f"stopped {where}; continue with --resume")
    cleanup_dist(engine)
