"""
The RL step both scripts share, in the order the loop takes it: every part of one step that no
equation of DA3PO or DARO points at. Read it after a script's main().
The files around it are to look up when needed: config.py (the flags), ranks.py (processes,
collectives, stop signals), modeling.py (loading, sharding), dataset.py (problems, prompts, eval
sets), engine.py (rollout engines), bookkeeping.py (start-up, records, checkpoints) and
verifier.py. The rooms a run may add reach it through one line each: shortcuts.py, lora.py,
vllm_engine.py, partial.py, entropy_control.py.

   1. the algorithm's hooks                   5. pi and pi_old: log-probs of the completions
   2. the step's record and its metrics       6. the token losses and the guarded update
   3. rollout, rewards, dynamic sampling      7. evaluation (avg@k, pass@k, maj@k)
   4. the update plan and the batch (its contract)

Shapes in comments: B = completions on this rank, G = group size, N = groups (B = N * G), P =
prompt tokens (left padded), T = completion tokens (right padded), V = vocabulary, H = hidden size.
"""
import contextlib
import math
import time

import torch
import torch.distributed as dist

import crosscheck
import entropy_control
import shortcuts
from dataset import PromptStream
from lora import adapter_disabled
from modeling import OUTSIDE_NUCLEUS, autocast, full_tensor, nucleus, positions, reshard
from ranks import (DistInfo, all_gather_list, all_reduce_max, all_reduce_sum, is_dist, print0,
                   stop_requested)
from verifier import extract_answer, majority_vote, verify_batch


# --------------------------------------------------------------------------------------------------
# 1. The algorithm's hooks: what main() calls on a script's algorithm (DAA, DARO),
#    in the loop's order.
class Algorithm:
    """The paper's part of the step: main() calls these hooks, in this order. Each default is the
    baselines' way (GRPO's advantages, --loss_agg's token weights) or does nothing.

      algo = DAA(cfg, device, state)        # once; state: a checkpoint's state_dict(), else {}
      algo.after_rollout(generated)         # each step: every generated group's summary
      algo.advantages(batch, groups)        # (B,); may add batch entries (the batch contract)
      algo.start_update(batch, rows)        # before each update: its tokens' shares (rows, T)
      algo.loss(token_loss, mb)             # each micro-batch: token losses (B, T) -> a scalar
      algo.after_update()                   # after each applied optimizer step
      algo.end_step()                       # each step, last: its metrics; its step sums restart
      algo.line(record)                     # its part of the step's printed line
      algo.state_dict()                     # each checkpoint
      algo.step_state(); algo.load_step_state(state)   # a stop between two updates; its resume

    Every rank calls each hook at the same point, so a hook may all-reduce (torchrun's lockstep).
    The papers' functions that a hook calls return this rank's sums, and the hook reduces them.
    """

    def __init__(self, cfg, device: torch.device, state: dict):
        self.cfg = cfg
        self.device = device

    def after_rollout(self, generated: list[dict]):
        """Sees every group generated this step, kept or not (summaries, all ranks')."""

    def advantages(self, batch: dict, groups: list[dict]) -> torch.Tensor:
        """The advantages (B,) of this rank's batch, made of `groups`. May add or change entries of
        `batch` (its contract). Default: GRPO's (--no-std_norm: Dr. GRPO's)."""
        G = self.cfg.group_size
        return group_advantages(batch["reward"].view(-1, G), self.cfg.std_norm).flatten()

    def start_update(self, batch: dict, rows: torch.Tensor) -> torch.Tensor:
        """Starts the update of `rows`: each token's share (len(rows), T) of its loss.
        Default: --loss_agg's."""
        return loss_weights(batch["mask"][rows], self.cfg.loss_agg, self.cfg.max_new_tokens)

    def loss(self, token_loss: torch.Tensor, mb: dict) -> torch.Tensor:
        """A micro-batch's loss from its token losses (B, T). Default: their weighted sum."""
        return (token_loss * mb["weight"]).sum()

    def after_update(self):
        """Runs after each applied optimizer step (a skipped, non-finite update calls nothing)."""

    def end_step(self) -> dict:
        """Ends the step: the algorithm's keys of its record; its sums over the step restart."""
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


