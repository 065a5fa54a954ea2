"""The verl drop-in (integrations/verl_da3po_daro.py, verl==0.9.1) on the CPU, in verl's own install
(requirements/verl.txt): its formulas equal the project's and the golden vectors; DA3PO's estimator through verl's
registry lookup equals the golden vectors and, with lam 1, verl's own grpo; the default counts a correct answer at
the length cap as correct, and 0/1 scores under it warn once; on 24 GPUs, where verl pads the recipes' batches, the
padding rows get advantage 0 and the others their values without it; an agent loop's several outputs per session
reach the estimators as rows of the prompt's uid; DAPO's loss is verl's vanilla (dual clip off at clip_ratio_c =
1e9); DARO's estimator and loss in verl's own actor update (FSDP on gloo, 1 and 2 ranks) equal daro.py's, its
weights saved with the actor's checkpoint and loaded back; the two recipe scripts compose on verl's config and pass
verl's checks. Skips without verl (pip install -r requirements/verl.txt, in a venv of its own).
Run: HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python -m pytest -q tests/test_verl.py"""
import json
import math
import os
import random
import re

import numpy as np
import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos",
                                 reason="verl is optional: pip install -r requirements/verl.txt")
for _module in ("verl.workers.engine_workers", "hydra"):  # verl's trainer stack: in verl's own install only
    pytest.importorskip(_module, reason="the drop-in needs verl's own install: pip install -r requirements/verl.txt")

import common  # noqa: E402
from tests.conftest import ROOT, run_script  # noqa: E402
from tests.dropin_formulas import check_copied_formulas  # noqa: E402
from integrations import golden  # noqa: E402
from integrations import verl_da3po_daro as drop_in  # noqa: E402
from integrations.verl_da3po_daro import register_da3po, register_daro  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402

F64 = torch.float64
RECIPES = {"verl_dapo_da3po.sh": "da3po", "verl_daro.sh": "daro"}


def verl_batch(inp: dict, seed: int = 0):
    """A golden case as verl hands it to an estimator: the score on each row's last response token, rows shuffled
    (verl does not promise group order), uids as strings. Returns (kwargs, the row order)."""
    rewards, lengths = inp["rewards"], inp["lengths"]
    rows = [(f"uid-{n}", r, max(1, L)) for n, (rs, ls) in enumerate(zip(rewards, lengths)) for r, L in zip(rs, ls)]
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    T = max(L for _, _, L in rows)
    scores, mask = torch.zeros(len(rows), T, dtype=F64), torch.zeros(len(rows), T, dtype=F64)
    for i, k in enumerate(order):
        _, r, L = rows[k]
        mask[i, :L], scores[i, L - 1] = 1.0, r
    index = np.array([rows[k][0] for k in order], dtype=object)
    return {"token_level_rewards": scores, "response_mask": mask, "index": index}, torch.tensor(order)


class ActorConfig:
    """What a policy loss reads of verl's ActorConfig: the clips, get(), and global_batch_info (per micro-batch)."""

    def __init__(self, clip_ratio_c: float = 3.0, global_batch_info: dict | None = None):
        self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high = 0.2, 0.2, 0.28
        self.clip_ratio_c = clip_ratio_c
        self.global_batch_info = global_batch_info or {}

    def get(self, key, default=None):
        return getattr(self, key, default)


def back_to_groups(per_token: torch.Tensor, mask: torch.Tensor, order: torch.Tensor, G: int) -> torch.Tensor:
    """An estimator's (bs, T) output, one value per row on its response tokens, back to the golden file's (N, G)."""
    per_row = per_token.sum(-1) / mask.sum(-1)
    return torch.empty_like(per_row).index_put_((order,), per_row).view(-1, G)

# -----------------------------------------------------------------------------------------------------------------
# The file's formulas: the project's, on the same inputs


