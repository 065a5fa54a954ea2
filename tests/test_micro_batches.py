"""Token-budget micro-batches (--micro_batch_tokens): the same loss and gradient as fixed micro-batches with less
padding, the update plan balanced over ranks, and the padding a run logs."""
import json
import math

import pytest
import torch

import shortcuts
import config
import common
import da3po
import modeling
import ranks
from tests.conftest import random_batch, weighted_loss


def test_token_budget_micro_batches_same_loss_and_gradient_less_padding(demo_dir):
    """Packed by length vs fixed micro-batches of 6 rows: the same loss and gradient (float64, so 1e-6 measures the
    split, not float32's summation order), and far less padding on skewed lengths."""
    model, tok = modeling.load_model(demo_dir, torch.device("cpu"))
    model.double().train()
    batch = random_batch(tok, 24, seed=1, skew=True)
    T = batch["mask"].shape[1]
    with torch.no_grad():
        batch["old_logp"] = shortcuts.token_logprobs(model, batch["input_ids"], batch["attention_mask"], T)[0] - 0.05
    batch["weight"] = common.loss_weights(batch["mask"].double(), "token-mean", 40)
    batch["advantage"] = batch["advantage"].double()
    rows = torch.arange(24)

    def run(size, max_tokens):
        model.zero_grad()
        total, padded, real, seen = 0.0, 0, 0, []
        for r, mb in common.micro_batches(batch, rows, size, max_tokens):
            seen += r.tolist()
            padded += mb["attention_mask"].numel()
            real += mb["attention_mask"].sum().item()
            assert len(r) <= size and (max_tokens == 0 or len(r) == 1 or mb["attention_mask"].numel() <= max_tokens)
            logp, _ = shortcuts.token_logprobs(model, mb["input_ids"], mb["attention_mask"], mb["mask"].shape[1])
            loss, _ = weighted_loss(logp, mb["old_logp"], mb["advantage"], mb["weight"], 0.2, 0.28)
            loss.backward()
            total += loss.item()
        assert sorted(seen) == rows.tolist()  # every row once
        return total, [p.grad.clone() for p in model.parameters()], 1 - real / padded

    loss_fixed, grads_fixed, pad_fixed = run(6, 0)
    loss_packed, grads_packed, pad_packed = run(64, 160)
    assert loss_packed == pytest.approx(loss_fixed, abs=1e-6)
    for a, b in zip(grads_fixed, grads_packed):
        assert (a - b).abs().max() <= 1e-6 * max(1.0, a.abs().max().item())
    assert pad_packed < pad_fixed / 2, (pad_packed, pad_fixed)


def test_plan_updates_balances_tokens_over_ranks():
    groups = [{"prompt_len": 3, "lengths": [n] * 2, "correct": [True, False]}
              for n in (40, 1, 1, 30, 2, 2, 25, 3, 1, 1, 1, 1)]  # kept summaries (dynamic_sampling)
    plans = [common.plan_updates(groups, 2, ranks.DistInfo(rank=r, world_size=2), balance=True) for r in (0, 1)]
    for u in range(2):  # each update: the 6 groups shared 3 and 3, heavy ones on different ranks
        shares = [[id(g) for g in plan[0][u * 3:(u + 1) * 3]] for plan in plans]
        assert len(set(shares[0]) | set(shares[1])) == 6
        loads = [sum(shortcuts.group_tokens(g) for g in plan[0][u * 3:(u + 1) * 3]) for plan in plans]
        assert max(loads) - min(loads) <= max(shortcuts.group_tokens(g) for g in groups[u * 6:(u + 1) * 6])
    strided = common.plan_updates(groups, 2, ranks.DistInfo(rank=0, world_size=2))
    loads = [sum(shortcuts.group_tokens(g) for g in strided[0][:3])]
    assert loads[0] > sum(shortcuts.group_tokens(g) for g in plans[0][0][:3])  # without balance rank 0 gets 40, 30 (+2)
    mine, updates = common.plan_updates(groups, 5, ranks.DistInfo(rank=1, world_size=2))
    assert [len(u) for u in updates] == [4, 2, 2, 2, 2] and len(mine) == 6  # 6 groups per rank in 5 updates


def test_token_budget_run_logs_padding(tmp_path):
    cfg = config.parse_config(da3po.Config, ["--demo", "arith", "--steps", "1", "--out_dir", str(tmp_path),
                                                  "--prompts_per_step", "8", "--eval_size", "10", "--eval_samples", "2",
                                                  "--micro_batch_tokens", "120"], da3po.PRESETS)
    da3po.main(cfg)
    train = [r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "train/loss" in r]
    assert 0 <= train[0]["perf/pad_frac"] < 0.5 and math.isfinite(train[0]["train/loss"])