# --------------------------------------------------------------------------------------------------
# 2. The step's record: sums over micro-batches and updates on each rank, then over ranks in one
#    all-reduce (Sums), and each phase's seconds (StepTimer); train_metrics makes the metrics.
class Sums:
    """Named sums on this rank; reduce() sums each over all ranks (which hold the same names)."""

    def __init__(self, *names: str):
        self.values = dict.fromkeys(names, 0.0)  # name -> this rank's sum

    def add(self, **amounts: float):
        for name, amount in amounts.items():
            self.values[name] += float(amount)

    def reduce(self) -> dict:
        mine = torch.tensor(list(self.values.values()))  # float32, like every logged sum
        totals = all_reduce_sum(mine)
        return dict(zip(self.values, totals.tolist()))


TRAIN_SUMS = ("loss", "entropy", "clip_low", "clip_high", "grad_norm", "tokens", "skipped",
              "logprob_diff", "kl_k1", "kl_k3", "compared", "boundary",
              "forward_tokens", "real_tokens")


class StepTimer:
    """`with timer("rollout"): ...` times a phase; metrics(): time/<phase>_s and time/step_s."""

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
    """The step's train/* record from the reduced TRAIN_SUMS: means per token the loss counts
    (rejected ones left out) or per applied update; `mismatch` (the engine's log-probs are not
    pi_old): the rollout/* gap too (mismatch_sums)."""
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
        record.update(mismatch_metrics(totals))
    return record


def mismatch_metrics(totals: dict) -> dict:
    """The engine/trainer gap's rollout/* metrics from the reduced sums of mismatch_sums."""
    compared = max(totals["compared"], 1.0)  # the tokens both could draw
    # with the tokens outside pi_old's nucleus
    measured = max(totals["compared"] + totals["boundary"], 1.0)
    return {"rollout/logprob_diff": totals["logprob_diff"] / compared,  # mean |log r|
            "rollout/kl_k1": totals["kl_k1"] / compared,  # KL(rollout || old)
            "rollout/kl_k3": totals["kl_k3"] / compared,
            "rollout/nucleus_boundary_frac": totals["boundary"] / measured}


# --------------------------------------------------------------------------------------------------
# 3. Rollout: G completions per prompt from the engine (engine.py), verified (verifier.py)
#    and rewarded (DAPO's shaped reward); dynamic sampling keeps the groups of mixed correctness,
#    refilling up to a cap.
def pad_prompt_completion(prompts: list[list[int]], completions: list[list[int]], pad_id: int,
                          min_width: int = 1):
    """Left-pad prompts to P and right-pad completions to T >= min_width: input_ids and
    attention_mask (B, P+T), the completion mask (B, T) (1 = a real completion token, the final
    eos included)."""
    P = max(map(len, prompts))
    T = max(min_width, max(map(len, completions)))
    ids = torch.tensor([[pad_id] * (P - len(p)) + p + c + [pad_id] * (T - len(c))
                        for p, c in zip(prompts, completions)], dtype=torch.long)  # (B, P+T)
    attn = torch.tensor([[0] * (P - len(p)) + [1] * (len(p) + len(c)) + [0] * (T - len(c))
                         for p, c in zip(prompts, completions)], dtype=torch.long)  # (B, P+T)
    return ids, attn, attn[:, P:].clone()


def shaped_reward(correct: bool, length: int, max_new_tokens: int, overlong_buffer: int,
                  overlong_penalty: float = 1.0) -> float:
    """DAPO's reward: +1 correct, -1 otherwise, plus the soft overlong punishment, falling linearly
    from 0 at `max_new_tokens - overlong_buffer` tokens to -overlong_penalty at `max_new_tokens`
    (DAPO, Sec. 3.4)."""
    reward = 1.0 if correct else -1.0
    expected = max_new_tokens - overlong_buffer
    if overlong_buffer > 0 and length > expected:
        reward += max(-(length - expected) / overlong_buffer, -1.0) * overlong_penalty
    return reward