def test_formulas_equal_the_projects():
    g = torch.Generator().manual_seed(0)
    N, G, B, T = 6, 8, 12, 7
    rewards = torch.randn(N, G, generator=g, dtype=F64)
    for std_norm in (True, False):
        assert torch.equal(drop_in.group_advantages(rewards, std_norm), common.group_advantages(rewards, std_norm))
    _, _, mask = check_copied_formulas(
        drop_in, lambda lr, literal: drop_in.DAROSettings(weight_lr=lr, daro_literal=literal), g, G, B, T)

    old = -torch.rand(B, T, generator=g, dtype=F64) * 3
    logp = old + torch.randn(B, T, generator=g, dtype=F64) * 0.5  # ratios beyond both clips and the dual clip
    advantages, is_weight = torch.randn(B, generator=g, dtype=F64), torch.rand(B, T, generator=g, dtype=F64)
    for kw in ({}, {"clip_ratio_c": 1.5}, {"is_weight": is_weight}):
        ours = drop_in.policy_loss(logp, old, advantages, mask, 0.2, 0.28, **kw)
        theirs = common.policy_loss(logp, old, advantages, mask, 0.2, 0.28, **kw)
        assert torch.equal(ours[0], theirs[0]) and ours[1] == theirs[1]
        per_token = drop_in.policy_loss(logp, old, advantages.unsqueeze(-1) * mask, mask, 0.2, 0.28, **kw)[0]
        assert torch.equal(per_token * mask, theirs[0] * mask)  # verl's (B, T) advantages, the same losses
    assert common.policy_loss(logp, old, advantages, mask, 0.2, 0.28, clip_ratio_c=1.5)[0].ne(theirs[0]).any()

# -----------------------------------------------------------------------------------------------------------------
# DA3PO's estimator through verl's registry


def through_registry(inp: dict):
    """The golden advantage cases through get_adv_estimator_fn; None for a running p (not offered for verl), and
    for rewards that do not tell correctness (verl's estimator sees only the scores: correct is a score > -0.5)."""
    told = all((r > -0.5) == bool(c) for rs, cs in zip(inp["rewards"], inp["correct"]) for r, c in zip(rs, cs))
    if inp["p"] is not None or not told:
        return None
    name = f"da3po_golden_{inp['lam']}_{inp['tau']}_{inp['adaptive_lam']}_{inp['lam_max']}_{inp['scope']}"
    register_da3po(name, inp["lam"], inp["tau"], inp["adaptive_lam"], inp["lam_max"], inp["scope"])
    kwargs, order = verl_batch(inp)
    adv, returns = core_algos.get_adv_estimator_fn(name)(
        **kwargs, config=AlgoConfig(adv_estimator=name, norm_adv_by_std_in_grpo=inp["std_norm"]))
    assert torch.equal(adv, returns) and torch.equal(adv, adv * kwargs["response_mask"])
    return {"advantages_after": back_to_groups(adv, kwargs["response_mask"], order, inp["G"])}


def test_registered_estimator_equals_the_golden_vectors():
    report = golden.check(advantages=through_registry)
    assert report["mismatches"] == []
    assert report["cases"] >= 10 and report["skipped"] == [  # running p; rewards that do not tell correctness
        "advantages/G8_running_p_lam1.5_tau0.25", "advantages/G8_running_p_adaptive", "advantages/G4_rewards_given"]


def test_default_da3po_counts_a_correct_answer_at_the_cap():
    """"da3po" as importing the file registers it, on DAPO's shaped scores: a correct answer at the length cap scores
    1 - 1 = 0 and is correct (correct_above = -0.5), so DAA doubles its advantage; a threshold of 0 would count it
    wrong, p_hat would be 0 and nothing amplified."""
    inp = next(c for c in golden.load()["advantages"] if c["name"] == "G4_correct_at_cap_amplified")
    kwargs, order = verl_batch(inp["inputs"], seed=3)
    adv, _ = core_algos.get_adv_estimator_fn("da3po")(**kwargs, config=AlgoConfig())
    after = back_to_groups(adv, kwargs["response_mask"], order, 4)
    assert torch.allclose(after, torch.tensor(inp["expected"]["advantages_after"], dtype=F64), rtol=1e-12, atol=0)
    assert after[0, 0] == pytest.approx(2 * 0.75 / (0.5 + 1e-6), rel=1e-12)  # 2 x the GRPO advantage
    register_da3po("da3po_threshold_0", correct_above=0.0)
    wrong, _ = core_algos.get_adv_estimator_fn("da3po_threshold_0")(**kwargs)
    assert back_to_groups(wrong, kwargs["response_mask"], order, 4)[0, 0] == pytest.approx(0.75 / (0.5 + 1e-6))


