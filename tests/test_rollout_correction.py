"""The rollout/trainer mismatch correction (--rollout_is, token or sequence level, truncated or masked) by hand, its
metrics, holes in the loss mask, and our sampler's own log-probs as the engine side."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import shortcuts
import config
import common
import da3po
import engine as eng
import modeling
import ranks
from tests.conftest import ROOT, random_batch, weighted_loss


def correction_batch():
    """Two completions of 3 and 2 tokens with hand-picked trainer and rollout log-probs: log r = old - rollout."""
    old = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -1.5, 0.0]], dtype=torch.float64)
    log_r = torch.tensor([[0.1, -0.9, 0.3], [1.0, 0.2, 0.0]], dtype=torch.float64)  # token ratios e^.1 e^-.9 ...
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return {"mask": mask, "old_logp": old, "rollout_logp": old - log_r}


def cfg_for(level, cap=2.0, mask=False):
    return config.parse_config(da3po.Config, ["--rollout_is", level, "--rollout_is_cap", str(cap)]
                               + (["--rollout_is_mask"] if mask else []), da3po.PRESETS)


def test_rollout_is_token_truncation_by_hand():
    batch = correction_batch()
    metrics = common.rollout_correction(batch, cfg_for("token", cap=2.0))
    r = [[math.exp(0.1), math.exp(-0.9), math.exp(0.3)], [math.exp(1.0), math.exp(0.2), 0.0]]
    expected = [[r[0][0], r[0][1], r[0][2]], [2.0, r[1][1], 0.0]]  # e^1 = 2.72 truncated at C = 2
    assert torch.allclose(batch["is_weight"], torch.tensor(expected, dtype=torch.float64), atol=1e-12)
    assert batch["mask"].tolist() == [[1, 1, 1], [1, 1, 0]]  # truncation rejects nothing
    assert metrics["rollout_is/truncated_frac"] == pytest.approx(1 / 5)
    assert metrics["rollout_is/weight_max"] == pytest.approx(2.0)
    assert metrics["rollout_is/weight_mean"] == pytest.approx((r[0][0] + r[0][1] + r[0][2] + 2.0 + r[1][1]) / 5)


def test_rollout_is_sequence_level_by_hand():
    batch = correction_batch()
    common.rollout_correction(batch, cfg_for("sequence", cap=3.0))
    w0, w1 = math.exp(0.1 - 0.9 + 0.3), min(math.exp(1.2), 3.0)  # products of the token ratios; e^1.2 = 3.32 > C
    assert torch.allclose(batch["is_weight"], torch.tensor([[w0] * 3, [w1, w1, 0.0]], dtype=torch.float64))


def test_rollout_is_mask_leaves_the_denominator():
    """A rejected token is out of the loss AND out of its token-mean denominator: the loss equals the formula over
    the kept tokens only (zeroing its weight but still counting it would divide by 5 instead of 4)."""
    batch = correction_batch()
    metrics = common.rollout_correction(batch, cfg_for("token", cap=2.0, mask=True))
    assert batch["mask"].tolist() == [[1, 0, 1], [0, 1, 0]]  # e^-0.9 = 0.41 < 1/2 and e^1 = 2.72 > 2: rejected
    batch2 = correction_batch()
    common.rollout_correction(batch2, cfg_for("token", cap=3.0, mask=True))
    assert batch2["mask"].tolist() == [[1, 1, 1], [1, 1, 0]]  # within [1/3, 3] everything stays
    assert metrics["rollout_is/masked_frac"] == pytest.approx(2 / 5)
    logp = batch["old_logp"] + 0.05  # the policy moved a little
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    weights = common.loss_weights(batch["mask"].to(torch.float64), "token-mean", 3)
    loss, _ = weighted_loss(logp, batch["old_logp"], adv, weights, 0.2, 0.28, is_weight=batch["is_weight"])
    kept = [(i, t) for i in range(2) for t in range(3) if batch["mask"][i, t]]
    ratio = math.exp(0.05)
    expected = sum(max(-adv[i].item() * ratio, -adv[i].item() * min(max(ratio, 0.8), 1.28))
                   * batch["is_weight"][i, t].item() for i, t in kept) / len(kept)
    assert len(kept) == 3 and loss.item() == pytest.approx(expected, abs=1e-12)
    # a sequence rejected whole also leaves the per-sequence mean (seq-mean-token-mean counts 1 sequence, not 2)
    seq = correction_batch()
    common.rollout_correction(seq, cfg_for("sequence", cap=3.0, mask=True))
    assert seq["mask"].tolist() == [[1, 1, 1], [0, 0, 0]]
    w = common.loss_weights(seq["mask"].to(torch.float64), "seq-mean-token-mean", 3)
    assert torch.allclose(w[0], torch.full((3,), 1 / 3, dtype=torch.float64)) and w[1].sum() == 0


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mismatch_metrics_do_not_depend_on_rollout_is_mask(demo_dir, level):
    """The engine/trainer gap is measured on the same tokens with and without --rollout_is_mask: the tokens (or
    sequences) the mask rejects are the most mismatched ones, and leaving them out would make a worse engine read
    better. A real model's micro-batches, an engine off by a spread of errors, two tokens in its top_p nucleus but
    outside pi_old's: every rollout/* metric is the same under both flags."""
    model, tok = modeling.load_model(demo_dir, torch.device("cpu"))
    batch = random_batch(tok, 8, seed=5)
    T = batch["mask"].shape[1]
    with torch.no_grad():
        batch["old_logp"] = shortcuts.token_logprobs(model, batch["input_ids"], batch["attention_mask"], T)[0]
    g = torch.Generator().manual_seed(0)
    batch["old_logp_nucleus"] = batch["old_logp"].clone()
    batch["old_logp_nucleus"][[0, 3], [0, 1]] = modeling.OUTSIDE_NUCLEUS  # pi_old's nucleus left them out
    batch["rollout_logp"] = batch["old_logp"] - torch.randn(batch["old_logp"].shape, generator=g) * batch["mask"]
    metrics = []
    for mask in (False, True):
        b = {k: v.clone() for k, v in batch.items()}
        cfg = config.parse_config(da3po.Config, ["--top_p", "0.9", "--rollout_is", level, "--rollout_is_cap",
                                                      "3"] + (["--rollout_is_mask"] if mask else []), da3po.PRESETS)
        correction = common.rollout_correction(b, cfg)
        b["weight"] = common.loss_weights(b["mask"], "token-mean", 40)
        sums = common.Sums(*common.TRAIN_SUMS)
        for _, mb in common.micro_batches(b, torch.arange(8), 3):
            common.token_losses(model, None, mb, cfg, torch.device("cpu"), sums)
        metrics.append({k: v for k, v in common.train_metrics(sums.reduce(), 1, 1e-4, True).items()
                        if k.startswith("rollout/")})
    assert correction["rollout_is/masked_frac"] > 0.1  # the mask did reject tokens
    assert metrics[0]["rollout/nucleus_boundary_frac"] > 0 and metrics[0]["rollout/kl_k3"] > 0.1
    assert metrics[1] == metrics[0]


