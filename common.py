"""
The RL step both scripts share, in the order the loop takes it: every part of one step that no equation of
DA3PO or DARO points at. Around it, in files to look up when needed: ranks.py (processes, collectives, stop
signals), modeling.py (loading, log-probs of any model, sharding, start-up probes), dataset.py (problems,
prompts, eval sets), bookkeeping.py (flags, records, checkpoints), engine.py (rollout engines), verifier.py.

   1. the shared knobs                        5. the update plan and the batch (its contract)
   2. the presets and the algorithm's hooks   6. pi and pi_old: log-probs of the completions
   3. the step's record and its metrics       7. the token losses and the guarded update
   4. rollout, rewards, dynamic sampling      8. evaluation (avg@k, pass@k, maj@k)

Shapes in comments: B = completions on this rank, G = group size, N = groups (B = N * G), P = prompt tokens
(left padded), T = completion tokens (right padded), V = vocabulary size, H = hidden size.
"""
import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import crosscheck
from dataset import PromptStream, parse_eval_data
from modeling import (OUTSIDE_NUCLEUS, adapter_disabled, autocast, forward_tokens, full_tensor,
                      reshard, token_logprobs)
from ranks import (DistInfo, all_gather_list, all_reduce_max, all_reduce_sum, is_dist, print0,
                   stop_requested)
from verifier import extract_answer, majority_vote, verify_batch


# ------------------------------------------------------------------------------------------------------------
# 1. The knobs both scripts share, written once; each script's Config adds its paper's own. Defaults run
#    the CPU demo; the papers' scale is in docs/gpu.md.
@dataclass
class TrainConfig:
    # run
    algo: str = ""
    """preset (the script's PRESETS); explicit flags override the preset"""
    demo: str = "arith"
    """the shipped demo whose flags apply: reasoning (the default; see below) | arith (the values
    shown)"""
    model: str = "demo"
    """local Hugging Face folder, hub id, or 'demo' (the tiny shipped model)"""
    train_data: str = "arith"
    """'arith' (built-in sums) or a .jsonl/.json/.parquet file of problem/answer rows"""
    eval_data: str = "arith"
    """as --train_data ('arith': 200 held-out sums); several sets comma-separated, each with
    its own k as set@k (aime24.jsonl@32,math500.jsonl@8; no @k: --eval_samples)"""
    out_dir: str = ""
    """config.json, metrics.jsonl, samples.jsonl, checkpoints"""
    seed: int = 0
    """init seed (same on every rank); sampling uses seed + rank"""
    steps: int = 60
    """RL steps (one rollout batch each)"""
    device: str = ""
    """'' = cuda if available, else cpu"""
    dtype: str = "float32"
    """compute dtype: float32 | bfloat16 (trained weights and optimizer state stay float32)"""
    grad_checkpointing: bool = False
    """recompute activations in backward (less memory, ~30% more compute)"""
    attn_implementation: str = ""
    """the trainer's attention, by transformers' name ('' = the model's own); docs/gpu.md"""
    cpu_offload: bool = False
    """FSDP2 (under torchrun): sharded parameters and optimizer state on the CPU"""
    # LoRA (peft, requirements/lora.txt): train low-rank adapters, the base frozen (docs/gpu.md)
    lora_rank: int = 0
    """r: rank of the adapters; 0 = off (every weight trained)"""
    lora_alpha: float = 32.0
    """alpha: the adapters' output is scaled by alpha / r"""
    lora_target_modules: str = ""
    """linear layers to adapt, comma-separated (q_proj,v_proj); '' = all in the blocks"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input while training"""
    lora_sync: str = "auto"
    """what vLLM receives after each update: adapter | merged | auto (the adapter if it can)"""
    # rollout
    prompts_per_step: int = 32
    """groups trained on per step, across all ranks (train batch size in DAPO)"""
    group_size: int = 8
    """G (K in DARO): completions per prompt"""
    dynamic_sampling: bool = True
    """DAPO: keep only groups with 0 < #correct < G, refill from fresh prompts"""
    oversample: float = 1.5
    """prompts generated per dynamic-sampling batch, as a multiple of prompts_per_step"""
    max_gen_batches: int = 4
    """cap on generation batches per step; at the cap, warn and train on what was kept"""
    max_new_tokens: int = 12
    """L_max: hard limit on completion length"""
    max_prompt_length: int = 1024
    """prompts longer than this (tokens, template included) are dropped at load"""
    temperature: float = 1.0
    """rollout sampling temperature"""
    top_p: float = 1.0
    """rollout nucleus sampling"""
    rollout_batch_size: int = 512
    """sequences per forward of our sampler (memory knob)"""
    rollout: str = "hf"
    """rollout engine: hf (our sampler on the HF model) | vllm | auto (vLLM if usable)"""
    vllm_gpu_memory: float = 0.0
    """vLLM's share of GPU memory; 0 = the most the trainer leaves (bench/memory.py)"""
    max_model_len: int = 0
    """longest sequence vLLM keeps KV cache for; 0 = longest prompt + max_new_tokens"""
    vllm_cpu_kv_gb: float = 0.5
    """vLLM on CPU: KV cache size in GiB"""
    rollout_is: str = "none"
    """correct the engine/trainer mismatch: none | token | sequence (docs/gpu.md)"""
    rollout_is_cap: float = 2.0
    """C: the weight pi_old / pi_rollout is truncated at C"""
    rollout_is_mask: bool = False
    """reject tokens (sequences) whose weight is outside [1/C, C] instead"""
    prompt_template: str = "auto"
    """chat | plain | dapo | none | auto (none for the demo, else chat if any)"""
    answer_format: str = "auto"
    """where the verifier looks: boxed | answer_line | auto"""
    verifier_crosscheck: bool = False
    """Math-Verify also judges the eval completions; log where it disagrees with ours
    (crosscheck/*, crosscheck.jsonl)"""
    crosscheck_train: int = 0
    """with --verifier_crosscheck: completions per training step it also judges; 0 = none"""
    prompt_key: str = ""
    """data field holding the problem ('' = try problem, question, prompt; dots for nested)"""
    answer_key: str = ""
    """data field holding the answer ('' = try answer, final_answer, reward_model.ground_truth)"""
    # reward (DAPO)
    overlong_buffer: int = 4
    """L_cache: penalty ramps from 0 at L_max - L_cache tokens to -1 at L_max; 0 = off"""
    overlong_penalty: float = 1.0
    """penalty factor of the overlong shaping"""
    # advantages and loss
    std_norm: bool = True
    """GRPO z-score advantage; off = Dr. GRPO (mean-centred only)"""
    loss_agg: str = "token-mean"
    """token-mean (DAPO) | seq-mean-token-mean (GRPO) | seq-mean-token-sum-norm"""
    seq_ratio: bool = False
    """GSPO: length-normalised sequence-level importance ratio"""
    clip_low: float = 0.2
    """epsilon_low: ratio clipped below at 1 - clip_low"""
    clip_high: float = 0.28
    """epsilon_high: ratio clipped above at 1 + clip_high (clip-higher)"""
    clip_ratio_c: float = 0.0
    """dual clip for negative advantages (verl uses 3.0); 0 = off"""
    kl_coef: float = 0.0
    """beta: k3 KL penalty to the initial model; 0 = none, as in DAPO"""
    # optimisation
    lr: float = 1e-4
    """AdamW learning rate (the papers: 1e-6)"""
    weight_decay: float = 0.1
    """AdamW weight decay (DAPO recipe)"""
    warmup_steps: int = 0
    """linear learning-rate warm-up over this many RL steps (not optimizer updates), as verl"""
    grad_clip: float = 1.0
    """max global gradient norm"""
    updates_per_step: int = 2
    """optimizer updates (mini-batches) per RL step; the step's groups are split evenly"""
    micro_batch_size: int = 64
    """sequences per forward/backward on one rank (memory knob; not the math)"""
    micro_batch_tokens: int = 0
    """> 0: micro-batches packed by length up to this many tokens, ranks balanced"""
    logprob_chunk: int = 1024
    """positions x rows whose logits exist at once (recomputed in backward); 0 = all"""
    pack: bool = True
    """pack a micro-batch's rows without padding, as transformers does, where that runs fewer
    positions; --no-pack: rows padded"""
    # evaluation, logging, checkpoints
    eval_every: int = 10
    """evaluate every N steps (also at step 0 and at the end); 0 = only at start and end"""
    eval_samples: int = 4
    """k: completions per eval problem (avg@k, pass@k, maj@k) of the sets without @k"""
    eval_size: int = 0
    """eval problems to use, spread evenly over each set (its mix of levels kept); 0 = all"""
    eval_temperature: float = 1.0
    """eval sampling temperature"""
    eval_top_p: float = 1.0
    """eval nucleus sampling (DAPO reports top_p 0.7)"""
    eval_batch_size: int = 128
    """eval problems per generate call"""
    sample_every: int = 10
    """write a few completions to samples.jsonl every N steps"""
    save_every: int = 0
    """checkpoint every N steps (and at the end, and on a stop request); 0 = only at the end"""
    keep_last: int = 2
    """checkpoints kept on disk (older ones are deleted)"""
    resume: bool = False
    """continue from the latest checkpoint in out_dir"""
    max_bad_updates: int = 3
    """stop the run after this many non-finite losses/gradients in a row (each is skipped)"""
    eval_only: bool = False
    """evaluate --model on --eval_data and exit"""
    report_to: str = "none"
    """also log to: none | tensorboard | wandb (requirements/tracking.txt)"""
    wandb_project: str = ""
    """wandb project of --report_to wandb"""


