"""The TRL drop-in (integrations/trl_da3po_daro.py, trl==1.16.0): its formulas equal the project's and the golden
vectors; real GRPOTrainer runs on the shipped demo model, CPU: DA3PO's advantages are DAA of TRL's group
advantages and each update is a token mean over its own tokens; DARO's two updates per generation batch equal
daro.py's two updates on the same rows (loss, gradient, weights, float64); DARO's weights and their Adam state resume
exactly; TRL's peft_config works with both trainers; docs/integrations.md's snippet runs as written and
clip-higher binds; two processes (torchrun, gloo) with a group split across them. Skips without TRL
(pip install -r requirements/trl.txt).
Run: HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python -m pytest -q tests/test_trl.py"""
import copy
import json
import os
import re

import pytest
import torch

pytest.importorskip("trl", reason="TRL is optional: pip install -r requirements/trl.txt")

import common  # noqa: E402
import shortcuts
import da3po  # noqa: E402
import daro  # noqa: E402
import modeling  # noqa: E402
from tests.conftest import ROOT, docs_block, run_script  # noqa: E402
from tests.dropin_formulas import check_copied_formulas  # noqa: E402
from integrations import golden  # noqa: E402
from integrations import trl_da3po_daro as drop_in  # noqa: E402
from integrations.trl_da3po_daro import (ALGO_STATE, DA3POConfig, DA3POTrainer, DAROConfig,  # noqa: E402
                                         DAROTrainer)
from transformers import TrainerCallback  # noqa: E402
from verifier import verify_batch  # noqa: E402

G = 8
F64 = torch.float64


def arith_dataset(level: int):
    """The demo eval set's sums of one difficulty level, as TRL conversational prompts (the demo model's chat
    template then gives the prompt da3po.py trains on)."""
    from datasets import Dataset
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "demo", "arith", "eval.jsonl"))]
    rows = [r for r in rows if r["level"] == level]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": r["problem"]}] for r in rows],
                              "answer": [r["answer"] for r in rows]})


def is_correct(completions, answer, **kwargs):
    return verify_batch([c[0]["content"] for c in completions], answer)[0]


class Rewards:
    """+1 / -1 from the verifier; keeps every batch's rewards so a test can recompute TRL's advantages."""

    def __init__(self):
        self.seen, self.__name__ = [], "verifier_reward"

    def __call__(self, completions, answer, **kwargs):
        rewards = [1.0 if c else -1.0 for c in is_correct(completions, answer)]
        self.seen.append(torch.tensor(rewards))
        return rewards


def config(cls, out_dir, **kw):
    return cls(**{"output_dir": out_dir, "use_cpu": True, "report_to": "none", "seed": 0, "save_strategy": "no",
                  "disable_tqdm": True, "num_generations": G, "max_completion_length": 8,
                  "per_device_train_batch_size": 2 * G, "learning_rate": 1e-4, "beta": 0.0, "logging_steps": 1,
                  "gradient_checkpointing": False, "bf16": False, **kw})


def trainer(cls, args, model, tok, level=3, reward=None, correct_func=is_correct, **kw):
    return cls(model=model, reward_funcs=reward or Rewards(), correct_func=correct_func, args=args,
               train_dataset=arith_dataset(level), processing_class=tok, **kw)


def spy(cls):
    """The trainer class, recording what each generation batch's _generate_and_score_completions returned (before
    TRL shuffles and splits it)."""
    class Spy(cls):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if self.model.training:
                self.outputs = getattr(self, "outputs", []) + [{k: v for k, v in out.items()}]
                self.daa = getattr(self, "daa", []) + [getattr(self, "last_daa", None)]
            return out
    return Spy

# -----------------------------------------------------------------------------------------------------------------
# The file's formulas: the project's, on the same inputs