def roll_groups(engine, tok, problems: list[dict], cfg, G: int, temperature: float, top_p: float,
                seed: int | None = None):
    """G completions for each problem, verified and rewarded: a group per prompt; its "completions",
    "texts", "truncated", "correct", "reward" and "rollout_logp" (engine log-probs or None) are
    lists of G. `seed`: evaluation's (the engine seeds each request). Returns (groups,
    verify_batch's info + "seconds")."""
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
    """What the other ranks need of a group to filter, count and plan it (no token ids, texts or
    log-probs), and where it lives: (the rank that generated it, its index there)."""
    return {"origin": (rank, index),
            "prompt": group["prompt"],
            "answer": group["answer"],
            "correct": group["correct"],
            "reward": group["reward"],
            "truncated": group["truncated"],
            "lengths": [len(c) for c in group["completions"]],
            "prompt_len": len(group["prompt_ids"])}


def dynamic_sampling(engine, tok, stream: PromptStream, cfg, dist_info: DistInfo):
    """DAPO's dynamic sampling: batches of fresh prompts, each rank its stride, until
    prompts_per_step groups of mixed correctness are kept across ranks; then exactly that many, or
    at the cap what was kept, cut to a multiple of the world size (possibly none, never an error).
    --no-dynamic_sampling: one batch, all kept. Groups stay where made; every rank gets every
    _summary(), and a kept one of this rank's holds its group under "group". Returns (kept
    summaries, all summaries, rollout metrics), or None if a stop came between two batches."""
    if cfg.max_staleness > 0:  # the engine carries unfinished groups over: partial.py
        return engine.carried_sampling(tok, stream, cfg, dist_info)
    rank = dist_info.rank
    world = dist_info.world_size
    oversample = cfg.oversample if cfg.dynamic_sampling else 1
    batch_groups = math.ceil(cfg.prompts_per_step * oversample / world) * world  # prompts a batch
    max_batches = cfg.max_gen_batches if cfg.dynamic_sampling else 1
    my_groups = []  # the groups this rank generated, whole
    generated = []  # every group's summary, all ranks
    kept_summaries = []
    num_batches = 0
    verify = {"timeouts": 0, "refused": 0, "seconds": 0.0}  # the verifier on this rank
    while len(kept_summaries) < cfg.prompts_per_step and num_batches < max_batches:
        if num_batches and stop_requested():
            return None
        prompts = stream.next(batch_groups)[rank::world]
        mine, info = roll_groups(engine, tok, prompts, cfg, cfg.group_size, cfg.temperature,
                                 cfg.top_p)
        mine_summaries = [_summary(g, rank, len(my_groups) + i) for i, g in enumerate(mine)]
        summaries = all_gather_list(mine_summaries)
        my_groups += mine
        for key in verify:
            verify[key] += info[key]
        num_batches += 1
        generated += summaries
        kept_summaries += [g for g in summaries if not cfg.dynamic_sampling or _mixed(g)]
    num_kept = len(kept_summaries)
    usable = num_kept - num_kept % world  # an equal share per rank: FSDP's collectives in lockstep
    if num_kept < cfg.prompts_per_step:
        _warn_at_cap(num_kept, usable, num_batches, cfg.prompts_per_step, world)
    kept_summaries = kept_summaries[:min(cfg.prompts_per_step, usable)]
    for g in kept_summaries:
        if g["origin"][0] == rank:
            g["group"] = my_groups[g["origin"][1]]
    stats = rollout_metrics(generated, len(kept_summaries), num_batches, verify)
    if cfg.verifier_crosscheck and cfg.crosscheck_train:  # a sample of the step's completions
        stats.update(crosscheck.check_train_groups(my_groups, cfg, rank, world))
    return kept_summaries, generated, stats


def _warn_at_cap(num_kept: int, usable: int, num_batches: int, wanted: int, world: int):
    """Dynamic sampling stopped at --max_gen_batches short of the groups it wanted: say so."""
    trained = f"all {usable}" if usable == num_kept else f"{usable} (a multiple of {world} ranks)"
    print0(f"warning: dynamic sampling kept {num_kept}/{wanted} groups after {num_batches} "
           f"generation batches (--max_gen_batches); training on {trained}")


