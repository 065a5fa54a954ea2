"""verl's own actor update on the CPU with DARO's loss (integrations/verl_da3po_daro.py, verl==0.9.1): verl's
ActorRolloutRefWorker (role "actor": its FSDP engine, ppo_loss, mini-batches) on the demo model, a global batch of
groups from verl's own advantage-estimator lookup ("daro"), rows shuffled across the data-parallel ranks as verl's
balancing does, old log-probs from the worker, then update_actor with 2 mini-batches (2 optimizer updates) of 2
micro-batches. Checked against daro.py and common.py on what the registered loss received: each micro-batch's loss,
each update's L_mu over all ranks, the weights after each update; the weights saved with verl's actor checkpoint and
loaded back. Used by tests/test_verl.py:
    torchrun --standalone --nproc_per_node=2 -m tests.verl_actor_update OUT_DIR
verl registers its FSDP engine for cuda and npu only, and has no CPU platform: this test registers one through
verl's platform plugin registry (VERL_PLATFORM=cpu) and picks the cuda engine class (VERL_ENGINE_DEVICE=cuda), which
then runs on the CPU with gloo. Rank 0 writes OUT_DIR/report.json."""
import contextlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.update(VERL_PLATFORM="cpu", VERL_ENGINE_DEVICE="cuda")
import torch  # noqa: E402
from verl.plugin.platform.platform_base import PlatformBase  # noqa: E402
from verl.plugin.platform.platform_manager import PlatformRegistry  # noqa: E402


class _CPUModule:
    """torch.cpu plus the memory and device queries verl asks an accelerator module for (all 0 on the CPU)."""

    def __getattr__(self, name):
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name == "get_device_name":
            return lambda *args: "cpu"
        if name in ("get_rng_state", "set_rng_state"):
            return getattr(torch, name)
        if name == "mem_get_info":
            return lambda *args: (0, 0)
        if name.startswith(("memory_", "max_memory", "reset_")) or name in ("empty_cache", "ipc_collect"):
            return lambda *args, **kwargs: 0
        raise AttributeError(name)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """A test-only verl platform: the CPU, gloo."""
    device_name = property(lambda self: "cpu")
    vendor_name = property(lambda self: "cpu")
    device_module = property(lambda self: _CPUModule())

    def is_available(self):
        return True

    def current_device(self):
        return "cpu"

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    def nvtx_range(self, msg):
        return contextlib.nullcontext()

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer import main_ppo  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

import common  # noqa: E402
import daro  # noqa: E402
from integrations import verl_da3po_daro as drop_in  # noqa: E402

out_dir = sys.argv[1]
dist.init_process_group("gloo")  # before verl's worker: it would ask for cpu:gloo,cpu:nccl
rank, world = dist.get_rank(), dist.get_world_size()
G, N, P, R = 4, 8, 6, 7  # 8 groups of 4, prompts up to 6 tokens, responses up to 7
rows_per_rank, mini_batches, clip_c = N * G // world, 2, 1e9
with initialize_config_dir(config_dir=os.path.join(os.path.dirname(main_ppo.__file__), "config"), version_base=None):
    config = compose(config_name="ppo_trainer", overrides=[
        f"actor_rollout_ref.model.path={os.path.join(ROOT, 'demo', 'arith', 'model')}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # no flash-attn on a CPU
        f"actor_rollout_ref.rollout.n={G}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={N // mini_batches}",  # prompts: 2 updates
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={rows_per_rank // mini_batches // 2}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={rows_per_rank}",
        "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.use_torch_compile=false",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",  # float32 compute: no bf16 autocast
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.policy_loss.loss_mode=daro", "actor_rollout_ref.actor.clip_ratio_low=0.2",
        "actor_rollout_ref.actor.clip_ratio_high=0.28", f"actor_rollout_ref.actor.clip_ratio_c={clip_c}",
        "actor_rollout_ref.actor.shuffle=false", "algorithm.adv_estimator=daro"])
worker = drop_in.engine_workers.ActorRolloutRefWorker(config=config.actor_rollout_ref, role="actor")
worker.init_model()
report = {"worker": type(worker.actor).__name__}

# the global batch (the same on every rank), its advantages and bins through verl's estimator lookup, then this rank's
# shard of the rows after a shuffle (groups split across ranks). The shards are 2 ranks' whatever the world size: on
# 1 rank, its mini-batch u is the 2 ranks' mini-batch u together, so that the two runs make the same updates
g = torch.Generator().manual_seed(0)
B = N * G
prompt_len, response_len = torch.randint(2, P + 1, (B,), generator=g), torch.randint(1, R + 1, (B,), generator=g)
prompts, responses = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, R, dtype=torch.long)
response_mask = (torch.arange(R) < response_len.unsqueeze(-1)).float()
for i in range(B):
    prompts[i, P - prompt_len[i]:] = torch.randint(5, 60, (int(prompt_len[i]),), generator=g)
    responses[i, :response_len[i]] = torch.randint(5, 60, (int(response_len[i]),), generator=g)