# ------------------------------------------------------------------------------------------------------------
# 2. The --algo presets, and the hooks the loop calls on a script's algorithm (Algorithm).

# The baselines both papers compare against, each its paper's recipe for every knob that defines the
# algorithm; the flags give the scale (model, lr, batch sizes, lengths, overlong_buffer where shaping is on).
# DAPO's 4 techniques (overlong shaping: the default buffer)
_DAPO = {"dynamic_sampling": True, "std_norm": True, "loss_agg": "token-mean", "seq_ratio": False,
         "clip_low": 0.2, "clip_high": 0.28}
# the baselines below turn DAPO's dynamic sampling, clip-higher and overlong shaping off
_OFF = {"dynamic_sampling": False, "clip_high": 0.2, "overlong_buffer": 0}

BASELINES = {
    "dapo": _DAPO,
    # GRPO, with no KL term as in DAPO, Dr. GRPO and GSPO, so GRPO vs DAPO changes nothing else;
    # verl's GRPO examples add a k3 KL loss to the initial model (--kl_coef 0.001 runs that),
    # DeepSeekMath's beta was 0.04
    "grpo": {**_DAPO, **_OFF, "loss_agg": "seq-mean-token-mean"},
    # Dr. GRPO: mean-centred advantages, token sums over the constant L_max
    "dr_grpo": {**_DAPO, **_OFF, "std_norm": False, "loss_agg": "seq-mean-token-sum-norm"},
    # GSPO: the sequence ratio, its tiny clip range, the rollout batch split into 4 mini-batches
    "gspo": {**_DAPO, **_OFF, "seq_ratio": True, "loss_agg": "seq-mean-token-mean",
             "clip_low": 3e-4, "clip_high": 4e-4, "updates_per_step": 4},
}

def presets(own: dict[str, dict], off: dict) -> dict[str, dict]:
    """A script's --algo presets: its own, then the baselines with its own algorithm switched off (`off`)."""
    return {**own, **{name: {**off, **recipe} for name, recipe in BASELINES.items()}}


