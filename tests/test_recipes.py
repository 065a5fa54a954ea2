"""docs/gpu.md's recipe commands, taken from the doc itself: each parses and passes the config checks at its world
size (no model or data loaded), each comparison changes what the doc says it changes, and the memory figures and
bench/memory.py's recipe constants agree with the commands. Run: python -m pytest -q tests/test_recipes.py"""
import importlib.util
import os
import re
import subprocess

import pytest

import bookkeeping
import dataset
import ranks
import da3po
import daro
from conftest import ROOT

DOC = os.path.join(ROOT, "docs", "gpu.md")
SCRIPTS = {"da3po.py": (da3po.Config, da3po.PRESETS), "daro.py": (daro.Config, daro.PRESETS)}
SAME_RUN = {"algo", "out_dir"}  # what differs between two arms of one comparison in any case


def doc_commands() -> list[list[str]]:
    """Every torchrun command of docs/gpu.md's ```bash blocks, as bash itself expands it (variables, quotes, line
    continuations): the blocks run in order in one bash, with torchrun a function that prints its arguments."""
    blocks = re.findall(r"```bash\n(.*?)```", open(DOC).read(), re.S)
    stub = "torchrun() { printf '%s\\x1f' \"$@\"; printf '\\x1e'; }\n"
    out = subprocess.run(["bash", "-euc", stub + "\n".join(blocks)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return [cmd.split("\x1f")[:-1] for cmd in out.stdout.split("\x1e")[:-1]]


def run_config(argv: list[str], capsys, monkeypatch):
    """(script, world size, config, the `note:` lines) of one torchrun command, through parse_config and
    check_config as the script's start-up runs them (check_config exits 2 on any bad combination)."""
    script = next(a for a in argv if a.endswith(".py"))
    nproc = next(int(a.split("=")[1]) for a in argv if a.startswith("--nproc_per_node="))
    nnodes = next((int(a.split("=")[1]) for a in argv if a.startswith("--nnodes=")), 1)
    monkeypatch.setattr(bookkeeping, "is_dist", lambda: True)  # as under torchrun, where --cpu_offload is allowed
    cls, presets = SCRIPTS[script]
    capsys.readouterr()
    cfg = bookkeeping.parse_config(cls, argv[argv.index(script) + 1:], presets)
    bookkeeping.check_config(cfg, nproc * nnodes)
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
    assert len(recipes) == 11 + 3 and all(w in (1, 8) for _, w, _, _ in recipes)  # + the three one-GPU commands
    assert len({c.out_dir for _, _, c, _ in recipes}) == len(recipes)  # no two runs write into one folder
    # packed micro-batches on a GPU need an attention that takes them without a dense mask (modeling.pack_refusal)
    assert all(c.pack and c.attn_implementation == "flash_attention_2" for _, _, c, _ in recipes)


def test_the_da3po_papers_runs(recipes):
    runs = {c.algo: (c, notes) for s, w, c, notes in recipes if s == "da3po.py" and w == 8}
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


def test_memory_figures_agree_with_bench_memory(recipes):
    spec = importlib.util.spec_from_file_location("memory", os.path.join(ROOT, "bench", "memory.py"))
    memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory)
    for script, recipe in (("da3po.py", memory.DAPO), ("daro.py", memory.DARO)):
        cfg = next(c for s, w, c, _ in recipes if s == script and w == 8)
        assert (recipe["prompt"], recipe["completion"], recipe["prompts_per_gpu"] * 8, recipe["updates"],
                recipe["G"]) == (cfg.max_prompt_length, cfg.max_new_tokens, cfg.prompts_per_step,
                                 cfg.updates_per_step, cfg.group_size), script
        assert cfg.micro_batch_tokens == memory.MICRO_BATCH_TOKENS
    table = open(os.path.join(ROOT, "bench", "results", "memory.md")).read()
    rows = [line.strip("| ").split(" | ") for line in table.splitlines() if line.startswith("| Qwen")]
    rows = {tuple(r[:2]): r for r in rows}  # (model, machine) -> model, machine, peak, spare, resident, u, ..., verdict
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
    one_gpu = {(s, c.cpu_offload): c for s, w, c, _ in recipes if w == 1}
    assert one_gpu["daro.py", False].micro_batch_tokens == 13312 and one_gpu["da3po.py", True].prompts_per_step == 64
