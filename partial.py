"""
A room of its own, to look up when a run sets --max_staleness S > 0: partial rollouts carried over
from step to step with bounded staleness. common.dynamic_sampling hands its work to the engine here,
and common.old_logprobs its pi_old (a line each that reaches this file: both engines inherit
CarriedRollouts); the step still reads one batch of groups, as it does without the flag.

Generation stops when the step is full. Each step continues the unfinished groups it carries, and
every sequence grows by chunks of --partial_chunk tokens: a carried sequence is its prompt and its
completion so far, prefilled again (our sampler and vLLM alike). After each chunk the ranks gather
the groups that finished, and fresh prompts are drawn whenever the groups in flight fall below
--oversample times the kept groups the step still needs (refill). Once prompts_per_step groups are
kept, generation stops: the unfinished groups wait in the buffer for the next step, and so do
finished kept groups beyond the step's share. Nothing is thrown away unsaid.
A group whose oldest token is more than S versions older than the weights that would train it is
dropped, and counted (partial/dropped_groups). A version is an RL step: the tokens sampled during
step k's rollout have version k - 1, the weights its updates start from.

The loss is unchanged. Each token keeps the engine's log-prob from when it was sampled, the
behaviour policy that common.rollout_correction compares with pi_old token by token; pi_old is
recomputed by the trainer wherever the engine's log-probs are no longer pi_old (exact_logprobs goes
off: engine.make_rollout), so S > 0 asks for --rollout_is token or sequence. Where they still are,
on a sequence that pi_old's own weights sampled whole with our float32 sampler, it keeps them
(old_logprobs): the trainer's forward runs on the other rows only.

The buffer lives on the prompt stream (stream.carried), as the prompts drawn but not yet trained, in
plain types: every rank's own is saved in its checkpoint file (bookkeeping.save_checkpoint), and a
stop in the rollout puts back the one the step started from.
Under torchrun each rank generates its own groups; how many fresh prompts to draw, whether work is
left anywhere and which groups are kept are agreed by collectives that every rank issues once per
chunk, whatever its data (an all-gather of the finished groups and an all-reduce of the work left).
"""
import copy
import math

import torch

import common
import crosscheck
from ranks import all_gather_list, all_reduce_max, all_reduce_sum, die, print0, stop_requested
from verifier import verify_batch

# the sums a step's partial/* metrics are made of, summed over ranks
SUMS = ("stale_tokens", "staleness", "seqs", "versions", "carried_groups", "carried_tokens",
        "dropped_groups", "dropped_tokens", "generated_tokens")


def new_buffer() -> dict:
    """An empty buffer: the version the next rollout samples with (the RL steps done), the groups
    still going ("flights") and the finished kept groups waiting for a step ("finished")."""
    return {"version": 0, "flights": [], "finished": []}


def chunk_size(cfg) -> int:
    """Tokens a sequence grows by between two looks at the step: --partial_chunk, or a quarter of
    --max_new_tokens (rounded up) when 0."""
    return cfg.partial_chunk or math.ceil(cfg.max_new_tokens / 4)


class CarriedRollouts:
    """What the engines (engine.HFRollout, vllm_engine.VLLMRollout) inherit: the step's rollout
    with carried-over partial rollouts, reached from common.dynamic_sampling."""

    def carried_sampling(self, tok, stream, cfg, dist_info):
        return dynamic_sampling(self, tok, stream, cfg, dist_info)

    # whether the log-probs of the tokens that pi_old's own weights sampled are pi_old: not vLLM's
    # (our sampler in float32 at top_p = 1 sets it: engine.HFRollout)
    exact_current_logprobs = False

    def carried_old_logprobs(self, model, batch, groups, cfg, device):
        return old_logprobs(self, model, batch, groups, cfg, device)


def check(engine, cfg):
    """What partial rollouts need of the run: the rollout correction, and an engine whose log-probs
    are not taken for pi_old (engine.make_rollout tells our sampler)."""
    if cfg.rollout_is == "none":
        die(f"--max_staleness {cfg.max_staleness} trains tokens sampled by older weights: set "
            f"--rollout_is token or sequence, the correction they need (docs/gpu.md)")
    assert not engine.exact_logprobs, "a carried token was sampled by older weights than pi_old's"


