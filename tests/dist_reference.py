"""Random reference cases (tests/harness.py) through the real pipeline on FSDP2 ranks (gloo, float64).
Used by test_reference.py: torchrun --nproc_per_node=2 -m tests.dist_reference MODEL_DIR OUT.pt SEED[:KEY=VALUE...] ...
Each SEED draws a case (KEY=VALUE fixes a flag; a value is read as a Python literal, e.g. 1:rollout_is='token').
Rank 0 writes [(case, the pipeline's results per update)] to OUT.pt; the test computes the reference in its own
process and compares."""
import ast
import sys

import torch

import modeling
import ranks
from tests import harness
from tests.conftest import float64_norms

torch.use_deterministic_algorithms(True)
model_dir, out, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
d = ranks.setup_dist("cpu")
float64_norms()  # the whole model in float64, as the reference
model, tok = modeling.load_model(model_dir, d.device)
model.double()
ref_model = harness.ref_model_of(model)  # the same perturbation on every rank (a seeded generator)
cases = []
for spec in specs:  # drawn on the unsharded model, the same on every rank (pi_old comes from its log-probs)
    seed, *fixed = spec.split(":")
    fixed = dict((k, ast.literal_eval(v)) for k, v in (x.split("=", 1) for x in fixed))
    script = fixed.pop("script", None)
    cases.append(harness.random_case(int(seed), model, script, **fixed))
model = modeling.shard_model(model, d, "float64")
ref_model = modeling.shard_model(ref_model, d, "float64").eval()  # as prepare_models shards the KL anchor
results = []
for case in cases:
    runs = harness.run_pipeline(model, ref_model if case["flags"]["kl_coef"] > 0 else None, case,
                                tok.pad_token_id, d)
    results.append((case, runs))
if d.is_main:
    torch.save(results, out)
ranks.cleanup_dist()
ranks.end_process()
