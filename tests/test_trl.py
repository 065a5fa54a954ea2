"""The TRL drop-ins (integrations/trl_trainers.py) in real GRPOTrainer runs (trl==1.16.0) on the shipped demo model,
CPU: DA3PO's advantages are DAA of TRL's group advantages; DARO's loss, gradient and weight step equal the project's
functions on the same batch in float64; DARO's weights and their Adam state resume exactly from a checkpoint; the
README's snippet runs as written. Skips without TRL (pip install -r requirements-trl.txt)."""
import copy
import json
import os

import pytest
import torch

pytest.importorskip("trl", reason="TRL is optional: pip install -r requirements-trl.txt")

import common  # noqa: E402
import modeling  # noqa: E402
import da3po  # noqa: E402
import daro  # noqa: E402
from conftest import ROOT, readme_block, run_script  # noqa: E402
from integrations import golden  # noqa: E402
from integrations.trl_trainers import (ALGO_STATE, DA3POConfig, DA3POTrainer, DAROConfig,  # noqa: E402
                                       DAROTrainer)
from transformers import TrainerCallback  # noqa: E402
from verifier import verify_batch  # noqa: E402

G = 8


def arith_dataset(level: int):
    """The demo eval set's sums of one difficulty level, as TRL conversational prompts (the demo model's chat
    template then gives the prompt da3po.py trains on)."""
    from datasets import Dataset
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "demo", "arith_eval.jsonl"))]
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


def trainer(cls, args, model, tok, level=3, reward=None, correct_func=is_correct):
    return cls(model=model, reward_funcs=reward or Rewards(), correct_func=correct_func, args=args,
               train_dataset=arith_dataset(level), processing_class=tok)


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


@pytest.mark.parametrize("knobs", [{}, {"adaptive_lam": True, "p_estimate": "running", "lam_max": 1.5}],
                         ids=["lam2", "adaptive_running"])
def test_da3po_advantages_are_daa_of_trls(demo_dir, tmp_path, knobs):
    model, tok = modeling.load_model(demo_dir)
    reward = Rewards()
    t = trainer(spy(DA3POTrainer), config(DA3POConfig, str(tmp_path), max_steps=3, **knobs), model, tok,
                reward=reward)
    t.train()
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
            p = torch.tensor([counts[key] for key in prompts], dtype=torch.float64)
            p = p[:, :1] / p[:, 1:]
        factor = da3po.adaptive_lam(p, G, knobs["lam_max"]) if knobs.get("adaptive_lam") else 2.0
        ref_after, amplified = da3po.daa(before.double(), correct, factor, 0.5, p, "correct")
        assert after.dtype == torch.float64 and torch.equal(after, ref_after)
        assert torch.equal(out["advantages"], ref_after.flatten().float())  # what the loss was given
        uniform = ((correct.sum(-1) == 0) | (correct.sum(-1) == G)).repeat_interleave(G)  # DAPO's filter, no refill
        assert out["completion_mask"][uniform].sum() == 0 and out["num_items_in_batch"] == out["completion_mask"].sum()
        amplified_total += (amplified & (ref_after != before.double())).sum().item()
    assert amplified_total > 0  # level-3 sums (pass rates 25-50%): some hard groups had correct answers
    assert "daa/amplified_frac" in t.state.log_history[0]


class Float64DARO(DAROTrainer):
    """TRL 1.16 scores tokens through transformers' fused LM head, in float32 whatever the model's dtype. For a
    float64 comparison this test class scores them with the project's modeling.token_logprobs (float64) instead; what
    is compared is DARO's part: the bins, Eq. (2)'s weights, w_mu, the loss, its gradient and the weights' step."""

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           compute_entropy=False, **kwargs):
        logp, entropy = modeling.token_logprobs(model, input_ids, attention_mask, logits_to_keep,
                                              with_entropy=compute_entropy)
        return logp, entropy, None


