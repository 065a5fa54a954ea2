"""Partial rollouts (--max_staleness, partial.py): a sequence continued from its prefix equals the uninterrupted one,
the rollout correction of a sequence that spans two weight versions (its importance weights against the KL between
the two snapshots), groups older than S dropped, S = 0 never reaching the room, 2 gloo ranks in lockstep while
carry-over makes them uneven, and a stop in the middle of carried work resumed exactly.
Run: python -m pytest -q tests/test_partial.py"""
import copy
import json
import os
import types

import pytest
import torch

import bookkeeping
import common
import config
import da3po
import engine as eng
import modeling
import partial
import ranks
from tests.conftest import ROOT
from tests.test_lockstep import SMALL as LOCKSTEP_SMALL
from tests.test_lockstep import launch
from tests.test_stop import STOPPED_AT, records, run, stop_when

REASONING_MODEL = os.path.join(ROOT, "demo", "reasoning", "model")  # completions of 30-60 tokens
PROMPTS = ["7890+141", "75+72", "902+48"]
PARTIAL = ["--max_staleness", "1", "--rollout_is", "token", "--partial_chunk", "3"]


def rollout_cfg(**kw):
    """The fields of a Config that partial.advance reads."""
    base = dict(group_size=2, max_new_tokens=48, partial_chunk=0, temperature=0.0, top_p=1.0)
    return types.SimpleNamespace(**{**base, **kw})


def flights_of(tok, G, prompts=PROMPTS):
    return [partial.new_flight({"prompt": p, "answer": "0", "prompt_ids": tok(p)["input_ids"]}, G) for p in prompts]


def grown(engine, cfg, flights):
    """Chunks until every sequence ended, each chunk a version later; returns the flights."""
    version = 0
    while not all(all(f["ended"]) for f in flights):
        partial.advance(engine, cfg, flights, version)
        version += 1
    return flights


