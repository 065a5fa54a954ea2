"""The randomized comparison of the real update pipeline against the plain reference (tests/reference.py).

random_case(seed) draws an update batch and a flag combination; run_pipeline runs it through the scripts' own code
path (plan_updates, make_batch, the script's advantages, rollout_correction, the script's token weights, micro_batches,
token_losses, the script's loss, backward; DARO's weight step), in one process or as one rank under torchrun;
compare() computes the reference of each update and returns the worst relative error of each check.
Run: python -m pytest -q tests/test_reference.py  |  python -m tools.reference_sweep --seeds 500
(its users: tests/test_reference.py, tests/dist_reference.py, tools/reference_sweep.py)

Tolerance (TOL, derived): the pipeline and the reference compute the same float64 numbers in a different order
(batched and padded vs one sequence alone, micro-batch sums vs one sum). Each rounding is at most 2^-53 = 1.1e-16
relative; the longest chain here (a forward through 2 layers of width 128 and a vocabulary sum, then a backward) has
a few thousand of them, so the results agree to about 1e-12 of their scale (measured: at most 2.1e-12 for the loss,
3.8e-13 for the gradient over 1000 cases). 1e-10 leaves a margin of 50 and is far below anything a wrong weight, a
lost token or a wrong clip makes (at least a token's share: above 1e-3 here).
"""
import contextlib
import copy
import random

import torch

import common
import modeling
import da3po
import daro
import ranks
from tests.reference import Adam, Flags, Seq, gradient, sequence_logprobs, update, weight_objective

TOL = 1e-10
CHECKS = ("advantage", "mask", "weight", "carried", "loss", "grad", "bin_loss", "s")


# -----------------------------------------------------------------------------------------------------------------
# Cases