def test_daro_loss_gradient_and_weight_step_match_daro_py(float64_model, tmp_path):
    model, tok = float64_model
    t = trainer(Float64DARO, config(DAROConfig, str(tmp_path), max_steps=1, weight_lr=0.05), model, tok, level=4)
    t.model.train()
    ds = t.train_dataset
    batch = t._generate_and_score_completions([ds[i] for i in range(2) for _ in range(G)])  # TRL's group order
    with torch.no_grad():  # weights away from 1, so that w_mu shows in the loss and the gradient
        for i, s in enumerate(t.neg_log_w):
            s.copy_(torch.tensor(0.3 * (-1) ** i * (i + 1) / G))
    s0 = [s.detach().clone() for s in t.neg_log_w]
    loss = t.compute_loss(t.model, batch)
    grads = torch.autograd.grad(loss, list(t.model.parameters()))
    t.step_weights()

    # the project's functions on the same batch: the verifier for the bins, token_logprobs, policy_loss, Eq. (2)
    texts = tok.batch_decode(batch["completion_ids"] * batch["completion_mask"], skip_special_tokens=True)
    correct = torch.tensor(verify_batch(texts, [ds[i]["answer"] for i in range(2) for _ in range(G)])[0])
    bins = correct.view(-1, G).sum(-1).repeat_interleave(G)
    assert 0 < bins[0] < G or 0 < bins[-1] < G  # the batch has a bin with a weight to learn
    mask = batch["completion_mask"].double()
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    logp, _ = modeling.token_logprobs(t.model, ids, attention, mask.shape[1])
    with torch.no_grad():  # TRL's own scoring (float32 fused head) agrees to float32 rounding of log-probs ~ -5..0
        trl_logp = DAROTrainer._get_per_token_logps_and_entropies(t, t.model, ids, attention, mask.shape[1])[0]
    assert ((trl_logp.double() - logp.detach()) * mask).abs().max() < 1e-5
    token_loss, _ = common.policy_loss(logp, logp.detach(), batch["advantages"], mask, 0.2, 0.28)
    weight, tokens = daro.bin_token_weights(mask, bins, G)
    s_ref = [s.clone().requires_grad_() for s in s0]
    w = daro.bin_weights(s_ref, "learned")
    ref_loss = (token_loss * weight * w[bins].unsqueeze(-1)).sum()
    ref_grads = torch.autograd.grad(ref_loss, list(t.model.parameters()))
    # float64, the same functions on the same tensors but through TRL's batching: ~1e-16 relative per term; the loss
    # (a sum of signed terms, near 0 on-policy) to 1e-12 of the sum of their magnitudes
    magnitude = (token_loss.abs() * weight * w[bins].unsqueeze(-1)).sum().item()
    assert loss.dtype == torch.float64 and abs(loss.item() - ref_loss.item()) <= 1e-12 * magnitude
    scale = max(g.abs().max().item() for g in ref_grads)
    assert scale > 0 and max((a - b).abs().max().item() for a, b in zip(grads, ref_grads)) <= 1e-12 * scale
    # the weights' step: L_mu, then one Adam step of s from the same start (daro.update_weights)
    ref_L = torch.zeros(G + 1, dtype=torch.float64).index_add_(0, bins, (token_loss.detach() * weight).sum(-1))
    assert (t.last_bin_loss - ref_L).abs().max() <= 1e-12 * ref_L.abs().max()
    cfg = DAROConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", weight_lr=0.05)
    opt = torch.optim.Adam(s_ref, lr=0.05)
    daro.update_weights(s_ref, opt, ref_L, tokens > 0, cfg)
    assert all(torch.equal(a, b) for a, b in zip(t.neg_log_w, s_ref))
    assert any(not torch.equal(a, b) for a, b in zip(t.neg_log_w, s0))  # it moved


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
    """3 steps in one run (a checkpoint at step 2) vs 2 + resume + 1: the weights, their Adam and the model agree
    exactly (the Trainer restores the RNG and data order; the weights come back from algo_state.pt)."""
    model, tok = modeling.load_model(demo_dir)
    args = config(DAROConfig, str(tmp_path), max_steps=3, save_strategy="steps", save_steps=2, weight_lr=0.05)
    first = trainer(DAROTrainer, args, model, tok)
    first.train()
    ckpt = tmp_path / "checkpoint-2"
    saved = torch.load(ckpt / ALGO_STATE, weights_only=True)
    assert any(k.startswith("daro/w_") for k in first.state.log_history[0])

    model, tok = modeling.load_model(demo_dir)
    second = trainer(DAROTrainer, config(DAROConfig, str(tmp_path / "resumed"), max_steps=3, weight_lr=0.05),
                     model, tok)
    assert torch.stack(second.neg_log_w).abs().max() == 0  # a new trainer starts at w = 1
    at_begin = AtTrainBegin(second)
    second.add_callback(at_begin)
    second.train(resume_from_checkpoint=str(ckpt))
    assert at_begin.step == 2 and torch.equal(at_begin.state["daro_neg_log_w"], saved["daro_neg_log_w"])
    assert_same_adam(at_begin.state["weight_optimizer"], saved["weight_optimizer"])
    assert saved["daro_neg_log_w"].abs().max() > 0.01  # two steps at lr 0.05 moved the weights
    final, resumed = first.algo_state_dict(), second.algo_state_dict()
    assert second.state.global_step == 3 and torch.equal(final["daro_neg_log_w"], resumed["daro_neg_log_w"])
    assert not torch.equal(final["daro_neg_log_w"], saved["daro_neg_log_w"])  # step 3 moved them further
    assert_same_adam(final["weight_optimizer"], resumed["weight_optimizer"])
    assert all(torch.equal(a, b) for a, b in zip(first.model.parameters(), second.model.parameters()))


