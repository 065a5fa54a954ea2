"""Config -> CLI. Run: python -m pytest -q tests/test_cli.py"""
import pytest

import common
from da3po import PRESETS, Config


def test_flag_forms_and_presets():
    cfg = common.parse_config(Config, ["--lr=1e-5", "--steps", "7", "--no-dynamic_sampling"], PRESETS)
    assert cfg.lr == 1e-5 and cfg.steps == 7 and cfg.dynamic_sampling is False
    cfg = common.parse_config(Config, ["--algo", "dr_grpo"], PRESETS)
    assert cfg.std_norm is False and cfg.loss_agg == "seq-mean-token-sum-norm" and cfg.lam == "1"
    # an explicit flag beats the preset
    cfg = common.parse_config(Config, ["--algo=gspo", "--clip_high", "0.001"], PRESETS)
    assert cfg.seq_ratio is True and cfg.clip_low == 3e-4 and cfg.clip_high == 0.001
    assert common.parse_config(Config, [], PRESETS) == Config()


@pytest.mark.parametrize("argv, message", [
    (["--nope", "1"], "unrecognized arguments: --nope"),
    (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
    (["--algo", "ppo"], "argument --algo: invalid choice 'ppo'"),
    (["--ste", "3"], "unrecognized arguments: --ste"),  # no prefix abbreviations
])
def test_bad_flags_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        common.parse_config(Config, argv, PRESETS)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_help_documents_every_field(capsys):
    with pytest.raises(SystemExit) as e:
        common.parse_config(Config, ["--help"], PRESETS)
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for name in Config.__dataclass_fields__:
        assert f"--{name}" in out
    assert "lambda: multiplier of correct completions' advantages on hard prompts" in out
    assert "'adaptive' = 1/gamma(p, G), the theory's imbalance, capped at lam_max" in out  # continuation line