def rollout_metrics(generated: list[dict], num_kept: int, num_batches: int, verify: dict) -> dict:
    """The step's rollout metrics (train/reward, train/acc, train/keep_rate, ...) over every
    generated group of every rank (their summaries); `verify`: this rank's verifier timeouts,
    refusals and seconds."""
    rewards = [r for g in generated for r in g["reward"]]
    correct = [c for g in generated for c in g["correct"]]
    truncated = [t for g in generated for t in g["truncated"]]
    lengths = [n for g in generated for n in g["lengths"]]
    troubles = torch.tensor([verify["timeouts"], verify["refused"]], dtype=torch.float)
    timeouts, refused = all_reduce_sum(troubles).tolist()
    return {
        "train/reward": sum(rewards) / len(rewards),
        "train/acc": sum(correct) / len(correct),
        "train/keep_rate": sum(map(_mixed, generated)) / len(generated),
        "train/num_gen_batches": num_batches,
        "train/num_groups": num_kept,
        "train/num_completions": len(lengths),
        "train/response_len": sum(lengths) / len(lengths),
        "train/truncated_frac": sum(truncated) / len(truncated),
        "verify/timeouts": timeouts,
        "verify/refused": refused,
        "time/verify_s": verify["seconds"],  # this rank's; it is part of time/rollout_s
    }


# --------------------------------------------------------------------------------------------------
# 4. The step's batch: plan_updates brings each rank its groups of each update; make_batch pads
#    them into the one dict the update reads; micro_batches cuts it. Its contract, B = this rank's
#    groups x G (entry, shape, who writes it, what it holds):
#    input_ids       (B, P+T)  make_batch          prompt (left padded) + completion (right padded)
#    attention_mask  (B, P+T)  make_batch          1 = a real token
#    mask            (B, T)    make_batch          1 = a token the loss counts (zeroed by
#                                                  rollout_correction and DARO.advantages)
#    reward, correct (B,)      make_batch          DAPO's shaped reward; the verifier's verdict
#    group           (B,)      make_batch          index of the row's group (prompt) on this rank
#    rollout_logp    (B, T)    make_batch          the engine's log-probs, when they are not pi_old
#    advantage       (B,)      algo.advantages     GRPO's advantage (group_advantages) [x DAA]
#    old_logp        (B, T)    old_logprobs        pi_old [+ old_logp_nucleus with top_p < 1]
#    is_weight       (B, T)    rollout_correction  the truncated pi_old / pi_rollout (--rollout_is)
#    rejected        (B, T)    rollout_correction  --rollout_is_mask: the tokens it took out of mask
#    weight          (B, T)    algo.start_update   each token's share of its update's loss
#    bin             (B,)      DARO.advantages     #correct of the row's group (mu = bin / G)
#    amplified       (B,)      DAA.advantages      the rows whose advantage DAA scaled
#    control         (B, T)    entropy_update      the tokens an entropy control acts on
def plan_updates(summaries: list[dict], num_updates: int, dist_info: DistInfo,
                 balance: bool = False):
    """This rank's groups in each optimizer update of the step, brought to it (one scatter per
    rank). `summaries`: the kept groups' (the same on every rank, a multiple of the world size).
    They make min(num_updates, groups / world) contiguous updates, their sizes multiples of the
    world size that differ by at most one group per rank: every group is trained once, no update is
    empty, also at the sampling cap. In an update each rank gets as many groups: every world-th, or
    with `balance` as many tokens as can be (shortcuts.balanced_shares). Returns (this rank's
    groups in update order, each update's rows in make_batch of them).
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
            shares = shortcuts.balanced_shares(part, summaries, world)
        for r in range(world):
            plan[r] += shares[r]
        sizes.append(size // world)
    # a kept summary of this rank's holds its group (a test may plan whole groups, for any rank)
    mine = [summaries[j].get("group", summaries[j]) for j in plan[rank]]
    if is_dist():  # the groups other ranks generated, brought here
        mine = _bring_groups(summaries, plan, mine, rank, world)
    bounds = [0] + [sum(sizes[:i + 1]) * G for i in range(len(sizes))]
    return mine, [torch.arange(a, b) for a, b in zip(bounds, bounds[1:])]


def _bring_groups(summaries: list[dict], plan: list[list[int]], mine: list[dict], rank: int,
                  world: int):
    """This rank's groups in plan order, each brought from the rank that generated it: from each
    rank in turn, one scatter of what it sends every rank (the groups it generated that the
    rank trains)."""
    for src in range(world):
        made_by_src = [summaries[j]["origin"][0] == src for j in range(len(summaries))]
        send = None
        if rank == src:
            send = [[summaries[j]["group"] for j in plan[r] if made_by_src[j]]
                    for r in range(world)]
        got = [None]
        dist.scatter_object_list(got, send, src=src)
        arrived = iter(got[0])
        mine = [next(arrived) if made_by_src[j] else g for j, g in zip(plan[rank], mine)]
    return mine


def make_batch(groups: list[dict], pad_id: int,
               device: torch.device = torch.device("cpu")) -> dict:
    """Flatten groups into the batch contract's padded tensors on `device` (T >= 2 columns)."""
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
    """GRPO's advantages from each group's rewards (N, G): (r - mean) / (std + eps), the unbiased
    std as in verl; Dr. GRPO: std_norm=False. Example: [1, -1, -1, 1] -> [0.866, -0.866,
    -0.866, 0.866]."""
    assert rewards.shape[-1] > 1, "group_size must be > 1 for group-relative advantages"
    centered = rewards - rewards.mean(-1, keepdim=True)
    if not std_norm:  # Dr. GRPO
        return centered
    return centered / (rewards.std(-1, keepdim=True) + eps)