def test_formulas_equal_the_projects():
    g = torch.Generator().manual_seed(0)
    B, T = 12, 7
    adv, correct, mask = check_copied_formulas(  # the weights' step reads weight_lr and daro_literal off the config
        drop_in, lambda lr, literal: DAROConfig(output_dir="unused", use_cpu=True, report_to="none", weight_lr=lr,
                                                daro_literal=literal), g, G, B, T)
    args = DA3POConfig(output_dir="unused", use_cpu=True, report_to="none", num_generations=G,
                       per_device_train_batch_size=G, adaptive_lam=True, lam_max=2.0)
    ours, metrics = drop_in.amplify(adv, correct, [], {}, args)
    theirs, counts = da3po.amplify(adv, correct, [], {}, args)
    their_metrics = da3po.daa_metrics(counts)
    assert torch.equal(ours, theirs) and metrics == pytest.approx(their_metrics, rel=1e-6)  # theirs: float32 sums

    old = -torch.rand(B, T, generator=g, dtype=F64) * 3
    logp = old + torch.randn(B, T, generator=g, dtype=F64) * 0.3  # ratios beyond both clips
    ref = old + torch.randn(B, T, generator=g, dtype=F64) * 0.1
    advantages, is_weight = torch.randn(B, generator=g, dtype=F64), torch.rand(B, T, generator=g, dtype=F64)
    for kw in ({}, {"seq_ratio": True}, {"ref_logp": ref, "kl_coef": 0.04}, {"is_weight": is_weight}):
        ours = drop_in.policy_loss(logp, old, advantages, mask, 0.2, 0.28, **kw)
        theirs = common.policy_loss(logp, old, advantages, mask, 0.2, 0.28, **kw)
        assert torch.equal(ours[0], theirs[0]) and ours[1] == theirs[1]
        assert theirs[1]["clip_low"] > 0 and theirs[1]["clip_high"] > 0


def test_advantage_golden_vectors_through_the_drop_in():
    """The file's DAA path (amplify with a DA3POConfig) on the golden advantage cases it covers (p_hat of the
    group: TRL has no running estimate to give it from outside). TRL computes the group advantages itself."""
    def via_drop_in(inp):
        if inp["p"] is not None:
            return None
        args = DA3POConfig(output_dir="unused", use_cpu=True, report_to="none", num_generations=inp["G"],
                           per_device_train_batch_size=inp["G"], lam=inp["lam"], tau=inp["tau"],
                           adaptive_lam=inp["adaptive_lam"], lam_max=inp["lam_max"], daa_scope=inp["scope"])
        before = common.group_advantages(torch.tensor(inp["rewards"], dtype=F64), inp["std_norm"], inp["eps"])
        after, _ = drop_in.amplify(before, torch.tensor(inp["correct"], dtype=torch.bool), [], {}, args)
        return {"advantages_after": after}
    report = golden.check(advantages=via_drop_in)
    running = sum(case["inputs"]["p"] is not None for case in golden.load()["advantages"])
    assert report["mismatches"] == [] and running == len(report["skipped"]) == 2 and report["cases"] >= 10


def test_daro_golden_vectors_through_the_drop_in(demo_dir, tmp_path):
    """DAROTrainer's loss path (daro_loss, with the file's Eq. 2 weights) and the file's weight objective on every
    golden DARO case, every expected key, float64."""
    model, tok = modeling.load_model(demo_dir)
    trainers = {G_: trainer(DAROTrainer, config(DAROConfig, str(tmp_path), num_generations=G_,
                                                per_device_train_batch_size=2 * G_), model, tok) for G_ in (4, 8)}

    def via_trainer(inp):
        t = trainers[inp["G"]]
        with torch.no_grad():
            for s, value in zip(t.neg_log_w, inp["neg_log_w"]):
                s.fill_(value)
        mask, bins = torch.tensor(inp["mask"], dtype=F64), torch.tensor(inp["bins"])
        tokens = drop_in.tokens_per_bin(mask, bins, inp["G"])
        weight = drop_in.bin_token_weights(mask, bins, tokens)
        loss, shares = t.daro_loss(torch.tensor(inp["token_loss"], dtype=F64), weight, bins)
        objective = drop_in.weight_objective(t.neg_log_w, shares, tokens > 0, inp["delta"], inp["literal"])
        grads = torch.autograd.grad(objective, t.neg_log_w, allow_unused=True)
        return {"token_weights": weight, "bin_tokens": tokens, "present": tokens > 0,
                "w": drop_in.bin_weights(t.neg_log_w, "learned"), "bin_loss": shares, "model_loss": loss,
                "weight_objective": objective, "weight_grad": [0.0 if g is None else g.item() for g in grads]}
    report = golden.check(daro=via_trainer)
    assert report["mismatches"] == [] and report["cases"] == 6 and report["values"] > 1200

