"""One optimizer update on a fixed global batch, in a plain process or under torchrun (FSDP2 on gloo).
Used by test_dist.py: python -m tests.dist_update MODEL_DIR OUT.pt [CHUNK_TOKENS]
                   | torchrun --nproc_per_node=2 -m tests.dist_update MODEL_DIR OUT.pt [CHUNK_TOKENS]
Rank 0 writes the summed loss, the gradient norm and the updated full parameters to OUT.pt."""
import sys

import torch

import common
import shortcuts
import modeling
import ranks
import engine as eng

from tests.conftest import float64_norms, weighted_loss

torch.use_deterministic_algorithms(True)
model_dir, out = sys.argv[1], sys.argv[2]
chunk = int(sys.argv[3]) if len(sys.argv) > 3 else 0  # token_logprobs' chunk_tokens (0: the whole logits at once)
d = ranks.setup_dist("cpu")
torch.manual_seed(0)
float64_norms()  # the whole model in float64: the tolerances then measure the method, not float32's rounding
model, tok = modeling.load_model(model_dir, d.device)
model.double()
engine = eng.HFRollout(model, tok, d, "float64")  # under FSDP a full copy that sync_weights refreshes
model = modeling.shard_model(model, d, "float64")
# SGD with lr 1 makes the update equal the gradient, so comparing parameters compares gradients. (Adam's first step is
# lr * g / |g|: for the few weights whose gradient is ~1e-9, float noise in the reduction flips it, which says nothing.)
opt = torch.optim.SGD(model.parameters(), lr=1.0)

# a fixed global batch: 8 groups x 4 completions of random lengths, random rewards (same on every rank)
g = torch.Generator().manual_seed(0)
rand_ids = lambda n: torch.randint(10, 40, (n,), generator=g).tolist()  # noqa: E731
groups = [{"prompt_ids": rand_ids(int(torch.randint(2, 9, (1,), generator=g))),
           "completions": [rand_ids(int(torch.randint(1, 12, (1,), generator=g))) for _ in range(4)],
           "reward": torch.randn(4, generator=g).tolist(), "correct": [True, False, True, False]} for _ in range(8)]
groups = groups[d.rank::d.world_size]  # each rank its stride, as dynamic_sampling hands them out
batch = common.make_batch(groups, tok.pad_token_id)
batch["advantage"] = common.group_advantages(batch["reward"].view(-1, 4).double()).flatten()
with torch.no_grad():
    batch["old_logp"] = shortcuts.token_logprobs(model, batch["input_ids"], batch["attention_mask"],
                                              batch["mask"].shape[1])[0] - 0.05
batch["weight"] = common.loss_weights(batch["mask"].double(), "token-mean", 12)

total = 0.0
for _, mb in common.micro_batches(batch, torch.arange(len(batch["mask"])), 3):  # uneven: 16 rows -> 3+3+3+3+3+1
    logp, _ = shortcuts.token_logprobs(model, mb["input_ids"], mb["attention_mask"], mb["mask"].shape[1], 1.0, False,
                                    chunk, mb["group"])  # a group's prompt run once, its KV cache shared
    loss, _ = weighted_loss(logp, mb["old_logp"], mb["advantage"], mb["weight"], 0.2, 0.28)
    loss.backward()
    total += loss.item()
grad_norm = modeling.full_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)).item()
opt.step()
engine.sync_weights(model)
loss_sum = ranks.all_reduce_sum(torch.tensor(total, dtype=torch.float64)).item()
params = modeling.full_state_dict(model)
if d.is_main:
    rollout = {k: v.clone() for k, v in engine.model.state_dict().items()}
    torch.save({"loss": loss_sum, "grad_norm": grad_norm, "params": params, "rollout": rollout}, out)
ranks.cleanup_dist()
ranks.end_process()