def test_lam1_is_verls_grpo():
    inp = golden.load()["advantages"][1]["inputs"]  # G = 8, every pass rate
    kwargs, _ = verl_batch(inp, seed=1)
    register_da3po("da3po_lam1", lam=1.0)
    ours, _ = core_algos.get_adv_estimator_fn("da3po_lam1")(**kwargs, config=AlgoConfig())
    verls, _ = core_algos.get_adv_estimator_fn("grpo")(**kwargs, config=AlgoConfig())
    assert (ours - verls).abs().max() < 1e-12  # float64: the same formula, operations in another order
    # (verl's grpo_vectorized computes its group statistics in float32: ~1e-7 off, so not the reference here)


def test_daro_estimator_is_grpo_with_the_bins():
    inp = golden.load()["advantages"][1]["inputs"]
    kwargs, order = verl_batch(inp, seed=2)
    adv, bins = core_algos.get_adv_estimator_fn("daro")(**kwargs, config=AlgoConfig())
    verls, _ = core_algos.get_adv_estimator_fn("grpo")(**kwargs, config=AlgoConfig())
    assert (adv - verls).abs().max() < 1e-12
    expected = torch.tensor(inp["correct"]).sum(-1, keepdim=True).expand(-1, 8).to(F64)
    assert torch.equal(back_to_groups(bins, kwargs["response_mask"], order, 8), expected)


def test_zero_one_scores_warn_once(monkeypatch, recwarn):
    """A 0/1 scorer (verl's default reward manager on gsm8k) under the default correct_above = -0.5: every answer
    counts as correct, so `da3po` is verl's grpo and every `daro` row is in bin G, of weight 0. The first batch of
    0s and 1s that falls on one side warns, once per process, with the setting to change; DAPO's +1/-1 scores and
    correct_above = 0.5 do not warn. (pytest's recwarn records every warning: Python's once-per-line filter is off,
    so the count is the file's own.)"""
    inp = golden.load()["advantages"][1]["inputs"]  # G = 8, every pass rate, +1/-1
    kwargs, _ = verl_batch(inp, seed=4)
    zero_one = {**kwargs, "token_level_rewards": (kwargs["token_level_rewards"] > 0).to(F64)}  # +1 -> 1, -1 -> 0
    register_da3po("da3po_01", correct_above=0.5)
    register_daro("daro_01", correct_above=0.5)
    verls, _ = core_algos.get_adv_estimator_fn("grpo")(**zero_one, config=AlgoConfig())
    for name in ("da3po", "daro"):
        monkeypatch.setattr(drop_in, "_warned_one_sided", False)  # a fresh process
        recwarn.clear()
        estimator = core_algos.get_adv_estimator_fn(name)
        estimator(**kwargs)
        core_algos.get_adv_estimator_fn(f"{name}_01")(**zero_one)
        assert not [w for w in recwarn if "0 or 1" in str(w.message)]
        advantages, returns = estimator(**zero_one)
        estimator(**zero_one)
        messages = [str(w.message) for w in recwarn if "0 or 1" in str(w.message)]
        assert len(messages) == 1 and "correct_above=-0.5 counts all of them correct" in messages[0]
        assert f"register_{name}(correct_above=0.5)" in messages[0]
        if name == "da3po":  # silently plain GRPO
            assert (advantages - verls).abs().max() < 1e-12
        else:  # every row in bin G: Eq. (2) weighs none of them
            assert torch.equal(returns, 8 * zero_one["response_mask"])
    amplified, _ = core_algos.get_adv_estimator_fn("da3po_01")(**zero_one)
    assert (amplified - verls).abs().max() > 0.1  # with the threshold between 0 and 1, DAA amplifies