def random_case(seed: int, model, script: str | None = None, **fixed) -> dict:
    """A random update batch and flags for `script` (da3po or daro; drawn if None); `fixed` overrides flags. The
    case is plain data (lists and numbers), so it can be saved and handed to another process."""
    rng = random.Random(seed)
    script = script or rng.choice(["da3po", "daro"])
    G = rng.choice([2, 3, 4, 5, 8])
    n_groups = 2 if G > 4 else rng.choice([2, 4])  # even: 2 ranks split them evenly
    flags = dict(group_size=G, max_new_tokens=8, temperature=rng.choice([1.0, 0.7]), std_norm=rng.random() < 0.7,
                 loss_agg=rng.choice(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]),
                 seq_ratio=rng.random() < 0.3, clip_ratio_c=rng.choice([0.0, 0.0, 1.3, 3.0]),
                 kl_coef=rng.choice([0.0, 0.0, 0.1]), rollout_is=rng.choice(["none", "token", "token", "sequence"]),
                 rollout_is_cap=rng.choice([1.5, 2.0]), rollout_is_mask=rng.random() < 0.6,
                 updates_per_step=rng.randint(1, 2), logprob_chunk=rng.choice([0, 7, 1024]))
    flags["clip_low"], flags["clip_high"] = rng.choice([(0.2, 0.28), (0.05, 0.1), (3e-4, 4e-4)])
    rows = n_groups * G
    flags["micro_batch_size"] = rng.randint(1, rows)
    flags["micro_batch_tokens"] = rng.choice([0, rng.randint(4, 60)])  # small: packs few rows, one row may exceed it
    # --pack from a stream of its own, so that every other draw (and so every earlier case) stays as it was
    flags["pack"] = random.Random(f"pack {seed}").random() < 0.5
    # the log-prob path, likewise: the plain padded forward, or the shortcuts (--pack, --logprob_chunk read there)
    flags["logprob_path"] = random.Random(f"path {seed}").choice(["plain", "shortcuts", "shortcuts"])
    if script == "da3po":
        flags.update(lam=rng.choice([1.0, 2.0, 3.0]), tau=rng.choice([0.25, 0.5, 0.75, 1.0]),
                     daa_scope=rng.choice(["correct", "correct", "all"]),
                     p_estimate=rng.choice(["group", "group", "running"]))
    else:
        flags.update(weighting=rng.choice(["learned", "learned", "uniform", "var", "none"]),
                     daro_delta=rng.choice([1e-3, 0.1]), daro_literal=rng.random() < 0.3, w_min=0.1, w_max=10.0,
                     weight_lr=rng.choice([1e-3, 0.05]))
    flags.update(fixed)
    G, T = flags["group_size"], flags["max_new_tokens"]
    noise = rng.choice([0.05, 0.2, 0.5])  # spread of log pi_old - log pi: how many ratios the clips reach
    rollout_noise = rng.choice([0.1, 0.4, 0.8])  # spread of log pi_old - log pi_rollout: how many IS rejections
    groups = []
    for gid in range(n_groups):
        n_correct = rng.choice([0, G] + list(range(1, G)) * 2)  # bins 0 and G now and then (DARO leaves them out)
        correct = [True] * n_correct + [False] * (G - n_correct)
        rng.shuffle(correct)
        completions = [[rng.randint(10, 40) for _ in range(rng.randint(1, T))] for _ in range(G)]
        # DAPO's reward with a shaping step now and then (dyadic values: exact in any float format)
        reward = [(1.0 if c else -1.0) - rng.choice([0.0, 0.0, 0.25, 0.5]) for c in correct]
        n_before = rng.choice([0, G, 3 * G])  # samples of this prompt in earlier steps (--p_estimate running)
        groups.append({"id": gid, "prompt_ids": [rng.randint(10, 40) for _ in range(rng.randint(1, 6))],
                       "completions": completions, "reward": reward, "correct": correct,
                       "prompt": f"problem {gid}", "answer": "42", "prior": [rng.randint(0, n_before), n_before]})
    with torch.no_grad():  # pi_old near the model's own log-probs, pi_rollout near pi_old
        for g in groups:
            g["old_logp"], g["rollout_logp"] = [], []
            for c in g["completions"]:
                seq = Seq(g["prompt_ids"], c, 0, 0.0, False, [])
                logp = sequence_logprobs(model, seq, flags["temperature"]).tolist()
                old = [x + rng.gauss(0, noise) for x in logp]
                g["old_logp"].append(old)
                g["rollout_logp"].append([x + rng.gauss(0, rollout_noise) for x in old])
    s0 = [rng.uniform(-1.0, 1.0) for _ in range(G - 1)]  # DARO's learned s_mu at the update's start
    return {"seed": seed, "script": script, "flags": flags, "groups": groups, "s0": s0}


def describe(case: dict) -> str:
    """The flags that select a code path, in one short string (the sweep's key)."""
    f = case["flags"]
    parts = [case["script"], f["loss_agg"] if f.get("weighting", "none") == "none" else f"daro-{f['weighting']}"]
    if f.get("p_estimate") == "running":
        parts.append("running-p")
    if f["rollout_is"] != "none":
        parts.append(f"is-{f['rollout_is']}" + ("-mask" if f["rollout_is_mask"] else ""))
    parts += [name for name, on in [("gspo", f["seq_ratio"]), ("dual", f["clip_ratio_c"] > 1), ("kl", f["kl_coef"]),
                                    ("packed", f["micro_batch_tokens"]), ("pack", f.get("pack"))] if on]
    return " ".join(parts)


