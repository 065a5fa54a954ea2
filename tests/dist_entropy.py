"""The entropy controls' selection over one update split across ranks (gloo). Used by test_entropy_control.py:
  python -m tests.dist_entropy OUT.pt                          (one process: every row)
  torchrun --nproc_per_node=2 -m tests.dist_entropy OUT.pt     (each rank its stride of the rows)
Each rank writes OUT.pt.<rank>: its rows' indices, Cov_t, N, KL-Cov's selection, Clip-Cov's candidates and draw."""
import sys

import torch

import entropy_control as ec
import ranks
from tests.test_entropy_control import update_tensors

out = sys.argv[1]
d = ranks.setup_dist("cpu")
logp, old_logp, adv, mask = update_tensors()  # the same float64 update on every rank
rows = torch.arange(len(mask))[d.rank::d.world_size]
logp, old_logp, adv, mask = logp[rows], old_logp[rows], adv[rows], mask[rows]
cov, n = ec.token_covariance(logp, adv, mask)
top = ec.top_covariance(cov, mask, 0.1, n)
candidates = ec.clip_cov_candidates(cov, mask, logp, old_logp, adv, 0.05, 5.0, 0.2, 0.28)
many = ec.random_share(candidates, 1.0, n, torch.Generator().manual_seed(3))  # more than the candidates: all of them
few = ec.random_share(candidates, 0.05, n, torch.Generator().manual_seed(3))
torch.save({"rows": rows, "cov": cov, "n": n, "top": top, "candidates": candidates, "many": many, "few": few},
           f"{out}.{d.rank}")
ranks.cleanup_dist()