def test_dapo_loss_is_verls_vanilla():
    """DA3PO's loss needs nothing registered: verl's vanilla loss with token-mean and clip 0.2 / 0.28 is
    common.policy_loss aggregated by common.loss_weights, in float64; with the recipes' clip_ratio_c = 1e9, verl's
    dual clip never binds (verl caps the ratio at e^20), the papers' loss; with verl's default 3.0 it does."""
    from omegaconf import OmegaConf
    g = torch.Generator().manual_seed(0)
    B, T = 6, 9
    mask = (torch.arange(T) < torch.randint(1, T + 1, (B,), generator=g).unsqueeze(-1)).to(F64)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3
    logp = old + torch.randn(B, T, generator=g, dtype=F64) * 0.8  # ratios on both sides of every clip
    logp[0, 0] = old[0, 0] + 25.0  # a ratio beyond verl's cap, on a negative advantage
    adv = torch.randn(B, generator=g, dtype=F64)
    adv[0] = -1.0
    weights = common.loss_weights(mask, "token-mean", T)
    for c, ours_c in ((3.0, 3.0), (1e9, 0.0)):
        cfg = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
                                "clip_ratio_c": c, "global_batch_info": {}})
        verls, _ = core_algos.get_policy_loss_fn("vanilla")(old, logp, adv.unsqueeze(-1) * mask, mask.bool(),
                                                            "token-mean", cfg)
        token_loss, clipped = common.policy_loss(logp, old, adv, mask, 0.2, 0.28, clip_ratio_c=ours_c)
        assert clipped["clip_low"] > 0 and clipped["clip_high"] > 0
        ours = (token_loss * weights).sum().item()
        assert abs(ours - verls.item()) <= 1e-14 * max(1.0, abs(ours))  # float64 rounding of the sum
    dual = common.policy_loss(logp, old, adv, mask, 0.2, 0.28, clip_ratio_c=3.0)[0]
    assert not torch.equal(dual, token_loss)  # the dual clip binds on this batch: the two settings differ


def test_verls_aggregations_on_the_golden_vectors():
    """verl's agg_loss on the golden --loss_agg cases. token-mean and seq-mean-token-sum-norm (verl's
    loss_scale_factor = max_new_tokens) to float64 rounding; verl's seq-mean-token-mean adds 1e-8 to each row's token
    count, so there each row is 1e-8 / (its tokens) relative off, not exact."""
    def via_agg_loss(inp):
        token_loss, mask = torch.tensor(inp["token_loss"], dtype=F64), torch.tensor(inp["mask"], dtype=F64)
        scale = inp["max_new_tokens"] if inp["loss_agg"] == "seq-mean-token-sum-norm" else None
        return {"loss": core_algos.agg_loss(token_loss, mask, inp["loss_agg"], loss_scale_factor=scale)}
    report = golden.check(loss_agg=via_agg_loss)
    assert report["cases"] == 3 and [m.split(".")[0] for m in report["mismatches"]] == ["loss_agg/seq-mean-token-mean"]
    report = golden.check(loss_agg=via_agg_loss, rtol=1e-6)  # each row 1e-8 / n off; the loss a signed sum of rows
    assert report["mismatches"] == []

# -----------------------------------------------------------------------------------------------------------------
# DARO in verl