@pytest.mark.parametrize("t", [1, 5, 17])
def test_a_greedy_sequence_continued_from_its_prefix_equals_the_uninterrupted_one(t):
    """Our sampler, greedy, weights unchanged: cut every t tokens (each piece a prefill of prompt + completion so
    far) or generated in one go (a chunk of --max_new_tokens), the same tokens, the same end."""
    model, tok = modeling.load_model(REASONING_MODEL)
    engine = eng.HFRollout(model, tok, ranks.DistInfo())
    whole = grown(engine, rollout_cfg(partial_chunk=48), flights_of(tok, 2))
    pieces = grown(engine, rollout_cfg(partial_chunk=t), flights_of(tok, 2))
    lengths = [len(c) for f in whole for c in f["completions"]]
    assert max(lengths) > 17 and min(lengths) > 1, lengths  # every cut falls inside a completion
    for a, b in zip(whole, pieces):
        assert a["completions"] == b["completions"] and a["ended"] == b["ended"]
        assert a["truncated"] == b["truncated"]
        for c, v in zip(b["completions"], b["versions"]):  # token i was sampled in chunk i // t
            assert v == [i // t for i in range(len(c))]


def test_a_sequence_spanning_two_versions_is_corrected_token_by_token(float64_model):
    """Staleness 1 on the sums demo's model in float64: 2 tokens of each sequence sampled by weights A, the rest by
    B = A plus noise. pi_old (recomputed by B) over the engine's recorded log-probs gives importance weights that are
    1 on B's tokens (same weights: the engine's float32 log-probs, bound 8 ulps) and exp(log pi_B - log pi_A) on A's,
    checked against both snapshots' own forwards; on A's tokens they are not all 1, and their log-mean estimates
    -KL(A || B), the exact KL of each position averaged, within 4 standard errors of the per-token differences."""
    model, tok = float64_model
    engine = eng.HFRollout(model, tok, ranks.DistInfo(), "float64")
    cfg = rollout_cfg(group_size=8, max_new_tokens=12, partial_chunk=2, temperature=1.0)
    torch.manual_seed(0)
    sums = [(12, 34), (907, 58), (4, 4), (66, 789), (1234, 9), (5, 61), (300, 300), (71, 2), (88, 19), (6, 6000)]
    flights = flights_of(tok, 8, [f"{a}+{b}" for a, b in sums])
    partial.advance(engine, cfg, flights, version=0)  # weights A
    snapshot_a = copy.deepcopy(model)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.02 * p.abs().mean() * torch.randn(p.shape, generator=g, dtype=p.dtype))
    while not all(all(f["ended"]) for f in flights):
        partial.advance(engine, cfg, flights, version=1)  # weights B
    groups = [{**f["problem"], "completions": f["completions"], "reward": [0.0] * 8, "correct": [False] * 8,
               "rollout_logp": f["logps"]} for f in flights]
    batch = common.make_batch(groups, tok.pad_token_id)
    batch["rollout_logp"] = batch["rollout_logp"].double()
    run_cfg = config.parse_config(da3po.Config, ["--demo", "arith", "--rollout_is", "token", "--rollout_is_cap", "1e9"],
                                  da3po.PRESETS)
    batch.update(common.recompute_old_logprobs(model, batch, run_cfg, torch.device("cpu")))
    common.rollout_correction(batch, run_cfg)
    versions = torch.zeros_like(batch["mask"])
    for row, v in enumerate(v for f in flights for v in f["versions"]):
        versions[row, :len(v)] = torch.tensor(v)
    log_w = torch.log(batch["is_weight"].clamp(min=1e-300))
    on_b = batch["mask"].bool() & (versions == 1)
    on_a = batch["mask"].bool() & (versions == 0)
    assert on_b.sum() > 20 and on_a.sum() > 100
    # the engine's log-probs are float32 (sample_token's log-softmax, make_batch's tensor): a few float32 ulps
    ulps = 8 * 2.0 ** -24 * (1 + batch["rollout_logp"].abs())
    assert (log_w[on_b].abs() <= ulps[on_b]).all()
    # the snapshots' own log-probs and the exact KL(A || B) at each of A's tokens
    kl, log_ratio = [], []
    for row, (prompt, completion) in enumerate((f["problem"]["prompt_ids"], c) for f in flights
                                               for c in f["completions"]):
        ids = torch.tensor([prompt + completion[:2]])
        with torch.no_grad():
            la = snapshot_a(ids).logits[0, len(prompt) - 1:-1].log_softmax(-1)  # predicts completion[:2]
            lb = model(ids).logits[0, len(prompt) - 1:-1].log_softmax(-1)
        target = torch.tensor(completion[:2])[:, None]
        log_ratio.append((lb.gather(-1, target) - la.gather(-1, target))[:, 0])
        kl.append((la.exp() * (la - lb)).sum(-1))
        assert ((log_w[row, :len(target)] - log_ratio[-1]).abs() <= ulps[row, :len(target)]).all()
    log_ratio, kl = torch.cat(log_ratio), torch.cat(kl)
    assert log_ratio.std() > 0.01  # the weights are not all 1
    n = len(kl)
    assert abs((log_ratio + kl).mean()) <= 4 * (log_ratio + kl).std() / n ** 0.5, (log_ratio.mean(), kl.mean())


