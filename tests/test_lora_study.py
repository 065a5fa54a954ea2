"""experiments/lora_study.py's decisions, without its runs: the equivalence test (TOST) against a t-table value, the
sweep's rule (the best mean; a tie to the smaller rate; one x3 extension at an end of the grid), and Holm across the
endpoints. Run: python -m pytest -q tests/test_lora_study.py"""
import math

import pytest

from experiments import lora_study as study


def test_tost_p_against_the_t_table():
    """Four paired differences whose mean sits 2.3534 standard errors inside the +-3 point margin: t(0.95, 3) =
    2.3534, so the equivalence p-value is 0.05; the other one-sided test is far from binding."""
    spread = [-0.015, 0.005, -0.005, 0.015]  # sd = sqrt(5e-4 / 3), se = sd / 2
    se = math.sqrt(5e-4 / 3) / 2
    mean = study.MARGIN - 2.3534 * se
    assert study.tost_p([mean + x for x in spread], study.MARGIN) == pytest.approx(0.05, abs=2e-5)
    assert study.tost_p([-mean + x for x in spread], study.MARGIN) == pytest.approx(0.05, abs=2e-5)  # symmetric
    assert study.tost_p([0.05 + x for x in spread], study.MARGIN) > 0.5  # a mean outside the margin
    assert study.tost_p([0.0] * 4, study.MARGIN) == 0.0 and study.tost_p([0.04] * 4, study.MARGIN) == 1.0


def fake_sweep(monkeypatch, accuracy):
    """sweep() with each run's accuracy endpoint = accuracy(task, arm, lr) (seed-independent), and the runs asked."""
    asked = []
    monkeypatch.setattr(study, "get", lambda runs, t, a, lr, s: asked.append((t, a, lr, s)) or (t, a, lr))
    monkeypatch.setattr(study, "endpoint", lambda run, task, metric: accuracy(*run))
    return study.sweep({}), asked


def test_the_sweep_takes_the_best_rate_and_extends_an_edge_once(monkeypatch):
    best = {"full": 3e-4, "lora_r1": 1e-3, "lora_r8": 4e-3, "lora_r32": 0.027}  # inside, just past, far past

    def accuracy(task, arm, lr):
        return 0.8 - abs(math.log(lr / best[arm]))
    chosen, asked = fake_sweep(monkeypatch, accuracy)
    for t in study.TASKS:
        assert chosen[t, "full"]["lr"] == 3e-4 and not chosen[t, "full"]["at_edge"]
        assert chosen[t, "lora_r1"]["lr"] == 1e-3 and chosen[t, "lora_r1"]["grid"] == [3e-4, 1e-3, 3e-3]
        assert chosen[t, "lora_r8"]["lr"] == 3e-3 and not chosen[t, "lora_r8"]["at_edge"]  # inside once extended
        assert chosen[t, "lora_r8"]["grid"] == pytest.approx([3e-4, 1e-3, 3e-3, 9e-3])
        assert chosen[t, "lora_r32"]["lr"] == pytest.approx(9e-3) and chosen[t, "lora_r32"]["at_edge"]  # said
        assert len(chosen[t, "lora_r32"]["grid"]) == 4
    assert {s for *_, s in asked} == set(study.SWEEP_SEEDS)
    chosen, _ = fake_sweep(monkeypatch, lambda task, arm, lr: 0.5)  # all tied: the smallest rate, then extended down
    assert chosen["hard", "full"]["lr"] == pytest.approx(1e-5) and chosen["hard", "full"]["at_edge"]


def test_the_endpoints_are_the_registered_twelve():
    assert len(study.ENDPOINTS) == 12 and len({e["id"] for e in study.ENDPOINTS}) == 12
    assert {(e["task"], e["arm"], e["metric"]) for e in study.ENDPOINTS} == {
        (t, f"lora_r{r}", m) for t in ("reasoning", "hard") for r in (1, 8, 32) for m in ("acc", "pass@k")}
    assert all(e["vs"] == "full" for e in study.ENDPOINTS)
    assert study.MARGIN == 0.03 and study.TEST_SEEDS == list(range(8))