def test_daro_golden_vectors_through_the_drop_in():
    """The file's Eq. (2) weights, w_mu, DARO's policy loss (as verl calls it, with the micro-batch's weights in
    global_batch_info) and the weights' objective on every golden DARO case, float64."""
    def via_drop_in(inp):
        G = inp["G"]
        mask, bins = torch.tensor(inp["mask"], dtype=F64), torch.tensor(inp["bins"])
        s = [torch.tensor(v, dtype=F64, requires_grad=True) for v in inp["neg_log_w"]]
        tokens = drop_in.tokens_per_bin(mask, bins, G)
        eq2 = drop_in.bin_token_weights(mask, bins, tokens)
        w = drop_in.bin_weights(s, "learned")
        # token losses as the loss computes them: at ratio 1 (old = new), -A, so A = -token_loss (exact in float64)
        token_loss = torch.tensor(inp["token_loss"], dtype=F64)
        info = {"daro": {"bins": bins, "eq2": eq2, "w": w, "shares": torch.zeros(G + 1, dtype=F64)}, "dp_size": 1}
        logp = torch.zeros_like(token_loss)
        loss, _ = drop_in.daro_policy_loss(logp, logp, -token_loss, mask, config=ActorConfig(1e9, info))
        objective = drop_in.weight_objective(s, info["daro"]["shares"], tokens > 0, inp["delta"], inp["literal"])
        grads = torch.autograd.grad(objective, s, allow_unused=True)
        return {"token_weights": eq2, "bin_tokens": tokens, "present": tokens > 0, "w": w,
                "bin_loss": info["daro"]["shares"], "model_loss": loss, "weight_objective": objective,
                "weight_grad": [0.0 if g is None else g.item() for g in grads]}
    report = golden.check(daro=via_drop_in)
    assert report["mismatches"] == [] and report["cases"] == 6


def test_daro_in_verls_actor_update(tmp_path):
    """verl's own actor update (ActorRolloutRefWorker, FSDP2, gloo) with DARO, on 2 ranks and on 1 with the same
    updates (tests/verl_actor_update.py): each micro-batch's loss equals daro.py's Eq. (2) over the update's rows on
    all ranks times w_mu (float32 losses: within a few float32 roundings of the terms' absolute sum); the weights
    after each update equal daro.update_weights on the gathered L_mu; they are saved with the actor's checkpoint
    and loaded back; and the 2-rank update's gradient norm is the 1-rank one's (the rank factor is right)."""
    reports = {}
    for n in (2, 1):
        out = tmp_path / f"ranks{n}"
        out.mkdir()
        run = run_script(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                          "-m", "tests.verl_actor_update", str(out)], timeout=600)
        assert run.returncode == 0, run.stderr[-4000:]
        reports[n] = json.loads((out / "report.json").read_text())
        assert len(reports[n]) == n
        for r in reports[n]:
            assert r["worker"] == "DAROTrainingWorker" and r["bins_ok"]
            assert r["metrics"] == ["daro/L_0.250", "daro/L_0.500", "daro/L_0.750", "daro/w_0.250", "daro/w_0.500",
                                    "daro/w_0.750"]
            assert r["micro_batches"] == 4 and r["worst_loss_rel"] < 2e-6 and r["worst_weight_abs"] < 1e-9
            assert r["weights_moved"] > 1e-3 and r["saved_file"] and r["moved_after_save"] and r["restored"]
        assert all(r["weights_after"] == reports[n][0]["weights_after"] for r in reports[n])  # ranks agree
    one, two = reports[1][0], reports[2][0]
    assert two["grad_norm"][0] == pytest.approx(one["grad_norm"][0], rel=1e-5)  # float32 sums in another order
    assert np.allclose(two["weights_after"][0], one["weights_after"][0], rtol=0, atol=1e-12)
    # after the first update the two models differ by float32 noise amplified by Adam's sign-like first step
    assert two["grad_norm"][1] == pytest.approx(one["grad_norm"][1], rel=1e-3)
    worst_loss = max(r["worst_loss_rel"] for r in reports[2])
    worst_weights = max(r["worst_weight_abs"] for r in reports[2])
    print(f"figure: verl actor update with DARO: loss vs daro.py worst {worst_loss:.1e} of the terms' absolute sum, "
          f"weights worst {worst_weights:.1e}; gradient norms 2 ranks {two['grad_norm']} vs 1 rank {one['grad_norm']}")