class Algorithm:
    """The paper's part of the step: main() calls these hooks, in this order. Each default is the
    baselines' way (GRPO's advantages, --loss_agg's token weights) or does nothing.

      algo = DAA(cfg, device, state)        # once; state: a checkpoint's state_dict(), else {}
      algo.after_rollout(generated)         # each step: every generated group's summary
      algo.advantages(batch, groups, record)    # (B,); may add batch entries and record keys
      algo.token_weights(batch, rows)       # before each update: its tokens' shares (rows, T)
      algo.loss(token_loss, mb)             # each micro-batch: token losses (B, T) -> a scalar
      algo.after_update()                   # after each applied optimizer step
      algo.metrics(record); algo.line(record)   # each step: its keys; its part of the line
      algo.state_dict()                     # each checkpoint
      algo.step_state(); algo.load_step_state(state)   # a stop between two updates; its resume

    Every rank calls each hook at the same point, so a hook may all-reduce (torchrun's lockstep).
    """

    def __init__(self, cfg, device: torch.device, state: dict):
        self.cfg = cfg
        self.device = device

    def after_rollout(self, generated: list[dict]):
        """Sees every group generated this step, kept or not (summaries, all ranks')."""

    def advantages(self, batch: dict, groups: list[dict], record: dict) -> torch.Tensor:
        """The advantages (B,) of this rank's batch, made of `groups`. May add or change entries of
        `batch` (its contract) and add keys to `record`. Default: GRPO's (--no-std_norm: Dr. GRPO's)."""
        G = self.cfg.group_size
        return group_advantages(batch["reward"].view(-1, G), self.cfg.std_norm).flatten()

    def token_weights(self, batch: dict, rows: torch.Tensor) -> torch.Tensor:
        """Each token's share (len(rows), T) of the update of `rows`. Default: --loss_agg's."""
        return loss_weights(batch["mask"][rows], self.cfg.loss_agg, self.cfg.max_new_tokens)

    def loss(self, token_loss: torch.Tensor, mb: dict) -> torch.Tensor:
        """A micro-batch's loss from its token losses (B, T). Default: their weighted sum."""
        return (token_loss * mb["weight"]).sum()

    def after_update(self):
        """Runs after each applied optimizer step (a skipped, non-finite update calls nothing)."""

    def metrics(self, record: dict) -> dict:
        """The algorithm's keys of the step's record, given the record so far."""
        return {}

    def line(self, record: dict) -> str:
        """The algorithm's part of the step's printed line."""
        return ""

    def state_dict(self) -> dict:
        """What a checkpoint keeps (tensors and plain types): the `state` __init__ gets back."""
        return {}

    def step_state(self) -> dict:
        """The algorithm's sums over the step so far, kept by a stop between two updates."""
        return {}

    def load_step_state(self, state: dict):
        """Put back what step_state() returned, on resuming the stopped step."""


# ------------------------------------------------------------------------------------------------------------
# 3. The step's record: numbers summed over micro-batches and updates on each rank, then over ranks in one
#    all-reduce (Sums), and each phase's seconds (StepTimer); train_metrics turns them into metrics.jsonl's.
class Sums:
    """Named sums on this rank; reduce() sums each over all ranks (all ranks hold the same fixed names)."""

    def __init__(self, *names: str):
        self.values = dict.fromkeys(names, 0.0)  # name -> this rank's sum

    def add(self, **amounts: float):
        for name, amount in amounts.items():
            self.values[name] += float(amount)

    def reduce(self) -> dict:
        mine = torch.tensor(list(self.values.values()))  # float32, like every logged sum
        totals = all_reduce_sum(mine)
        return dict(zip(self.values, totals.tolist()))


TRAIN_SUMS = ("loss", "entropy", "clip_low", "clip_high", "grad_norm", "tokens", "skipped", "logprob_diff",
              "kl_k1", "kl_k3", "compared", "boundary", "forward_tokens", "real_tokens")


class StepTimer:
    """`with timer("rollout"): ...` times a phase; metrics(): time/<phase>_s, time/step_s (step so far)."""

    def __init__(self):
        self.start = time.time()
        self.seconds = {}  # phase -> seconds so far

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.time()
        yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.time() - t0

    def metrics(self) -> dict:
        return {**{f"time/{k}_s": v for k, v in self.seconds.items()},
                "time/step_s": time.time() - self.start}


def train_metrics(totals: dict, num_updates: int, lr: float, mismatch: bool) -> dict:
    """The step's train/* record from the reduced TRAIN_SUMS: means per token the loss counts (rejected
    ones left out) or per applied update; `mismatch` (the engine's log-probs are not pi_old): the
    rollout/* gap too (mismatch_sums)."""
    tokens = max(totals["tokens"], 1.0)
    applied = max(num_updates - totals["skipped"], 1.0)
    record = {
        "train/loss": totals["loss"] / applied,
        "train/entropy": totals["entropy"] / tokens,
        "train/clipfrac_low": totals["clip_low"] / tokens,
        "train/clipfrac_high": totals["clip_high"] / tokens,
        "train/grad_norm": totals["grad_norm"] / applied,
        "train/skipped_updates": totals["skipped"],
        "train/num_updates": num_updates,
        "train/lr": lr,
        "perf/pad_frac": 1 - totals["real_tokens"] / max(totals["forward_tokens"], 1.0),
    }
    if mismatch:
        compared = max(totals["compared"], 1.0)  # the tokens both could draw
        measured = max(totals["compared"] + totals["boundary"], 1.0)  # with those outside pi_old's nucleus
        record["rollout/logprob_diff"] = totals["logprob_diff"] / compared  # mean |log r|
        record["rollout/kl_k1"] = totals["kl_k1"] / compared  # KL(rollout || old)
        record["rollout/kl_k3"] = totals["kl_k3"] / compared
        record["rollout/nucleus_boundary_frac"] = totals["boundary"] / measured
    return record


# ------------------------------------------------------------------------------------------------------------
# 4. Rollout: G completions per prompt from the engine (engine.py), verified (verifier.py) and rewarded
#    (DAPO's shaped reward); dynamic sampling keeps the groups of mixed correctness, refilling up to a cap.
def pad_prompt_completion(prompts: list[list[int]], completions: list[list[int]], pad_id: int,
                          min_width: int = 1):
    """Left-pad prompts to P and right-pad completions to T >= min_width: input_ids and attention_mask
    (B, P+T), the completion mask (B, T) (1 = a real completion token, the final eos included)."""
    P = max(map(len, prompts))
    T = max(min_width, max(map(len, completions)))
    ids = torch.tensor([[pad_id] * (P - len(p)) + p + c + [pad_id] * (T - len(c))
                        for p, c in zip(prompts, completions)], dtype=torch.long)  # (B, P+T)
    attn = torch.tensor([[0] * (P - len(p)) + [1] * (len(p) + len(c)) + [0] * (T - len(c))
                         for p, c in zip(prompts, completions)], dtype=torch.long)  # (B, P+T)
    return ids, attn, attn[:, P:].clone()


