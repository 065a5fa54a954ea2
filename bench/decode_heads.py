"""Our sampler's decode steps with grouped key/value heads read in place (engine._rollout_sdpa) against
transformers' sdpa, which copies them for every query head (repeat_kv) at every token: seconds per rollout,
alternating, in one process, and a check that both draw the same completions and log-probs.
Usage: python -m bench.decode_heads [--demo reasoning|arith] [--threads 1] [--rounds 8] [--prompts 16]

The rollout is a training step's: the demo's prompts, G = 8 completions each, its --max_new_tokens, through
HFRollout (our sampler as the trainer calls it). Each round runs both sides from the same seed, in turns."""
import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

import config  # noqa: E402
import da3po  # noqa: E402
import dataset  # noqa: E402
import engine  # noqa: E402
import modeling  # noqa: E402
from ranks import DistInfo  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo", default="reasoning", choices=list(config.DEMOS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--prompts", type=int, default=16)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = config.parse_config(da3po.Config, ["--demo", args.demo], da3po.PRESETS)
    model, tok = modeling.load_model(modeling.model_path(cfg.model), torch.device("cpu"))
    template = dataset.resolve_template(cfg.prompt_template, tok)
    problems = dataset.load_data(cfg.train_data, "train")[:args.prompts]
    tokenized = dataset.tokenize_problems(problems, tok, template, cfg.max_prompt_length, cfg.train_data)
    prompts = [x["prompt_ids"] for x in tokenized]
    rollout = engine.HFRollout(model, tok, DistInfo())
    in_place = engine._rollout_sdpa
    sides = {"in place": in_place, "copied": sdpa_attention_forward}  # transformers' sdpa as it is

    def run(side, seed):
        engine._rollout_sdpa = sides[side]
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        out = rollout.generate(prompts, cfg.max_new_tokens, n=cfg.group_size)
        return time.perf_counter() - t0, out

    run("in place", 0), run("copied", 0)  # warm-up
    seconds = {side: [] for side in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        outs = {}
        for side in order:
            s, outs[side] = run(side, r)
            seconds[side].append(s)
        assert outs["in place"] == outs["copied"], f"round {r}: the sides drew different samples"
    engine._rollout_sdpa = in_place
    c = model.config
    print(f"--demo {args.demo}: {len(prompts)} prompts x {cfg.group_size}, <= {cfg.max_new_tokens} tokens, "
          f"{c.num_attention_heads} query heads on {c.num_key_value_heads} key/value heads, {args.threads} "
          f"thread(s), {args.rounds} alternating rounds; samples and log-probs identical in every round")
    for side, s in seconds.items():
        print(f"{side:>9}: {statistics.median(s):.4f} s per rollout "
              f"(median; min {min(s):.4f}, max {max(s):.4f})")
    print(f"in place / copied: {statistics.median(seconds['in place']) / statistics.median(seconds['copied']):.3f}")


if __name__ == "__main__":
    main()