@pytest.mark.parametrize("max_tokens", [0, 64], ids=["fixed", "token-budget"])
def test_a_hole_in_the_mask_keeps_the_tokens_after_it(max_tokens):
    """Rows of 6 and 3 completion tokens, the 3rd token of the first rejected (a hole in the loss
    mask, as --rollout_is_mask makes). Its 4th-6th tokens are still trained, so every micro-batch keeps the row's 6
    columns: the micro-batches carry the update's whole token weight, 1.000 (trimming on the mask's row sums kept 5
    columns and carried 0.875)."""
    ids, attn, mask = common.pad_prompt_completion([[5, 6], [7]], [[1, 2, 3, 4, 5, 6], [1, 2, 3]], 0)
    batch = {"input_ids": ids, "attention_mask": attn, "mask": mask, "group": torch.tensor([0, 1])}
    batch["mask"][0, 2] = 0  # rejected
    batch["weight"] = common.loss_weights(batch["mask"].double(), "token-mean", 8)  # 1/8 per kept token
    assert batch["weight"].sum().item() == pytest.approx(1.0)
    carried, widths = 0.0, []
    for _, mb in common.micro_batches(batch, torch.arange(2), 2, max_tokens):
        carried += mb["weight"].sum().item()
        widths.append(mb["mask"].shape[1])
    assert carried == pytest.approx(1.0, abs=1e-12) and max(widths) == 6, (carried, widths)


