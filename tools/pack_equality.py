"""--pack against the padded path in float64: each of the reference harness's random cases (uneven lengths, holes
in the loss mask, token-budget micro-batches that split groups, chunks, KL, both scripts) through the real update
pipeline twice, packed and padded, and the largest gaps of the update's loss and gradient: on the demo model, or on
tiny random models of other families (tests/harness.py FAMILIES: sliding windows of 6 tokens where they have one).
Usage: python -m tools.pack_equality [--seeds 30] [--family demo|all|llama,mistral,...]
(one thread; one line per model)"""
import argparse
import contextlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402

import modeling  # noqa: E402
from tests import conftest, harness  # noqa: E402


def models(names: str):
    """(name, float64 model, pad id) for --family: the demo model (all of it in float64), or harness.FAMILIES'."""
    for name in (["demo", *harness.FAMILIES] if names == "all" else names.split(",")):
        if name == "demo":
            conftest.float64_norms()  # the demo model all in float64, as tests/test_reference.py runs it
            model, tok = modeling.load_model(conftest.ARITH_MODEL)
            yield name, model.double(), tok.pad_token_id
        else:
            yield name, harness.family_model(name), 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=30)
    p.add_argument("--family", default="demo", help="demo, all, or comma-separated harness.FAMILIES names")
    args = p.parse_args()
    torch.set_num_threads(1)
    for name, model, pad_id in models(args.family):
        ref_model = harness.ref_model_of(model)
        loss_abs = loss_rel = grad_abs = grad_rel = 0.0
        for seed in range(args.seeds):
            case = harness.random_case(seed, model)
            runs = []
            for pack in (False, True):  # padded (a group's prompt once), and every micro-batch packed
                c = {**case, "flags": {**case["flags"], "pack": pack}}
                with harness.every_micro_batch_packed(model, ref_model) if pack else contextlib.nullcontext():
                    runs.append(harness.run_pipeline(model, ref_model if c["flags"]["kl_coef"] > 0 else None, c,
                                                     pad_id))
            for a, b in zip(*runs):
                gap = abs(a["loss"] - b["loss"])
                loss_abs, loss_rel = max(loss_abs, gap), max(loss_rel, gap / max(abs(a["loss"]), 1e-3))
                gap = max((a["grad"][n] - b["grad"][n]).abs().max().item() for n in a["grad"])
                scale = max(g.abs().max().item() for g in a["grad"].values())
                grad_abs, grad_rel = max(grad_abs, gap), max(grad_rel, gap / scale if scale else gap)  # 0: no token
        print(f"{name}: {args.seeds} cases, padded vs packed, float64: loss max abs {loss_abs:.3g} (rel "
              f"{loss_rel:.3g}), gradient max abs {grad_abs:.3g} (rel to its largest entry {grad_rel:.3g}); "
              f"tolerance {harness.FAMILY_TOL.get(name, harness.TOL):g}", flush=True)


if __name__ == "__main__":
    main()
