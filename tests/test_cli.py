"""Config -> CLI. Run: python -m pytest -q tests/test_cli.py"""
import dataclasses
import os

import pytest

import config
import dataset
import modeling
from da3po import PRESETS, Config


def test_flag_forms_and_presets(capsys):
    cfg = config.parse_config(Config, ["--lr=1e-5", "--steps", "7", "--no-dynamic_sampling"], PRESETS)
    assert cfg.lr == 1e-5 and cfg.steps == 7 and cfg.dynamic_sampling is False
    assert "--dynamic_sampling False overrides the da3po preset" in capsys.readouterr().out
    cfg = config.parse_config(Config, ["--algo", "dr_grpo"], PRESETS)
    assert cfg.std_norm is False and cfg.loss_agg == "seq-mean-token-sum-norm" and cfg.lam == 1.0
    # an explicit flag beats the preset, and says so in one line
    cfg = config.parse_config(Config, ["--algo=gspo", "--clip_high", "0.001"], PRESETS)
    assert cfg.seq_ratio is True and cfg.clip_low == 3e-4 and cfg.clip_high == 0.001
    assert capsys.readouterr().out.strip() == "note: --clip_high 0.001 overrides the gspo preset's clip_high = 0.0004"
    # no flags: the reasoning demo, which is Config()'s defaults (one default demo, in code and on the command line)
    assert config.parse_config(Config, [], PRESETS) == Config() and Config().demo == "reasoning"
    # --demo arith: the sums demo's flags replace seven defaults and nothing else
    arith = config.parse_config(Config, ["--demo", "arith"], PRESETS)
    changed = {f.name for f in dataclasses.fields(Config) if getattr(arith, f.name) != getattr(Config(), f.name)}
    assert changed == {"demo", *config.DEMOS["arith"]} and arith.train_data == "arith"
    assert capsys.readouterr().out == ""  # no note without an override


def test_demo_reasoning_stands_for_its_flags_which_presets_and_flags_override(capsys):
    cfg = config.parse_config(Config, ["--demo", "reasoning"], PRESETS)
    spelled = config.parse_config(Config, [
        "--demo", "reasoning", "--model", "demo", "--train_data", "reasoning", "--eval_data", "reasoning",
        "--max_new_tokens", "72", "--overlong_buffer", "16", "--prompts_per_step", "16", "--steps", "20"], PRESETS)
    assert cfg == spelled and os.path.isfile(os.path.join(modeling.model_path(cfg.model), "config.json"))
    assert modeling.model_path(cfg.model).endswith(os.path.join("demo", "reasoning", "model"))
    assert len(dataset.load_data(cfg.train_data, "train")) == 4000 and len(dataset.load_data("reasoning", "eval")) == 200
    assert config.parse_config(Config, ["--demo", "reasoning", "--steps", "3"], PRESETS).steps == 3
    grpo = config.parse_config(Config, ["--demo", "reasoning", "--algo", "grpo"], PRESETS)
    assert grpo.overlong_buffer == 0 and grpo.max_new_tokens == 72  # GRPO's recipe has no shaping
    assert capsys.readouterr().out == ""


def test_every_preset_writes_out_its_whole_recipe():
    """The README's paper-scale DA3PO command with --algo X must still run X: every preset sets every knob that
    defines an algorithm, so no DA3PO setting leaks into a baseline, and GSPO keeps its 4 updates per step."""
    knobs = set(PRESETS["dapo"])
    for name, preset in PRESETS.items():
        assert knobs <= set(preset), (name, knobs - set(preset))
    scale = ["--prompts_per_step", "512", "--max_new_tokens", "20480", "--lr", "1e-6"]
    gspo = config.parse_config(Config, ["--algo", "gspo", *scale], PRESETS)
    assert gspo.updates_per_step == 4 and gspo.overlong_buffer == 0 and not gspo.dynamic_sampling
    assert gspo.lam == 1.0 and (gspo.clip_low, gspo.clip_high) == (3e-4, 4e-4)
    for algo in ("grpo", "dr_grpo", "gspo"):
        cfg = config.parse_config(Config, ["--algo", algo, *scale], PRESETS)
        assert cfg.overlong_buffer == 0 and cfg.dynamic_sampling is False and cfg.lam == 1.0, algo
    da3po = config.parse_config(Config, scale, PRESETS)
    assert da3po.lam == 2.0 and da3po.tau == 0.5 and da3po.dynamic_sampling and da3po.clip_high == 0.28


