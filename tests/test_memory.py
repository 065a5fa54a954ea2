"""bench/memory.py's arithmetic checked by hand: parameter counts from the config.json shapes, KV bytes per token, the
vLLM share, the figures it prints, and its bad-flag exits. No GPU, no torch in the script: a few seconds."""
import re

from bench import memory
from tests.conftest import run_script


def test_parameter_counts_match_the_published_totals():
    # Qwen3-4B: layer = q 2560*4096 + k, v 2*2560*1024 + o 4096*2560 + q/k norms 2*128 + MLP 3*2560*9728 + norms 2*2560
    layer = 2560 * 4096 + 2 * 2560 * 1024 + 4096 * 2560 + 2 * 128 + 3 * 2560 * 9728 + 2 * 2560
    assert layer == 100_930_816
    n = 36 * layer + 151_936 * 2560 + 2560  # tied embedding once, final norm
    assert memory.param_count(memory.MODELS["Qwen3-4B-Base"]) == n == 4_022_468_096  # the hub's 4.02B
    # Qwen2.5-Math-7B: q/k/v biases, no q/k norms, untied lm_head
    layer = 3584 * 3584 + 3584 + 2 * (3584 * 512 + 512) + 3584 * 3584 + 3 * 3584 * 18944 + 2 * 3584
    n = 28 * layer + 2 * 152_064 * 3584 + 3584
    assert memory.param_count(memory.MODELS["Qwen2.5-Math-7B"]) == n == 7_615_616_512  # 7.62B
    assert round(memory.param_count(memory.MODELS["Qwen3-8B-Base"]) / 1e9, 2) == 8.19


def test_kv_bytes_per_token_and_vllm_share_by_hand():
    assert memory.kv_bytes_per_token(memory.MODELS["Qwen3-4B-Base"]) == 2 * 36 * 8 * 128 * 2 == 147_456
    assert memory.kv_bytes_per_token(memory.MODELS["Qwen2.5-Math-7B"]) == 2 * 28 * 4 * 128 * 2 == 57_344
    GiB = 2**30
    # start-up bound min(50, 80 - 1.5 - 10) / 80 = 0.625, minus the 5% margin = 0.575 -> floored 0.57
    assert memory.vllm_share(80 * GiB, 50 * GiB, 10 * GiB, context=1.5 * GiB, margin=0.05) == 0.57
    # rollout bound: (80 - 1.5 - 60) / 80 - 0.05 = 0.18125 -> 0.18
    assert memory.vllm_share(80 * GiB, 70 * GiB, 60 * GiB, context=1.5 * GiB, margin=0.05) == 0.18


def test_script_prints_the_hand_worked_figures():
    r = run_script(["-m", "bench.memory", "--model", "Qwen3-4B-Base", "--gpus", "8", "--gpu_gb", "80"], timeout=60)
    assert r.returncode == 0, r.stderr
    assert "N = 4.02B" in r.stdout and "147,456 B/token" in r.stdout
    # the sharded optimizer state: 8 * 4,022,468,096 / 8 bytes = 3.7 GiB; resident during rollouts 12N/8 = 5.6 GiB
    assert "AdamW moments fp32 8N/W       3.7 GiB" in r.stdout and "trainer resident    5.6 GiB" in r.stdout
    assert "verdict: fits with --vllm_gpu_memory" in r.stdout
    assert "G = 16, 64 prompts = 1024 sequences per GPU per step" in r.stdout  # the DA3PO recipes' G = 16
    r = run_script(["-m", "bench.memory", "--model", "Qwen2.5-Math-7B"], timeout=60)  # all machines
    assert r.returncode == 0 and r.stdout.count("verdict:") == 3 + 4  # full fine-tuning's 3, LoRA's 4 GPU sizes
    # the DARO recipe's --max_prompt_length 1096 + --max_new_tokens 3000 fill the model's 4096 positions exactly
    assert "4096 tokens <= max_position_embeddings 4096: ok (prompts up to 1096 tokens fit)" in r.stdout
    # every verdict says what the update leaves: DARO on one 141 GB GPU fits with 2.2 GiB to spare, no more
    assert "(update peak 131.1 of 133.4 GiB usable: 2.2 GiB to spare)" in r.stdout
    assert "G = 8, 16 prompts = 128 sequences per GPU per step" in r.stdout


