"""Each neighbour's advantages, token weights, loss and metrics on one fixed global batch, in one process or as one of
two gloo ranks (each rank its stride of the groups, as dynamic_sampling deals them). Used by test_neighbours.py:
  python -m tests.dist_neighbours OUT.json  |  torchrun --nproc_per_node=2 -m tests.dist_neighbours OUT.json
Rank 0 writes, per --algo, the loss summed over ranks, the metrics, its state, and every row's advantage and weight in
the global batch's order. Each algorithm sees the batch twice, as two steps (HA-DW's anchor then has a history). The token losses are a fixed function of the advantages (-A times a per-token number), so the
loss is the aggregation the hooks decide, without a model."""
import json
import sys

import torch

import common
import ranks
from da3po import PRESETS, Config
from neighbours import NEIGHBOURS

G = 4
d = ranks.setup_dist("cpu")
g = torch.Generator().manual_seed(0)
groups = []
for i in range(10):  # mixed groups, and every few an all-wrong or all-correct one
    k = [1, 2, 0, 3, 4, 1, 2, 0, 3, 1][i]
    correct = [j < k for j in range(G)]
    groups.append({"id": i, "prompt_ids": torch.randint(10, 40, (int(torch.randint(2, 6, (1,), generator=g)),),
                                                       generator=g).tolist(),
                   "completions": [torch.randint(10, 40, (int(torch.randint(1, 9, (1,), generator=g)),),
                                                 generator=g).tolist() for _ in range(G)],
                   "correct": correct,
                   "reward": [(1.0 if c else -1.0) - float(torch.randint(0, 3, (1,), generator=g)) / 4
                              for c in correct]})
scale = {i: torch.rand(16, generator=g, dtype=torch.float64) for i in range(len(groups) * G)}  # per-token numbers
mine = groups[d.rank::d.world_size]
out = {}
for name in NEIGHBOURS:
    cfg = Config(**{**PRESETS[name], "group_size": G, "max_new_tokens": 16})
    algo = NEIGHBOURS[name](cfg, d.device, {})
    batch = common.make_batch(mine, 0)
    batch["reward"] = batch["reward"].double()
    algo.advantages(batch, mine)  # the first step
    algo.end_step()
    batch["advantage"] = algo.advantages(batch, mine).double()
    rows = torch.arange(len(batch["mask"]))
    weight = algo.start_update(batch, rows).double()  # (B, T)
    ids = [grp["id"] * G + j for grp in mine for j in range(G)]
    per_token = torch.stack([scale[i][:weight.shape[1]] for i in ids])  # (B, T)
    loss = (-batch["advantage"][:, None] * per_token * weight).sum()
    rows_out = ranks.all_gather_list([(i, a, w) for i, a, w in zip(ids, batch["advantage"].tolist(),
                                                                      weight.sum(-1).tolist())])
    out[name] = {"loss": ranks.all_reduce_sum(loss).item(), "metrics": algo.end_step(),
                 "state": algo.state_dict(), "rows": sorted(rows_out)}
if d.is_main:
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
ranks.cleanup_dist()
ranks.end_process()