def deal_carried(buffers: list, rank: int, world: int) -> dict | None:
    """This rank's buffer from those a checkpoint saved on len(buffers) ranks, for a run on `world`
    ranks: every old rank's groups, dealt out in turn (None: the run carried nothing)."""
    if all(b is None for b in buffers):
        return None
    buffers = [b for b in buffers if b is not None]
    return {"version": buffers[0]["version"],
            "flights": [g for b in buffers for g in b["flights"]][rank::world],
            "finished": [g for b in buffers for g in b["finished"]][rank::world]}


# --------------------------------------------------------------------------------------------------
# 1. A group in flight: its problem and its G sequences so far, each token with the engine's
#    log-prob and the version that sampled it.
def new_flight(problem: dict, G: int) -> dict:
    """A fresh group of `problem` (the fields a trained group keeps), G empty sequences."""
    return {"problem": {k: problem.get(k, 0) for k in ("prompt", "answer", "level", "prompt_ids")},
            "completions": [[] for _ in range(G)],
            "logps": [[] for _ in range(G)],
            "versions": [[] for _ in range(G)],
            "ended": [False] * G,  # an eos, or --max_new_tokens reached
            "truncated": [False] * G}  # --max_new_tokens reached without an eos


def oldest(versions: list[list[int]]) -> int | None:
    """The version of a group's oldest token (None before its first token)."""
    firsts = [v[0] for v in versions if v]
    return min(firsts) if firsts else None


def advance(engine, cfg, flights: list[dict], version: int) -> int:
    """One chunk more of every unfinished sequence of `flights` (this rank's), sampled by the
    weights of `version`: a fresh group's G samples share one prefill of its prompt, a sequence
    under way continues its prompt + completion so far. Returns the tokens generated."""
    chunk = chunk_size(cfg)
    calls = {}  # (prompts' n, token budget) -> [(flight, its sequence or None for all G)]
    for f in flights:
        if not any(f["completions"]):  # fresh: G samples of the prompt
            calls.setdefault((cfg.group_size, min(chunk, cfg.max_new_tokens)), []).append((f, None))
            continue
        for i, done in enumerate(f["ended"]):
            if not done:
                budget = min(chunk, cfg.max_new_tokens - len(f["completions"][i]))
                calls.setdefault((1, budget), []).append((f, i))
    generated = 0
    for (n, budget), work in sorted(calls.items()):
        prompts = [f["problem"]["prompt_ids"] + ([] if i is None else f["completions"][i])
                   for f, i in work]
        completions, truncated, logps = engine.generate(prompts, budget, cfg.temperature,
                                                        cfg.top_p, n)
        logps = logps or [[0.0] * len(c) for c in completions]  # greedy: sample_token's 0s
        targets = [(f, j) for f, i in work for j in (range(n) if i is None else [i])]
        for (f, j), ids, cut, lps in zip(targets, completions, truncated, logps):
            f["completions"][j] += ids
            f["logps"][j] += lps
            f["versions"][j] += [version] * len(ids)
            full = len(f["completions"][j]) >= cfg.max_new_tokens
            f["ended"][j] = not cut or full
            f["truncated"][j] = cut and full
            generated += len(ids)
    return generated


def finish(flights: list[dict], tok, cfg) -> tuple[list[dict], dict]:
    """The groups of finished flights, verified and rewarded as common.roll_groups does, with
    "rollout_logp" and each token's "versions". Returns (groups, verify_batch's info)."""
    completions = [c for f in flights for c in f["completions"]]
    texts = tok.batch_decode(completions, skip_special_tokens=True) if completions else []
    answers = [f["problem"]["answer"] for f in flights for _ in f["completions"]]
    correct, info = verify_batch(texts, answers, cfg.answer_format)
    G = cfg.group_size
    groups = []
    for i, f in enumerate(flights):
        s = slice(i * G, (i + 1) * G)
        rewards = [common.shaped_reward(c, len(ids), cfg.max_new_tokens, cfg.overlong_buffer,
                                        cfg.overlong_penalty)
                   for c, ids in zip(correct[s], f["completions"])]
        groups.append({**f["problem"],
                       "completions": f["completions"],
                       "texts": texts[s],
                       "truncated": f["truncated"],
                       "correct": correct[s],
                       "reward": rewards,
                       "rollout_logp": f["logps"],
                       "versions": f["versions"]})
    return groups, info