# Tiny random models of other families, for the packed path against the padded one on the harness's cases:
# config class and settings; a window of `window` tokens where the family has one (the cases' rows run up to 14
# tokens, the windows 6). Keys are families, or a family with its window on (Qwen2, Qwen3-MoE: off by default).
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),  # biases on q, k and v
    "gpt_neox": ("GPTNeoXConfig", dict(rotary_pct=0.5)),  # partial rotary, parallel residual
    "mistral": ("MistralConfig", dict(sliding_window="window")),  # the window in config.sliding_window
    "mixtral": ("MixtralConfig", dict(sliding_window="window", num_local_experts=4, num_experts_per_tok=2)),
    "phi3": ("Phi3Config", dict(sliding_window="window")),
    "starcoder2": ("Starcoder2Config", dict(sliding_window="window")),
    "qwen3_moe": ("Qwen3MoeConfig", dict(use_sliding_window=True, sliding_window="window", num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=16)),
    "qwen2_window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window="window", max_window_layers=1)),
    "gemma2": ("Gemma2Config", dict(sliding_window="window", query_pre_attn_scalar=8, final_logit_softcapping=2.0)),
}
WINDOWED = [f for f, (_, settings) in FAMILIES.items() if settings.get("sliding_window") == "window"]
# Mixtral's and Qwen3-MoE's routers compute their softmax in float32: each routing weight is rounded to 6e-8 of itself,
# and every expert output is weighed by one, so their losses and gradients agree to about 1e-7, not TOL; 1e-6 bounds it
FAMILY_TOL = {"mixtral": 1e-6, "qwen3_moe": 1e-6}


def family_model(family: str, window: int = 6, seed: int = 0):
    """A tiny random causal LM of `family` (FAMILIES) in float64, in training mode: vocabulary 64 (the cases' tokens
    are 10-40), 2 layers, grouped-query heads; `window` where the family has one."""
    import transformers
    config_cls, settings = FAMILIES[family]
    settings = {k: window if v == "window" else v for k, v in settings.items()}
    config = getattr(transformers, config_cls)(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, **settings)
    config._experts_implementation = "eager"  # the grouped-matmul experts take no float64
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).double().train()
    for module in model.modules():  # float64 norms, as conftest.float64_norms makes the demo model's
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = _float64_rms_norm.__get__(module)
    return model


def _float64_rms_norm(self, x):
    """An RMSNorm in its input's dtype: transformers' compute in float32 (for bf16), so a float64 model's gradient
    is rounded to float32 there, 1e-7 of its scale, at points that depend on the batch's layout. Gemma's scale is
    1 + weight."""
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
    scale = 1.0 + self.weight if "Gemma" in type(self).__name__ else self.weight
    return scale * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@contextlib.contextmanager
def every_micro_batch_packed(*models):
    """Inside, --pack packs every micro-batch: the models run as ones whose KV cache cannot serve a group's prompt
    once (model.shares_prompts False, as the start-up check leaves a hybrid model), so the padded path would run
    rows whole and packing always runs fewer positions (shortcuts._packs)."""
    saved = [m.__dict__.get("shares_prompts") for m in models]
    for m in models:
        m.shares_prompts = False
    try:
        yield
    finally:
        for m, value in zip(models, saved):
            if value is None:
                del m.shares_prompts
            else:
                m.shares_prompts = value


def ref_model_of(model, seed: int = 1):
    """The KL anchor: a copy of the model with slightly moved weights (so that the k3 term and its gradient are not
    zero), frozen."""
    ref = copy.deepcopy(model).requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return ref


# -----------------------------------------------------------------------------------------------------------------
# The pipeline, as da3po.py's and daro.py's main run steps 2-5 of a step (no optimizer step: the model stays as it is,
# so every update's gradient is taken at the same weights)


def _padded(lists: list[list[float]], T: int) -> torch.Tensor:
    return torch.tensor([x + [0.0] * (T - len(x)) for x in lists], dtype=torch.float64)