def shaped_reward(correct: bool, length: int, max_new_tokens: int, overlong_buffer: int,
                  overlong_penalty: float = 1.0) -> float:
    """DAPO's reward: +1 correct, -1 otherwise, plus the soft overlong punishment, falling linearly from 0 at
    `max_new_tokens - overlong_buffer` tokens to -overlong_penalty at `max_new_tokens` (DAPO, Sec. 3.4)."""
    reward = 1.0 if correct else -1.0
    expected = max_new_tokens - overlong_buffer
    if overlong_buffer > 0 and length > expected:
        reward += max(-(length - expected) / overlong_buffer, -1.0) * overlong_penalty
    return reward


def roll_groups(engine, tok, problems: list[dict], cfg, G: int, temperature: float, top_p: float,
                seed: int | None = None):
    """G completions for each problem, verified and rewarded: a group per prompt; its "completions", "texts",
    "truncated", "correct", "reward" and "rollout_logp" (engine log-probs or None) are lists of G. `seed`:
    evaluation's (the engine seeds each request). Returns (groups, verify_batch's info + "seconds")."""
    prompt_ids = [p["prompt_ids"] for p in problems]  # tokenized once at load (tokenize_problems)
    completions, truncated, logps = engine.generate(
        prompt_ids, cfg.max_new_tokens, temperature, top_p, G, seed)
    texts = tok.batch_decode(completions, skip_special_tokens=True)
    t0 = time.perf_counter()
    answers = [p["answer"] for p in problems for _ in range(G)]
    correct, info = verify_batch(texts, answers, cfg.answer_format)
    info["seconds"] = time.perf_counter() - t0
    groups = []
    for i, p in enumerate(problems):
        s = slice(i * G, (i + 1) * G)
        rewards = [shaped_reward(c, len(ids), cfg.max_new_tokens, cfg.overlong_buffer,
                                 cfg.overlong_penalty)
                   for c, ids in zip(correct[s], completions[s])]
        groups.append({"prompt": p["prompt"],
                       "answer": p["answer"],
                       "level": p.get("level", 0),
                       "prompt_ids": prompt_ids[i],
                       "completions": completions[s],
                       "texts": texts[s],
                       "truncated": truncated[s],
                       "correct": correct[s],
                       "reward": rewards,
                       "rollout_logp": None if logps is None else logps[s]})
    return groups, info


def _mixed(group: dict) -> bool:
    """The groups DAPO keeps: 0 < #correct < G (correctness, never the shaped reward)."""
    return 0 < sum(group["correct"]) < len(group["correct"])


def _summary(group: dict, rank: int, index: int) -> dict:
    """What the other ranks need of a group to filter, count and plan it (no token ids, texts or log-probs),
    and where it lives: (the rank that generated it, its index there)."""
    return {"origin": (rank, index),
            "prompt": group["prompt"],
            "answer": group["answer"],
            "correct": group["correct"],
            "reward": group["reward"],
            "truncated": group["truncated"],
            "lengths": [len(c) for c in group["completions"]],
            "prompt_len": len(group["prompt_ids"])}


def dynamic_sampling(engine, tok, stream: PromptStream, cfg, dist_info: DistInfo):
    """DAPO's dynamic sampling: batches of fresh prompts, each rank its stride, until prompts_per_step
    groups of mixed correctness are kept across ranks; then exactly that many, or at the cap what was
    kept, cut to a multiple of the world size (possibly none, never an error). --no-dynamic_sampling:
    one batch, all kept. Groups stay where made; every rank gets every _summary(), and a kept one of
    this rank's holds its group under "group". Returns (kept summaries, all summaries, rollout
    metrics), or None if a stop came between two batches."""
    rank = dist_info.rank
    world = dist_info.world_size
    oversample = cfg.oversample if cfg.dynamic_sampling else 1
    batch_groups = math.ceil(cfg.prompts_per_step * oversample / world) * world  # prompts a batch
    max_batches = cfg.max_gen_batches if cfg.dynamic_sampling else 1
    my_groups = []  # the groups this rank generated, whole
    generated = []  # every group's summary, all ranks
    kept_summaries = []
    num_batches = 0
    verify_s = 0.0
    troubles = torch.zeros(2)  # the verifier's timeouts and refused answers on this rank
    while len(kept_summaries) < cfg.prompts_per_step and num_batches < max_batches:
        if num_batches and stop_requested():
            return None
        prompts = stream.next(batch_groups)[rank::world]
        mine, info = roll_groups(engine, tok, prompts, cfg, cfg.group_size, cfg.temperature, cfg.top_p)
        mine_summaries = [_summary(g, rank, len(my_groups) + i) for i, g in enumerate(mine)]
        summaries = all_gather_list(mine_summaries)
        my_groups += mine
        troubles += torch.tensor([info["timeouts"], info["refused"]])
        verify_s += info["seconds"]
        num_batches += 1
        generated += summaries
        kept_summaries += [g for g in summaries if not cfg.dynamic_sampling or _mixed(g)]
    num_kept = len(kept_summaries)
    usable = num_kept - num_kept % world  # an equal share per rank: FSDP's collectives in lockstep
    if num_kept < cfg.prompts_per_step:
        trained = f"all {usable}"
        if usable < num_kept:
            trained = f"{usable} (a multiple of the {world} ranks)"
        print0(f"warning: dynamic sampling kept {num_kept}/{cfg.prompts_per_step} groups after "
               f"{num_batches} generation batches (--max_gen_batches); training on {trained}")
    kept_summaries = kept_summaries[:min(cfg.prompts_per_step, usable)]
    for g in kept_summaries:
        if g["origin"][0] == rank:
            g["group"] = my_groups[g["origin"][1]]
    rewards = [r for g in generated for r in g["reward"]]
    correct = [c for g in generated for c in g["correct"]]
    truncated = [t for g in generated for t in g["truncated"]]
    lengths = [n for g in generated for n in g["lengths"]]
    timeouts, refused = all_reduce_sum(troubles).tolist()
    stats = {
        "train/reward": sum(rewards) / len(rewards),
        "train/acc": sum(correct) / len(correct),
        "train/keep_rate": sum(map(_mixed, generated)) / len(generated),
        "train/num_gen_batches": num_batches,
        "train/num_groups": len(kept_summaries),
        "train/num_completions": len(lengths),
        "train/response_len": sum(lengths) / len(lengths),
        "train/truncated_frac": sum(truncated) / len(truncated),
        "verify/timeouts": timeouts,
        "verify/refused": refused,
        "time/verify_s": verify_s,  # this rank's; it is part of time/rollout_s
    }
    if cfg.verifier_crosscheck and cfg.crosscheck_train:  # a sample of the step's completions
        t0 = time.perf_counter()
        per_rank = math.ceil(cfg.crosscheck_train / world)
        stats.update(crosscheck.check_groups(my_groups, cfg, "train", per_rank, rank))
        stats["time/crosscheck_s"] = time.perf_counter() - t0
    return kept_summaries, generated, stats