correct = torch.rand(N, G, generator=g) < 0.5  # DAPO's scores: +1 / -1, a few correct ones at the cap (0)
scores = torch.where(correct, 1.0, -1.0) - (torch.rand(N, G, generator=g) < 0.2).float() * correct.float()
token_scores = torch.zeros(B, R)
token_scores[torch.arange(B), response_len - 1] = scores.flatten()
uids = np.array([f"q{i // G}" for i in range(B)], dtype=object)
advantages, returns = core_algos.get_adv_estimator_fn("daro")(
    token_level_rewards=token_scores, response_mask=response_mask, index=uids, config=config.algorithm)
shards = torch.randperm(B, generator=g).view(2, mini_batches, -1)  # (nominal rank, update, rows)
mine = shards[rank::world].transpose(0, 1).flatten()  # this rank's rows, update by update
attention = torch.cat([(torch.arange(P) >= P - prompt_len.unsqueeze(-1)).long(), response_mask.long()], 1)
batch = DataProto.from_dict(tensors={
    "prompts": prompts[mine], "responses": responses[mine], "input_ids": torch.cat([prompts, responses], 1)[mine],
    "attention_mask": attention[mine], "position_ids": (attention.cumsum(-1) - 1).clamp(min=0)[mine],
    "response_mask": response_mask[mine], "advantages": advantages[mine], "returns": returns[mine]},
    meta_info={"temperature": 1.0})
report["bins_ok"] = torch.equal(returns[mine].amax(-1).long(), correct.sum(-1).repeat_interleave(G)[mine])


def as_tensordict(batch, **meta):
    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(td, **meta)
    return td


# pi_old from the worker (verl's _compute_old_log_prob), then the update (verl's _update_actor)
td = as_tensordict(batch, calculate_entropy=False, compute_loss=False)
batch.batch["old_log_probs"] = no_padding_2_padding(tu.get(worker.compute_log_prob(td), "log_probs"), td).float()
calls = []  # what the registered DARO loss received and returned, micro-batch by micro-batch
real_loss = core_algos.POLICY_LOSS_REGISTRY["daro"]


def recording_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None):
    loss, metrics = real_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                              rollout_is_weights)
    info = config.global_batch_info
    calls.append({"old": old_log_prob.detach().tolist(), "logp": log_prob.detach().tolist(),
                  "adv": advantages.tolist(), "mask": response_mask.float().tolist(),
                  "bins": info["daro"]["bins"].tolist(),
                  "loss": loss.item(), "dp_size": int(info["dp_size"])})
    return loss, metrics


core_algos.POLICY_LOSS_REGISTRY["daro"] = recording_loss
weights_after = []
real_end = worker.actor.daro.end


def recording_end(bin_loss):  # the weights after each update's step
    metrics = real_end(bin_loss)
    weights_after.append(torch.stack(worker.actor.daro.neg_log_w).tolist())
    return metrics