# -----------------------------------------------------------------------------------------------------------------
# DA3PO in real runs


@pytest.mark.parametrize("knobs", [{}, {"adaptive_lam": True, "p_estimate": "running", "lam_max": 1.5}],
                         ids=["lam2", "adaptive_running"])
def test_da3po_advantages_are_daa_of_trls(demo_dir, tmp_path, knobs):
    model, tok = modeling.load_model(demo_dir)
    reward = Rewards()
    t = trainer(spy(DA3POTrainer), config(DA3POConfig, str(tmp_path), max_steps=4, **knobs), model, tok,
                reward=reward)
    t.train()
    assert len(t.outputs) == 2  # 4 updates, 2 per generation batch
    counts, amplified_total = {}, 0
    for rewards, out, daa in zip(reward.seen, t.outputs, t.daa):
        before, after, correct = daa["before"], daa["after"], daa["correct"]
        assert torch.equal(correct, rewards.view(-1, G) > 0)  # correct_func's verdicts, the rewards' signs
        # TRL's group advantages: the unbiased std, eps 1e-4 (ours: 1e-6), in float32: a few roundings of values <= 3
        ref_before = common.group_advantages(rewards.view(-1, G).double(), std_norm=True, eps=1e-4)
        assert (before.double() - ref_before).abs().max() < 1e-6
        # DAA on them, float64, from da3po.py's functions on the same inputs: exactly
        p = correct.double().mean(-1, keepdim=True)  # p_hat
        if knobs.get("p_estimate") == "running":  # the test's own running counts, per prompt, across the steps
            prompts = [str(x) for x in out["prompt_ids"][::G].tolist()]  # the test's own key: the prompt's tokens
            for key, c in zip(prompts, correct):
                counts[key] = [counts.get(key, [0, 0])[0] + c.sum().item(), counts.get(key, [0, 0])[1] + G]
            p = torch.tensor([counts[key] for key in prompts], dtype=F64)
            p = p[:, :1] / p[:, 1:]
        factor = da3po.adaptive_lam(p, G, knobs["lam_max"]) if knobs.get("adaptive_lam") else 2.0
        ref_after, amplified = da3po.daa(before.double(), correct, factor, 0.5, p, "correct")
        assert after.dtype == F64 and torch.equal(after, ref_after)
        assert torch.equal(out["advantages"], ref_after.flatten().float())  # what the loss was given
        uniform = ((correct.sum(-1) == 0) | (correct.sum(-1) == G)).repeat_interleave(G)  # DAPO's filter, no refill
        assert out["completion_mask"][uniform].sum() == 0
        amplified_total += (amplified & (ref_after != before.double())).sum().item()
    assert amplified_total > 0  # level-3 sums (pass rates 25-50%): some hard groups had correct answers
    assert "daa/amplified_frac" in t.state.log_history[0]