def test_mismatch_metrics_leave_nucleus_boundary_tokens_out():
    """1,000 trained tokens with a small engine/trainer gap (log r ~ N(0, 0.0187^2): KL ~ 1.75e-4)
    and one more the engine drew from its top_p nucleus but outside pi_old's (OUTSIDE_NUCLEUS): the gap is measured on
    the 1,000 (kl_k3 ~ 1.75e-4, not ~10.5) and the boundary token is a share of its own, 1/1001."""
    g = torch.Generator().manual_seed(0)
    old = torch.randn(1, 1001, generator=g, dtype=torch.float64) - 2.0
    log_r = 0.0187 * torch.randn(1, 1001, generator=g, dtype=torch.float64)
    mb = {"mask": torch.ones(1, 1001, dtype=torch.long), "old_logp": old, "old_logp_nucleus": old.clone(),
          "rollout_logp": old - log_r}
    mb["old_logp_nucleus"][0, 500] = modeling.OUTSIDE_NUCLEUS
    totals = {**dict.fromkeys(common.TRAIN_SUMS, 0.0), **common.mismatch_sums(mb), "tokens": 1001.0}
    m = common.train_metrics(totals, 1, 1e-4, True)
    inside = torch.cat([log_r[0, :500], log_r[0, 501:]])
    assert m["rollout/kl_k3"] == pytest.approx((inside.exp() - 1 - inside).mean().item(), rel=1e-12)
    assert 1e-4 < m["rollout/kl_k3"] < 3e-4 and m["rollout/logprob_diff"] < 0.03
    assert m["rollout/nucleus_boundary_frac"] == pytest.approx(1 / 1001)


class MismatchedRollout(eng.HFRollout):
    """A deliberately mismatched engine: it samples at 2 x the temperature it is asked for and reports the log-probs
    of what it really sampled from, as an engine with other kernels or precision would differ from the trainer."""
    def __init__(self, *args):
        super().__init__(*args)
        self.exact_logprobs = False

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, n=1, seed=None):
        return eng.hf_generate(self.model, self.tok, prompts, max_new_tokens, temperature * 2.0, top_p,
                                  self.batch_size, n)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_is_with_a_mismatched_engine(tmp_path, monkeypatch, level):
    monkeypatch.setattr(da3po, "make_rollout", lambda cfg, model, tok, dist_info, path: MismatchedRollout(
        model, tok, dist_info))
    cfg = config.parse_config(da3po.Config, ["--demo", "arith", "--steps", "2", "--out_dir", str(tmp_path),
                                                  "--prompts_per_step", "8", "--eval_size", "10", "--eval_samples", "2",
                                                  "--rollout_is", level, "--rollout_is_cap", "1.05"], da3po.PRESETS)
    da3po.main(cfg)
    train = [r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "train/loss" in r]
    for r in train:
        assert r["rollout/kl_k3"] > 1e-3 and r["rollout/logprob_diff"] > 1e-2  # the mismatch is there
        assert r["rollout_is/truncated_frac"] > 0 and r["rollout_is/weight_max"] <= 1.05 + 1e-6
        assert 0 < r["rollout_is/weight_mean"] <= 1.05 and math.isfinite(r["train/loss"])