worker.actor.daro.end = recording_end
meta = dict(calculate_entropy=False, distillation_use_topk=False, distillation_only=False, global_batch_size=B // 2,
            mini_batch_size=B // mini_batches, epochs=1, seed=0, dataloader_kwargs={"shuffle": False},
            compute_loss=True)
metrics = tu.get(worker.update_actor(as_tensordict(batch, **meta)), "metrics")
report["metrics"] = sorted(k for k in metrics if k.startswith("daro/"))

# the reference, from every rank's records: daro.py's Eq. (2) over each update's rows on all ranks, common.py's
# clipped surrogate, daro.py's weights and their Adam steps
everyone = [None] * world
dist.all_gather_object(everyone, calls)
per_update = len(calls) // mini_batches  # micro-batches of one update on one rank
s_ref = [torch.zeros((), dtype=torch.float64, requires_grad=True) for _ in range(G - 1)]
adam = torch.optim.Adam(s_ref, lr=1e-3)
settings = drop_in.DARO_SETTINGS["daro"]
worst_loss, worst_weights = 0.0, 0.0
for u in range(mini_batches):
    mbs = [c for calls_r in everyone for c in calls_r[u * per_update:(u + 1) * per_update]]
    masks = [torch.tensor(c["mask"], dtype=torch.float64) for c in mbs]
    bins = [torch.tensor(c["bins"]) for c in mbs]
    tokens = sum(torch.zeros(G + 1, dtype=torch.float64).index_add_(0, b, m.sum(-1)) for b, m in zip(bins, masks))
    w = daro.bin_weights(s_ref, "learned").double()
    bin_loss = torch.zeros(G + 1, dtype=torch.float64)
    for c, m, b in zip(mbs, masks, bins):
        token_loss, _ = common.policy_loss(torch.tensor(c["logp"]), torch.tensor(c["old"]),
                                           torch.tensor(c["adv"])[:, 0], m, 0.2, 0.28, clip_ratio_c=clip_c)
        inside = ((b > 0) & (b < G)).double().unsqueeze(-1)
        eq2 = m * inside / tokens.clamp(min=1)[b].unsqueeze(-1)
        terms = token_loss.double() * eq2 * w[b].unsqueeze(-1) * c["dp_size"]
        # float32 token losses summed: off by a few float32 roundings (1.2e-7) of the terms' absolute sum
        worst_loss = max(worst_loss, abs(terms.sum().item() - c["loss"]) / terms.abs().sum().item())
        bin_loss.index_add_(0, b, (token_loss.double() * eq2).sum(-1))
    daro.update_weights(s_ref, adam, bin_loss, tokens > 0, settings)
    worst_weights = max(worst_weights, (torch.stack(s_ref) - torch.tensor(weights_after[u], dtype=torch.float64))
                        .abs().max().item())
report.update(micro_batches=len(calls), worst_loss_rel=worst_loss, worst_weight_abs=worst_weights,
              weights_moved=max(map(abs, weights_after[-1])), weights_after=weights_after[:],
              grad_norm=metrics["grad_norm"], losses=[c["loss"] for c in calls])

# the checkpoint: saved with the actor's, another update moves the weights, loading brings them back
ckpt = os.path.join(out_dir, "global_step_1", "actor")
worker.save_checkpoint(ckpt, global_step=1)
saved = worker.actor.daro.state_dict()
saved = {"s": saved["daro_neg_log_w"].clone(), "adam": json.dumps(saved["weight_optimizer"], default=str)}
worker.update_actor(as_tensordict(batch, **meta))
moved = not torch.equal(torch.stack(worker.actor.daro.neg_log_w).detach(), saved["s"])
worker.load_checkpoint(ckpt)
back = worker.actor.daro.state_dict()
report.update(saved_file=os.path.exists(os.path.join(ckpt, drop_in.DARO_STATE)), moved_after_save=moved,
              restored=torch.equal(back["daro_neg_log_w"], saved["s"]) and
              json.dumps(back["weight_optimizer"], default=str) == saved["adam"])
reports = [None] * world
dist.all_gather_object(reports, report)
if rank == 0:
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(reports, f)
dist.destroy_process_group()