def test_da3po_each_update_is_a_token_mean_over_its_own_tokens(demo_dir, tmp_path):
    """TRL's "dapo" loss divides a micro-batch's token-loss sum by num_items_in_batch / processes * accumulation /
    steps_per_generation: by default the generation batch's tokens per update on average. The drop-in sets each
    slice's num_items_in_batch so that this is its own update's token count (all processes)."""
    model, tok = modeling.load_model(demo_dir)
    args = config(DA3POConfig, str(tmp_path), max_steps=2, gradient_accumulation_steps=2,
                  per_device_train_batch_size=G, mask_uniform_groups=False)
    assert args.steps_per_generation == 4 and args.updates_per_generation == 2
    t = trainer(DA3POTrainer, args, model, tok)
    t.train()
    slices = t._buffered_inputs  # the last generation batch: 4 slices, 2 updates of 2
    tokens = [sum(s["completion_mask"].sum().item() for s in slices[u:u + 2]) for u in (0, 2)]
    for u, n in zip((0, 2), tokens):
        for s in slices[u:u + 2]:  # TRL's normaliser, from its formula
            assert s["num_items_in_batch"].item() * args.gradient_accumulation_steps / 4 == n
    assert tokens[0] != tokens[1]  # the two updates differ in length: TRL's average would be off for both
    average = sum(tokens) / 2
    print(f"figure: DA3PO update token counts {tokens}; TRL's default normaliser (their mean) scales them by "
          f"{[round(n / average, 3) for n in tokens]}")


# -----------------------------------------------------------------------------------------------------------------
# DARO in real runs


class Float64DARO(DAROTrainer):
    """TRL 1.16 scores tokens through transformers' fused LM head, in float32 whatever the model's dtype. For a
    float64 comparison this test class scores them with the project's shortcuts.token_logprobs (float64) instead; what
    is compared is DARO's part: the bins, Eq. (2)'s weights, w_mu, the loss, its gradient and the weights' steps."""

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           compute_entropy=False, **kwargs):
        logp, entropy = shortcuts.token_logprobs(model, input_ids, attention_mask, logits_to_keep,
                                              with_entropy=compute_entropy)
        return logp, entropy, None


def reference_bins(tok, ds, slices: list[dict]) -> list[torch.Tensor]:
    """Each slice row's bin from the verifier on its decoded completion: #correct among the generation batch's rows
    with the same prompt (found by the problem text in the decoded prompt)."""
    answers = {row["prompt"][0]["content"]: row["answer"] for row in ds}
    keys, correct = [], []
    for s in slices:
        for ids, completion, mask in zip(s["prompt_ids"], s["completion_ids"], s["completion_mask"]):
            prompt = tok.decode(ids, skip_special_tokens=True)
            problem = next(p for p in answers if p in prompt)
            keys.append(problem)
            text = tok.decode(completion * mask, skip_special_tokens=True)
            correct.append(verify_batch([text], [answers[problem]])[0][0])
    per_prompt = {k: sum(c for k2, c in zip(keys, correct) if k2 == k) for k in set(keys)}
    bins = torch.tensor([per_prompt[k] for k in keys])
    return list(bins.split([len(s["prompt_ids"]) for s in slices]))