def micro_batches(batch: dict, index: torch.Tensor, size: int, max_tokens: int = 0):
    """The rows `index` of `batch` in micro-batches of `size` rows (max_tokens > 0: packed by
    length, shortcuts.token_budget_rows), each with its empty padding columns trimmed away (the loss
    weights are global, so results are unchanged). Yields (rows, micro-batch)."""
    chunks = [index[s:s + size] for s in range(0, len(index), size)]
    if max_tokens > 0:  # --micro_batch_tokens
        chunks = shortcuts.token_budget_rows(batch, index, size, max_tokens)
    P = batch["input_ids"].shape[1] - batch["mask"].shape[1]
    for rows in chunks:
        mb = {k: v[rows] for k, v in batch.items()}
        # the longest completion (>= 2), by the attention mask: a trained token after a hole in the
        # loss mask (rollout_correction's rejections, DARO's bins 0 and G) stays in
        T = int(batch["attention_mask"][rows, P:].sum(-1).max().clamp(min=2))
        left_pads = (mb["attention_mask"][:, :P].cumsum(-1) == 0).sum(-1)  # (B,)
        shared_pad = int(left_pads.min())  # the left padding every row has
        for k in ("input_ids", "attention_mask"):
            mb[k] = mb[k][:, shared_pad:P + T]
        for k, v in mb.items():
            if v.dim() == 2 and k not in ("input_ids", "attention_mask"):
                mb[k] = v[:, :T]
        yield rows, mb


# --------------------------------------------------------------------------------------------------
# 5. pi and pi_old: a batch's completion log-probs from one padded forward (token_logprobs); pi_old
#    once per step, before the first update, unless the engine's are exact; the rollout correction.
def token_logprobs(model, input_ids, attention_mask, T: int, temperature: float = 1.0,
                   with_entropy: bool = False, top_p: float = 1.0):
    """log pi (B, T) of each row's last T tokens at `temperature`, from one forward of the padded
    rows, and a second (B, T) output: the entropy (with_entropy, with its gradient), the log-probs
    renormalised over the top_p nucleus as a sampler returns them (top_p < 1, no gradient), or None.
    Example: a row [pad, p1, p2, c1, c2] with T = 2: the outputs at p2 and c1 predict c1 and c2."""
    position_ids = positions(attention_mask)  # 0 at each row's first real token
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=T + 1)
    logits = out.logits[:, :-1]  # (B, T, V): the position before each completion token predicts it
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32 at least
    logits = logits / temperature  # the distribution the engine sampled from
    targets = input_ids[:, -T:, None]  # (B, T, 1)
    lse = logits.logsumexp(-1)  # (B, T)
    logp = logits.gather(-1, targets)[..., 0] - lse  # the log-softmax at the targets
    if with_entropy:  # H = lse - sum_v p_v logit_v (differentiable: --entropy_coef's bonus)
        return logp, lse - (logits.softmax(-1) * logits).sum(-1)
    if top_p < 1:  # (OUTSIDE_NUCLEUS, not -inf: a masked-out padding token multiplies to 0)
        with torch.no_grad():
            nucleus_logp = nucleus(logits.log_softmax(-1), top_p).log_softmax(-1)  # (B, T, V)
            return logp, nucleus_logp.gather(-1, targets)[..., 0].clamp(min=OUTSIDE_NUCLEUS)
    return logp, None