def test_clear_errors():
    inp = golden.load()["advantages"][1]["inputs"]
    kwargs, _ = verl_batch(inp)
    kwargs["index"][0] = "a lone uid"  # one group of 1, one of 7
    padded = {key: torch.cat([value, value.new_zeros(3, value.shape[1])]) for key, value in kwargs.items()
              if key != "index"}  # 3 rows with no response token, as verl pads
    padded["index"] = np.concatenate([kwargs["index"], np.array(["pad0"] * 3, dtype=object)])
    for name in ("da3po", "daro"):
        for batch in (kwargs, padded):  # the padding is set aside, the real groups of the wrong size are not
            with pytest.raises(ValueError, match=r"G >= 2 of completions \(a uid whose rows have no response "
                                                 r"token, verl's padding, aside\); got group sizes \[1, 7, 8\]"):
                core_algos.get_adv_estimator_fn(name)(**batch)
    with pytest.raises(ValueError, match="tau"):
        register_da3po("bad", tau=0.0)
    register_da3po("da3po_x", lam=3.0)
    with pytest.raises(ValueError, match="already been registered"):
        register_da3po("da3po_x", lam=4.0)
    with pytest.raises(ValueError, match="w_min"):
        register_daro("daro_bad", w_min=2.0)
    with pytest.raises(ValueError, match="other settings"):
        register_daro("daro", weight_lr=0.5)
    x = torch.zeros(2, 3)
    with pytest.raises(RuntimeError, match="the actor worker is not DARO's"):
        core_algos.get_policy_loss_fn("daro")(x, x, x, x.bool(), "token-mean", ActorConfig())

# -----------------------------------------------------------------------------------------------------------------
# The recipes: complete verl commands, every override a key of verl's config


def recipe_overrides(name: str) -> list[str]:
    """The hydra overrides of a recipe script's command, its shell variables given test values."""
    text = open(os.path.join(ROOT, "integrations", name)).read()
    command = text[text.index("python3 -m verl.trainer.main_ppo"):].splitlines()[1:]
    values = {"TRAIN": "train.parquet", "VAL": "val.parquet", "MODEL": "/models/m", "OUT": "/runs/x"}
    lines = [line.strip().rstrip("\\").strip() for line in command]
    return [re.sub(r"\$(\w+)", lambda m: values[m.group(1)], line) for line in lines if line and line != '"$@"']


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir
    from verl.trainer import main_ppo
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(main_ppo.__file__), "config"),
                               version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=overrides)


@pytest.mark.parametrize("script", sorted(RECIPES))
def test_recipe_composes_on_verls_config(script):
    """Every override of the recipe is a key of verl's ppo_trainer config (hydra's compose refuses an unknown one),
    and the composed config passes verl's own checks (main_ppo's validate_config, the actor's dataclass)."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    overrides = recipe_overrides(script)
    assert len(overrides) > 40 and all("=" in o for o in overrides)
    config = compose(overrides)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    algo = RECIPES[script]
    assert config.algorithm.adv_estimator == algo and algo in core_algos.ADV_ESTIMATOR_REGISTRY
    assert actor.policy_loss.loss_mode == ("vanilla" if algo == "da3po" else "daro")
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c) == (0.2, 0.28, 1e9)  # no dual clip
    assert actor.optim.weight_decay == 0.1 and actor.optim.lr == 1e-6 and not actor.use_kl_loss
    assert not need_reference_policy(config) and not need_critic(config)
    if algo == "da3po":  # DAPO: the filter on correctness, token mean, the overlong shaping
        assert config.algorithm.filter_groups.enable and config.algorithm.filter_groups.metric == "acc"
        assert actor.loss_agg_mode == "token-mean" and config.reward.reward_kwargs.overlong_buffer_cfg.enable
        assert config.data.train_batch_size // actor.ppo_mini_batch_size == 16  # 16 updates per step
    else:  # DARO: no dynamic sampling, 128 prompts in 2 updates, K = 8
        assert not config.algorithm.filter_groups.enable and config.actor_rollout_ref.rollout.n == 8
        assert config.data.train_batch_size // actor.ppo_mini_batch_size == 2


def test_a_wrong_override_path_fails_to_compose():
    """What the test above relies on: the old documented short paths are not keys of verl's config."""
    from hydra.errors import ConfigCompositionException
    for wrong in ("actor.loss_agg_mode=token-mean", "actor_rollout_ref.actor.clip_ratio_hihg=0.28"):
        with pytest.raises(ConfigCompositionException):
            compose([wrong])

# -----------------------------------------------------------------------------------------------------------------
# verl's batches as its trainer hands them to an estimator