@pytest.fixture
def float64_default():
    """torch's default dtype float64 for the test (daro.py's weights and sums are then float64, as the drop-in's)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    yield
    torch.set_default_dtype(default)


def test_daro_two_updates_equal_daro_py(float64_model, tmp_path, float64_default):
    """One generation batch cut by TRL into 2 optimizer updates (the default): for each, the trainer's loss, its
    gradient and the weights' step equal daro.py's DARO (start_update, loss, after_update) on the same rows, with
    the project's token_logprobs and policy_loss; the model takes the same step in between, so the second update
    is off-policy (its ratios move)."""
    model, tok = float64_model
    t = trainer(Float64DARO, config(DAROConfig, str(tmp_path), max_steps=2, weight_lr=0.05), model, tok, level=4)
    ds = t.train_dataset
    t.model.train()
    t._step, t._buffered_inputs = 0, None
    t._prepare_inputs([ds[i] for i in range(4) for _ in range(G)])  # TRL's path: generate, shuffle, cut
    slices = t._buffered_inputs
    assert len(slices) == 2 and t.args.updates_per_generation == 2
    with torch.no_grad():  # weights away from 1, so that w_mu shows in the loss and the gradient
        for i, s in enumerate(t.neg_log_w):
            s.copy_(torch.tensor(0.3 * (-1) ** i * (i + 1) / G))
    ref = daro.DARO(daro.Config(group_size=G, weight_lr=0.05), torch.device("cpu"), {})
    with torch.no_grad():
        for a, b in zip(ref.neg_log_w, t.neg_log_w):
            a.copy_(b)
    bins = reference_bins(tok, ds, slices)
    assert any(((0 < b) & (b < G)).any() for b in bins)  # bins with a weight to learn
    params = list(t.model.parameters())
    for u, (s, bin_) in enumerate(zip(slices, bins)):
        loss = t.compute_loss(t.model, s)
        grads = torch.autograd.grad(loss, params)
        # daro.py on the same rows: its update's weights, the project's log-probs and clipped surrogate
        batch = {"mask": s["completion_mask"].double(), "bin": bin_}
        weight = ref.start_update(batch, torch.arange(len(bin_)))
        ids = torch.cat([s["prompt_ids"], s["completion_ids"]], 1)
        attention = torch.cat([s["prompt_mask"], s["completion_mask"]], 1)
        logp, _ = shortcuts.token_logprobs(t.model, ids, attention, ids.shape[1] - s["prompt_ids"].shape[1])
        token_loss, clipped = common.policy_loss(logp, s["old_per_token_logps"], s["advantages"], batch["mask"],
                                                 0.2, 0.28)
        ref_loss = ref.loss(token_loss, {"bin": bin_, "weight": weight})
        ref_grads = torch.autograd.grad(ref_loss, params)
        assert torch.equal(s["daro_bin"], bin_) and torch.allclose(s["daro_weight"], weight, rtol=1e-15, atol=0)
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-12) and ref_loss.abs() > 1e-3
        worst = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item() for a, b in zip(grads, ref_grads))
        assert worst < 1e-10
        print(f"figure: DARO update {u}: loss {loss.item():.6f} vs daro.py {ref_loss.item():.6f} (rel "
              f"{abs(loss.item() / ref_loss.item() - 1):.1e}), gradient worst rel {worst:.1e}, clipped tokens "
              f"{int(clipped['clip_low'] + clipped['clip_high'])}")
        if u == 1:
            assert clipped["clip_low"] + clipped["clip_high"] > 0  # the second update is off-policy
        t.step_weights()  # the callback's call after the optimizer step
        ref.after_update()
        assert torch.allclose(t.last_bin_loss, ref.bin_loss.cpu(), rtol=1e-12, atol=1e-15)
        assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(t.neg_log_w, ref.neg_log_w))
        with torch.no_grad():  # the same model step for both (a plain SGD step, lr 0.2)
            for p, g in zip(params, grads):
                p -= 0.2 * g
    print("figure: DARO weights after both updates equal daro.py's exactly:", [round(w, 6) for w in
                                                                           torch.stack(t.neg_log_w).tolist()])
    assert torch.stack(t.neg_log_w).sub(torch.tensor([0.3 * (-1) ** i * (i + 1) / G for i in range(G - 1)],
                                                     dtype=F64)).abs().max() > 0.01  # the weights moved


class AtTrainBegin(TrainerCallback):
    """Records a trainer's algorithm state when train() starts: after a resume has loaded the checkpoint."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.step, self.state = state.global_step, copy.deepcopy(self.trainer.algo_state_dict())


def assert_same_adam(a: dict, b: dict):
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys() and a["state"]
    for i, state in a["state"].items():
        assert all(torch.equal(state[k], b["state"][i][k]) for k in state)