def test_importance_weights_of_our_sampler_are_1_under_top_p(demo_dir):
    """Our sampler at top_p 0.7 returns the log-probs of the nucleus it sampled from, as vLLM does; the trainer's pi_old
    is then compared renormalised over its own nucleus: weights of 1 (float32, the same weights), token and sequence.
    Against the full softmax they would be below 1 on every token whose nucleus left mass out."""
    model, tok = modeling.load_model(demo_dir, torch.device("cpu"))
    cfg = config.parse_config(da3po.Config, ["--top_p", "0.7", "--rollout_is", "sequence"], da3po.PRESETS)
    engine = eng.HFRollout(model, tok, ranks.DistInfo(), "float32", 512, cfg.top_p)
    assert not engine.exact_logprobs  # at top_p < 1 they are not pi_old: the trainer recomputes it
    problems = [{"prompt": p, "answer": "1", "prompt_ids": tok(p, add_special_tokens=False)["input_ids"]}
                for p in ("12+7", "305+96", "4+4", "77+15")]
    torch.manual_seed(0)
    groups = common.roll_groups(engine, tok, problems, cfg, 4, 1.0, cfg.top_p)[0]
    batch = common.make_batch(groups, tok.pad_token_id)
    batch.update(common.old_logprobs(model, batch, cfg, torch.device("cpu"), engine, groups))
    m = common.rollout_correction(batch, cfg)
    assert abs(m["rollout_is/weight_mean"] - 1) < 1e-4 and m["rollout_is/truncated_frac"] == 0, m
    token_full = torch.exp((batch["old_logp"] - batch["rollout_logp"]) * batch["mask"])
    assert token_full.min() < 0.9  # what comparing with the full softmax would have weighed


def test_bf16_sampler_log_probs_are_measured_not_assumed(tmp_path):
    """In bf16 our sampler runs under the trainer's autocast, so it samples from the bf16 policy the trainer trains,
    but its log-probs come from other kernels (a KV cache, row by row): they are not taken as pi_old. The trainer
    recomputes pi_old and logs the gap; no note says that there is no mismatch."""
    r = subprocess.run([sys.executable, "da3po.py", "--demo", "arith", "--steps", "2", "--out_dir", str(tmp_path),
                        "--dtype", "bfloat16", "--prompts_per_step", "8", "--eval_size", "10", "--eval_samples", "2", "--rollout_is", "token"],
                       cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "changes nothing here" not in r.stdout
    train = [x for x in map(json.loads, open(tmp_path / "metrics.jsonl")) if "train/loss" in x]
    for x in train:
        assert 0 < x["rollout/logprob_diff"] < 0.05, x  # measured; small: both sides compute in bf16
        assert abs(x["rollout_is/weight_mean"] - 1) < 0.05


def test_clip_fractions_count_only_the_tokens_the_loss_counts(demo_dir):
    """Half the rows rejected by --rollout_is_mask, every other token's ratio far above 1 + clip_high with A > 0: the
    clipped share is 1.0 (the rejected tokens are not in its denominator), not 0.5."""
    model, tok = modeling.load_model(demo_dir, torch.device("cpu"))
    batch = random_batch(tok, 6, seed=3)
    T = batch["mask"].shape[1]
    with torch.no_grad():
        logp = shortcuts.token_logprobs(model, batch["input_ids"], batch["attention_mask"], T)[0]
    batch["old_logp"] = logp - 5.0  # ratio e^5
    batch["rollout_logp"] = batch["old_logp"] + 5.0 * (torch.arange(6) % 2 == 1)[:, None]  # odd rows: w = e^-5
    batch["advantage"] = torch.ones(6)
    cfg = config.parse_config(da3po.Config, ["--logprob_chunk", "0", "--rollout_is", "token", "--rollout_is_mask"],
                              da3po.PRESETS)
    kept = int((batch["mask"] * (torch.arange(6) % 2 == 0)[:, None]).sum())
    common.rollout_correction(batch, cfg)
    batch["weight"] = common.loss_weights(batch["mask"], "token-mean", 40)
    sums = common.Sums(*common.TRAIN_SUMS)
    for _, mb in common.micro_batches(batch, torch.arange(6), 6):
        common.token_losses(model, None, mb, cfg, torch.device("cpu"), sums)
    m = common.train_metrics(sums.reduce(), 1, 1e-4, True)
    assert m["train/clipfrac_high"] == 1.0 and m["train/clipfrac_low"] == 0.0
    assert sums.values["tokens"] == sums.values["clip_high"] == kept > 0