def batch_logprobs(model, mb: dict, cfg, with_entropy: bool = False, with_nucleus: bool = False):
    """token_logprobs of a micro-batch's completion tokens at the rollout temperature: (logp (B, T),
    the entropy (with_entropy), the log-probs renormalised over the --top_p nucleus (with_nucleus),
    or None)."""
    T = mb["mask"].shape[1]
    top_p = cfg.top_p if with_nucleus else 1.0
    if cfg.logprob_path == "shortcuts":  # the same numbers, with less time and memory at scale
        return shortcuts.token_logprobs(model, mb["input_ids"], mb["attention_mask"], T,
                                        cfg.temperature, with_entropy, cfg.logprob_chunk,
                                        mb.get("group"), top_p, cfg.pack)
    return token_logprobs(model, mb["input_ids"], mb["attention_mask"], T, cfg.temperature,
                          with_entropy, top_p)


def old_logprobs(model, batch: dict, cfg, device: torch.device, engine, groups: list) -> dict:
    """pi_old, new batch entries: the engine's log-probs where they are pi_old, else recomputed."""
    if engine.exact_logprobs:  # our float32 sampler at top_p = 1: the trainer's own arithmetic
        return {"old_logp": batch.pop("rollout_logp")}
    if cfg.max_staleness > 0:  # carried-over rollouts: partial.py recomputes where `groups` need it
        return engine.carried_old_logprobs(model, batch, groups, cfg, device)
    return recompute_old_logprobs(model, batch, cfg, device)


@torch.no_grad()
def recompute_old_logprobs(model, batch: dict, cfg, device: torch.device) -> dict:
    """pi_old by the trainer before the step's first update: old_logp (B, T) [with top_p < 1 also
    old_logp_nucleus (B, T), pi_old renormalised over its own nucleus, as the engine's are]."""
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


def rollout_correction(batch: dict, cfg) -> dict:
    """Weigh each token's clipped surrogate (policy_loss's is_weight) by w = pi_old / pi_rollout,
    detached and truncated, as the engine does not sample from pi_old exactly:
      token      w_t = exp(log pi_old_t - log pi_rollout_t)
      sequence   w_i = exp(sum_t (log pi_old_t - log pi_rollout_t)), on each of its tokens
    Truncation (default): w <- min(w, C), C = --rollout_is_cap. With --rollout_is_mask, tokens
    (sequences) with w outside [1/C, C] are rejected instead: batch["mask"] drops them from the
    loss and its denominators, batch["rejected"] keeps them for mismatch_sums. With top_p < 1,
    pi_old is renormalised over its own nucleus (old_logp_nucleus), as the engine's log-probs are.
    docs/gpu.md, "Rollout/trainer mismatch": why each choice, and how verl and TRL differ.

    Sets batch["is_weight"] (B, T); returns the rollout_is/* metrics ({} for an exact
    engine's batch).
    """
    if "rollout_logp" not in batch:  # the engine's log-probs were pi_old itself: weights of 1
        return {}
    mask = batch["mask"].to(batch["old_logp"].dtype)  # (B, T), before rejection
    old_logp = batch.get("old_logp_nucleus", batch["old_logp"])
    log_r = (old_logp - batch["rollout_logp"]) * mask  # (B, T)
    if cfg.rollout_is == "sequence":
        # the sequence's log ratio on each of its tokens
        log_r = log_r.sum(-1, keepdim=True).expand_as(mask)
    raw = torch.exp(log_r.clamp(-20, 20))  # (B, T)
    cap = cfg.rollout_is_cap
    if cfg.rollout_is_mask:
        outside = (raw > cap) | (raw < 1 / cap)
        # out of the loss, still in the mismatch metrics
        batch["rejected"] = batch["mask"].bool() & outside
        batch["mask"] = batch["mask"] * ~outside
        weight = raw
    else:
        outside = raw > cap
        weight = raw.clamp(max=cap)
    batch["is_weight"] = (weight * mask).detach()
    tokens = all_reduce_sum(mask.sum()).clamp(min=1)
    kept = batch["mask"].to(mask.dtype)
    weight_sum = all_reduce_sum((weight * kept).sum())
    weight_mean = weight_sum / all_reduce_sum(kept.sum()).clamp(min=1)
    weight_max = all_reduce_max((weight * kept).max())
    outside_frac = all_reduce_sum((outside * mask).sum()) / tokens
    outside_key = "rollout_is/masked_frac" if cfg.rollout_is_mask else "rollout_is/truncated_frac"
    return {"rollout_is/weight_mean": weight_mean.item(),
            "rollout_is/weight_max": weight_max.item(),
            outside_key: outside_frac.item()}


