"""bench/replication_cost.py's arithmetic checked by hand: one recipe's GPU-hours written out independently here,
dynamic sampling's expected batches, the synchronous tail, and the published-run check (its ratio, and that the
published figure lies inside the band the script's stated response range spans). No torch: a second."""
import math

from bench import replication_cost as rc
from tests.conftest import run_script


def test_daro_recipe_on_h100_by_hand():
    # DARO's 8-GPU recipe: Qwen2.5-Math-7B, 128 prompts x 8, no dynamic sampling, 300 steps, eval every 20 steps
    N = 7_615_616_512
    L, p = 1000, 200                       # the script's response and prompt means for a 3,000-token budget
    bw, mem, peak = 3.35e12, 80e9, 989e12  # H100
    kvb = 2 * 28 * 4 * 128 * 2             # bytes per token: K and V, 28 layers, 4 KV heads of 128, bf16
    seqs = 128 * 8 + (30 * 32 * 2 + (500 + 1319 + 272 + 675) * 8) / 20  # training + the eval's share per step
    ctx = p + L / 2
    kv = 0.86 * mem - 3e9 - 2 * N          # --vllm_gpu_memory 0.86 less the engine's fixed 3 GB and its weights
    batch = min(kv / (kvb * ctx), 256, seqs / 8)
    t_dec = max((2 * N + batch * ctx * kvb) / bw, batch * (2 * N + 4 * 28 * 28 * 128 * ctx) / peak) / 0.5
    gen = seqs * L / (8 * batch / t_dec) + 2 * N * 128 * p / (8 * peak * 0.35)
    # the tail: the longest response (3,000 tokens) shares the bulk's seqs/8 x L / batch decode steps, then
    # decodes the rest alone at batch 1, at 75 tok/s x 2 x 8.03B / 1.555 TB/s = 0.77 of that step's roofline
    alone = 3000 - (seqs / 8) * L / batch
    assert alone > 0
    eff1 = 75 * 2 * 8_030_261_248 / 1.555e12
    gen += alone * (2 * N + (p + 3000 - alone / 2) * kvb) / bw / eff1
    S = p + L
    attn = 4 * 28 * 28 * 128 * S / 2
    train = 128 * 8 * S * (6 * N + 3 * attn + 2 * N + attn) / (8 * peak * 0.35)  # update + pi_old's forward
    hours = 300 * (gen + train) * 8 / 3600
    daro = next(r for r in rc.RECIPES if r["cmd"].endswith("runs/daro"))
    assert math.isclose(rc.run_hours(daro, rc.GPUS["H100"]), hours, rel_tol=1e-12)
    assert 25 < hours < 50  # and the figure itself: 37 GPU-hours


def test_expected_generation_batches():
    # one prompt wanted, one drawn a batch, kept with p = 1/2, at most 10 batches: E = sum_b 2^-b, b = 0..9
    assert math.isclose(rc.expected_batches(1, 0.5, oversample=1, cap=10), sum(0.5**b for b in range(10)))
    assert math.isclose(rc.expected_batches(512, 0.5), 1.0, abs_tol=1e-9)   # 3 x 512 x 0.5 = 768 >= 512 kept
    assert math.isclose(rc.expected_batches(512, 0.25), 2.0, abs_tol=1e-6)  # 384 kept a batch: two batches
    assert math.isclose(rc.expected_batches(512, 0.01), 10, abs_tol=1e-9)  # the cap


def test_synchronous_tail():
    r, g = rc.VERL, rc.GPUS["H20"]
    m, tp = rc.MODELS[r["model"]], r["tp"]
    c = rc.step_cost(r, g)
    assert c["tail"]["s"] > 0 and c["gen"] > c["bulk"]  # verl's run: one wave of 1,024 per engine, 28K budget
    # the engine's longest response decodes cap - (its share of the bulk's steps) alone: 28,672 - 3,000 here
    assert math.isclose(c["tail"]["tokens"], 28672 - 1024 * 3000 / 1024)
    # a batch-1 step is slower than the weights' roofline floor and faster than the floor / 0.5
    assert c["tail"]["floor"] < c["tail"]["t_tok"] < c["tail"]["floor"] / 0.5
    # zero when every response has the mean length, and it grows with the budget
    assert rc.tail_seconds(m, g, tp, 3000, 3000, 200, 1024, 1024)["s"] == 0
    assert rc.tail_seconds(m, g, tp, 3000, 3000, 200, 5000, 256)["s"] == 0
    budgets = [rc.step_cost(dict(r, new=n), g)["tail"]["s"] for n in (4096, 8192, 16384, 28672)]
    assert all(a < b for a, b in zip(budgets, budgets[1:]))
    # every recipe row gets its own budget's tail, and the table shows it
    grpo = next(x for x in rc.RECIPES if x["cmd"].endswith("runs/grpo"))
    assert rc.step_cost(grpo, rc.GPUS["H100"])["tail"]["tokens"] > 0
    assert rc.run_hours(grpo, rc.GPUS["H100"]) > rc.run_hours(grpo, rc.GPUS["H100"], tail=False)


def test_published_run_check_and_its_band():
    r, g = rc.VERL, rc.GPUS["H20"]
    published = (3 * 24 + 17 + 5 / 60) * 32  # 3d 17h 5m on 32 H20s
    assert round(published) == 2851
    ratio = rc.run_hours(r, g) / published
    # the published run lies inside the band the stated response means span (1,500 to 6,000 tokens)
    assert rc.run_hours(r, g, resp=1500) < published < rc.run_hours(r, g, resp=6000)
    out = run_script(["-m", "bench.replication_cost"], timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"ratio model / published = {ratio:.2f}" in out.stdout
    c = rc.step_cost(r, g)  # the printed split of generation into bulk and tail is the same arithmetic
    assert f"generation = bulk {c['bulk']:.0f} s + tail {c['tail']['s']:.0f} s" in out.stdout
    verdict = "within +-30%" if abs(ratio - 1) <= 0.3 else "OUTSIDE +-30%"
    assert verdict in out.stdout  # the script says which, and says so in words when it misses
    assert abs(ratio - 1) <= 0.3 or "misses the published run by more than 30%" in out.stdout
    assert "H100: 3.35 TB/s, 80 GB, 989 TFLOP/s" in out.stdout and "H20: 4.00 TB/s, 96 GB, 148 TFLOP/s" in out.stdout
