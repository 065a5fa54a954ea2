"""The verl drop-in (integrations/verl_da3po.py, verl==0.9.1) on CPU, through verl's own registry lookups: the
registered estimator equals the project's DAA on the golden vectors (rows shuffled, groups found by uid), lam = 1 is
verl's own GRPO, verl's DAPO loss ("vanilla", token-mean) and aggregations equal common.policy_loss and
common.loss_weights, and the README's module works through VERL_USE_EXTERNAL_MODULES. A whole verl run needs GPUs.
Skips without verl (pip install -r requirements-verl.txt && pip install --no-deps verl==0.9.1)."""
import os
import random

import numpy as np
import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos",
                                 reason="verl is optional: pip install -r requirements-verl.txt")

import common  # noqa: E402
from conftest import ROOT, readme_block, run_script  # noqa: E402
from integrations import golden  # noqa: E402
from integrations.verl_da3po import register_da3po  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402

F64 = torch.float64


def verl_batch(inp: dict, seed: int = 0):
    """A golden case as verl hands it to an estimator: the score on each row's last response token, rows shuffled
    (verl does not promise group order), uids as strings. Returns (kwargs, the row order)."""
    G, rewards, lengths = inp["G"], inp["rewards"], inp["lengths"]
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


def through_registry(inp: dict):
    """The golden advantage cases through get_adv_estimator_fn; None for a running p (not offered for verl)."""
    if inp["p"] is not None:
        return None
    name = f"da3po_golden_{inp['lam']}_{inp['tau']}_{inp['adaptive_lam']}_{inp['lam_max']}_{inp['scope']}"
    # DAPO's shaped rewards: correct ones in [0, 1], wrong ones in [-2, -1]
    register_da3po(name, inp["lam"], inp["tau"], inp["adaptive_lam"], inp["lam_max"], inp["scope"], -0.5)
    kwargs, order = verl_batch(inp)
    adv, returns = core_algos.get_adv_estimator_fn(name)(
        **kwargs, config=AlgoConfig(adv_estimator=name, norm_adv_by_std_in_grpo=inp["std_norm"]))
    assert torch.equal(adv, returns) and torch.equal(adv, adv * kwargs["response_mask"])
    per_row = adv.sum(-1) / kwargs["response_mask"].sum(-1)  # one value per row, on every response token
    after = torch.empty_like(per_row).index_put_((order,), per_row).view(-1, inp["G"])  # back to the file's order
    return {"advantages_after": after}


def test_registered_estimator_equals_the_golden_vectors():
    report = golden.check(advantages=through_registry)
    assert report["mismatches"] == []
    assert report["cases"] == 9 and len(report["skipped"]) == 2  # the two running-p cases


def test_lam1_is_verls_grpo():
    inp = golden.load()["advantages"][1]["inputs"]  # G = 8, every pass rate
    kwargs, _ = verl_batch(inp, seed=1)
    register_da3po("da3po_lam1", lam=1.0)
    ours, _ = core_algos.get_adv_estimator_fn("da3po_lam1")(**kwargs, config=AlgoConfig())
    verls, _ = core_algos.get_adv_estimator_fn("grpo")(**kwargs, config=AlgoConfig())
    assert (ours - verls).abs().max() < 1e-12  # float64: the same formula, operations in another order
    # (verl's grpo_vectorized computes its group statistics in float32: ~1e-7 off, so not the reference here)


def test_dapo_loss_is_verls_vanilla():
    """DA3PO's loss needs nothing registered: verl's vanilla loss (token-mean, clip 0.2 / 0.28, dual clip 3) is
    common.policy_loss aggregated by common.loss_weights, in float64."""
    from omegaconf import OmegaConf
    g = torch.Generator().manual_seed(0)
    B, T = 6, 9
    mask = (torch.arange(T) < torch.randint(1, T + 1, (B,), generator=g).unsqueeze(-1)).to(F64)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3
    logp = old + torch.randn(B, T, generator=g, dtype=F64) * 0.3  # ratios on both sides of both clips
    adv = torch.randn(B, generator=g, dtype=F64)
    cfg = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
                            "global_batch_info": {}})
    verls, _ = core_algos.get_policy_loss_fn("vanilla")(old, logp, adv.unsqueeze(-1) * mask, mask.bool(),
                                                        "token-mean", cfg)
    token_loss, clipped = common.policy_loss(logp, old, adv, mask, 0.2, 0.28, clip_ratio_c=3.0)
    ours = (token_loss * common.loss_weights(mask, "token-mean", T)).sum()
    assert clipped["clip_low"] > 0 and clipped["clip_high"] > 0
    assert abs(ours.item() - verls.item()) <= 1e-14


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


def test_clear_errors():
    inp = golden.load()["advantages"][1]["inputs"]
    kwargs, _ = verl_batch(inp)
    kwargs["index"][0] = "a lone uid"  # one group of 1, one of 7
    with pytest.raises(ValueError, match=r"same number G >= 2 of completions; got group sizes \[1, 7, 8\]"):
        core_algos.get_adv_estimator_fn("da3po")(**kwargs)
    with pytest.raises(ValueError, match="tau"):
        register_da3po("bad", tau=0.0)
    register_da3po("da3po_x", lam=3.0)
    with pytest.raises(ValueError, match="already been registered"):
        register_da3po("da3po_x", lam=4.0)


def test_readme_module_through_verls_external_modules(tmp_path):
    (tmp_path / "my_da3po.py").write_text(readme_block("register_da3po"))
    code = ("from verl.trainer.ppo.core_algos import get_adv_estimator_fn as get\n"
            "import torch, numpy as np\n"
            "r = torch.tensor([[1.0], [-1.0], [-1.0], [-1.0]]); m = torch.ones(4, 1)\n"
            "adv, _ = get('da3po_dapo')(token_level_rewards=r, response_mask=m, index=np.array(['q'] * 4))\n"
            "print([round(a, 4) for a in adv.flatten().tolist()])\n")
    env_path = os.pathsep.join([str(tmp_path), ROOT])
    out = run_script(["-c", f"import os; os.environ['VERL_USE_EXTERNAL_MODULES'] = 'my_da3po'\n"
                            f"import sys; sys.path[:0] = {env_path.split(os.pathsep)!r}\n{code}"], cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[3.0, -0.5, -0.5, -0.5]"  # p_hat 1/4: the correct one doubled
