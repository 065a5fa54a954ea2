"""
Look up when needed: what keeps a run going around the step. The models at start-up (loaded,
sharded, checked), records (metrics.jsonl, samples.jsonl, config.json, trackers), checkpoints:
atomic, resumed exactly on any number of ranks.
"""
import atexit
import glob
import json
import os
import pickle
import random
import shutil
import sys
import warnings
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import partial
from common import evaluate
from config import config_dict
from dataset import PromptStream, parse_eval_data
from lora import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_state_dict, is_lora, load_lora_policy,
                  save_adapter)
from modeling import full_state_dict, load_model, set_attention, shard_model
from ranks import DistInfo, all_reduce_max, die, is_dist, print0
from shortcuts import check_logprob_paths

# the log-prob paths the start-up checks chose, by model: in out_dir and in every checkpoint
# torch.distributed.checkpoint warns at each save/load of a plain run that it works in one process:
# it should
warnings.filterwarnings("ignore",
                        message="torch.distributed is disabled, unavailable or uninitialized")


# --------------------------------------------------------------------------------------------------
# The models at start-up: the policy loaded (with LoRA's adapters), sharded,
# and checked where it trains.
def load_policy(resume_from: str | None, base_path: str, cfg):
    """(model, tokenizer, the folder of its full weights), on the CPU: the checkpoint's model
    (--resume) or --model's; with --lora_rank, the base with LoRA adapters (lora.load_lora_policy).
    A resumed model carries the log-prob paths its run's start chose (recorded_paths)."""
    if cfg.lora_rank:
        model, tok, path = load_lora_policy(resume_from, base_path, cfg)
    else:
        path = resume_from or base_path
        model, tok = load_model(path)
    if resume_from:
        model.logprob_paths = recorded_paths(resume_from)
    return model, tok, path


def prepare_models(model, engine, base_path: str, cfg, dist_info: DistInfo):
    """(model, ref_model), sharded, and the rollout engine calibrated against the model (vLLM: the
    weight-sync probe's start-up gap). ref_model, the KL anchor, is the initial model even after a
    resume: with LoRA the model itself, which token_losses runs with its adapters off (the base: no
    second copy); None without KL. --logprob_path shortcuts: each model's shortcuts checked where
    training runs, once a run (decide_paths)."""
    set_attention(model, cfg.attn_implementation)
    model = shard_model(model, dist_info, cfg.dtype, cfg.grad_checkpointing, cfg.cpu_offload)
    engine.calibrate(model)
    ref_model = None
    if cfg.kl_coef > 0:
        ref_model = model if is_lora(model) else load_ref_model(base_path, cfg, dist_info)
    if cfg.logprob_path == "shortcuts":
        decide_paths(model, ref_model, cfg, dist_info)
    return model, ref_model


def load_ref_model(base_path: str, cfg, dist_info: DistInfo):
    """--kl_coef > 0 without LoRA: the KL anchor, the initial model frozen and sharded as the
    policy is (in eval mode: a no-grad forward's gathered parameters are freed after it);
    prepare_models checks it."""
    ref_model = load_model(base_path)[0].requires_grad_(False)
    set_attention(ref_model, cfg.attn_implementation)
    return shard_model(ref_model, dist_info, cfg.dtype, cpu_offload=cfg.cpu_offload).eval()


# --------------------------------------------------------------------------------------------------
# --logprob_path shortcuts: the verdicts of the start-up checks, decided once a run, recorded in
# every checkpoint (save_checkpoint writes model.logprob_paths to PATHS_FILE) and in --out_dir for a
# reader; a --resume takes them again.
PATHS_FILE = "logprob_paths.json"


def recorded_paths(checkpoint: str) -> dict:
    """The verdicts a checkpoint recorded ({} in one written before they were)."""
    path = os.path.join(checkpoint, PATHS_FILE)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def decide_paths(model, ref_model, cfg, dist_info):
    """Each model's shortcuts checked where training runs (check_logprob_paths), or the verdicts the
    run's start recorded (model.logprob_paths, set by load_policy on --resume)."""
    recorded = getattr(model, "logprob_paths", {})
    paths = {"policy": check_logprob_paths(model, cfg, dist_info.device, recorded.get("policy"))}
    if ref_model is not None and ref_model is not model:
        paths["reference"] = check_logprob_paths(ref_model, cfg, dist_info.device,
                                                 recorded.get("reference"))
    model.logprob_paths = paths
    if dist_info.is_main and cfg.out_dir:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, PATHS_FILE), "w") as f:
            json.dump(paths, f, indent=1)