# ------------------------------------------------------------------------------------------------------------
# 5. The step's batch: plan_updates brings each rank its groups of each update; make_batch pads them into the
#    one dict the update reads; advantages; micro-batches. Its contract (B = this rank's groups x G):
#    input_ids, attention_mask  (B, P+T)  make_batch          prompt (left padded) + completion (right padded)
#    mask                       (B, T)    make_batch          1 = a token the loss counts; zeroed where
#                                                             rollout_correction rejects; daro.py: bins 0, G
#    reward, correct            (B,)      make_batch          DAPO's shaped reward; the verifier's verdict
#    group                      (B,)      make_batch          index of the row's group (prompt) on this rank
#    rollout_logp               (B, T)    make_batch          the engine's log-probs, when they are not pi_old
#    advantage                  (B,)      the script          GRPO advantage (group_advantages) [x DAA]
#    old_logp                   (B, T)    old_logprobs        pi_old [+ old_logp_nucleus with top_p < 1]
#    is_weight                  (B, T)    rollout_correction  the truncated pi_old / pi_rollout (--rollout_is)
#    rejected                   (B, T)    rollout_correction  --rollout_is_mask: tokens it took out of mask
#    weight                     (B, T)    the script          each token's share of its update's loss
#    bin                        (B,)      daro.py             #correct of the row's group (mu = bin / G)
def group_tokens(group: dict) -> int:
    """Tokens a group (or its _summary) puts through the trainer: its G prompt + completion rows."""
    return sum(group["prompt_len"] + n for n in group["lengths"])