# --------------------------------------------------------------------------------------------------
# 6. The update: each token's clipped surrogate (the papers agree on it),
#    weighed and summed each script's way (loss_weights; DARO's per-bin means times w_mu),
#    one micro-batch's forward, the guarded optimizer step.
def loss_weights(mask: torch.Tensor, loss_agg: str, max_new_tokens: int) -> torch.Tensor:
    """Per-token weights (B, T): summed token losses give the chosen aggregation over the WHOLE
    update, the denominators spanning its micro-batches and ranks (verl's global token count),
    whatever the split.
      token-mean               1 / (#completion tokens)            DAPO
      seq-mean-token-mean      1 / (#sequences * |o_i|)            GRPO, GSPO
      seq-mean-token-sum-norm  1 / (#sequences * max_new_tokens)   Dr. GRPO (a constant)"""
    mask = mask if mask.is_floating_point() else mask.float()  # a float64 mask stays float64
    if loss_agg == "token-mean":
        return mask / all_reduce_sum(mask.sum()).clamp(min=1)
    # sequences with a token to train on: one rollout correction rejected whole leaves the mean
    # (verl #3915)
    num_seqs = all_reduce_sum((mask.sum(-1) > 0).sum().to(mask.dtype)).clamp(min=1)
    if loss_agg == "seq-mean-token-mean":
        return mask / (mask.sum(-1, keepdim=True).clamp(min=1) * num_seqs)
    if loss_agg == "seq-mean-token-sum-norm":
        return mask / (max_new_tokens * num_seqs)
    raise ValueError(f"unknown loss_agg {loss_agg!r}")


def policy_loss(logp, old_logp, advantages, mask, clip_low: float, clip_high: float, *,
                clip_ratio_c: float = 0.0, seq_ratio: bool = False, ref_logp=None,
                kl_coef: float = 0.0, is_weight=None):
    """Each token's loss (B, T): the clipped surrogate, in the inputs' dtype; the caller weighs and
    sums it.
      max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))   PPO/GRPO, DAPO's decoupled clip
      clip_ratio_c > 1 (dual clip): for A < 0 the loss is capped at -A * clip_ratio_c
      seq_ratio (GSPO): r_t = sg[s_i] * pi_t / sg[pi_t], s_i = exp(mean_t log(pi_t / pi_old_t)):
        every token of a completion shares the length-normalised sequence ratio, clipped together
      is_weight (B, T): rollout_correction's pi_old / pi_rollout, on the surrogate only (as verl
        and TRL do)
      kl_coef > 0: + kl_coef * the k3 estimate of KL(pi || pi_ref)
    Returns (token losses (B, T), counts of `mask`'s tokens clipped below and above: logged)."""
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
    """The engine/trainer gap on a micro-batch's trained tokens (those --rollout_is_mask rejected
    too), log r = log pi_old - log pi_rollout. Returns sums of |log r| and of the k1 and k3
    estimates of KL(rollout || old) over the tokens both could draw (`compared`), and the count of
    `boundary` tokens: in the engine's nucleus, outside pi_old's (docs/metrics.md: why they are
    counted apart)."""
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
    """One micro-batch's forward: each token's loss (B, T) (policy_loss), for the script to weigh
    and sum; its entropy, clipped-token counts, tokens, padding and engine/trainer gap
    (mismatch_sums) go to `sums`."""
    with autocast(cfg.dtype, device):
        # --kl_coef > 0: the KL anchor's log-probs
        ref_logp = None if ref_model is None else ref_logprobs(model, ref_model, mb, cfg)
        logp, entropy = batch_logprobs(model, mb, cfg, with_entropy=True)
    if "rollout_logp" in mb:  # the engine vs the trainer, same weights
        sums.add(**mismatch_sums(mb))
    token_loss, clipped = policy_loss(
        logp, mb["old_logp"], mb["advantage"], mb["mask"], cfg.clip_low, cfg.clip_high,
        clip_ratio_c=cfg.clip_ratio_c, seq_ratio=cfg.seq_ratio, ref_logp=ref_logp,
        kl_coef=cfg.kl_coef, is_weight=mb.get("is_weight"))
    if "control" in mb:  # --entropy_coef, --entropy_control
        token_loss = entropy_control.apply(token_loss, logp, entropy, mb, cfg)
    if cfg.logprob_path == "shortcuts":  # the positions its forwards ran, and those they needed
        ran, real = shortcuts.forward_tokens(model, mb["attention_mask"], mb["mask"].shape[1],
                                             mb.get("group"), cfg.pack)
    else:  # one padded forward: every position runs
        ran, real = mb["attention_mask"].numel(), mb["attention_mask"].sum().item()
    sums.add(entropy=(entropy * mb["mask"]).sum().item(),
             clip_low=clipped["clip_low"].item(),
             clip_high=clipped["clip_high"].item(),
             tokens=mb["mask"].sum().item(),
             forward_tokens=ran,
             real_tokens=real)
    return token_loss