def test_pi_old_is_recomputed_only_where_older_weights_sampled(monkeypatch):
    """Our float32 sampler on the reasoning demo's model: 3 groups begun by weights A and finished by B = A plus
    noise, 3 sampled by B alone. With pi_old = B, partial.old_logprobs runs the trainer's forward on the first 3
    groups' rows only and keeps the engine's log-probs on the others; both equal common.recompute_old_logprobs on
    every row within the float32 gap between a KV cache and a full forward. Derived bound: the two differ only in
    the order of float32 sums, the longest in a block being the MLP's over intermediate_size terms, so Higham's
    n u per sum, over the layers, on the log-prob's scale: layers x intermediate_size x 2^-24 x (1 + |log p|).
    The stale rows' engine log-probs are A's, visibly off. A bf16 engine (or vLLM) recomputes every row."""
    model, tok = modeling.load_model(REASONING_MODEL)
    engine = eng.HFRollout(model, tok, ranks.DistInfo(), "float32", 512, 1.0, max_staleness=1)
    cfg = rollout_cfg(group_size=4, max_new_tokens=24, partial_chunk=6, temperature=1.0)
    torch.manual_seed(0)
    flights = flights_of(tok, 4, ["12+7", "305+96", "4+4", "77+15", "1+2", "40+41"])
    partial.advance(engine, cfg, flights[:3], version=0)  # weights A
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=g))
    while not all(all(f["ended"]) for f in flights):
        partial.advance(engine, cfg, flights, version=1)  # weights B, pi_old's
    groups = [{**f["problem"], "completions": f["completions"], "reward": [0.0] * 4, "correct": [False] * 4,
               "rollout_logp": f["logps"], "current": [all(x == 1 for x in v) for v in f["versions"]]}
              for f in flights]
    assert [all(g["current"]) for g in groups] == [False] * 3 + [True] * 3  # as _close marks them
    batch = common.make_batch(groups, tok.pad_token_id)
    run_cfg = config.parse_config(da3po.Config, ["--demo", "reasoning", *PARTIAL], da3po.PRESETS)
    cpu = torch.device("cpu")
    full = common.recompute_old_logprobs(model, batch, run_cfg, cpu)["old_logp"]
    recomputed = []  # the rows of each batch that the trainer's forward saw
    real = common.recompute_old_logprobs
    monkeypatch.setattr(common, "recompute_old_logprobs", lambda m, b, *a: recomputed.append(
        [row.tolist() for row in b["input_ids"]]) or real(m, b, *a))
    mine = partial.old_logprobs(engine, model, batch, groups, run_cfg, cpu)["old_logp"]
    assert recomputed == [batch["input_ids"][:12].tolist()]  # the forward ran on the stale groups' rows only
    assert torch.equal(mine[12:], batch["rollout_logp"][12:])  # the engine's own, kept
    mask = batch["mask"].bool()
    text = model.config
    bound = text.num_hidden_layers * text.intermediate_size * 2.0 ** -24 * (1 + full.abs())
    assert ((mine - full).abs() <= bound)[mask].all(), ((mine - full).abs() / bound)[mask].max()
    assert ((batch["rollout_logp"] - full).abs()[:12][mask[:12]]).max() > 100 * bound.max()  # A's are off
    bf16 = eng.HFRollout(model, tok, ranks.DistInfo(), "bfloat16", 512, 1.0, max_staleness=1)
    recomputed.clear()
    assert torch.equal(partial.old_logprobs(bf16, model, batch, groups, run_cfg, cpu)["old_logp"], full)
    assert recomputed == [batch["input_ids"].tolist()]


def test_groups_older_than_s_are_dropped_and_counted():
    """At version 3 with S = 1: a group whose oldest token is from version 2 stays, from 1 goes (tokens counted); a
    fresh group (no token yet) stays; the same for finished groups waiting for a step."""
    def group(*versions):
        return {"versions": [list(v) for v in versions], "completions": [[7] * len(v) for v in versions]}
    buffer = {"version": 3, "flights": [group([2, 2, 3], [2]), group([1, 2], [2, 2, 3]), group([], [])],
              "finished": [group([1], [1, 1]), group([2], [2])]}
    assert partial.drop_stale(buffer, 1) == (2, 2 + 3 + 1 + 2)
    assert [f["versions"] for f in buffer["flights"]] == [[[2, 2, 3], [2]], [[], []]]
    assert [f["versions"] for f in buffer["finished"]] == [[[2], [2]]]
    assert partial.drop_stale(buffer, 0) == (2, 4 + 2)


def test_refill_draws_what_the_step_still_needs():
    """16 groups a step at 1.5x (the demo's): the first draw is dynamic sampling's batch of 24; with 6 kept and 12 in
    flight, 1.5 * 10 - 12 = 3 more; none once in flight covers it; the cap (4 batches, 96 prompts) bounds it; with
    nothing kept or in flight on 2 ranks, at least a prompt per rank."""
    cfg = config.parse_config(da3po.Config, [], da3po.PRESETS)
    assert partial.refill(0, 0, 0, True, cfg, 1) == 24
    assert partial.refill(6, 12, 24, False, cfg, 1) == 3
    assert partial.refill(6, 12, 24, False, cfg, 2) == 4
    assert partial.refill(6, 15, 24, False, cfg, 1) == 0
    assert partial.refill(0, 0, 94, False, cfg, 1) == 2
    assert partial.refill(16, 0, 0, True, cfg, 2) == 2


def test_a_checkpoint_on_two_ranks_deals_its_carried_groups_to_any_number():
    a = {"version": 5, "flights": ["a0", "a1"], "finished": ["fa"]}
    b = {"version": 5, "flights": ["b0"], "finished": []}
    assert partial.deal_carried([a, b], 0, 1) == {"version": 5, "flights": ["a0", "a1", "b0"], "finished": ["fa"]}
    assert partial.deal_carried([a, b], 1, 3) == {"version": 5, "flights": ["a1"], "finished": []}
    assert partial.deal_carried([None, None], 0, 1) is None


