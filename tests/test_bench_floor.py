"""bench/vs_trl_floor.py's accounting checked by hand on a profiled block of known work: the GEMMs' FLOPs
(2 M N K each), their self time, and sdpa's kernels kept apart from them. No TRL needed (it is imported only
to run)."""
import sys

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from bench import vs_trl_floor as floor


def test_kernel_seconds_counts_gemm_flops_per_step_and_keeps_attention_apart():
    torch.manual_seed(0)
    a, b, bias = torch.randn(64, 32), torch.randn(32, 48), torch.randn(48)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    steps = 2
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        for _ in range(3):
            a @ b  # aten::mm
            torch.addmm(bias, a, b)  # aten::addmm
            torch.bmm(q[0], k[0].transpose(1, 2))  # aten::bmm: (4, 16, 8) x (4, 8, 16)
            torch.nn.functional.scaled_dot_product_attention(q, k, v)
    out = floor.kernel_seconds(prof, steps)
    flops = 3 * (2 * 64 * 32 * 48 * 2 + 2 * 4 * 16 * 8 * 16)
    assert abs(out["gflop"] - flops / 1e9 / steps) < 1e-12
    gemm_self = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in floor.GEMMS) / 1e6 / steps
    assert gemm_self > 0 and out["gemm_s"] == pytest.approx(gemm_self, rel=1e-12)  # summed in another order
    attention = [e for e in prof.key_averages() if floor.ATTENTION in e.key and e.key.startswith("aten::_")]
    attention_s = sum(e.self_cpu_time_total for e in attention) / 1e6 / steps
    assert attention_s > 0 and out["attention_s"] == pytest.approx(attention_s, rel=1e-12)


def test_its_settings_are_vs_trls(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["vs_trl_floor.py", "--workload", "reasoning", "--steps", "3"])
    args, repeats, with_compile = floor.parse_args()
    assert (args.workload, args.steps, args.max_new_tokens) == ("reasoning", 3, 72)
    assert (repeats, with_compile) == (3, False)
    assert vars(args) == vars(floor.vs_trl.parse_args(["--workload", "reasoning", "--steps", "3"]))