@torch.no_grad()
def ref_logprobs(model, ref_model, mb: dict, cfg) -> torch.Tensor:
    """log pi_ref (B, T) under the KL anchor: a frozen copy of the initial model, or with LoRA the
    model with its adapters off (before pi's forward: see lora.adapter_disabled)."""
    with adapter_disabled(ref_model):
        ref_logp = batch_logprobs(ref_model, mb, cfg)[0]
    if ref_model is not model:
        reshard(ref_model)
    return ref_logp


class UpdateGuard:
    """The optimizer step of one update, guarded: clip the global gradient norm and step, unless the
    loss or gradient is not finite on a rank; then every rank skips it, so one bad batch cannot
    poison the weights."""

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
        if not applied:
            return self.skipped(sums, world, where)
        sums.add(loss=loss_value, grad_norm=grad_norm.item() / world)
        self.in_a_row = 0
        return True

    def skipped(self, sums: Sums, world: int, where: str) -> bool:
        """A skipped update: counted and said; --max_bad_updates of them in a row stop the run."""
        sums.add(skipped=1.0 / world)
        self.in_a_row += 1
        print0(f"warning: {where}: non-finite loss or gradient; update skipped")
        if self.in_a_row >= self.max_bad:
            print0(f"error: {self.in_a_row} non-finite updates in a row (--max_bad_updates); "
                   f"stopping. Try a lower --lr, --dtype float32, or check the data.")
            raise SystemExit(1)
        return False


# --------------------------------------------------------------------------------------------------
# 7. Evaluation: avg@k (mean accuracy over k samples per problem),
#    unbiased pass@k and maj@k (the majority answer's accuracy), per difficulty level too;
#    each --eval_data set with its own k (set@k).
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k, n samples, c correct: 1 - C(n-c, k) / C(n, k) as a stable product (Chen et
    al. 2021)."""
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def majority_correct(group: dict, answer_format: str) -> bool:
    """maj@k of one group: is the answer most of its samples give (equivalent answers as one; ties:
    the first seen, verifier.majority_vote) correct? The winner's own verdict decides: nothing is
    verified twice."""
    index, _ = majority_vote([extract_answer(t, answer_format) for t in group["texts"]])
    return index is not None and bool(group["correct"][index])


@torch.no_grad()
def evaluate(engine, tok, problems: list[dict], cfg, rank: int = 0, world_size: int = 1,
             k: int = 0) -> dict:
    """k completions per problem (0: cfg.eval_samples) from a private seeded stream: the same
    weights get the same score. Returns eval/acc (avg@k), eval/pass@j (j = 1, 2, 4, ...),
    eval/maj@k, eval/acc_level<l>."""
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
        out.update(crosscheck.check_eval_groups(groups, cfg, rank))
    return out