def test_overriding_a_preset_prints_a_note(capsys):
    cfg = config.parse_config(Config, ["--algo", "grpo", "--overlong_buffer", "4096", "--updates_per_step", "16"],
                              PRESETS)
    assert cfg.overlong_buffer == 4096
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["note: --overlong_buffer 4096 overrides the grpo preset's overlong_buffer = 0"]
    config.parse_config(Config, ["--algo", "gspo", "--updates_per_step", "16"], PRESETS)
    assert "--updates_per_step 16 overrides the gspo preset's updates_per_step = 4" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--nope", "1"], "unrecognized arguments: --nope"),
    (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
    (["--algo", "ppo"], "argument --algo: invalid choice 'ppo'"),
    (["--demo", "chess"], "argument --demo: invalid choice 'chess'"),
    (["--ste", "3"], "unrecognized arguments: --ste"),  # no prefix abbreviations
])
def test_bad_flags_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        config.parse_config(Config, argv, PRESETS)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_help_documents_every_field(capsys):
    with pytest.raises(SystemExit) as e:
        config.parse_config(Config, ["--help"], PRESETS)
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    helps = config.field_help(Config)
    for name in Config.__dataclass_fields__:
        assert f"--{name}" in out
        assert helps.get(name), f"--{name} has no help: a docstring under the field"
        assert "".join(f"{helps[name]} (default: ".split()) in "".join(out.split()), name  # wrapped anywhere
    assert "lambda: multiplier of correct completions' advantages on hard prompts" in out
    assert "lambda(p) = 1/gamma(p, G) in place of lam, capped at lam_max [dev 4]" in out
    assert "AdamW learning rate (the papers: 1e-6)" in out  # a shared knob (config.TrainConfig), documented once
    assert "warm-up over this many RL steps (not optimizer updates)" in out


# A model of the user's own (--model, not a demo's) and the knobs the defaults size for the demos
REAL_RUN = ["--train_data", "x.jsonl", "--eval_data", "y.jsonl", "--max_new_tokens", "4096", "--overlong_buffer",
            "512", "--steps", "300", "--prompts_per_step", "512", "--lr", "1e-6"]


def test_a_model_of_your_own_without_its_knobs_stops_naming_them(capsys):
    """The real run's mistake: a named model, a training set, nothing else. Before, it trained on the reasoning
    demo's 72 tokens, 20 steps, 16 prompts, overlong buffer 16 and eval set, and said nothing."""
    with pytest.raises(SystemExit) as e:
        config.parse_config(Config, ["--model", "Qwen/Qwen3-4B-Base", "--train_data", "x.jsonl"], PRESETS)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--model Qwen/Qwen3-4B-Base" in err[0], err
    named = "set --eval_data, --max_new_tokens, --overlong_buffer, --steps, --prompts_per_step, --lr ("
    assert named in err[0] and "--train_data" not in err[0].split("(")[0]
    with pytest.raises(SystemExit):  # evaluation alone needs its eval set and token budget
        config.parse_config(Config, ["--model", "m", "--eval_only", "--eval_data", "y.jsonl"], PRESETS)
    assert "set --max_new_tokens (" in capsys.readouterr().err


def test_a_model_of_your_own_gets_no_demo_value():
    """Every knob set: no field holds a demo's value unless a flag or the preset put it there; the demo is none.
    A preset's knob counts as set (GRPO's recipe has no overlong shaping)."""
    cfg = config.parse_config(Config, ["--model", "Qwen/Qwen3-4B-Base", *REAL_RUN], PRESETS)
    given = {k.lstrip("-") for k in REAL_RUN[::2]} | {"model"}
    assert cfg.demo == "" and given >= set(config.DEMO_SIZED)
    for f in dataclasses.fields(Config):
        if f.name not in given | set(PRESETS[cfg.algo]) | {"demo"}:
            assert getattr(cfg, f.name) == f.default and f.name not in config.DEMO_SIZED, f.name
    grpo = config.parse_config(Config, ["--model", "m", "--algo", "grpo",
                                             *REAL_RUN[:2 * 3], *REAL_RUN[2 * 4:]], PRESETS)
    assert grpo.overlong_buffer == 0
    cfg = config.parse_config(Config, ["--model", "m", "--eval_only", "--eval_data", "y", "--max_new_tokens",
                                            "99"], PRESETS)
    assert cfg.eval_only and cfg.demo == ""


def test_a_demo_given_with_a_model_of_your_own_says_what_it_brings(capsys):
    """--demo with a named model runs it on the demo's values, each named in one note (its model is not taken)."""
    cfg = config.parse_config(Config, ["--model", "m", "--demo", "arith", "--train_data", "x.jsonl"], PRESETS)
    note = capsys.readouterr().out.strip().splitlines()
    assert note == ["note: --model m runs on --demo arith's eval_data arith, max_new_tokens 12, overlong_buffer 4, "
                    "steps 60, prompts_per_step 32, lr 0.0001"]
    assert cfg.model == "m" and cfg.max_new_tokens == 12 and cfg.train_data == "x.jsonl"
    cfg = config.parse_config(Config, ["--model", "m", "--demo", "reasoning", *REAL_RUN[:8]], PRESETS)
    assert capsys.readouterr().out.strip() == "note: --model m runs on --demo reasoning's steps 20, " \
                                              "prompts_per_step 16, lr 0.0001"
    assert cfg.model == "m" and cfg.steps == 20 and cfg.max_new_tokens == 4096
    # the demos' own models are no model of the user's own: --model demo/reasoning/model is the default demo
    folder = os.path.join(config.DEMO_DIR, "reasoning", "model")
    assert config.parse_config(Config, ["--model", folder], PRESETS).demo == "reasoning"
    assert config.parse_config(Config, ["--model", config.ARITH_MODEL, "--demo", "arith"], PRESETS) == \
        config.parse_config(Config, ["--demo", "arith"], PRESETS)
    assert capsys.readouterr().out == ""