def recipe_rows(script: str, nnodes: int, seed: int = 0):
    """One step's rows of a recipe on `nnodes` nodes of 8 GPUs, as verl 0.9.1's V1 trainer holds them before its
    advantages: train_batch_size x n rows (DAPO's +1/-1 on each row's last response token, some with an overlong
    penalty), then the padding of its _balance_batch: the multiple from the trainer's own
    _get_required_batch_multiple on the recipe's config, the rows from its padding template under one pad<hex> uid;
    all rows shuffled, as the balancing reorders them. Returns (rows, padding (bs,) bool, the composed config)."""
    from types import SimpleNamespace
    from uuid import UUID
    from verl.trainer.ppo.padding_utils import construct_minimal_padding_template
    from verl.trainer.ppo.utils import need_critic
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    overrides = [o for o in recipe_overrides(script) if not o.startswith("trainer.nnodes=")]
    config = compose(overrides + [f"trainer.nnodes={nnodes}"])
    trainer = SimpleNamespace(config=config, use_critic=need_critic(config), global_steps=1)
    dp_size = config.trainer.n_gpus_per_node * nnodes
    multiple = PPOTrainer._get_required_batch_multiple(trainer, dp_size)
    rng = random.Random(seed)
    rows = []
    for _ in range(config.data.train_batch_size):
        uid = str(UUID(int=rng.getrandbits(128), version=4))  # verl's uids are uuid4 strings
        pass_rate = rng.random()
        for _ in range(config.actor_rollout_ref.rollout.n):
            length = rng.randint(1, 24)
            score = torch.zeros(length)  # float32, as verl's rm_scores
            score[-1] = (1.0 if rng.random() < pass_rate else -1.0) - (rng.random() if rng.random() < 0.1 else 0.0)
            rows.append({"response_mask": torch.ones(length, dtype=torch.int64), "rm_scores": score, "uid": uid})
    template, tag = construct_minimal_padding_template(rows[0], {}, eos_token_id=0)
    assert tag["is_padding"] and not template["response_mask"].any() and not template["rm_scores"].any()
    pad_uid = f"pad{rng.getrandbits(128):032x}"  # verl: f"pad{uuid.uuid4().hex}", one for all the padding
    pad_size = -len(rows) % multiple  # verl's batch_multiple - remainder, none when the multiple divides
    rows += [{"response_mask": template["response_mask"], "rm_scores": template["rm_scores"], "uid": pad_uid}
             for _ in range(pad_size)]
    padding = torch.arange(len(rows)) >= len(rows) - pad_size
    order = rng.sample(range(len(rows)), len(rows))
    return [rows[i] for i in order], padding[order], config


def through_verl(rows: list[dict], algorithm, n: int, keys: list[str] | None = None):
    """The rows' advantages as the V1 trainer's _compute_advantage computes them: its padded tensors, uids as an
    object array, then verl's compute_advantage_for_multi_trajectories, which calls algorithm.adv_estimator. keys:
    each row's {uid}_{session}_{output}, by default one output per session."""
    from verl import DataProto
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict
    data = DataProto(batch=list_of_dict_to_tensordict(rows).to_padded_tensor())
    data.batch["token_level_scores"] = data.batch["rm_scores"]
    data.non_tensor_batch["uid"] = np.array(data.batch.pop("uid").tolist(), dtype=object)
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]  # no KL in the reward
    keys = keys or [f"{uid}_{i}_0" for i, uid in enumerate(data.non_tensor_batch["uid"])]
    return compute_advantage_for_multi_trajectories(data, batch_keys=keys, adv_estimator=algorithm.adv_estimator,
                                                    num_repeat=n, config=algorithm)