def test_da3po_running_counts_resume(demo_dir, tmp_path):
    model, tok = modeling.load_model(demo_dir)
    args = config(DA3POConfig, str(tmp_path), max_steps=2, save_strategy="steps", save_steps=1,
                  p_estimate="running")
    first = trainer(DA3POTrainer, args, model, tok)
    first.train()
    assert sum(n for _, n in first.pass_counts.values()) == 2 * 2 * G  # every completion of both steps
    model, tok = modeling.load_model(demo_dir)
    second = trainer(DA3POTrainer, config(DA3POConfig, str(tmp_path / "r"), max_steps=2, p_estimate="running"),
                     model, tok)
    at_begin = AtTrainBegin(second)
    second.add_callback(at_begin)
    second.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert sum(n for _, n in at_begin.state["pass_counts"].values()) == 2 * G  # step 1's counts came back
    assert second.pass_counts == first.pass_counts


def test_clear_errors(demo_dir, tmp_path):
    model, tok = modeling.load_model(demo_dir)
    with pytest.raises(ValueError, match="needs correct_func"):
        trainer(DA3POTrainer, config(DA3POConfig, str(tmp_path)), model, tok, correct_func=None)
    with pytest.raises(ValueError, match="tau"):
        config(DA3POConfig, str(tmp_path), tau=0.0)
    with pytest.raises(ValueError, match="steps_per_generation"):
        config(DAROConfig, str(tmp_path), steps_per_generation=2, per_device_train_batch_size=G)
    with pytest.raises(TypeError, match="DAROConfig"):
        trainer(DAROTrainer, config(DA3POConfig, str(tmp_path)), model, tok)
    t = trainer(DA3POTrainer, config(DA3POConfig, str(tmp_path), max_steps=1), model, tok,
                correct_func=lambda completions, **kw: [True])
    with pytest.raises(ValueError, match="correct_func returned 1 values for 16 completions"):
        t.train()


def test_readme_snippet_runs_as_written():
    out = run_script(["-c", readme_block("DA3POTrainer")], cwd=ROOT, timeout=600)  # pasted, in the repository root
    assert out.returncode == 0, out.stderr[-3000:]
    assert "daa/amplified_frac" in out.stdout + out.stderr and "daro/w_0.500" in out.stdout + out.stderr


def test_daro_golden_vectors_through_the_drop_in(demo_dir, tmp_path):
    """DAROTrainer's loss path (daro_loss, with Eq. 2's weights from daro.bin_token_weights as the trainer computes
    them) on the golden DARO cases: the model loss and L_mu, float64. (The weights' objective and step are
    daro.weight_objective / daro.update_weights themselves, checked by tests/test_golden.py.)"""
    model, tok = modeling.load_model(demo_dir)
    trainers = {G_: trainer(DAROTrainer, config(DAROConfig, str(tmp_path), num_generations=G_,
                                                per_device_train_batch_size=2 * G_), model, tok) for G_ in (4, 8)}

    def via_trainer(inp):
        t = trainers[inp["G"]]
        with torch.no_grad():
            for s, value in zip(t.neg_log_w, inp["neg_log_w"]):
                s.fill_(value)
        mask, bins = torch.tensor(inp["mask"], dtype=torch.float64), torch.tensor(inp["bins"])
        weight, _ = daro.bin_token_weights(mask, bins, inp["G"])
        loss, shares = t.daro_loss(torch.tensor(inp["token_loss"], dtype=torch.float64), weight, bins)
        return {"model_loss": loss, "bin_loss": shares}
    report = golden.check(daro=via_trainer)
    assert report["mismatches"] == [] and report["cases"] == 5


def test_golden_vectors_through_the_drop_in():
    """The DA3POTrainer's own DAA path (da3po.amplify with a DA3POConfig) on the golden advantage cases it covers
    (p_hat of the group; TRL has no running estimate to give it from outside)."""
    def via_trainer_path(inp):
        if inp["p"] is not None:
            return None
        args = DA3POConfig(output_dir="unused", use_cpu=True, report_to="none", num_generations=inp["G"],
                           per_device_train_batch_size=inp["G"], lam=inp["lam"], tau=inp["tau"],
                           adaptive_lam=inp["adaptive_lam"], lam_max=inp["lam_max"], daa_scope=inp["scope"])
        before = torch.tensor(inp["rewards"], dtype=torch.float64)
        before = common.group_advantages(before, inp["std_norm"], inp["eps"])
        after, _ = da3po.amplify(before, torch.tensor(inp["correct"], dtype=torch.bool), [], {}, args)
        return {"advantages_after": after}
    report = golden.check(advantages=via_trainer_path)
    assert report["mismatches"] == [] and report["cases"] >= 7