def run_pipeline(model, ref_model, case: dict, pad_id: int, dist_info=None) -> list[dict]:
    """Each update of the case through the real code, on this rank's share. Returns per update (every rank gets the
    same): the group ids trained, each row's advantage, trained tokens and effective token weights (w_mu included),
    what the micro-batches carried per token, the loss, the full gradient, DARO's L_mu and s after the step."""
    dist_info = dist_info or ranks.DistInfo()
    f, default = case["flags"], torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # everything the pipeline creates (rewards, advantages, w_mu) in float64
    try:
        if case["script"] == "da3po":
            cfg = da3po.Config(**f)
            algo = da3po.DAA(cfg, torch.device("cpu"), {})
            if cfg.p_estimate == "running":  # the earlier steps' counts, then this step's
                algo.pass_counts = {da3po.pass_key(g): list(g["prior"]) for g in case["groups"]}
                algo.after_rollout(case["groups"])  # as main: every group generated, on every rank
        else:
            cfg = daro.Config(**f)
            algo = daro.DARO(cfg, torch.device("cpu"), {})
            with torch.no_grad():
                for s, value in zip(algo.neg_log_w, case["s0"]):
                    s.fill_(value)
        world = dist_info.world_size
        kept = [{"group": g, "origin": (i % world, i), "prompt_len": len(g["prompt_ids"]),
                 "lengths": [len(c) for c in g["completions"]], "correct": g["correct"]}
                for i, g in enumerate(case["groups"])]
        my_groups, update_rows = common.plan_updates(kept, cfg.updates_per_step, dist_info, cfg.micro_batch_tokens > 0)
        batch = common.make_batch(my_groups, pad_id)
        # a float64 mask, so that the loss weights are float64 too (loss_weights makes an integer mask's float32:
        # exact to 6e-8 only); the values, and every use of the mask, are the same
        batch["mask"] = batch["mask"].double()
        # ALGO LOGIC 3): the advantages, the script's way
        batch["advantage"] = algo.advantages(batch, my_groups)
        T = batch["mask"].shape[1]
        batch["old_logp"] = _padded([lp for g in my_groups for lp in g["old_logp"]], T)  # pi_old, given
        if cfg.rollout_is != "none":
            common.rollout_correction(batch, cfg)
        row_ids = [(g["id"], j) for g in my_groups for j in range(len(g["completions"]))]
        batch["weight"] = torch.zeros_like(batch["mask"], dtype=torch.float64)
        sums, out = common.Sums(*common.TRAIN_SUMS), []
        for rows in update_rows:
            batch["weight"][rows] = algo.start_update(batch, rows)
            w_bin = algo.w[batch["bin"]].unsqueeze(-1) if case["script"] == "daro" else 1.0  # DARO's w_mu per row
            effective = batch["weight"] * w_bin
            carried, total = torch.zeros_like(batch["weight"]), 0.0
            for mb_rows, mb in common.micro_batches(batch, rows, cfg.micro_batch_size, cfg.micro_batch_tokens):
                loss = algo.loss(common.token_losses(model, ref_model, mb, cfg, torch.device("cpu"), sums), mb)
                loss.backward()
                total += loss.item()
                mb_w = mb["weight"] * (algo.w[mb["bin"]].unsqueeze(-1) if case["script"] == "daro" else 1.0)
                carried[mb_rows, :mb_w.shape[1]] += mb_w  # the share of each token some micro-batch trained
            grads = {n: (modeling.full_tensor(p.grad) if p.grad is not None else torch.zeros_like(
                modeling.full_tensor(p.detach()))).clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            record = {"loss": ranks.all_reduce_sum(torch.tensor(total)).item(), "grad": grads,
                      "rows": ranks.all_gather_list([
                          (row_ids[r], batch["advantage"][r].item(), batch["mask"][r].tolist(),
                           effective[r].tolist(), carried[r].tolist()) for r in rows.tolist()])}
            if case["script"] == "daro":
                record["bin_loss"] = ranks.all_reduce_sum(algo.bin_loss.clone()).tolist()
                algo.after_update()
                record["s"] = [s.item() for s in algo.neg_log_w]
            out.append(record)
        return out
    finally:
        torch.set_default_dtype(default)


# -----------------------------------------------------------------------------------------------------------------
# The comparison


def _rel(err: float, scale: float) -> float:
    return err / scale if scale > 0 else err


def compare(model, ref_model, case: dict, results: list[dict]) -> dict[str, float]:
    """The reference of each update the pipeline ran (its groups as the pipeline reports them, after checking that
    every group was trained in exactly one update), and the worst relative error of each check over the updates:
      advantage  each row's A (script's advantages vs reference, DAA and Dr. GRPO included)
      mask       the share of tokens whose trained / not trained differs (IS rejection, DARO's bins 0 and G)
      weight     each token's share of the loss after the script's start_update (x w_mu): the aggregation
      carried    each token's share that the micro-batches actually trained (packing, trimming)
      loss, grad the update's loss and gradient (max abs difference over the largest reference entry)
      bin_loss   DARO's L_mu; s: DARO's s_mu = -ln w_mu after the weights' step (the reference's Adam)"""
    f = Flags(G=case["flags"]["group_size"],
              **{k: v for k, v in case["flags"].items() if k in Flags.__dataclass_fields__})
    if case["script"] == "da3po":
        f.weighting = "none"
    groups = {g["id"]: g for g in case["groups"]}
    seen = [gid for r in results for gid in sorted({row[0][0] for row in r["rows"]})]
    assert sorted(seen) == sorted(groups), f"groups trained {seen}, not each of {sorted(groups)} once"
    errors = dict.fromkeys(CHECKS, 0.0)
    adam = Adam(case["s0"], f)
    for r in results:
        gids = sorted({row[0][0] for row in r["rows"]})
        seqs, index = [], {}
        for gid in gids:
            g = groups[gid]
            for j, c in enumerate(g["completions"]):
                index[(gid, j)] = len(seqs)
                seqs.append(Seq(g["prompt_ids"], c, gid, g["reward"][j], g["correct"][j], g["old_logp"][j],
                                g["rollout_logp"][j], tuple(g.get("prior", (0, 0)))))
        ref = update(model, seqs, f, ref_model, adam.s)
        for (key, A, mask, weight, carried) in r["rows"]:
            i = index[tuple(key)]
            L = len(seqs[i].completion)
            coef = ref.coef[i] + [0.0] * (len(weight) - L)
            trained = ref.trained[i] + [False] * (len(mask) - L)
            scale = max(max(map(abs, coef)), 1e-300)
            errors["advantage"] = max(errors["advantage"], _rel(abs(A - ref.advantage[i]), max(1.0, abs(A))))
            errors["mask"] = max(errors["mask"], sum(bool(m) != t for m, t in zip(mask, trained)) / len(mask))
            errors["weight"] = max(errors["weight"], max(abs(a - b) for a, b in zip(weight, coef)) / scale)
            errors["carried"] = max(errors["carried"], max(abs(a - b) for a, b in zip(carried, coef)) / scale)
        ref_loss = ref.loss.item()
        errors["loss"] = max(errors["loss"], _rel(abs(r["loss"] - ref_loss), max(abs(ref_loss), 1e-3)))
        ref_grad = gradient(model, ref)
        scale = max(g.abs().max().item() for g in ref_grad.values())
        diff = max((r["grad"][n] - ref_grad[n]).abs().max().item() for n in ref_grad)
        errors["grad"] = max(errors["grad"], _rel(diff, scale))
        if "bin_loss" in r and f.weighting != "none":
            for b in range(f.G + 1):
                L_ref = ref.bin_loss.get(b, 0.0)
                errors["bin_loss"] = max(errors["bin_loss"], _rel(abs(r["bin_loss"][b] - L_ref), max(1.0, abs(L_ref))))
            if f.weighting == "learned":
                adam.step(weight_objective(ref.bin_loss, adam.s, f)[1])
            errors["s"] = max(errors["s"], max(abs(a - b) for a, b in zip(r["s"], adam.s)))
    return errors


def check_case(model, ref_model, pad_id: int, seed: int, script: str | None = None, **fixed):
    """One random case end to end: (case, errors by check)."""
    case = random_case(seed, model, script, **fixed)
    results = run_pipeline(model, ref_model if case["flags"]["kl_coef"] > 0 else None, case, pad_id)
    return case, compare(model, ref_model, case, results)


def failures(errors: dict[str, float], tol: float = TOL) -> dict[str, float]:
    """The checks whose error is above the tolerance."""
    return {k: v for k, v in errors.items() if not v <= tol}  # `not <=`: a NaN fails too
