"""DA3POTrainer and DAROTrainer (integrations/trl_da3po_daro.py) under torchrun with 2 processes (gloo), one
generation batch each, cut into 2 optimizer updates, with a group split across the processes (G = 4, 3 rows per
micro-batch: each process holds 6 rows, so the middle group has 2 rows on one and 2 on the other).
Used by tests/test_trl.py: torchrun --standalone --nproc_per_node=2 -m tests.trl_two_processes OUT_DIR
Every process checks what it can see; rank 0 gathers the rest and writes OUT_DIR/report.json."""
import json
import os
import sys

import torch
import torch.distributed as dist

import da3po
import daro
import modeling
from integrations.trl_da3po_daro import DA3POConfig, DA3POTrainer, DAROConfig, DAROTrainer
from tests.test_trl import arith_dataset, is_correct
from tests.conftest import ARITH_MODEL

out_dir, G = sys.argv[1], 4
shared = dict(use_cpu=True, report_to="none", seed=0, save_strategy="no", disable_tqdm=True, num_generations=G,
              max_completion_length=8, per_device_train_batch_size=3, learning_rate=1e-3, beta=0.0, logging_steps=1,
              bf16=False, max_steps=2)


def reward(completions, answer, **kwargs):
    return [1.0 if c else -1.0 for c in is_correct(completions, answer)]


def gather(value):
    """Every process's value (any picklable object), in rank order."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


class Recorder:
    """What a trainer's updates saw: the slices of its last generation batch (rows, masks, bins, normalisers) and,
    for DARO, each update's L_mu shares before and after the reduction over processes."""

    def record_slices(self):
        return [{k: v.tolist() for k, v in s.items() if k in ("prompt_ids", "completion_mask", "daro_bin",
                                                              "daro_weight", "daro_tokens", "num_items_in_batch")}
                for s in self._buffered_inputs]


class DA3PO(Recorder, DA3POTrainer):
    pass


class DARO(Recorder, DAROTrainer):
    def step_weights(self):
        self.shares = getattr(self, "shares", []) + [self.bin_loss.tolist()]
        super().step_weights()
        self.reduced = getattr(self, "reduced", []) + [self.last_bin_loss.tolist()]


def make(cls, args_cls, **kw):
    model, tok = modeling.load_model(ARITH_MODEL)
    return cls(model=model, reward_funcs=reward, correct_func=is_correct, processing_class=tok,
               train_dataset=arith_dataset(3), args=args_cls(output_dir=os.path.join(out_dir, cls.__name__), **shared,
                                                             **kw))


report, problems = {"ok": True}, []


def check(condition: bool, what: str):
    if not condition:
        problems.append(what)


# DA3PO: DAA of all processes' groups; each update's normaliser is its own tokens over both processes
t = make(DA3PO, DA3POConfig, mask_uniform_groups=False)
t.train()
daa = t.last_daa
check(torch.equal(daa["after"], da3po.daa(daa["before"].double(), daa["correct"], 2.0, 0.5)[0]), "da3po: DAA")
slices = gather(t.record_slices())  # [rank][slice]
for u in range(2):  # GA = 1: update u is slice u on every process
    tokens = sum(sum(map(sum, s[u]["completion_mask"])) for s in slices)
    check(all(s[u]["num_items_in_batch"] == tokens * 2 for s in slices), f"da3po: update {u}'s token count")
report["da3po_updates"] = 2
rows = [[tuple(r) for s in rank for r in s["prompt_ids"]] for rank in slices]  # each process's prompts
report["split_groups"] = len(set(rows[0]) & set(rows[1]))

# DARO: global Eq. (2) denominators per update; weights identical on both processes and equal to daro.py's steps on
# the gathered L_mu
t = make(DARO, DAROConfig, weight_lr=0.05)
t.train()
slices = gather(t.record_slices())
for u in range(2):
    tokens = torch.zeros(G + 1, dtype=torch.float64)
    for s in slices:
        mask = torch.tensor(s[u]["completion_mask"], dtype=torch.float64)
        tokens.index_add_(0, torch.tensor(s[u]["daro_bin"]), mask.sum(-1))
    for s in slices:
        mask, bins = torch.tensor(s[u]["completion_mask"], dtype=torch.float64), torch.tensor(s[u]["daro_bin"])
        inside = ((bins > 0) & (bins < G)).double().unsqueeze(-1)
        expected = mask * inside / tokens.clamp(min=1)[bins].unsqueeze(-1)
        check(torch.allclose(torch.tensor(s[u]["daro_weight"], dtype=torch.float64), expected, rtol=1e-15, atol=0),
              f"daro: update {u}'s weights over both processes")
        check(torch.equal(torch.tensor(s[u]["daro_tokens"], dtype=torch.float64), tokens),
              f"daro: update {u}'s tokens per bin")
shares, reduced = gather(t.shares), gather(t.reduced)
for u in range(2):
    total = sum(torch.tensor(s[u]) for s in shares)
    check(all(torch.allclose(torch.tensor(r[u]), total, rtol=1e-12, atol=1e-15) for r in reduced),
          f"daro: update {u}'s L_mu summed over processes")
weights = gather(torch.stack(t.neg_log_w).tolist())
check(weights[0] == weights[1], "daro: the weights differ between processes")
s_ref = [torch.zeros((), dtype=torch.float64, requires_grad=True) for _ in range(G - 1)]
opt = torch.optim.Adam(s_ref, lr=0.05)
cfg = DAROConfig(output_dir=out_dir, use_cpu=True, report_to="none", weight_lr=0.05)
for u in range(2):
    daro.update_weights(s_ref, opt, torch.tensor(reduced[0][u], dtype=torch.float64),
                        torch.tensor(slices[0][u]["daro_tokens"]) > 0, cfg)
check(torch.stack(s_ref).tolist() == weights[0], "daro: the weights are not daro.update_weights' on the gathered L_mu")
check(max(map(abs, weights[0])) > 0, "daro: the weights did not move")
report["daro_updates"] = 2

problems = sum(gather(problems), [])
if dist.get_rank() == 0:
    report.update(ok=not problems, problems=problems)
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f)