def drop_stale(buffer: dict, max_staleness: int) -> tuple[int, int]:
    """Drop the buffer's groups whose oldest token is more than max_staleness versions older than
    the weights that would train them now; returns (groups, tokens) dropped on this rank."""
    version = buffer["version"]
    groups = tokens = 0
    for key in ("flights", "finished"):
        fresh_enough = []
        for g in buffer[key]:
            first = oldest(g["versions"])
            if first is not None and version - first > max_staleness:
                groups += 1
                tokens += sum(map(len, g["completions"]))
            else:
                fresh_enough.append(g)
        buffer[key] = fresh_enough
    return groups, tokens


def refill(kept: int, going: float, drawn: int, first: bool, cfg, world: int) -> int:
    """Fresh prompts to draw now, a multiple of the world size: enough that the groups in flight
    are --oversample times the kept groups the step still needs (so the step's first draw is
    dynamic sampling's batch), within --max_gen_batches such batches in all. `first`: the step has
    finished no group yet, so with nothing in flight it draws one prompt per rank at least.
    Example: 16 groups a step, 1.5x, 6 kept, 12 in flight, 1 rank -> 3 prompts."""
    oversample = cfg.oversample if cfg.dynamic_sampling else 1
    batch = math.ceil(cfg.prompts_per_step * oversample / world) * world
    allowed = batch * (cfg.max_gen_batches if cfg.dynamic_sampling else 1) - drawn
    want = math.ceil(oversample * max(0, cfg.prompts_per_step - kept) - going)
    if first and not going:
        want = max(want, 1)
    return min(math.ceil(max(0, want) / world) * world, allowed)


# --------------------------------------------------------------------------------------------------
# 2. The step's rollout: common.dynamic_sampling's contract, generation stopping when it is full.
def dynamic_sampling(engine, tok, stream, cfg, dist_info):
    """common.dynamic_sampling with carried-over partial rollouts: the carried kept groups first,
    then chunks of generation over the carried and fresh groups until prompts_per_step kept groups
    are there (or, at --max_gen_batches fresh batches, until nothing is left in flight: then what
    was kept, as a multiple of the world size). Returns (kept summaries, the summaries of the groups
    that finished this step, rollout metrics with partial/*), or None if a stop came between two
    generation batches (the buffer is then as the step found it)."""
    rank, world = dist_info.rank, dist_info.world_size
    check(engine, cfg)
    if not hasattr(stream, "carried"):
        stream.carried = new_buffer()
    buffer = stream.carried
    started_from = copy.deepcopy(buffer)
    version = buffer["version"]
    sums = common.Sums(*SUMS)
    dropped = drop_stale(buffer, cfg.max_staleness)
    sums.add(dropped_groups=dropped[0], dropped_tokens=dropped[1])
    my_groups = buffer["finished"]  # the groups this rank holds this step: carried kept ones first
    buffer["finished"] = []
    flights = buffer["flights"]
    kept = all_gather_list([common._summary(g, rank, i) for i, g in enumerate(my_groups)])
    # every rank: the groups in flight anywhere (so that all draw as many fresh prompts)
    going = all_reduce_sum(torch.tensor(float(len(flights)))).item()
    generated = []
    num_batches = drawn = 0
    verify = {"timeouts": 0, "refused": 0, "seconds": 0.0}  # the verifier on this rank
    while True:
        # (the same on every rank: from gathered or all-reduced numbers)
        draw = refill(len(kept), going, drawn, not generated, cfg, world)
        if draw:
            if num_batches and stop_requested():
                stream.carried = started_from
                return None
            flights += [new_flight(p, cfg.group_size) for p in stream.next(draw)[rank::world]]
            num_batches += 1
            drawn += draw
        elif not going:  # at the cap: nothing in flight, nothing more to draw
            break
        sums.add(generated_tokens=advance(engine, cfg, flights, version))
        done = [f for f in flights if all(f["ended"])]
        flights = [f for f in flights if not all(f["ended"])]
        groups, info = finish(done, tok, cfg)
        for key in verify:
            verify[key] += info.get(key, 0)
        mine = [common._summary(g, rank, len(my_groups) + i) for i, g in enumerate(groups)]
        my_groups += groups
        summaries = all_gather_list(mine)  # every rank, in rank order: the same list everywhere
        generated += summaries
        kept += [s for s in summaries if not cfg.dynamic_sampling or common._mixed(s)]
        going = all_reduce_sum(torch.tensor(float(len(flights)))).item()
        if len(kept) >= cfg.prompts_per_step and generated:
            break
    buffer["flights"] = flights
    buffer["version"] = version + 1
    return _close(kept, generated, my_groups, num_batches, verify, buffer, sums, version, cfg,
                  dist_info)