def test_lora_arithmetic_by_hand(demo_dir):
    """The adapters' size: rank x (in + out) of q, k, v, o, gate, up, down per layer (Qwen3-8B: 4096 + 4096, 4096 +
    1024 twice, 4096 + 4096, then 4096 + 12288 three times = 75,776), the same count peft makes on the demo model;
    the gathered units of a LoRA update under --cpu_offload, bf16 params only: 2R + two layers' 2P."""
    assert memory.lora_params(memory.MODELS["Qwen3-8B-Base"], 32) == 32 * 36 * 75_776 == 87_293_952
    assert memory.lora_params(memory.MODELS["Qwen3-4B-Base"], 32) == 32 * 36 * 57_344 == 66_060_288
    r = run_script(["-m", "bench.memory", "--model", "Qwen3-4B-Base", "--gpu_gb", "24", "--gpus", "1"], timeout=60)
    assert r.returncode == 0, r.stderr
    two_r_four_p = (2 * (151_936 * 2560 + 2560) + 4 * 100_930_816) / 2**30  # 1.1 GiB
    assert f"gathered bf16 2R + 4P          {two_r_four_p:.1f} GiB" in r.stdout
    assert "adapters A = 66.1M (1.64% of N)" in r.stdout and "(--cpu_offload: FSDP2 at world size 1)" in r.stdout
    peft = __import__("pytest").importorskip("peft")
    import modeling
    model = modeling.load_model(demo_dir)[0]
    c = model.config
    demo = dict(H=c.hidden_size, L=c.num_hidden_layers, heads=c.num_attention_heads, kv=c.num_key_value_heads,
                hd=c.head_dim, I=c.intermediate_size)
    model = peft.inject_adapter_in_model(peft.LoraConfig(r=8, target_modules="all-linear"), model)
    assert memory.lora_params(demo, 8) == sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)


def test_bad_flags_exit_2():
    for args in (["--model", "Llama-3-8B"], ["--gpus", "-1"], ["--gpu_gb", "lots"], ["--lora_rank", "-8"]):
        r = run_script(["-m", "bench.memory", *args], timeout=60)
        assert r.returncode == 2, (args, r.stdout, r.stderr)


def test_packed_attention_memory_by_hand():
    """The recipes' attention, packed (flash_attention_2, one row, no mask): the sequences' offsets (int32, at most
    one sequence a token) per forward and the softmax's log-sum-exp (heads x tokens float32) per layer, linear in
    tokens; flex attention's BlockMask is 4 int32 tables of (T/128)^2 blocks; a dense mask (sdpa) is T^2 bool plus
    its bf16 copy. Printed for every recipe, with the kernel it assumes."""
    m = memory.MODELS["Qwen3-4B-Base"]
    flash = memory.attention_bytes(m, 24576, "flash_attention_2")
    assert flash == dict(whole=4 * 24577, layer=32 * 24576 * 4)
    double = memory.attention_bytes(m, 2 * 24576, "flash_attention_2")
    assert double["layer"] == 2 * flash["layer"]  # linear in tokens
    assert memory.attention_bytes(m, 24576, "flex_attention")["whole"] == 16 * 192 * 192
    assert memory.attention_bytes(m, 24576, "sdpa") == dict(whole=24576 ** 2, layer=2 * 24576 ** 2)
    r = run_script(["-m", "bench.memory"], timeout=60)
    assert r.returncode == 0
    verdicts = r.stdout.count("verdict:")  # every recipe: 12 full fine-tuning cases and 16 LoRA ones
    flash = re.findall(r"flash_attention_2 +([\d.]+) MiB per forward \+ ([\d.]+) MiB per layer", r.stdout)
    assert len(flash) == verdicts == 12 + 16 and all(float(w) <= 0.1 and float(l) <= 3.0 for w, l in flash), flash
    assert r.stdout.count("(the recipes')") == verdicts and "linear in tokens" in r.stdout


def test_the_rollout_phase_counts_the_units_offloaded_passes_gather():
    """--cpu_offload: the trainer's state sits on the host, but its no-grad passes while vLLM is awake (pi_old, the
    sync probe) gather FSDP2's root unit and two layers on the GPU, 2R + 4P in bf16 (1.1 GiB for Qwen3-4B, 3.0 GiB for
    Qwen3-8B). The rollout budget counts them: vLLM's share, the trainer's context, those units and the passes'
    activations stay within the usable memory (Qwen3-8B's LoRA run on 48 GB needed 45.7 GiB of 45.0 without them)."""
    GiB = 2**30
    m4, m8 = memory.MODELS["Qwen3-4B-Base"], memory.MODELS["Qwen3-8B-Base"]
    assert memory.gathered_for_forward(m4) == 2 * (151_936 * 2560 + 2560) + 4 * 100_930_816
    assert round(memory.gathered_for_forward(m4) / GiB, 1) == 1.1
    assert round(memory.gathered_for_forward(m8) / GiB, 1) == 3.0
    assert memory.trainer_rollout_resident(m8, 1, True) == memory.gathered_for_forward(m8)
    for name, gb in (("Qwen3-4B-Base", 24564 / 1024), ("Qwen3-8B-Base", 46068 / 1024)):
        total = gb * GiB
        p = memory.best_lora_plan(memory.MODELS[name], memory.RECIPE[name], total, 32)
        assert p["offload"] and p["resident"] == memory.gathered_for_forward(memory.MODELS[name])
        assert p["u"] * total + memory.CONTEXT + p["resident"] + p["passes"] <= (1 - memory.MARGIN) * total, name
    total = 81559 / 1024 * GiB
    p = memory.best_plan(m8, memory.RECIPE["Qwen3-8B-Base"], 1, total)
    assert p["offload"] and p["u"] * total + memory.CONTEXT + p["resident"] <= (1 - memory.MARGIN) * total
    r = run_script(["-m", "bench.memory", "--model", "Qwen3-8B-Base", "--gpus", "1", "--gpu_gb", "80"], timeout=60)
    assert "trainer resident    3.0 GiB  (weights and AdamW on the host; the bf16 root unit + 2 layers" in r.stdout