@pytest.mark.parametrize("script", sorted(RECIPES))
def test_verls_padding_at_24_gpus(script):
    """On 3 nodes of 8 GPUs verl 0.9.1 pads the recipes' 8,192 and 1,024 rows to a multiple of lcm(24, mini-batch x
    n) = 1,536 with 1,024 and 512 rows of one uid and no response token. Those rows get advantage 0 (DARO: bin 0
    and no token in any bin's count), and every other row exactly what the batch without the padding gives it."""
    rows, padding, config = recipe_rows(script, nnodes=3)
    assert (len(rows), int(padding.sum())) == {"da3po": (9216, 1024), "daro": (1536, 512)}[RECIPES[script]]
    n = config.actor_rollout_ref.rollout.n
    padded = through_verl(rows, config.algorithm, n)
    alone = through_verl([row for row, pad in zip(rows, padding) if not pad], config.algorithm, n)
    for key in ("advantages", "returns"):
        assert torch.equal(padded.batch[key][~padding], alone.batch[key])
        assert not padded.batch[key][padding].any()
    assert alone.batch["advantages"].abs().sum() > 0
    if RECIPES[script] == "daro":  # the actor's side: each row's bin and Eq. (2) weights
        bins, mask = drop_in._bins_and_mask(padded.batch)
        tokens = drop_in.tokens_per_bin(mask, bins, n)
        eq2 = drop_in.bin_token_weights(mask, bins, tokens)
        bins_alone, mask_alone = drop_in._bins_and_mask(alone.batch)
        tokens_alone = drop_in.tokens_per_bin(mask_alone, bins_alone, n)
        eq2_alone = drop_in.bin_token_weights(mask_alone, bins_alone, tokens_alone)
        assert torch.equal(tokens, tokens_alone) and tokens[1:n].sum() > 0
        assert torch.equal(eq2[~padding], eq2_alone) and not eq2[padding].any()


def test_agent_loops_with_several_outputs_per_session():
    """verl 0.9.1 stores each output of an agent loop that returns several per session (one per turn, say) as a row
    under the prompt's uid, each with the session's final score. Only verl's grpo computes its statistics on each
    session's last output and gives that advantage to the session's other outputs. da3po and daro count every
    output as a completion. With k outputs per session a group holds n k rows: DAA amplifies the same sessions,
    the std is over n k rows, and DARO's bins are k x #correct, past the actor's G = n. Sessions with different
    numbers of outputs make groups of different sizes, the estimators' error."""
    n, k = 4, 3
    rows, keys = [], []
    rng = random.Random(5)
    for prompt in range(1, 4):  # 1, 2, 3 correct sessions of 4
        for session in range(n):
            for output in range(k):
                score = torch.zeros(rng.randint(1, 6))
                score[-1] = 1.0 if session < prompt else -1.0
                rows.append({"response_mask": torch.ones_like(score, dtype=torch.int64), "rm_scores": score,
                             "uid": f"uid-{prompt}"})
                keys.append(f"uid-{prompt}_{session}_{output}")
    outputs = {name: through_verl(rows, AlgoConfig(adv_estimator=name), n, keys) for name in ("grpo", "da3po", "daro")}
    per_row = {name: out.batch["advantages"][:, 0] for name, out in outputs.items()}  # a row's first token
    last = through_verl(rows[k - 1::k], AlgoConfig(adv_estimator="grpo"), n)  # one row per session: its last
    sessions = last.batch["advantages"][:, 0]
    assert torch.equal(per_row["grpo"], sessions.repeat_interleave(k))
    correct = torch.tensor([session < prompt for prompt in range(1, 4) for session in range(n)])
    amplified = correct & (correct.view(-1, n).sum(-1, keepdim=True) < n / 2).expand(-1, n).flatten()  # p < tau
    ratio = math.sqrt((n * k - 1) / (k * (n - 1))) * (1 + amplified.float())  # the std over n k rows; DAA's lam 2
    assert torch.allclose(per_row["da3po"] / per_row["grpo"], ratio.repeat_interleave(k), rtol=1e-5, atol=0)
    bins = outputs["daro"].batch["returns"].amax(-1)
    assert torch.equal(bins, (k * correct.view(-1, n).sum(-1)).repeat_interleave(n * k).to(bins.dtype))
    with pytest.raises(ValueError, match="several outputs per session puts each under the prompt's uid"):
        through_verl(rows[1:], AlgoConfig(adv_estimator="da3po"), n, keys[1:])  # one session with 2 outputs