def plan_updates(summaries: list[dict], num_updates: int, dist_info: DistInfo,
                 balance: bool = False):
    """This rank's groups in each optimizer update of the step, brought to it (one scatter per rank).
    `summaries`: the kept groups' (the same on every rank, a multiple of the world size). They make
    min(num_updates, groups / world) contiguous updates, their sizes multiples of the world size that
    differ by at most one group per rank: every group is trained once, no update is empty, also at the
    sampling cap. In an update each rank gets as many groups: every world-th, or with `balance`
    (_balanced_shares) as many tokens as can be. Returns (this rank's groups in update order, each
    update's rows in make_batch of them).
    Example, one rank, G = 8: 13 groups, 2 updates -> rows 0-55 (7 groups) and 56-103 (6)."""
    world = dist_info.world_size
    rank = dist_info.rank
    G = len(summaries[0]["correct"])
    blocks = len(summaries) // world  # groups per rank
    n = min(num_updates, blocks)
    plan = [[] for _ in range(world)]  # plan[r]: the indices rank r trains, in update order
    sizes = []  # groups per rank in each update
    start = 0
    for i in range(n):
        size = (blocks // n + (i < blocks % n)) * world
        part = list(range(start, start + size))
        start += size
        shares = [part[r::world] for r in range(world)]
        if balance and world > 1:
            shares = _balanced_shares(part, summaries, world)
        for r in range(world):
            plan[r] += shares[r]
        sizes.append(size // world)
    # a kept summary of this rank's holds its group (a test may plan whole groups, for any rank)
    mine = [summaries[j].get("group", summaries[j]) for j in plan[rank]]
    if is_dist():  # from each rank in turn, the groups it generated to the ranks that train them
        for src in range(world):
            made_by_src = [summaries[j]["origin"][0] == src for j in range(len(summaries))]
            send = None  # what src sends each rank: the groups src generated that the rank trains
            if rank == src:
                send = [[summaries[j]["group"] for j in plan[r] if made_by_src[j]]
                        for r in range(world)]
            got = [None]
            dist.scatter_object_list(got, send, src=src)
            arrived = iter(got[0])
            mine = [next(arrived) if made_by_src[j] else g for j, g in zip(plan[rank], mine)]
    bounds = [0] + [sum(sizes[:i + 1]) * G for i in range(len(sizes))]
    return mine, [torch.arange(a, b) for a, b in zip(bounds, bounds[1:])]


def _balanced_shares(part: list[int], summaries: list[dict], world: int) -> list[list[int]]:
    """The groups `part` (indices into `summaries`) dealt to `world` ranks, as many each: the heaviest
    first, each to the rank with the fewest tokens so far (sorted() is stable: every rank deals alike)."""
    shares = [[] for _ in range(world)]
    load = [0] * world  # tokens dealt to each rank
    per_rank = len(part) // world
    for j in sorted(part, key=lambda j: group_tokens(summaries[j]), reverse=True):
        open_ranks = [r for r in range(world) if len(shares[r]) < per_rank]
        r = min(open_ranks, key=lambda r: load[r])
        shares[r].append(j)
        load[r] += group_tokens(summaries[j])
    return shares


def make_batch(groups: list[dict], pad_id: int,
               device: torch.device = torch.device("cpu")) -> dict:
    """Flatten groups into the batch contract's padded tensors on `device` (T >= 2: _predicting_outputs)."""
    prompts = [g["prompt_ids"] for g in groups for _ in g["completions"]]
    completions = [c for g in groups for c in g["completions"]]
    ids, attn, mask = pad_prompt_completion(prompts, completions, pad_id, min_width=2)
    rewards = [r for g in groups for r in g["reward"]]
    correct = [c for g in groups for c in g["correct"]]
    group_of_row = [i for i, g in enumerate(groups) for _ in g["completions"]]
    batch = {"input_ids": ids,
             "attention_mask": attn,
             "mask": mask,
             "reward": torch.tensor(rewards),
             "correct": torch.tensor(correct, dtype=torch.bool),
             "group": torch.tensor(group_of_row)}
    if groups[0].get("rollout_logp") is not None:
        T = mask.shape[1]
        padded = [lp + [0.0] * (T - len(lp)) for g in groups for lp in g["rollout_logp"]]
        batch["rollout_logp"] = torch.tensor(padded)  # (B, T)
    return {k: v.to(device) for k, v in batch.items()}


def group_advantages(rewards: torch.Tensor, std_norm: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO's advantages from each group's rewards (N, G): (r - mean) / (std + eps), the unbiased std as in
    verl; Dr. GRPO: std_norm=False. Example: [1, -1, -1, 1] -> [0.866, -0.866, -0.866, 0.866]."""
    assert rewards.shape[-1] > 1, "group_size must be > 1 for group-relative advantages"
    centered = rewards - rewards.mean(-1, keepdim=True)
    if not std_norm:  # Dr. GRPO
        return centered
    return centered / (rewards.std(-1, keepdim=True) + eps)


def completion_lengths(batch: dict, rows: torch.Tensor) -> torch.Tensor:
    """Completion lengths (len(rows),), counted on the attention mask, not the loss mask: a trained token
    after a hole in that (tokens rollout_correction rejects, DARO's bins 0 and G) stays in the micro-batch."""
    P = batch["input_ids"].shape[1] - batch["mask"].shape[1]
    return batch["attention_mask"][rows, P:].sum(-1)


def _packed_rows(batch: dict, index: torch.Tensor, size: int,
                 max_tokens: int) -> list[torch.Tensor]:
    """The rows `index` in micro-batches. max_tokens = 0: chunks of `size` rows in order. Otherwise packed by
    length: rows sorted longest first, each micro-batch filled while its padded size (rows x (longest prompt +
    longest completion)) stays within max_tokens and it has at most `size` rows; then every rank splits its
    largest micro-batches until all make as many as the busiest one (FSDP: collectives must match)."""
    if max_tokens <= 0:
        return [index[s:s + size] for s in range(0, len(index), size)]
    P = batch["input_ids"].shape[1] - batch["mask"].shape[1]
    prompt_len = batch["attention_mask"][index, :P].sum(-1).tolist()
    completion_len = completion_lengths(batch, index).tolist()
    order = sorted(range(len(index)), key=lambda i: -(prompt_len[i] + completion_len[i]))
    chunks = []
    width = (0, 0)  # the longest prompt and completion of the current chunk
    for i in order:
        wider = (max(width[0], prompt_len[i]), max(width[1], completion_len[i]))
        too_wide = chunks and (len(chunks[-1]) + 1) * sum(wider) > max_tokens
        if not chunks or too_wide or len(chunks[-1]) >= size:
            chunks.append([])
            wider = (prompt_len[i], completion_len[i])
        chunks[-1].append(i)
        width = wider
    # the busiest rank's number of micro-batches (0: no rank has rows)
    count = int(all_reduce_max(torch.tensor(float(len(chunks)))).item())
    assert chunks or not count, ("a rank with no rows where another has some: "
                                 "plan_updates gives every rank as many")
    while len(chunks) < count:
        k = max(range(len(chunks)), key=lambda j: len(chunks[j]))
        half = len(chunks[k]) // 2
        chunks[k:k + 1] = [chunks[k][:half], chunks[k][half:]]
    return [index[torch.tensor(c, dtype=torch.long)] for c in chunks]


def micro_batches(batch: dict, index: torch.Tensor, size: int, max_tokens: int = 0):
    """The rows `index` of `batch` in micro-batches (_packed_rows), each with its empty padding columns
    trimmed away (the loss weights are global, so results are unchanged). Yields (rows, micro-batch)."""
    for rows in _packed_rows(batch, index, size, max_tokens):
        mb = {k: v[rows] for k, v in batch.items()}
        # the longest completion, >= 2 (_predicting_outputs)
        T = int(completion_lengths(batch, rows).max().clamp(min=2))
        P = batch["input_ids"].shape[1] - batch["mask"].shape[1]
        left_pads = (mb["attention_mask"][:, :P].cumsum(-1) == 0).sum(-1)  # (B,)
        shared_pad = int(left_pads.min())  # the left padding every row has
        for k in ("input_ids", "attention_mask"):
            mb[k] = mb[k][:, shared_pad:P + T]
        for k, v in mb.items():
            if v.dim() == 2 and k not in ("input_ids", "attention_mask"):
                mb[k] = v[:, :T]
        yield rows, mb


# ------------------------------------------------------------------------------------------------------------
# 6. pi and pi_old: the log-probs of a batch's completion tokens (modeling.token_logprobs: a group's prompt
#    once, the output layer in chunks); pi_old once per step, before the first update, unless exact.
def batch_logprobs(model, mb: dict, cfg, with_entropy: bool = False, with_nucleus: bool = False):
    """token_logprobs of a micro-batch's completion tokens at the rollout temperature: (logp (B, T), the
    entropy (with_entropy), the log-probs renormalised over the --top_p nucleus (with_nucleus), or None)."""
    T = mb["mask"].shape[1]
    top_p = cfg.top_p if with_nucleus else 1.0
    return token_logprobs(model, mb["input_ids"], mb["attention_mask"], T, cfg.temperature,
                          with_entropy, cfg.logprob_chunk, mb.get("group"), top_p, cfg.pack)


@torch.no_grad()
def old_logprobs(model, batch: dict, cfg, device: torch.device, exact: bool) -> dict:
    """pi_old: the engine's log-probs if exactly the trainer's (`exact`: our sampler in float32 at top_p = 1,
    the trainer's own weights and arithmetic), else recomputed before the step's first update. Returns new
    batch entries: old_logp (B, T) [with top_p < 1 also old_logp_nucleus (B, T), pi_old renormalised over its
    own nucleus, for the engine's nucleus samples]; an exact engine's rollout_logp becomes old_logp."""
    if exact:
        return {"old_logp": batch.pop("rollout_logp")}
    out = {"old_logp": torch.zeros_like(batch["mask"], dtype=torch.float)}  # (B, T)
    if cfg.top_p < 1:
        out["old_logp_nucleus"] = torch.zeros_like(out["old_logp"])
    for rows, mb in micro_batches(batch, torch.arange(len(batch["mask"])), cfg.micro_batch_size,
                                  cfg.micro_batch_tokens):
        with autocast(cfg.dtype, device):
            logp, nucleus_logp = batch_logprobs(model, mb, cfg, with_nucleus=cfg.top_p < 1)
        out["old_logp"][rows, :logp.shape[1]] = logp.float()
        if cfg.top_p < 1:
            out["old_logp_nucleus"][rows, :logp.shape[1]] = nucleus_logp.float()
    reshard(model)
    return out


# ------------------------------------------------------------------------------------------------------------
# 7. The update: each token's clipped surrogate (the papers agree on it), weighed and summed each script's way
#    (loss_weights; DARO's per-bin means times w_mu), one micro-batch's forward, the guarded optimizer step.
def loss_weights(mask: torch.Tensor, loss_agg: str, max_new_tokens: int) -> torch.Tensor:
    """Per-token weights (B, T): summed token losses give the chosen aggregation over the WHOLE update, the
    denominators spanning its micro-batches and ranks (verl's global token count), whatever the split.
      token-mean               1 / (#completion tokens)            DAPO
      seq-mean-token-mean      1 / (#sequences * |o_i|)            GRPO, GSPO
      seq-mean-token-sum-norm  1 / (#sequences * max_new_tokens)   Dr. GRPO (a constant, not batch lengths)"""
    mask = mask if mask.is_floating_point() else mask.float()  # a float64 mask stays float64
    if loss_agg == "token-mean":
        return mask / all_reduce_sum(mask.sum()).clamp(min=1)
    # sequences with a token to train on: one rollout correction rejected whole leaves the mean (verl #3915)
    num_seqs = all_reduce_sum((mask.sum(-1) > 0).sum().to(mask.dtype)).clamp(min=1)
    if loss_agg == "seq-mean-token-mean":
        return mask / (mask.sum(-1, keepdim=True).clamp(min=1) * num_seqs)
    if loss_agg == "seq-mean-token-sum-norm":
        return mask / (max_new_tokens * num_seqs)
    raise ValueError(f"unknown loss_agg {loss_agg!r}")


def policy_loss(logp, old_logp, advantages, mask, clip_low: float, clip_high: float, *,
                clip_ratio_c: float = 0.0, seq_ratio: bool = False, ref_logp=None,
                kl_coef: float = 0.0, is_weight=None):
    """Each token's loss (B, T): the clipped surrogate, in the inputs' dtype; the caller weighs and sums it.
      max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))          PPO/GRPO, DAPO's decoupled clip
      clip_ratio_c > 1 (dual clip): for A < 0 the loss is capped at -A * clip_ratio_c
      seq_ratio (GSPO): r_t = sg[s_i] * pi_t / sg[pi_t], s_i = exp(mean_t log(pi_t / pi_old_t)): every token
        of a completion shares the length-normalised sequence ratio; the whole sequence is clipped together
      is_weight (B, T): rollout_correction's pi_old / pi_rollout, on the surrogate only (as verl and TRL do)
      kl_coef > 0: + kl_coef * the k3 estimate of KL(pi || pi_ref)
    Returns (token losses (B, T), counts of `mask`'s tokens clipped below and above, for logging)."""
    mask = mask.to(logp.dtype)
    log_ratio = logp - old_logp  # (B, T)
    if seq_ratio:
        lengths = mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
        seq = (log_ratio * mask).sum(-1, keepdim=True) / lengths  # (B, 1)
        log_ratio = seq.detach() + logp - logp.detach()
    ratio = torch.exp(log_ratio.clamp(max=20.0))  # no exp overflow; such a ratio is clipped anyway
    adv = advantages.unsqueeze(-1)  # (B, 1)
    token_loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_low, 1 + clip_high))
    if clip_ratio_c > 1:
        capped = torch.minimum(token_loss, -adv * clip_ratio_c)
        token_loss = torch.where(adv < 0, capped, token_loss)
    if is_weight is not None:
        token_loss = token_loss * is_weight
    if kl_coef > 0:
        delta = ref_logp - logp
        token_loss = token_loss + kl_coef * (torch.exp(delta) - delta - 1)  # k3 estimator, >= 0
    with torch.no_grad():
        below = (ratio < 1 - clip_low) & (adv < 0)
        above = (ratio > 1 + clip_high) & (adv > 0)
        stats = {"clip_low": (below.float() * mask).sum(),
                 "clip_high": (above.float() * mask).sum()}
    return token_loss, stats


def mismatch_sums(mb: dict) -> dict:
    """The engine/trainer gap on a micro-batch's trained tokens (those --rollout_is_mask rejected too),
    log r = log pi_old - log pi_rollout. Returns sums of |log r| and of the k1 and k3 estimates of
    KL(rollout || old) over the tokens both could draw (`compared`), and the count of `boundary` tokens:
    in the engine's nucleus, outside pi_old's (docs/metrics.md: why they are counted apart)."""
    old = mb.get("old_logp_nucleus", mb["old_logp"])
    mask = mb["mask"].to(old.dtype)
    if "rejected" in mb:  # (disjoint from the mask: rollout_correction moved them out of it)
        mask = mask + mb["rejected"].to(old.dtype)
    boundary = mask * (old <= OUTSIDE_NUCLEUS)
    compared = mask - boundary
    log_r = (old - mb["rollout_logp"]) * compared
    return {
        "logprob_diff": log_r.abs().sum().item(),
        "kl_k1": -log_r.sum().item(),
        "kl_k3": ((torch.exp(log_r) - 1 - log_r) * compared).sum().item(),
        "compared": compared.sum().item(),
        "boundary": boundary.sum().item(),
    }


def token_losses(model, ref_model, mb: dict, cfg, device: torch.device, sums: Sums):
    """One micro-batch's forward: each token's loss (B, T) (policy_loss), for the script to weigh and sum; its
    entropy, clipped-token counts, tokens, padding and engine/trainer gap (mismatch_sums) go to `sums`."""
    with autocast(cfg.dtype, device):
        ref_logp = None
        # the initial model: a frozen copy, or with LoRA the model with its adapters off
        # (before pi's forward: see adapter_disabled)
        if ref_model is not None:
            with torch.no_grad(), adapter_disabled(ref_model):
                ref_logp = batch_logprobs(ref_model, mb, cfg)[0]
            if ref_model is not model:
                reshard(ref_model)
        logp, entropy = batch_logprobs(model, mb, cfg, with_entropy=True)
    if "rollout_logp" in mb:  # the engine vs the trainer, same weights
        sums.add(**mismatch_sums(mb))
    token_loss, clipped = policy_loss(
        logp, mb["old_logp"], mb["advantage"], mb["mask"], cfg.clip_low, cfg.clip_high,
        clip_ratio_c=cfg.clip_ratio_c, seq_ratio=cfg.seq_ratio, ref_logp=ref_logp, kl_coef=cfg.kl_coef,
        is_weight=mb.get("is_weight"))
    T = mb["mask"].shape[1]
    ran, real = forward_tokens(model, mb["attention_mask"], T, mb.get("group"), cfg.pack)
    sums.add(entropy=(entropy * mb["mask"]).sum().item(),
             clip_low=clipped["clip_low"].item(),
             clip_high=clipped["clip_high"].item(),
             tokens=mb["mask"].sum().item(),
             forward_tokens=ran,
             real_tokens=real)
    return token_loss


class UpdateGuard:
    """The optimizer step of one update, guarded: clip the global gradient norm and step, unless the loss or
    gradient is not finite on a rank; then every rank skips it, so one bad batch cannot poison the weights."""

    def __init__(self, max_bad_updates: int):
        self.max_bad = max_bad_updates
        self.in_a_row = 0  # skipped updates in a row

    def step(self, model, opt, grad_clip: float, loss_value: float, sums: Sums, where: str) -> bool:
        """Returns whether the update was applied; adds loss, grad_norm (or skipped) to `sums`."""
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        grad_norm = full_tensor(norm)  # the same global norm on every rank
        world = dist.get_world_size() if is_dist() else 1
        finite = all_reduce_sum(torch.tensor(float(math.isfinite(loss_value)))).item() == world
        applied = finite and bool(torch.isfinite(grad_norm))
        if applied:
            opt.step()
        opt.zero_grad(set_to_none=True)  # freed at once: no gradient lives through the next rollout
        if applied:
            sums.add(loss=loss_value, grad_norm=grad_norm.item() / world)
            self.in_a_row = 0
            return True
        sums.add(skipped=1.0 / world)
        self.in_a_row += 1
        print0(f"warning: {where}: non-finite loss or gradient; update skipped")
        if self.in_a_row >= self.max_bad:
            print0(f"error: {self.in_a_row} non-finite updates in a row (--max_bad_updates); stopping. "
                   f"Try a lower --lr, --dtype float32, or check the data.")
            raise SystemExit(1)
        return False


# ------------------------------------------------------------------------------------------------------------
# 8. Evaluation: avg@k (mean accuracy over k samples per problem), unbiased pass@k and maj@k (the majority
#    answer's accuracy), per difficulty level too; each --eval_data set with its own k (set@k).
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k, n samples, c correct: 1 - C(n-c, k) / C(n, k), a stable product (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def majority_correct(group: dict, answer_format: str) -> bool:
    """maj@k of one group: is the answer most of its samples give (equivalent answers as one; ties: the first
    seen, verifier.majority_vote) correct? The winner's own verdict decides: nothing is verified twice."""
    index, _ = majority_vote([extract_answer(t, answer_format) for t in group["texts"]])
    return index is not None and bool(group["correct"][index])


@torch.no_grad()
def evaluate(engine, tok, problems: list[dict], cfg, rank: int = 0, world_size: int = 1,
             k: int = 0) -> dict:
    """k completions per problem (0: cfg.eval_samples) from a private seeded stream: the same weights get the
    same score. Returns eval/acc (avg@k), eval/pass@j (j = 1, 2, 4, ...), eval/maj@k, eval/acc_level<l>."""
    n = k or cfg.eval_samples
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    seed = cfg.seed + 7919 * (rank + 1)
    with torch.random.fork_rng(devices=devices):  # our sampler's RNG; training's stays untouched
        torch.manual_seed(seed)
        groups = []
        mine = problems[rank::world_size]  # this rank's stride of the eval set
        for s in range(0, len(mine), cfg.eval_batch_size):
            batch = mine[s:s + cfg.eval_batch_size]
            batch_seed = 1_000_003 * seed + s
            groups += roll_groups(engine, tok, batch, cfg, n, cfg.eval_temperature, cfg.eval_top_p,
                                  seed=batch_seed)[0]
    # per problem, all ranks: (samples, correct ones, level, is the majority answer correct)
    results = all_gather_list([(len(g["correct"]), sum(g["correct"]), g["level"],
                                majority_correct(g, cfg.answer_format)) for g in groups])
    out = {"eval/acc": sum(c for _, c, _, _ in results) / sum(m for m, _, _, _ in results)}
    j = 1
    while j <= n:
        out[f"eval/pass@{j}"] = sum(pass_at_k(m, c, j) for m, c, _, _ in results) / len(results)
        j *= 2
    out[f"eval/maj@{n}"] = sum(maj for *_, maj in results) / len(results)
    for level in sorted({lv for _, _, lv, _ in results}):
        sel = [(m, c) for m, c, lv, _ in results if lv == level]
        out[f"eval/acc_level{level}"] = sum(c for _, c in sel) / sum(m for m, _ in sel)
    if cfg.verifier_crosscheck:  # every completion, on every rank
        checks = crosscheck.check_groups(groups, cfg, "eval", rank=rank)
        for key, value in checks.items():  # the disagreements keep their name: Logger writes them
            out[key if key == "crosscheck_samples" else "eval/" + key] = value
    return out


def evaluate_sets(engine, tok, eval_sets: dict[str, list[dict]], cfg, rank: int = 0,
                  world_size: int = 1) -> dict:
    """evaluate() on each eval set with its own k (--eval_data set@k, else --eval_samples), as eval/<set>/...;
    the headline eval/acc, eval/pass@j, eval/maj@k, eval/acc_level<l>: means over the sets with the key."""
    ks = [k for _, k in parse_eval_data(cfg.eval_data, cfg.eval_samples)]
    out = {}
    per_set = []  # each set's scores
    samples = []  # the cross-check's disagreements, all sets
    for (name, problems), k in zip(eval_sets.items(), ks):
        scores = evaluate(engine, tok, problems, cfg, rank, world_size, k)
        disagreements = scores.pop("crosscheck_samples", [])
        samples += [{**row, "where": f"eval/{name}"} for row in disagreements]
        per_set.append(scores)
        out.update({key.replace("eval/", f"eval/{name}/", 1): v for key, v in scores.items()})
    every_key = dict.fromkeys(key for scores in per_set for key in scores)  # in first-seen order
    for key in every_key:
        values = [s[key] for s in per_set if key in s]
        out[key] = sum(values) / len(values)
    if cfg.verifier_crosscheck:
        out["crosscheck_samples"] = samples  # written by Logger.log, never a metric
    return out