def test_staleness_0_never_reaches_the_room(tmp_path, monkeypatch):
    """S = 0 (the default) is today's code path: the room's entry raises, and the run does not notice. (The
    same-numbers guard, python -m tools.same_numbers, compares whole runs with a saved one.)"""
    def unreachable(*args, **kwargs):
        raise AssertionError("partial rollouts reached with --max_staleness 0")
    monkeypatch.setattr(partial, "dynamic_sampling", unreachable)
    run(da3po, tmp_path / "s0", "--steps", "1", "--eval_every", "0")
    train = [r for r in records(tmp_path / "s0" / "metrics.jsonl") if "train/num_groups" in r]
    assert len(train) == 1 and train[0]["train/num_groups"] == 8 and "partial/carried_groups" not in train[0]


def test_staleness_needs_the_rollout_correction(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        run(da3po, tmp_path / "x", "--steps", "1", "--eval_every", "0", "--max_staleness", "1")
    assert e.value.code == 2 and "--rollout_is token or sequence" in capsys.readouterr().err


def carried_in(checkpoint: str) -> int:
    saved = torch.load(os.path.join(checkpoint, "rank0.pt"), weights_only=True)["carried"]
    return len(saved["flights"]) + len(saved["finished"])


@pytest.mark.parametrize("where", ["rollout", "updates", "eval_due"])
def test_a_stop_in_the_middle_of_carried_work_resumes_exactly(tmp_path, monkeypatch, capsys, where):
    """As tests/test_stop.py, with chunks of 3 tokens and S = 1 on the sums demo: step 2 is stopped in its rollout
    (before a fresh draw: the step is redone, its buffer as it found it), before its second update, or after it
    with an evaluation due; the checkpoint carries unfinished or waiting groups, and the resumed run's metrics.jsonl
    equals the uninterrupted one's."""
    flags = ["--steps", "3", "--eval_every", "2", *PARTIAL]
    run(da3po, tmp_path / "straight", *flags)
    straight = records(tmp_path / "straight" / "metrics.jsonl")
    train = [r for r in straight if "partial/carried_groups" in r]
    assert train[1]["train/num_gen_batches"] > 1 and train[0]["partial/carried_groups"] > 0
    assert max(r["partial/versions_per_seq"] for r in train) > 1  # sequences spanning versions were trained
    if where == "rollout":  # a stop request as step 2's rollout starts: seen before its second draw
        stop_when(monkeypatch, partial, "dynamic_sampling", lambda n: n == 2)
    elif where == "updates":
        stop_when(monkeypatch, common.UpdateGuard, "step", lambda n: n == 3)
    else:
        stop_when(monkeypatch, eng.HFRollout, "sync_weights", lambda n: n == 2)
    out = tmp_path / "stopped"
    run(da3po, out, *flags)
    said = capsys.readouterr().out
    assert STOPPED_AT[where] in said
    saved = bookkeeping.latest_checkpoint(str(out))
    assert carried_in(saved) > 0
    monkeypatch.undo()
    run(da3po, out, *flags, "--resume")
    assert records(out / "metrics.jsonl") == straight
    assert f"carries {carried_in(saved)} groups of partial rollouts" in capsys.readouterr().out  # said on resume


def test_ranks_stay_in_lockstep_when_carry_over_makes_them_uneven(tmp_path):
    """2 gloo ranks, our sampler (tests/lockstep.py, no script), S = 1 and chunks of 3 tokens: each rank carries its
    own unfinished groups, so the ranks generate, finish and hold different numbers of groups each step, and still
    issue the same collectives in the same order (the draws, the stop and the kept groups are agreed through the
    all-gather of finished groups and the all-reduce of groups in flight); every step trains its 8 groups."""
    code, _, stderr = launch(tmp_path, "da3po.py", "real", [*LOCKSTEP_SMALL, *PARTIAL])
    assert code == 0, stderr[-3000:]
    traces = [json.load(open(tmp_path / f"collectives_rank{r}.json")) for r in (0, 1)]
    assert len(traces[0]) > 50 and traces[0] == traces[1]
    train = [json.loads(x) for x in open(tmp_path / "metrics.jsonl") if "train/loss" in x]
    assert [m["train/num_groups"] for m in train] == [8, 8, 8]
    assert any(m["partial/carried_groups"] > 0 for m in train)
    data = [json.load(open(tmp_path / f"data_rank{r}.json")) for r in (0, 1)]
    assert data[0]["tokens"] != data[1]["tokens"]