# --------------------------------------------------------------------------------------------------
# Records, by rank 0: metrics.jsonl (a record per step and evaluation, the source of truth),
# samples.jsonl, config.json, a console line per step (tqdm.write keeps a bar intact); --report_to:
# TensorBoard or wandb too.
class Logger:
    """rank 0's records. --resume drops those after step `resumed_step` (all at -1: no checkpoint):
    the run writes them again."""

    def __init__(self, cfg, dist_info: DistInfo, resumed_step: int = -1):
        self.enabled = dist_info.is_main  # rank 0 writes
        self.out_dir = cfg.out_dir
        self.tracker = None
        self.sample_every = cfg.sample_every
        if self.enabled:
            os.makedirs(cfg.out_dir, exist_ok=True)
            if cfg.resume:  # the records after the checkpoint are written again
                _truncate_records(cfg.out_dir, resumed_step)
            config = config_dict(cfg, dist_info.world_size)
            print0("config: " + " ".join(f"{k}={v}" for k, v in config.items()))
            with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
                json.dump(config, f, indent=1)
            if cfg.report_to != "none":
                self.tracker = Tracker(cfg.report_to, cfg.out_dir, config, cfg.wandb_project)

    def log(self, record: dict, name: str = "metrics.jsonl"):
        if "crosscheck_samples" in record:  # the cross-check's disagreements: their own file
            record = self.log_disagreements(record)
        if self.enabled:
            with open(os.path.join(self.out_dir, name), "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            if self.tracker is not None and name == "metrics.jsonl":
                self.tracker.log(record)

    def log_disagreements(self, record: dict) -> dict:
        """Write the record's cross-check disagreements to crosscheck.jsonl; return the rest."""
        for row in record["crosscheck_samples"]:
            self.log({"step": record["step"], **row}, "crosscheck.jsonl")
        return {k: v for k, v in record.items() if k != "crosscheck_samples"}

    def line(self, text: str):
        if self.enabled:
            tqdm.write(text)

    def samples(self, step: int, groups: list[dict]):
        """Every --sample_every steps, a few of the step's completions (write_samples)."""
        if self.sample_every and step % self.sample_every == 0 and groups:
            self.write_samples(step, groups[0])

    def write_samples(self, step: int, group: dict, n: int = 4):
        """A few completions of a group to samples.jsonl, one of them to the console."""
        for text, reward in list(zip(group["texts"], group["reward"]))[:n]:
            row = {"step": step, "prompt": group["prompt"], "answer": group["answer"],
                   "completion": text, "reward": reward}
            self.log(row, "samples.jsonl")
        self.line(f"sample: {group['prompt'][-60:]!r} -> {group['texts'][0][-80:]!r} "
                  f"(answer {group['answer']}, reward {group['reward'][0]:+.2f})")


class Tracker:
    """--report_to tensorboard (event files in out_dir/tensorboard) or wandb (project
    --wandb_project, run files in out_dir/wandb, offline with WANDB_MODE=offline), imported only
    when chosen: the config, then every record's numbers under their metrics.jsonl names."""

    def __init__(self, kind: str, out_dir: str, config: dict, wandb_project: str):
        self.kind = kind
        try:
            if kind == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(os.path.join(out_dir, "tensorboard"))
                self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", 0)
            else:
                import wandb
                self.run = wandb.init(project=wandb_project, dir=out_dir, config=config,
                                      name=os.path.basename(os.path.normpath(out_dir)))
        except ImportError as e:
            die(f"--report_to {kind}: {e.name} is not installed "
                f"(pip install -r requirements/tracking.txt)")
        atexit.register(self.close)

    def log(self, record: dict):
        numbers = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if self.kind == "tensorboard":
            for key, value in numbers.items():
                self.writer.add_scalar(key, value, record["step"])
            self.writer.flush()
        else:
            self.run.log(numbers, step=record["step"])

    def close(self):
        if self.kind == "tensorboard":
            self.writer.close()
        else:
            self.run.finish()


def _truncate_records(out_dir: str, last_step: int):
    """Keep the records with step <= last_step in out_dir's .jsonl files (the run after a resume
    rewrites the rest)."""
    for name in ("metrics.jsonl", "samples.jsonl", "crosscheck.jsonl"):
        path = os.path.join(out_dir, name)
        if os.path.exists(path):
            keep = [ln for ln in open(path, encoding="utf-8")
                    if ln.strip() and json.loads(ln).get("step", 0) <= last_step]
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.writelines(keep)
            os.replace(path + ".tmp", path)


def format_step(step: int, steps: int, record: dict) -> str:
    """The one printed line per step: fixed keys, fixed widths, `|` separators."""
    parts = [f"step {step:4d}/{steps}",
             f"reward {record['train/reward']:+.3f}",
             f"acc {record['train/acc']:.3f}",
             f"keep {record['train/keep_rate']:.2f}",
             f"len {record['train/response_len']:5.1f}",
             f"loss {record['train/loss']:+.4f}",
             f"ent {record['train/entropy']:.3f}",
             f"gnorm {record['train/grad_norm']:.3f}",
             f"{record['time/step_s']:.1f}s"]
    return " | ".join(parts)


def evaluate_sets(engine, tok, eval_sets: dict[str, list[dict]], cfg, rank: int = 0,
                  world_size: int = 1) -> dict:
    """evaluate() on each eval set with its own k (--eval_data set@k, else --eval_samples), as
    eval/<set>/...; the headline eval/acc, eval/pass@j, eval/maj@k, eval/acc_level<l>: means over
    the sets with the key."""
    ks = [k for _, k in parse_eval_data(cfg.eval_data, cfg.eval_samples)]
    out = {}
    per_set = []  # each set's scores
    for (name, problems), k in zip(eval_sets.items(), ks):
        scores = evaluate(engine, tok, problems, cfg, rank, world_size, k)
        for row in scores.pop("crosscheck_samples", []):  # written by Logger.log, never a metric
            out.setdefault("crosscheck_samples", []).append({**row, "where": f"eval/{name}"})
        per_set.append(scores)
        out.update({key.replace("eval/", f"eval/{name}/", 1): v for key, v in scores.items()})
    every_key = dict.fromkeys(key for scores in per_set for key in scores)  # in first-seen order
    for key in every_key:
        values = [s[key] for s in per_set if key in s]
        out[key] = sum(values) / len(values)
    return out


def evaluate_and_log(engine, tok, eval_sets: dict, cfg, dist_info: DistInfo, logger: Logger,
                     step: int, before: dict | None = None) -> dict:
    """evaluate_sets at `step`: a metrics.jsonl record, a line per eval set (acc, pass@k, maj@k,
    levels); at the last step, with `before`, the step-0 evaluation's record, the run's gain too."""
    scores = evaluate_sets(engine, tok, eval_sets, cfg, dist_info.rank, dist_info.world_size)
    record = {"step": step, **scores}
    logger.log(record)
    for name in eval_sets:
        prefix = f"eval/{name}/"
        scores = {k[len(prefix):]: v for k, v in record.items() if k.startswith(prefix)}
        passes = " | ".join(f"{k} {v:.3f}" for k, v in scores.items()
                            if k.startswith(("pass@", "maj@")))
        levels = " ".join(f"L{k[9:]} {v:.2f}" for k, v in scores.items()
                          if k.startswith("acc_level") and k != "acc_level0")
        label = f" [{name}]" if len(eval_sets) > 1 else ""
        logger.line(f"eval step {step}{label}: acc {scores['acc']:.3f} | {passes}"
                    + (f" | {levels}" if levels else ""))
    if before is not None and before["step"] == 0 and step == cfg.steps:
        print0(f"eval/acc before {before['eval/acc']:.3f} -> after {record['eval/acc']:.3f}")
    return record


def step_bar(start_step: int, cfg, dist_info: DistInfo):
    """The loop's steps, those after start_step up to --steps (none with --eval_only), with a
    progress bar on rank 0 in a terminal (none in a log file). A --resume with none left says that
    the run is done."""
    steps = range(start_step + 1, 0 if cfg.eval_only else cfg.steps + 1)
    if cfg.resume and not steps and not cfg.eval_only:
        print0(f"--resume: the run is done (step {start_step} of {cfg.steps}, its evaluation too): "
               f"nothing to add (a larger --steps trains on)")
    hidden = not dist_info.is_main or not sys.stderr.isatty()
    return tqdm(steps, desc="steps", leave=False, disable=hidden)


# --------------------------------------------------------------------------------------------------
# Checkpoints, what they hold. out_dir/step_XXXXXX/: a Hugging Face model folder (from_pretrained,
# vLLM); optimizer/, sharded by torch.distributed.checkpoint (dcp), resumable on any number of
# ranks; trainer.pt (step, scheduler, data position, the algorithm's state); logprob_paths.json
# (the start-up checks' verdicts, taken again on --resume); rank<r>.pt per rank (RNG states and,
# after a stop mid-step, that step's remaining work: a PendingStep). The .pt files hold only tensors
# and plain types, for torch's safe loader: a checkpoint from elsewhere cannot run code on --resume
# (dcp's metadata is a pickle).
def rng_state() -> dict:
    """This rank's RNG states as tensors and plain types: Python's, numpy's, torch's (CPU, GPUs)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    # no ndarray
    numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)
    return {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict):
    """Inverse of rng_state."""
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to(obj, device):
    """Every tensor in nested dicts, lists and tuples moved to `device`."""
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return obj.to(device) if torch.is_tensor(obj) else obj


@dataclass
class PendingStep:
    """What a stop mid-step leaves on this rank: `batch` on the training device, the rest on CPU."""
    step: int  # the unfinished step
    # its metrics record so far (rollout, advantages, pi_old); rank 0's is the one logged
    record: dict
    groups: list  # its first group on this rank (samples.jsonl)
    update_rows: list  # the rows of each of its updates (tensors)
    batch: dict  # the batch's tensors (common: the batch contract)
    next_update: int  # the first update not yet applied
    sums: dict  # Sums.values of its updates so far on this rank (summed over ranks when logged)
    # the algorithm's own sums over the step, the same on every rank (algo.step_state(): DARO's
    algo: dict
    #             per-bin sums)

    def plain(self) -> dict:
        """Tensors and plain types on the CPU, for torch's safe loader."""
        return _to(asdict(self), "cpu")

    def resume(self, sums, algo) -> tuple:
        """Put the step's sums back (the loop's Sums, the algorithm's own); returns where the loop
        goes on."""
        sums.values = self.sums
        algo.load_step_state(self.algo)
        return self.record, self.groups, self.update_rows, self.batch, self.next_update


def _group_rows(pending: PendingStep, rows: torch.Tensor) -> list[torch.Tensor]:
    """An update's rows on one rank, cut into its groups (make_batch keeps their rows together)."""
    counts = torch.unique_consecutive(pending.batch["group"][rows], return_counts=True)[1]
    return list(rows.split(counts.tolist()))


def _repadded(pending: PendingStep, key: str, rows: torch.Tensor, width: tuple,
              pad_id: int) -> torch.Tensor:
    """pending.batch[key][rows] in a batch of `width` (P, T): prompts left-padded to P, completions
    right-padded to T (common.make_batch's layout), with pad_id (input_ids) or 0."""
    x = pending.batch[key][rows]
    if x.dim() == 1:
        return x
    T = pending.batch["mask"].shape[1]
    if key not in ("input_ids", "attention_mask"):  # (B, T): completion columns only
        return F.pad(x, (0, width[1] - T))
    value = pad_id if key == "input_ids" else 0
    P = x.shape[1] - T
    return F.pad(F.pad(x, (width[0] - P, 0), value=value), (0, width[1] - T), value=value)


def reshard_pending(pendings: list[PendingStep], rank: int, world: int, pad_id: int) -> PendingStep:
    """This rank's share of a step a stop interrupted on len(pendings) ranks, for a run on `world`
    ranks (each rank computes it from all the saved ones, no collective). Each remaining update's
    groups, in old-rank order, are cut into `world` contiguous shares of one size, so that every
    rank trains as many rows and issues the same collectives; a share a group short gets a copy of
    one with its mask zeroed (it adds to no loss, count or sum). The loss denominators are global:
    the update is the one the old ranks would have made. The step's sums so far go to rank 0 (they
    are summed over ranks when logged); every rank takes old rank 0's record (the one logged) and
    the algorithm's step state (the same on every rank). Example: 3 groups left on 1 rank, for 2
    ranks -> rank 0 takes groups 0 and 1, rank 1 group 2 and a zeroed copy of group 0."""
    head = pendings[0]
    prompt_width = max(p.batch["input_ids"].shape[1] - p.batch["mask"].shape[1] for p in pendings)
    # (P, T) of the new batch
    width = (prompt_width, max(p.batch["mask"].shape[1] for p in pendings))
    # this rank's groups: (the pending step holding it, its rows there, trained or a copy)
    pieces = []
    update_rows = []
    for u in range(len(head.update_rows)):
        if u < head.next_update:  # applied before the stop
            update_rows.append(torch.arange(0))
            continue
        groups = [(p, rows, True) for p in pendings for rows in _group_rows(p, p.update_rows[u])]
        share = -(-len(groups) // world)  # groups per rank, rounded up
        mine = groups[rank * share:(rank + 1) * share]
        # copies that train nothing
        mine += [(groups[0][0], groups[0][1], False)] * (share - len(mine))
        start = sum(len(rows) for _, rows, _ in pieces)
        pieces += mine
        update_rows.append(torch.arange(start, start + sum(len(rows) for _, rows, _ in mine)))
    batch = {k: torch.cat([_repadded(p, k, rows, width, pad_id) for p, rows, _ in pieces])
             for k in head.batch}
    batch["group"] = torch.cat([torch.full((len(rows),), i)
                                for i, (_, rows, _) in enumerate(pieces)])
    trained = torch.cat([torch.full((len(rows),), t) for _, rows, t in pieces])[:, None]  # (B, 1)
    for key in ("mask", "rejected"):  # what the losses and sums count (common.token_losses)
        if key in batch:
            batch[key] = batch[key] * trained
    sums = {k: sum(p.sums[k] for p in pendings) if rank == 0 else 0.0 for k in head.sums}
    groups = head.groups if rank == 0 else []  # (samples.jsonl, written by rank 0)
    return PendingStep(head.step, head.record, groups, update_rows, batch, head.next_update, sums,
                       head.algo)


def _load_plain(path: str):
    """torch.load with the safe loader, onto the CPU whatever device a tensor was saved from (a GPU
    run's checkpoint resumes anywhere; under torchrun no rank loads onto GPU 0); a file with more
    than tensors and plain types dies with one line."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        die(f"--resume: {path} holds more than tensors and plain types, so it is not loaded: "
            f"unpickling it could run code (a checkpoint written before this format, by an older "
            f"version of this code, lands here too: resume it with that version, or start from its "
            f"model with --model). torch: {str(e).splitlines()[0][:80]}")


def seed_everything(seed: int):
    """Seed this rank's sampling RNGs: torch's (our sampler), numpy's (vLLM seeds its requests
    from it) and Python's."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------------------------------
# Checkpoints, written and read: atomically, by every rank, on any number of ranks;
# --resume's choice of one.
def save_checkpoint(out_dir: str, step: int, model, tok, opt, sched, stream: PromptStream,
                    extra: dict, keep: int = 2, pending: PendingStep | None = None) -> str:
    """Write step_<step>/ atomically and keep the newest `keep`. `step` is the last finished step;
    with `pending` the folder takes the unfinished step's number. The model goes through an empty
    (meta-device) copy of its architecture, so no second full copy exists under FSDP; the optimizer
    through dcp, each rank its shards; `extra` is the algorithm's state (the same on every rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from transformers import AutoModelForCausalLM
    rank, world = (dist.get_rank(), dist.get_world_size()) if is_dist() else (0, 1)
    path = os.path.join(out_dir, f"step_{pending.step if pending else step:06d}")
    tmp = path + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if is_dist():
        dist.barrier()
    os.makedirs(tmp, exist_ok=True)
    lora = is_lora(model)
    state_dict = adapter_state_dict(model) if lora else full_state_dict(model)
    # An optimizer that has not stepped (a stop in step 1) has no state: torch's state dict gives it
    # a zero-lr step (Adam's count 1), undone below, so the first real update is Adam's step 1.
    fresh = not opt.state
    if rank == 0 and lora:
        save_adapter(model, state_dict, tmp)  # peft's format: the base is --model's
    elif rank == 0:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(model.config)
        skeleton.generation_config = model.generation_config
        skeleton.save_pretrained(tmp, state_dict=state_dict)
    if rank == 0:
        tok.save_pretrained(tmp)
        with open(os.path.join(tmp, PATHS_FILE), "w") as f:  # what a --resume takes again
            json.dump(getattr(model, "logprob_paths", {}), f, indent=1)
        torch.save({"step": step, "world_size": world, "scheduler": sched.state_dict(),
                    "optimizer_fresh": fresh, "data_position": stream.position,
                    "pad_token_id": tok.pad_token_id, **extra}, os.path.join(tmp, "trainer.pt"))
    dcp.save({"optimizer": get_optimizer_state_dict(model, opt)},
             checkpoint_id=os.path.join(tmp, "optimizer"), no_dist=not is_dist())
    if fresh:
        opt.state.clear()
    torch.save({"rng": rng_state(), "pending": pending and pending.plain(),
                "carried": getattr(stream, "carried", None)}, os.path.join(tmp, f"rank{rank}.pt"))
    if is_dist():
        dist.barrier()
    if rank == 0:  # the atomic step: a checkpoint folder without .tmp is always complete
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        for old in sorted(glob.glob(os.path.join(out_dir, "step_??????")))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    if is_dist():
        dist.barrier()
        check_every_rank_sees(path, ADAPTER_WEIGHTS if lora else "model.safetensors", world)
    return path


def check_every_rank_sees(path: str, weights: str, world: int):
    """Exit 2 on every rank unless each sees the whole checkpoint (several nodes, one disk)."""
    files = ["trainer.pt", PATHS_FILE, weights, os.path.join("optimizer", ".metadata")] + [
        f"rank{r}.pt" for r in range(world)]
    missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
    if all_reduce_max(torch.tensor(float(len(missing)))).item():
        die(f"checkpoint {path}: a rank does not see {', '.join(missing) or 'all of it'}; "
            f"with several nodes, --out_dir must be on a filesystem every node shares")


def latest_checkpoint(out_dir: str) -> str | None:
    """The newest complete checkpoint folder in out_dir (an interrupted write's .tmp is ignored)."""
    found = sorted(glob.glob(os.path.join(out_dir, "step_??????")))
    return found[-1] if found else None


def find_checkpoint(cfg) -> str | None:
    """The checkpoint --resume continues from (resume_from), else None."""
    return resume_from(cfg) if cfg.resume else None


def resume_from(cfg) -> str | None:
    """The latest checkpoint in --out_dir, checked (rank 0's choice, on every rank; said if
    there is none)."""
    ckpt = [latest_checkpoint(cfg.out_dir)]
    if is_dist():
        dist.broadcast_object_list(ckpt, src=0)
    if ckpt[0] is None:
        print0(f"--resume: no checkpoint in {cfg.out_dir!r}; starting from step 0")
    else:
        check_checkpoint_kind(ckpt[0], cfg.lora_rank)
    return ckpt[0]


def check_checkpoint_kind(ckpt: str, lora_rank: int):
    """A LoRA run resumes an adapter checkpoint and a full fine-tune a whole model's: never the
    other kind."""
    adapter = os.path.exists(os.path.join(ckpt, ADAPTER_CONFIG))
    if lora_rank and not adapter:
        die(f"--resume: {ckpt} was written without LoRA (a whole model, no adapter): resume it "
            f"without --lora_rank, or start LoRA from its model (--model {ckpt}) in a new "
            f"--out_dir")
    if not lora_rank and adapter:
        rank = json.load(open(os.path.join(ckpt, ADAPTER_CONFIG)))["r"]
        die(f"--resume: {ckpt} holds a LoRA adapter of rank {rank}: resume it with its --lora_* "
            f"flags, or merge it (python -m tools.merge_lora {ckpt} <folder>) and start from that "
            f"with --model")


def load_checkpoint(ckpt: str | None, model, opt, sched, stream: PromptStream, seed: int,
                    dist_info: DistInfo):
    """(the step to continue after, the saved state): a fresh run (no `ckpt`) seeds this rank's RNGs
    and starts at step 0; --resume restores the trainer's state (resume_checkpoint)."""
    if ckpt is None:
        seed_everything(seed + dist_info.rank)
        return 0, {"pending": None}
    return resume_checkpoint(ckpt, model, opt, sched, stream, seed, dist_info)


def resume_checkpoint(ckpt: str, model, opt, sched, stream: PromptStream, seed: int,
                      dist_info: DistInfo):
    """Inverse of save_checkpoint for the trainer's state: the optimizer (resharded to this run's
    ranks), scheduler, data position, this rank's RNGs (a run on another number of ranks seeds them
    afresh: the saved streams belong to the old ranks; a stopped step's work is then split anew,
    reshard_pending). Returns (the step to continue after, the saved state: the algorithm's entries,
    "eval_due", and "pending": this rank's PendingStep or None)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    state = _load_plain(os.path.join(ckpt, "trainer.pt"))
    if not state.get("optimizer_fresh"):  # (a fresh one stays as it is: see save_checkpoint)
        # this run's layout: the state to fill
        optim = {"optimizer": get_optimizer_state_dict(model, opt)}
        dcp.load(optim, checkpoint_id=os.path.join(ckpt, "optimizer"), no_dist=not is_dist())
        set_optimizer_state_dict(model, opt, optim["optimizer"])
    sched.load_state_dict(state["scheduler"])
    stream.position = state["data_position"]
    if state["world_size"] == dist_info.world_size:
        mine = _load_plain(os.path.join(ckpt, f"rank{dist_info.rank}.pt"))
        set_rng_state(mine["rng"])
        state["pending"] = mine["pending"] and PendingStep(**mine["pending"])
        carried = mine.get("carried")
    else:
        files = [os.path.join(ckpt, f"rank{r}.pt") for r in range(state["world_size"])]
        ranks_saved = [_load_plain(f) for f in files]
        carried = partial.deal_carried([r.get("carried") for r in ranks_saved], dist_info.rank,
                                       dist_info.world_size)
        # every old rank's: the step's rows, split anew
        saved = [r["pending"] for r in ranks_saved]
        print0(f"note: {ckpt} was saved on {state['world_size']} ranks, this run has "
               f"{dist_info.world_size}: the optimizer state is resharded, the sampling RNGs are "
               f"seeded afresh"
               + (", the stopped step's remaining work is split anew" if saved[0] else ""))
        seed_everything(seed + dist_info.rank + 1_000_003 * state["step"])
        state["pending"] = None
        if saved[0]:  # a stopped step: its remaining work split anew over this run's ranks
            pendings = [PendingStep(**p) for p in saved]
            state["pending"] = reshard_pending(pendings, dist_info.rank, dist_info.world_size,
                                               state.get("pad_token_id", 0))
    if carried is not None:  # --max_staleness: the rollouts it carries (partial.py)
        stream.carried = carried
        waiting = len(carried["flights"]) + len(carried["finished"])
        if waiting:  # (rank 0's count; a run without --max_staleness never reads them)
            print0(f"note: {ckpt} carries {waiting} groups of partial rollouts: "
                   f"--max_staleness > 0 continues them, --max_staleness 0 leaves them")
    if state["pending"]:  # its batch to the training device (see PendingStep)
        state["pending"].batch = _to(state["pending"].batch, dist_info.device)
    print0(f"resumed from {ckpt} (step {state['step']})")
    return state["step"], state