def _close(kept, generated, my_groups, num_batches, verify, buffer, sums, version, cfg,
           dist_info):
    """The step's share of the kept groups (each of this rank's holds its group under "group"),
    the rest of this rank's kept ones back into the buffer, and the metrics."""
    rank, world = dist_info.rank, dist_info.world_size
    num_kept = len(kept)
    usable = num_kept - num_kept % world  # an equal share per rank: FSDP's collectives in lockstep
    if num_kept < cfg.prompts_per_step:
        common._warn_at_cap(num_kept, usable, num_batches, cfg.prompts_per_step, world)
    take = min(cfg.prompts_per_step, usable)
    trained, left = kept[:take], kept[take:]
    for s in trained:
        if s["origin"][0] == rank:
            s["group"] = my_groups[s["origin"][1]]
    buffer["finished"] = [my_groups[s["origin"][1]] for s in left if s["origin"][0] == rank]
    for g in [s["group"] for s in trained if "group" in s]:
        g["current"] = [all(x == version for x in v) for v in g["versions"]]  # by pi_old's weights
        for v in g["versions"]:
            sums.add(stale_tokens=len(v), staleness=sum(version - x for x in v), seqs=1,
                     versions=len(set(v)))
    waiting = buffer["flights"] + buffer["finished"]
    sums.add(carried_groups=len(waiting),
             carried_tokens=sum(len(c) for g in waiting for c in g["completions"]))
    totals = sums.reduce()
    mine = [version - x for s in trained if "group" in s for v in s["group"]["versions"] for x in v]
    stale_max = all_reduce_max(torch.tensor(float(max(mine, default=0)))).item()
    stats = common.rollout_metrics(generated, take, num_batches, verify)
    trained_tokens = sum(n for s in trained for n in s["lengths"])
    stats.update({
        "partial/staleness_mean": totals["staleness"] / max(totals["stale_tokens"], 1.0),
        "partial/staleness_max": stale_max,
        "partial/versions_per_seq": totals["versions"] / max(totals["seqs"], 1.0),
        "partial/carried_groups": totals["carried_groups"],
        "partial/carried_tokens": totals["carried_tokens"],
        "partial/dropped_groups": totals["dropped_groups"],
        "partial/dropped_tokens": totals["dropped_tokens"],
        "partial/generated_tokens": totals["generated_tokens"],
        "partial/gen_per_trained_token": totals["generated_tokens"] / max(trained_tokens, 1),
        "partial/trained_len": trained_tokens / max(sum(len(s["lengths"]) for s in trained), 1),
    })
    if cfg.verifier_crosscheck and cfg.crosscheck_train:  # a sample of the step's completions
        stats.update(crosscheck.check_train_groups(my_groups, cfg, rank, world))
    return trained, generated, stats


# --------------------------------------------------------------------------------------------------
# 3. pi_old for the step's batch: recomputed only on the rows that older weights sampled.
def old_logprobs(engine, model, batch: dict, groups: list[dict], cfg, device) -> dict:
    """common.old_logprobs with carried-over rollouts: a row whose tokens pi_old's own weights
    sampled (its group's "current", set by _close) keeps the engine's log-probs when they are pi_old
    there (engine.exact_current_logprobs, as exact_logprobs would say without --max_staleness);
    every other row is recomputed. With vLLM or in bf16 all rows are, as before. Under torchrun
    each rank recomputes as many rows, the most any rank needs (an all-reduce), its own stale rows
    first and then rows the engine had right: FSDP's forwards stay in lockstep."""
    if not engine.exact_current_logprobs:
        return common.recompute_old_logprobs(model, batch, cfg, device)
    current = torch.tensor([c for g in groups
                            for c in g.get("current", [False] * len(g["completions"]))])  # (B,)
    # every rank: the stale rows of the rank that has most
    need = int(all_reduce_max(torch.tensor(float((~current).sum()))).item())
    rows = torch.cat([(~current).nonzero()[:, 0], current.nonzero()[:, 0]])[:need].sort().values
    stale = common.recompute_old_logprobs(model, {k: v[rows] for k, v in batch.items()}, cfg,
                                          device)["old_logp"]  # (need, T)
    old_logp = batch["rollout_logp"].clone()  # (B, T): pi_old on the current rows (float32)
    old_logp[rows] = stale
    return {"old_logp": old_logp}
