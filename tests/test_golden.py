"""The golden vectors (tests/data/golden.json): written by integrations/make_golden.py from the project's functions,
checked by integrations/golden.py. Here: the file is what the script writes, the project's functions pass the checker
in float64, two small cases agree with a hand computation, and the checker does fail a wrong implementation."""
import json
import os

import pytest
import torch

from tests.conftest import ROOT
from integrations import golden, make_golden

from tests import golden_port


def test_file_is_what_the_script_writes():
    with open(golden.DEFAULT_PATH) as f:
        assert f.read() == make_golden.dumps(make_golden.build()), "run python -m integrations.make_golden"


def test_project_functions_pass_the_checker():
    report = golden.check(**make_golden.PROJECT)
    assert report["mismatches"] == [] and report["skipped"] == []
    data = golden.load()
    assert report["cases"] == sum(len(data[s]) for s in golden.SECTIONS) >= 19
    assert report["values"] > 2000  # every expected number of every case was compared


def test_hand_checked_cases():
    data = golden.load()
    # G = 4, one correct of four, rewards [1, -1, -1, -1]: mean -0.5, unbiased std sqrt((1.5^2 + 3 * 0.5^2) / 3) = 1,
    # so A = [1.5, -0.5, -0.5, -0.5] / (1 + 1e-6); p_hat = 1/4 < tau = 0.5: the correct one's A doubles (lam = 2)
    case = next(c for c in data["advantages"] if c["name"] == "hand_G4_one_correct")["expected"]
    d = 1 + 1e-6
    assert case["advantages_before"][0] == pytest.approx([1.5 / d, -0.5 / d, -0.5 / d, -0.5 / d], rel=1e-15)
    assert case["advantages_after"][0] == pytest.approx([3.0 / d, -0.5 / d, -0.5 / d, -0.5 / d], rel=1e-15)
    assert case["amplified"] == [[True, False, False, False]]
    # DARO, G = 4: bins [1, 1, 3] with 2, 4, 5 tokens -> token weights 1/6, 1/6, 1/5 (daro.bin_token_weights' example)
    # L_1 = (0.5 - 0.25 + 1 + 1 - 1 + 0.5) / 6 = 1.75 / 6, L_3 = 5 * 0.2 / 5 = 0.2; w = 1 (s = 0): model loss
    # L_1 + L_3; weight objective sum (|L| + delta) w - ln w = L_1 + L_3 + 2 delta; its gradient in s: 1 - (|L| + delta)
    # A correct answer at the cap: rewards [0, -1, -1, -1] (1 - 1 at the cap; R = 0, not > 0): mean -0.75, unbiased std
    # sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5, A = [0.75, -0.25, -0.25, -0.25] / (0.5 + 1e-6): A > 0, so amplified
    case = next(c for c in data["advantages"] if c["name"] == "G4_correct_at_cap_amplified")["expected"]
    d = 0.5 + 1e-6
    assert case["rewards"][0] == [0.0, -1.0, -1.0, -1.0]
    assert case["advantages_after"][0] == pytest.approx([1.5 / d, -0.25 / d, -0.25 / d, -0.25 / d], rel=1e-15)
    assert case["amplified"][0] == [True, False, False, False]
    case = next(c for c in data["daro"] if c["name"] == "hand_G4")["expected"]
    L1, L3, delta = 1.75 / 6, 0.2, 1e-3
    assert case["token_weights"][0][:2] == pytest.approx([1 / 6, 1 / 6]) and case["token_weights"][2][0] == 0.2
    assert case["bin_loss"] == pytest.approx([0, L1, 0, L3, 0], rel=1e-15)
    assert case["model_loss"] == pytest.approx(L1 + L3, rel=1e-15)
    assert case["weight_objective"] == pytest.approx(L1 + L3 + 2 * delta, rel=1e-15)
    assert case["weight_grad"] == pytest.approx([1 - L1 - delta, 0.0, 1 - L3 - delta], rel=1e-15)


def test_no_two_cases_alike():
    """Each case tests something the others do not: no two cases of a section share their inputs or their outputs."""
    data = golden.load()
    for section in golden.SECTIONS:
        inputs = [json.dumps(c["inputs"], sort_keys=True) for c in data[section]]
        outputs = [json.dumps(c["expected"], sort_keys=True) for c in data[section]]
        assert len(set(inputs)) == len(inputs) and len(set(outputs)) == len(outputs), section
    daro = {c["name"]: c for c in data["daro"]}
    assert all(daro["G8_random"]["expected"]["present"])  # every bin 0..G: the absent-bin cases differ from it
    assert not daro["G8_absent_bins"]["expected"]["present"][2] and not daro["G8_absent_bins"]["expected"]["present"][5]


def test_checker_fails_a_wrong_implementation():
    # DAA applied to every correct completion, whatever its group's pass rate: the hard-group test is what matters
    def no_tau(inp):
        out = make_golden.project_advantages({**inp, "tau": 1.01})
        return {"advantages_after": out["advantages_after"], "amplified": out["amplified"]}
    report = golden.check(advantages=no_tau)
    assert report["mismatches"] and all("advantages_after" in m or "amplified" in m for m in report["mismatches"])

    # the same numbers in float32: off by ~1e-7 relative, far outside the float64 tolerance
    def float32(inp):
        return {k: v.float().double() if v.is_floating_point() else v for k, v in
                make_golden.project_loss_agg(inp).items()}
    assert golden.check(loss_agg=float32)["mismatches"]

    # a wrong shape and a callable that declines a case
    report = golden.check(daro=lambda inp: {"bin_loss": [0.0]} if inp["G"] == 4 else None)
    assert "expected a list of 5, got list of 1" in report["mismatches"][0] and len(report["skipped"]) == 5


def test_clear_error_on_g_mismatch():
    inp = json.loads(json.dumps(golden.load()["advantages"][1]["inputs"]))
    with pytest.raises(ValueError, match="G = 4 but the groups have 8 completions"):
        make_golden.project_advantages({**inp, "G": 4})


def test_checker_cli_needs_only_the_standard_library():
    from tests.conftest import run_script
    out = run_script(["-S", "-c", "import sys; from integrations import golden;"
                      "assert 'torch' not in sys.modules; print(len(golden.load()['daro']))"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(len(golden.load()["daro"]))
    assert os.path.exists(os.path.join(ROOT, "tests", "data", "golden.json"))


def test_float64_throughout():
    out = make_golden.project_daro(golden.load()["daro"][1]["inputs"])
    assert out["token_weights"].dtype == out["bin_loss"].dtype == out["model_loss"].dtype == torch.float64


def test_an_independent_port_from_the_conventions_page_passes():
    report = golden.check(golden.DEFAULT_PATH, advantages=golden_port.advantages, daro=golden_port.daro,
                          loss_agg=golden_port.loss_agg)
    assert not report["mismatches"] and not report["skipped"], report["mismatches"][:5]
    assert report["cases"] == sum(len(golden.load()[s]) for s in golden.SECTIONS)
