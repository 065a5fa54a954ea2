"""docs/gpu.md's recipe commands, taken from the doc itself: each parses and passes the config checks at its world
size (no model or data loaded), each comparison changes what the doc says it changes, and the memory figures and
bench/memory.py's recipe constants agree with the commands. Run: python -m pytest -q tests/test_recipes.py"""
import os
import re
import subprocess

import pytest

import config
import dataset
import da3po
import daro
from tests.conftest import ROOT

DOC = os.path.join(ROOT, "docs", "gpu.md")
SCRIPTS = {"da3po.py": (da3po.Config, da3po.PRESETS), "daro.py": (daro.Config, daro.PRESETS)}
SAME_RUN = {"algo", "out_dir"}  # what differs between two arms of one comparison in any case


def doc_commands() -> list[list[str]]:
    """Every torchrun or python command of docs/gpu.md's ```bash blocks, as bash itself expands it (variables,
    quotes, line continuations): the blocks run in order in one bash, with torchrun and python functions that print
    their arguments."""
    blocks = re.findall(r"```bash\n(.*?)```", open(DOC).read(), re.S)
    stub = ("torchrun() { printf '%s\\x1f' \"$@\"; printf '\\x1e'; }\n"
            "python() { printf '%s\\x1f' \"$@\"; printf '\\x1e'; }\n")
    out = subprocess.run(["bash", "-euc", stub + "\n".join(blocks)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return [cmd.split("\x1f")[:-1] for cmd in out.stdout.split("\x1e")[:-1]]


def run_config(argv: list[str], capsys, monkeypatch):
    """(script, world size, config, the `note:` lines) of one torchrun or python command, through parse_config and
    check_config as the script's start-up runs them (check_config exits 2 on any bad combination)."""
    script = next(a for a in argv if a.endswith(".py"))
    nproc = next((int(a.split("=")[1]) for a in argv if a.startswith("--nproc_per_node=")), 0)
    nnodes = next((int(a.split("=")[1]) for a in argv if a.startswith("--nnodes=")), 1)
    # under torchrun --cpu_offload is allowed; a plain python run (no --nproc_per_node) refuses it
    monkeypatch.setattr(config, "is_dist", lambda: nproc > 0)
    nproc = max(nproc, 1)
    cls, presets = SCRIPTS[script]
    capsys.readouterr()
    cfg = config.parse_config(cls, argv[argv.index(script) + 1:], presets)
    config.check_config(cfg, nproc * nnodes)
    notes = capsys.readouterr().out.strip().splitlines()
    return script, nproc * nnodes, cfg, notes


@pytest.fixture
def recipes(capsys, monkeypatch):
    return [run_config(argv, capsys, monkeypatch) for argv in doc_commands()]


def changed(a, b) -> set[str]:
    return {k for k, v in vars(a).items() if vars(b)[k] != v} - SAME_RUN


def test_every_command_parses_and_passes_the_checks(recipes):
    eight = {(s, c.algo) for s, w, c, _ in recipes if w == 8}
    assert eight == {("da3po.py", a) for a in ("da3po", "dapo", "grpo", "dr_grpo", "gspo")} | {
        ("daro.py", a) for a in ("daro", "uniform", "var", "grpo", "dr_grpo", "dapo")}
    # + the three one-GPU commands, the four one-GPU LoRA ones and the headline's replication (2 arms x 2 seeds)
    assert len(recipes) == 11 + 3 + 4 + 4 and all(w in (1, 8) for _, w, _, _ in recipes)
    assert len({c.out_dir for _, _, c, _ in recipes}) == len(recipes)  # no two runs write into one folder
    assert all(c.demo == "" for _, _, c, _ in recipes)  # a model of the user's own: no demo's value applies
    # packed micro-batches on a GPU need an attention that takes them without a dense mask (shortcuts.pack_refusal)
    assert all(c.pack and c.attn_implementation == "flash_attention_2" for _, _, c, _ in recipes)


def test_a_recipe_without_a_flag_the_demos_size_stops_naming_it(capsys, monkeypatch):
    """Every command sets each knob whose default is a demo's (config.DEMO_SIZED), on its line or through
    its preset: drop any one of them and the command stops with one line naming it, instead of running on the
    sums demo's value."""
    dropped = 0
    for argv in doc_commands():
        script, _, cfg, _ = run_config(argv, capsys, monkeypatch)
        preset = SCRIPTS[script][1][cfg.algo]  # (GRPO's and Dr. GRPO's set overlong_buffer 0 themselves)
        for flag in {a for a in argv if a.lstrip("-") in config.DEMO_SIZED and a.lstrip("-") not in preset}:
            without = [a for i, a in enumerate(argv) if flag not in argv[max(i - 1, 0):i + 1]]  # (every time)
            with pytest.raises(SystemExit) as e:
                run_config(without, capsys, monkeypatch)
            err = capsys.readouterr().err.strip().splitlines()
            assert e.value.code == 2 and len(err) == 1 and f"set {flag} (" in err[0], (argv, err)
            dropped += 1
    assert dropped >= 14 * 6


def test_the_da3po_papers_runs(recipes):
    runs = {c.algo: (c, notes) for s, w, c, notes in recipes
            if s == "da3po.py" and w == 8 and "headline" not in c.out_dir}
    for algo, (cfg, notes) in runs.items():
        assert notes == [], (algo, notes)  # nothing in the shared flags overrides a preset
        assert cfg.group_size == 16 and cfg.prompts_per_step == 512 and cfg.prompt_template == "dapo"
        assert (cfg.oversample, cfg.max_gen_batches) == (3, 10)  # verl's DAPO recipe: 3 x 512, at most 10 batches
        assert dataset.parse_eval_data(cfg.eval_data, cfg.eval_samples) == [
            ("aime24.jsonl", 32), ("aime25.jsonl", 32), ("aime26.jsonl", 32), ("amc23.jsonl", 32),
            ("minerva.jsonl", 8), ("olympiad.jsonl", 8), ("math500.jsonl", 8)]
        assert cfg.updates_per_step == (4 if algo == "gspo" else 16)
        assert cfg.overlong_buffer == (4096 if algo in ("da3po", "dapo") else 0) and cfg.kl_coef == 0
    da3po_cfg = runs["da3po"][0]
    assert (da3po_cfg.lam, da3po_cfg.tau) == (2.0, 0.5)
    assert changed(da3po_cfg, runs["dapo"][0]) == {"lam"}  # DA3PO vs DAPO: DAA and nothing else


def test_the_headline_replication_is_the_papers_runs_on_aime_and_amc(recipes):
    """docs/gpu.md's "What a run costs": DA3PO (lam 2) vs DAPO, two seeds each, the paper runs' commands but for the
    evaluation (AIME and AMC at avg@32) and the seed."""
    paper = {c.algo: c for s, w, c, _ in recipes if s == "da3po.py" and w == 8 and "headline" not in c.out_dir}
    runs = [(c, notes) for _, _, c, notes in recipes if "headline" in c.out_dir]
    assert sorted((c.algo, c.seed) for c, _ in runs) == [("da3po", 1), ("da3po", 2), ("dapo", 1), ("dapo", 2)]
    for cfg, notes in runs:
        assert notes == [] and cfg.lam == (2.0 if cfg.algo == "da3po" else 1.0) and changed(cfg, paper[cfg.algo]) == {"eval_data", "seed"}
        assert dataset.parse_eval_data(cfg.eval_data, cfg.eval_samples) == [
            ("aime24.jsonl", 32), ("aime25.jsonl", 32), ("aime26.jsonl", 32), ("amc23.jsonl", 32)]


def test_the_daro_papers_runs_change_one_thing_each(recipes):
    runs = {c.algo: (c, notes) for s, w, c, notes in recipes if s == "daro.py" and w == 8}
    for algo, (cfg, notes) in runs.items():
        assert cfg.group_size == 8 and cfg.prompts_per_step == 128 and cfg.updates_per_step == 2
        assert cfg.max_prompt_length + cfg.max_new_tokens == 4096 and cfg.overlong_buffer == 0
        assert (cfg.clip_low, cfg.clip_high) == (0.2, 0.28) and cfg.weight_lr == 1e-3
        assert cfg.dynamic_sampling is (algo == "dapo")
        assert dataset.parse_eval_data(cfg.eval_data, cfg.eval_samples) == [
            ("aime24.jsonl", 32), ("aime25.jsonl", 32), ("math500.jsonl", 8), ("gsm8k.jsonl", 8),
            ("minerva.jsonl", 8), ("olympiad.jsonl", 8)]
        # the deliberate overrides, and only those (docs/gpu.md, notes k and l)
        expected = {"daro": "dynamic_sampling False", "uniform": "dynamic_sampling False",
                    "var": "dynamic_sampling False", "grpo": "clip_high 0.28", "dr_grpo": "clip_high 0.28"}
        assert len(notes) == (algo in expected) and all(f"--{expected[algo]} overrides" in n for n in notes)
    daro_cfg = runs["daro"][0]
    assert changed(daro_cfg, runs["uniform"][0]) == {"weighting"}
    assert changed(daro_cfg, runs["var"][0]) == {"weighting"}
    assert changed(daro_cfg, runs["grpo"][0]) == {"weighting", "loss_agg"}  # GRPO's own loss, no bins
    assert changed(daro_cfg, runs["dr_grpo"][0]) == {"weighting", "loss_agg", "std_norm"}
    assert changed(daro_cfg, runs["dapo"][0]) == {"weighting", "dynamic_sampling"}  # the paper's contrast


def load_memory():
    from bench import memory
    return memory


def memory_tables() -> tuple[dict, dict]:
    """bench/results/memory.md's two tables, full fine-tuning's and LoRA's: (model, machine) -> the row's cells."""
    text = open(os.path.join(ROOT, "bench", "results", "memory.md")).read()
    tables = [[line.strip("| ").split(" | ") for line in block.splitlines() if line.startswith("| ")][2:]
              for block in text.split("```")[0].split("\n\n") if block.startswith("| model")]
    assert len(tables) == 2
    return tuple({tuple(r[:2]): r for r in rows} for rows in tables)


def test_memory_figures_agree_with_bench_memory(recipes):
    memory = load_memory()
    for script, recipe in (("da3po.py", memory.DAPO), ("daro.py", memory.DARO)):
        cfg = next(c for s, w, c, _ in recipes if s == script and w == 8)
        assert (recipe["prompt"], recipe["completion"], recipe["prompts_per_gpu"] * 8, recipe["updates"],
                recipe["G"]) == (cfg.max_prompt_length, cfg.max_new_tokens, cfg.prompts_per_step,
                                 cfg.updates_per_step, cfg.group_size), script
        assert cfg.micro_batch_tokens == memory.MICRO_BATCH_TOKENS
    rows = memory_tables()[0]  # (model, machine) -> model, machine, peak, spare, resident, u, ..., verdict
    doc = " ".join(open(DOC).read().replace("\n# ", "\n").split())  # comments in code blocks wrap too
    usable = {label: f"{(1 - memory.MARGIN) * gb:.1f}" for _, gb, label in memory.MACHINES}  # 75.7, 133.4 GiB
    h200_4b, h200_daro = rows["Qwen3-4B-Base", "1 x 141 GB (H200)"], rows["Qwen2.5-Math-7B", "1 x 141 GB (H200)"]
    h200 = usable["1 x 141 GB (H200)"]
    assert f"update peak {h200_4b[2]} GiB of {h200} usable, vLLM's share {h200_4b[5]}" in doc
    assert f"update peak {h200_daro[2]} GiB of {h200} usable: {h200_daro[3]} GiB to spare" in doc
    assert "--micro_batch_tokens 13312" in h200_daro[-1]
    offload = [rows[m, "1 x 80 GB"] for m in ("Qwen3-4B-Base", "Qwen3-8B-Base")]
    assert all("--cpu_offload" in r[-1] for r in offload)
    assert f"update peak {offload[0][2]} / {offload[1][2]} GiB of {usable['1 x 80 GB']} usable" in doc
    shares = [rows[m, "8 x 80 GB"][5] for m in ("Qwen3-4B-Base", "Qwen3-8B-Base")]  # --vllm_gpu_memory 0's choice
    assert f"{shares[0]} for Qwen3-4B and {shares[1]} for Qwen3-8B on 8 x 80 GB" in doc
    one_gpu = {(s, c.cpu_offload): c for s, w, c, _ in recipes if w == 1 and not c.lora_rank}
    assert one_gpu["daro.py", False].micro_batch_tokens == 13312 and one_gpu["da3po.py", True].prompts_per_step == 64


def test_the_one_gpu_lora_recipes_are_bench_memorys_plans(recipes):
    """Each LoRA command: one GPU, rank 32, 10x the full fine-tune's lr, and the flags bench/memory.py's LoRA row of
    its model and GPU gives (--vllm_gpu_memory, --cpu_offload, --micro_batch_tokens), the doc quoting the row's
    margin; besides those, only the one-GPU batch differs from the paper's 8-GPU run of the same algorithm."""
    memory, rows = load_memory(), memory_tables()[1]
    gpu = {"Qwen/Qwen3-4B-Base": "1 x 24 GB", "Qwen/Qwen3-8B-Base": "1 x 48 GB", "Qwen/Qwen2.5-Math-7B": "1 x 48 GB",
           "meta-llama/Llama-3.1-8B": "1 x 48 GB"}
    lora = [(s, c) for s, w, c, _ in recipes if c.lora_rank]
    assert sorted(c.model for _, c in lora) == sorted(gpu) and all(w == 1 for _, w, c, _ in recipes if c.lora_rank)
    doc = " ".join(open(DOC).read().replace("\n# ", "\n").split())
    eight = {(s, c.algo): c for s, w, c, _ in recipes if w == 8 and "headline" not in c.out_dir}
    for script, cfg in lora:
        row = rows[cfg.model.split("/")[1], gpu[cfg.model]]  # model, machine, adapters, peak, spare, u, ..., verdict
        assert (cfg.lora_rank, cfg.lora_alpha) == (memory.LORA_RANK, 32.0)
        assert cfg.lr == pytest.approx(10 * eight[script, cfg.algo].lr, rel=1e-12)
        flags = f"--lora_rank 32 --vllm_gpu_memory {cfg.vllm_gpu_memory:.2f}" + " --cpu_offload" * cfg.cpu_offload + (
            f" --micro_batch_tokens {cfg.micro_batch_tokens}" if cfg.micro_batch_tokens != 24576 else "")
        launch = "fits: torchrun" if cfg.cpu_offload else "fits: python"  # (python refuses --cpu_offload)
        assert row[-1].endswith(flags) and row[-1].startswith(launch), (cfg.model, row[-1], flags)
        usable = f"{(1 - memory.MARGIN) * dict((label, gb) for gb, label in memory.LORA_MACHINES)[row[1]]:.1f}"
        assert f"update peak {row[3]} GiB of {usable} usable: {row[4]} GiB to spare" in doc, cfg.model
        assert changed(cfg, eight[script, cfg.algo]) <= {"model", "prompts_per_step", "lora_rank", "lr",
                                                         "vllm_gpu_memory", "cpu_offload", "micro_batch_tokens"}
        assert cfg.prompts_per_step * 8 == eight[script, cfg.algo].prompts_per_step