def test_daro_checkpoint_resumes_weights_and_adam_exactly(demo_dir, tmp_path):
    """4 updates in one run (a checkpoint after the first generation batch, update 2) vs 2 + resume + 2: the
    weights, their Adam and the model agree exactly (the Trainer restores the RNG and data order; the weights come
    back from algo_state.pt)."""
    model, tok = modeling.load_model(demo_dir)
    args = config(DAROConfig, str(tmp_path), max_steps=4, save_strategy="steps", save_steps=2, weight_lr=0.05)
    first = trainer(DAROTrainer, args, model, tok)
    first.train()
    ckpt = tmp_path / "checkpoint-2"
    saved = torch.load(ckpt / ALGO_STATE, weights_only=True)
    assert any(k.startswith("daro/w_") for k in first.state.log_history[0])

    model, tok = modeling.load_model(demo_dir)
    second = trainer(DAROTrainer, config(DAROConfig, str(tmp_path / "resumed"), max_steps=4, weight_lr=0.05),
                     model, tok)
    assert torch.stack(second.neg_log_w).abs().max() == 0  # a new trainer starts at w = 1
    at_begin = AtTrainBegin(second)
    second.add_callback(at_begin)
    second.train(resume_from_checkpoint=str(ckpt))
    assert at_begin.step == 2 and torch.equal(at_begin.state["daro_neg_log_w"], saved["daro_neg_log_w"])
    assert_same_adam(at_begin.state["weight_optimizer"], saved["weight_optimizer"])
    assert saved["daro_neg_log_w"].abs().max() > 0.01  # two updates at lr 0.05 moved the weights
    final, resumed = first.algo_state_dict(), second.algo_state_dict()
    assert second.state.global_step == 4 and torch.equal(final["daro_neg_log_w"], resumed["daro_neg_log_w"])
    assert not torch.equal(final["daro_neg_log_w"], saved["daro_neg_log_w"])  # updates 3, 4 moved them further
    assert_same_adam(final["weight_optimizer"], resumed["weight_optimizer"])
    assert all(torch.equal(a, b) for a, b in zip(first.model.parameters(), second.model.parameters()))


def test_da3po_running_counts_resume(demo_dir, tmp_path):
    model, tok = modeling.load_model(demo_dir)
    args = config(DA3POConfig, str(tmp_path), max_steps=4, save_strategy="steps", save_steps=2,
                  p_estimate="running")
    first = trainer(DA3POTrainer, args, model, tok)
    first.train()
    assert sum(n for _, n in first.pass_counts.values()) == 2 * 4 * G  # every completion of both generation batches
    model, tok = modeling.load_model(demo_dir)
    second = trainer(DA3POTrainer, config(DA3POConfig, str(tmp_path / "r"), max_steps=4, p_estimate="running"),
                     model, tok)
    at_begin = AtTrainBegin(second)
    second.add_callback(at_begin)
    second.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert sum(n for _, n in at_begin.state["pass_counts"].values()) == 4 * G  # the first batch's counts came back
    assert second.pass_counts == first.pass_counts


def test_recipe_defaults():
    """Both configs: 2 updates per generation batch (TRL's default is 1: every update on-policy, the ratio 1, and
    clip-higher never binds), DAPO's weight decay 0.1, a constant learning rate, clip-higher 0.28."""
    for cls in (DA3POConfig, DAROConfig):
        args = cls(output_dir="unused", use_cpu=True, report_to="none", num_generations=G,
                   per_device_train_batch_size=G, gradient_accumulation_steps=3)
        assert (args.steps_per_generation, args.updates_per_generation) == (6, 2)
        assert args.weight_decay == 0.1 and args.lr_scheduler_type == "constant_with_warmup"
        assert (args.epsilon, args.epsilon_high) == (0.2, 0.28)
        args = cls(output_dir="unused", use_cpu=True, report_to="none", num_generations=G,
                   per_device_train_batch_size=G, steps_per_generation=8, gradient_accumulation_steps=2)
        assert args.updates_per_generation == 4  # an explicit steps_per_generation wins


