"""The update pipeline against the plain reference (tests/reference.py), and the scripts' classes against it.
Run: python -m pytest -q tests/test_reference.py           (about a minute on one core)
Longer sweep: python -m tools.reference_sweep --seeds 500

Every check compares float64 numbers computed two ways to harness.TOL = 1e-10 (derived in tests/harness.py); a wrong
weight, a lost token or a wrong clip is off by far more. One exception: DAA's --adaptive_lam factor is computed in
float32 (test_daa_advantages_and_start_update says why it gets 1e-6), so the random cases leave it off."""
import contextlib
import math
import random

import pytest
import torch

import da3po
import daro
from tests import harness
from tests import reference
from tests.conftest import ARITH_MODEL, run_script
from tests.reference import Flags, Seq

# The CI's cases: each seed with the script and the rollout correction fixed in turn (so that every pair is covered
# three times however the generator evolves); the other flags are drawn (test_ci_cases_cover_every_flag).
ROLLOUT = [dict(rollout_is="token", rollout_is_mask=True), dict(rollout_is="token", rollout_is_mask=False),
           dict(rollout_is="sequence", rollout_is_mask=True), dict(rollout_is="sequence", rollout_is_mask=False),
           dict(rollout_is="none")]
CI_CASES = [(seed, ("da3po", "daro")[seed % 2], ROLLOUT[seed // 2 % len(ROLLOUT)]) for seed in range(30)]


@pytest.fixture
def models(float64_model):
    """The demo model in float64, its KL anchor (moved weights), the pad id."""
    model, tok = float64_model
    return model, harness.ref_model_of(model), tok.pad_token_id


# -----------------------------------------------------------------------------------------------------------------
# The whole update, one process


@pytest.mark.parametrize("seed,script,rollout", CI_CASES, ids=[f"{s}-{c}-{'-'.join(map(str, r.values()))}"
                                                               for s, c, r in CI_CASES])
def test_pipeline_matches_reference(models, seed, script, rollout):
    """One random batch and flag combination (random lengths, IS-rejected tokens and rows, bins 0 and G, group sizes,
    micro-batch splits, packing, chunked log-probs, 1 or 2 updates) through make_batch, the script's advantages,
    rollout_correction, the script's start_update, micro_batches, token_losses, the script's loss and backward (and
    DARO's weight step): every row's advantage and trained tokens, every token's weight and the share the
    micro-batches carried, the loss, the gradient, L_mu and s_mu equal the reference's."""
    model, ref_model, pad_id = models
    case, errors = harness.check_case(model, ref_model, pad_id, seed, script, **rollout)
    assert not harness.failures(errors), (harness.describe(case), harness.failures(errors))


def test_ci_cases_cover_every_flag(float64_model):
    """The CI seeds reach every code path the harness can draw (else a path would go unchecked in CI)."""
    model, _ = float64_model
    seen = set()
    for seed, script, rollout in CI_CASES:
        f = harness.random_case(seed, model, script, **rollout)["flags"]
        shortcuts = f["logprob_path"] == "shortcuts"  # --logprob_chunk and --pack are read there only
        seen |= {f["loss_agg"] if f.get("weighting", "none") == "none" else f["weighting"],
                 f"updates{f['updates_per_step']}", f["logprob_path"]}
        seen |= {f"chunk{f['logprob_chunk']}"} if shortcuts else set()
        seen |= {name for name, on in [("gspo", f["seq_ratio"]), ("dual", f["clip_ratio_c"] > 1), ("kl", f["kl_coef"]),
                                       ("packed", f["micro_batch_tokens"]), ("pack", f["pack"] and shortcuts),
                                       ("dr_grpo", not f["std_norm"]),
                                       ("scope_all", f.get("daa_scope") == "all"), ("literal", f.get("daro_literal")),
                                       ("running", f.get("p_estimate") == "running")]
                 if on}
    wanted = {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "learned", "uniform", "var", "updates1",
              "updates2", "chunk0", "chunk7", "chunk1024", "gspo", "dual", "kl", "packed", "pack", "dr_grpo",
              "scope_all", "literal", "running", "plain", "shortcuts"}
    assert wanted <= seen, wanted - seen


@pytest.mark.parametrize("family", list(harness.FAMILIES))
def test_other_families_packed_and_padded_match_reference(family):
    """The harness's random cases on other families (tiny random Llama, Qwen2 with its q/k/v biases, GPT-NeoX, and the
    sliding-window families with a window of 6 tokens against rows of up to 14): each case through the real pipeline
    on the plain path, on the shortcuts padded and with every micro-batch packed, each equal to the reference, so
    the three are equal, in float64 (harness.FAMILY_TOL: MoE)."""
    model = harness.family_model(family)
    ref_model = harness.ref_model_of(model)
    for seed in range(4):
        for path, pack in (("plain", False), ("shortcuts", False), ("shortcuts", True)):
            with harness.every_micro_batch_packed(model, ref_model) if pack else contextlib.nullcontext():
                case, errors = harness.check_case(model, ref_model, 0, seed, pack=pack, logprob_path=path)
            bad = harness.failures(errors, harness.FAMILY_TOL.get(family, harness.TOL))
            assert not bad, (seed, harness.describe(case), bad)


def _hand_case(model, lengths, rejected, **flags):
    """A case built by hand: one group of completions of `lengths`, whose tokens `rejected` ((row, t) pairs) have an
    engine log-prob far from pi_old, so that --rollout_is token --rollout_is_mask rejects exactly them."""
    g = torch.Generator().manual_seed(0)
    G = len(lengths)
    group = {"id": 0, "prompt_ids": [12, 13, 14], "correct": [i % 2 == 0 for i in range(G)],
             "reward": [1.0 if i % 2 == 0 else -1.0 for i in range(G)], "old_logp": [], "rollout_logp": [],
             "completions": [torch.randint(10, 40, (n,), generator=g).tolist() for n in lengths]}
    for i, c in enumerate(group["completions"]):
        with torch.no_grad():
            logp = reference.sequence_logprobs(model, Seq(group["prompt_ids"], c, 0, 0.0, False, []), 1.0).tolist()
        old = [x - 0.1 for x in logp]
        group["old_logp"].append(old)
        group["rollout_logp"].append([x + (3.0 if (i, t) in rejected else 0.0) for t, x in enumerate(old)])
    f = dict(group_size=G, max_new_tokens=8, temperature=1.0, std_norm=True, loss_agg="token-mean", seq_ratio=False,
             clip_low=0.2, clip_high=0.28, clip_ratio_c=0.0, kl_coef=0.0, rollout_is="token", rollout_is_cap=2.0,
             rollout_is_mask=True, updates_per_step=1, logprob_chunk=0, micro_batch_size=G, micro_batch_tokens=0)
    return {"seed": -1, "script": "da3po", "flags": {**f, **flags}, "groups": [group], "s0": [0.0] * (G - 1)}


@pytest.mark.parametrize("micro_batch_tokens", [0, 100])
def test_a_rejected_token_inside_a_row_keeps_the_rows_last_tokens(models, micro_batch_tokens):
    """Defect 1's own example: rows of 6 and 3 tokens, token 2 of the first rejected by --rollout_is_mask. The 8
    trained tokens weigh 1/8 each and the micro-batches must carry all of them (trimming the micro-batch to the
    longest row's count of trained tokens, 5, dropped the first row's last token: 0.875 carried)."""
    model, ref_model, pad_id = models
    case = _hand_case(model, [6, 3], {(0, 2)}, micro_batch_tokens=micro_batch_tokens)
    results = harness.run_pipeline(model, None, case, pad_id)
    carried = sum(sum(row[4]) for row in results[0]["rows"])
    assert abs(carried - 1.0) < harness.TOL, carried
    assert not harness.failures(harness.compare(model, ref_model, case, results))


# -----------------------------------------------------------------------------------------------------------------
# The whole update, two ranks


def test_two_ranks_match_reference(models, tmp_path):
    """A real `torchrun --nproc_per_node=2` (FSDP2 on gloo): each rank its groups (plan_updates, balanced when packed),
    the loss weights' denominators and DARO's bin counts and L_mu all-reduced, the gradient summed over ranks: equal
    to the reference of the whole update in one process."""
    model, ref_model, pad_id = models
    specs = ["0:script='da3po':rollout_is='token':rollout_is_mask=True",  # CI_CASES' seeds 0 and 21 on 2 ranks
             "21:script='daro':rollout_is='token':rollout_is_mask=True",
             "2:script='da3po':rollout_is='sequence':rollout_is_mask=True:kl_coef=0.1:micro_batch_tokens=30:"
             "updates_per_step=2"]
    out = tmp_path / "dist.pt"
    r = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                    "tests.dist_reference", ARITH_MODEL, str(out), *specs])
    assert r.returncode == 0, r.stderr[-3000:]
    bad = []
    for case, results in torch.load(out, weights_only=False):
        errors = harness.compare(model, ref_model, case, results)
        if harness.failures(errors):
            bad.append((harness.describe(case), harness.failures(errors)))
    assert not bad, bad


# -----------------------------------------------------------------------------------------------------------------
# The harness finds a planted bug (so a pass means something)


def test_harness_finds_planted_bugs(models, monkeypatch):
    """Two bugs planted in turn, each in a case where it matters: DARO's var weights as mu (1 - mu) (the square of
    the right ones), and DAA amplifying the incorrect completions of hard groups too. Without them the cases pass."""
    model, ref_model, pad_id = models
    var_case = dict(script="daro", weighting="var", rollout_is="none")
    daa_case = dict(script="da3po", lam=3.0, tau=1.0, daa_scope="correct", rollout_is="none")
    for fixed in (var_case, daa_case):
        assert not harness.failures(harness.check_case(model, ref_model, pad_id, 4, **fixed)[1])
    bin_weights = daro.bin_weights
    monkeypatch.setattr(daro, "bin_weights", lambda s, weighting, shared=False: bin_weights(s, weighting, shared) ** (
        2 if weighting == "var" else 1))
    assert "weight" in harness.failures(harness.check_case(model, ref_model, pad_id, 4, **var_case)[1])
    daa = da3po.daa
    monkeypatch.setattr(da3po, "daa", lambda adv, correct, lam, tau, p=None, scope="correct": daa(
        adv, correct, lam, tau, p, "all"))
    assert "advantage" in harness.failures(harness.check_case(model, ref_model, pad_id, 4, **daa_case)[1])


# -----------------------------------------------------------------------------------------------------------------
# The scripts' classes, method by method, against the reference (no model: random token losses and masks)


def _random_batch(rng: random.Random, G: int, n_groups: int, T: int = 6, rates=(0.0, 0.3, 0.7, 1.0)):
    """A batch of the contract's keys the classes read (float64), with random lengths, holes and empty rows; and the
    reference's sequences and trained flags of the same rows."""
    rows = n_groups * G
    p = [rng.choice(rates) for _ in range(n_groups)]  # each group's pass rate: bins 0 and G too
    correct = [rng.random() < p[i // G] for i in range(rows)]
    reward = [(1.0 if c else -1.0) - rng.choice([0.0, 0.25]) for c in correct]
    lengths = [rng.randint(1, T) for _ in range(rows)]
    mask = [[float(t < n and rng.random() > 0.2) for t in range(T)] for n in lengths]  # holes
    mask[rng.randrange(rows)] = [0.0] * T  # a row rejected whole
    seqs = [Seq([1], [1] * n, i // G, r, c, [0.0] * n) for i, (n, r, c) in enumerate(zip(lengths, reward, correct))]
    batch = {"mask": torch.tensor(mask, dtype=torch.float64), "reward": torch.tensor(reward, dtype=torch.float64),
             "correct": torch.tensor(correct), "group": torch.arange(rows) // G}
    trained = [[bool(m) for m in mk[:n]] for mk, n in zip(mask, lengths)]
    return batch, seqs, trained


def _config(script: str, **flags):
    cls = da3po.Config if script == "da3po" else daro.Config
    return cls(**flags)


def _flags(cfg) -> Flags:
    f = Flags(G=cfg.group_size, **{k: getattr(cfg, k) for k in Flags.__dataclass_fields__ if hasattr(cfg, k)})
    if not hasattr(cfg, "weighting"):
        f.weighting = "none"
    return f


@pytest.mark.parametrize("seed", range(8))
def test_daa_advantages_and_start_update(seed):
    """DAA.advantages (GRPO / Dr. GRPO advantages, then DAA with p < tau strict, scope correct or all, p = p_hat or
    --p_estimate running over earlier steps' counts, lam fixed or --adaptive_lam) and DAA.start_update (every
    --loss_agg over an update with holes and a rejected row) equal the reference's. The adaptive factor is computed
    in float32 (from correct.float()), even for a float64 batch: (G - 1) roundings of 2^-24 in p^(G-1) and a few
    more, so it agrees to 1e-6 relative there; every other number to harness.TOL."""
    rng = random.Random(seed)
    G = rng.choice([2, 4, 8])
    cfg = _config("da3po", group_size=G, lam=rng.choice([1.0, 2.0, 3.0]), tau=rng.choice([0.25, 0.5, 1.0]),
                  daa_scope=rng.choice(["correct", "all"]), std_norm=rng.random() < 0.5, max_new_tokens=6,
                  loss_agg=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"][seed % 3],
                  adaptive_lam=seed % 2 == 1, p_estimate="running" if seed >= 4 else "group", lam_max=2.5)
    batch, seqs, trained = _random_batch(rng, G, 6)
    priors = [(c, n) for n in (rng.choice([0, G, 5 * G]) for _ in range(6)) for c in [rng.randint(0, n)]]
    seqs = [Seq(s.prompt, s.completion, s.group, s.reward, s.correct, s.old_logp, prior=priors[s.group])
            for s in seqs]
    groups = [{"prompt": f"problem {i}", "answer": "7", "correct": batch["correct"][i * G:(i + 1) * G].tolist()}
              for i in range(6)]
    counts = {da3po.pass_key(g): list(p) for g, p in zip(groups, priors)}
    algo, f = da3po.DAA(cfg, torch.device("cpu"), {"pass_counts": counts}), _flags(cfg)
    algo.after_rollout(groups)  # this step's samples join the running counts before the advantages, as in main
    A = algo.advantages(batch, groups)
    A_ref = torch.tensor(reference.advantages(seqs, f), dtype=A.dtype)
    assert torch.allclose(A, A_ref, rtol=1e-6 if cfg.adaptive_lam else 0, atol=harness.TOL)
    rows = torch.arange(len(seqs))
    coef, _ = reference.coefficients(seqs, trained, f)
    expected = torch.tensor([c + [0.0] * (6 - len(c)) for c in coef], dtype=torch.float64)
    weight = algo.start_update(batch, rows)
    assert torch.allclose(weight, expected, rtol=0, atol=harness.TOL)
    token_loss = torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ref_loss = math.fsum(c * token_loss[i, t].item() for i, row in enumerate(coef) for t, c in enumerate(row))
    assert abs(algo.loss(token_loss, {"weight": weight}).item() - ref_loss) < harness.TOL


@pytest.mark.parametrize("weighting", ["learned", "uniform", "var", "none"])
def test_daro_advantages_bins_and_masking(weighting):
    """DARO.advantages: GRPO advantages, batch["bin"] = #correct of the row's group, and (with bins) the rows of bins 0
    and G leave the loss mask; with weighting none nothing is masked."""
    rng = random.Random(7)
    cfg = _config("daro", group_size=4, weighting=weighting)
    batch, seqs, trained = _random_batch(rng, 4, 8)
    algo, f = daro.DARO(cfg, torch.device("cpu"), {}), _flags(cfg)
    before = batch["mask"].clone()
    A = algo.advantages(batch, [{}] * 8)
    assert torch.allclose(A, torch.tensor(reference.advantages(seqs, f), dtype=A.dtype), rtol=0, atol=harness.TOL)
    assert batch["bin"].tolist() == [reference.bin_of(seqs, i) for i in range(len(seqs))]
    kept = reference.trained_tokens(seqs, f, [[True] * len(s.completion) for s in seqs])
    for i, k in enumerate(kept):
        assert batch["mask"][i].tolist() == [m * t for m, t in zip(before[i].tolist(), k + [True] * (6 - len(k)))]
    assert {b for b in batch["bin"].tolist()} & {0, 4}, "the batch must have a group in bin 0 or G to test masking"


def _daro_update(algo, batch, rows, rng):
    """One update of DARO's methods on random token losses: start_update, loss over two micro-batches.
    Returns (the loss, the token losses)."""
    batch["weight"] = torch.zeros_like(batch["mask"])
    batch["weight"][rows] = algo.start_update(batch, rows)
    token_loss = torch.tensor([[rng.uniform(-2, 2) for _ in range(batch["mask"].shape[1])] for _ in rows])
    total = 0.0
    for part in (slice(0, len(rows) // 2), slice(len(rows) // 2, len(rows))):  # two micro-batches
        mb = {k: v[rows[part]] for k, v in batch.items() if k in ("weight", "bin", "mask")}
        total += algo.loss(token_loss[part], mb).item()
    return total, token_loss


def _reference_daro(seqs, trained, f, s, token_loss):
    """The reference's coefficients, loss and L_mu for given token losses (what reference.update does with the
    model's)."""
    trained_in_bins = reference.trained_tokens(seqs, f, trained)
    coef, bin_tokens = reference.coefficients(seqs, trained_in_bins, f, s)
    loss = math.fsum(coef[i][t] * token_loss[i][t].item() for i in range(len(seqs)) for t in range(len(coef[i])))
    bin_loss = {}
    for i, tr in enumerate(trained_in_bins):
        for t, on in enumerate(tr):
            if on and f.weighting != "none":
                b = reference.bin_of(seqs, i)
                bin_loss[b] = bin_loss.get(b, 0.0) + token_loss[i][t].item() / bin_tokens[b]
    return loss, bin_loss


@pytest.mark.parametrize("weighting,literal", [("learned", False), ("learned", True), ("uniform", False),
                                               ("var", False)])
def test_daro_loss_weight_steps_and_state_dict(weighting, literal):
    """DARO.start_update, loss (over micro-batches), after_update over three updates (bins absent from some, w
    reaching its clamp) and a state_dict round trip after the second: the loss, L_mu and s_mu after each step equal
    the reference's (its objective's gradient in closed form, its written-out Adam; static weights do not move), and
    the resumed copy continues exactly as the original."""
    rng = random.Random(3)
    G = 4
    cfg = _config("daro", group_size=G, weighting=weighting, weight_lr=0.3, daro_literal=literal, w_min=0.8,
                  w_max=1.5)
    batch, seqs, trained = _random_batch(rng, G, 6, rates=(0.0, 0.3, 0.6))
    f, default = _flags(cfg), torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # DARO's w_mu and L_mu accumulators in float64, as the batch
    try:
        algo = daro.DARO(cfg, torch.device("cpu"), {})
        algo.advantages(batch, [{}] * 6)
        adam, resumed = reference.Adam([0.0] * (G - 1), f), None
        for u, groups in enumerate([[0, 1, 2, 3], [4, 5], [1, 5]]):  # the bins present change from update to update
            rows = torch.tensor([g * G + j for g in groups for j in range(G)])
            sub = [seqs[i] for i in rows.tolist()]
            sub = [Seq(s.prompt, s.completion, k // G, s.reward, s.correct, s.old_logp) for k, s in enumerate(sub)]
            copy = {k: v.clone() for k, v in batch.items()}  # for the resumed copy (start_update writes "weight")
            loss, token_loss = _daro_update(algo, batch, rows, random.Random(u))
            ref_loss, bin_loss = _reference_daro(sub, [trained[i] for i in rows.tolist()], f, adam.s, token_loss)
            assert abs(loss - ref_loss) < harness.TOL * max(1.0, abs(ref_loss))
            assert all(abs(algo.bin_loss[b].item() - bin_loss.get(b, 0.0)) < harness.TOL for b in range(G + 1))
            algo.after_update()
            if weighting == "learned":
                adam.step(reference.weight_objective(bin_loss, adam.s, f)[1])
            assert [s.item() for s in algo.neg_log_w] == pytest.approx(adam.s, abs=harness.TOL)
            if resumed is not None:  # the copy made from the state dict does the same update
                _daro_update(resumed, copy, rows, random.Random(u))
                resumed.after_update()
                assert [s.item() for s in resumed.neg_log_w] == [s.item() for s in algo.neg_log_w]
            if u == 1:
                resumed = daro.DARO(cfg, torch.device("cpu"), algo.state_dict())
        if weighting != "learned":
            return
        bounds = (-math.log(cfg.w_max), -math.log(cfg.w_min))
        assert any(min(abs(x - b) for b in bounds) < 1e-12 for x in adam.s), "no weight reached its clamp"
        assert min(adam.k) < 3 and max(adam.k) >= 2, "a bin absent from an update, and one with a second Adam step"
    finally:
        torch.set_default_dtype(default)


@pytest.mark.parametrize("literal", [False, True])
def test_daro_weight_objective_and_gradient(literal):
    """daro.weight_objective and its autograd gradient equal the reference's J(s) and dJ/ds in closed form, over the
    bins present only (bins 0 and G and absent bins contribute nothing)."""
    G, f = 6, Flags(G=6, weighting="learned", daro_literal=literal, daro_delta=0.01)
    s = [0.3, -0.2, 0.0, 0.7, -1.0]
    bin_loss = {0: 5.0, 1: 0.4, 2: -0.3, 4: 1.2, 6: -7.0}  # bins 3 and 5 absent
    J, grad = reference.weight_objective(bin_loss, s, f)
    s_t = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in s]
    L = torch.tensor([bin_loss.get(b, 0.0) for b in range(G + 1)], dtype=torch.float64)
    present = torch.tensor([b in bin_loss for b in range(G + 1)])
    value = daro.weight_objective(s_t, L, present, f.daro_delta, literal)
    value.backward()
    assert abs(value.item() - J) < harness.TOL
    for b in range(1, G):
        assert (s_t[b - 1].grad is None) == (b not in grad)
        if b in grad:
            assert abs(s_t[b - 1].grad.item() - grad[b]) < harness.TOL