def test_clear_errors(demo_dir, tmp_path):
    model, tok = modeling.load_model(demo_dir)
    with pytest.raises(ValueError, match="needs correct_func"):
        trainer(DA3POTrainer, config(DA3POConfig, str(tmp_path)), model, tok, correct_func=None)
    with pytest.raises(ValueError, match="tau"):
        config(DA3POConfig, str(tmp_path), tau=0.0)
    with pytest.raises(ValueError, match="multiple of gradient_accumulation_steps"):
        config(DAROConfig, str(tmp_path), steps_per_generation=3, gradient_accumulation_steps=2,
               per_device_train_batch_size=G)
    with pytest.raises(TypeError, match="DAROConfig"):
        trainer(DAROTrainer, config(DA3POConfig, str(tmp_path)), model, tok)
    with pytest.raises(ValueError, match=r"does not support \['delta'\]"):
        trainer(DAROTrainer, config(DAROConfig, str(tmp_path), delta=2.0), model, tok)
    t = trainer(DA3POTrainer, config(DA3POConfig, str(tmp_path), max_steps=1), model, tok,
                correct_func=lambda completions, **kw: [True])
    with pytest.raises(ValueError, match="correct_func returned 1 values for 32 completions"):
        t.train()


def test_peft_config_trains_only_the_adapter(demo_dir, tmp_path):
    """TRL's peft_config (a tiny LoRA) with both trainers: they train, DARO's weights step, and only the adapter's
    parameters change."""
    peft = pytest.importorskip("peft", reason="peft is optional: pip install -r requirements/trl.txt")
    for cls, args_cls, knobs in ((DA3POTrainer, DA3POConfig, {}), (DAROTrainer, DAROConfig, {"weight_lr": 0.05})):
        model, tok = modeling.load_model(demo_dir)
        base = {k: v.clone() for k, v in model.state_dict().items()}
        lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        t = trainer(cls, config(args_cls, str(tmp_path), max_steps=2, learning_rate=1e-2, **knobs), model, tok,
                    peft_config=lora)
        t.train()
        assert isinstance(t.model, peft.PeftModel)
        trained = {k for k, p in t.model.named_parameters() if p.requires_grad}
        assert trained and all("lora_" in k for k in trained)
        merged = t.model.get_base_model().state_dict()
        frozen = {k.replace(".base_layer", ""): v for k, v in merged.items() if "lora_" not in k}
        assert frozen.keys() == base.keys() and all(torch.equal(frozen[k], base[k]) for k in base)
        moved = [k for k, p in t.model.named_parameters() if "lora_B" in k and p.abs().max() > 0]
        assert moved  # lora_B starts at 0: the adapter learned
        if cls is DAROTrainer:
            assert torch.stack(t.neg_log_w).abs().max() > 0


def logged(text: str, key: str) -> list[float]:
    """The values of `key` in the Trainer's printed log dicts, in order."""
    return [float(v) for v in re.findall(rf"'{re.escape(key)}': '?([-0-9.e]+)'?", text)]


def test_the_docs_snippet_runs_as_written():
    out = run_script(["-c", docs_block("DA3POTrainer")], cwd=ROOT, timeout=600)  # pasted, in the repository root
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "daa/amplified_frac" in text and "daro/w_0.500" in text
    assert "rewards/soft_overlong_punishment_reward/mean" in text  # TRL's own overlong shaping, as a reward
    high = logged(text, "clip_ratio/high_mean")
    assert len(high) == 8 and high[0] == high[4] == 0  # 2 trainers x 4 updates; each batch's first is on-policy
    assert max(high[1:4]) > 0 and max(high[5:]) > 0  # clip-higher binds after the first update
    print(f"figure: docs/integrations.md snippet clip_ratio/high_mean per update, DA3PO {high[:4]}, DARO {high[4:]}")


def test_two_processes_group_split_across_them(tmp_path):
    """torchrun, 2 processes (gloo), groups split across them: DA3PO's advantages are DAA of all processes' groups
    and each update's token count is global; DARO's Eq. (2) denominators are global, its weights identical on both
    processes and equal to daro.update_weights on the gathered L_mu (tests/trl_two_processes.py checks, rank 0
    reports)."""
    out = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                      "-m", "tests.trl_two_processes", str(tmp_path)], timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["split_groups"] > 0 and report["da3po_updates"] == 2 and report["daro_updates"] == 2
    assert report["ok"], report
    print(f"figure: 2 processes, {report['split_groups']} group(s) split across them, every check passed")
