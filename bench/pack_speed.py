"""The update's forward and backward with --pack and with --no-pack, on a demo's own rollouts: CPU seconds of one RL
step's log-probs and their backward (bench/vs_trl.py's work: 16 prompts x G 8, micro-batches of 32 rows), the two
sides alternating in one process, one thread. CPU time, not wall time, so that other processes on a shared machine
move the figures less (they still share its caches).
Usage: python -m bench.pack_speed [--workload reasoning|arith] [--rounds 14]"""
import argparse
import statistics
import time

import torch

import config
import common
import da3po
import dataset
import engine
import modeling


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="reasoning", choices=list(config.DEMOS))
    p.add_argument("--rounds", type=int, default=14)
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = config.parse_config(da3po.Config, ["--demo", args.workload], da3po.PRESETS)
    model, tok = modeling.load_model(modeling.model_path(cfg.model))
    template = dataset.resolve_template(cfg.prompt_template, tok)
    problems = dataset.tokenize_problems(dataset.load_data(cfg.train_data, "train"), tok, template,
                                         cfg.max_prompt_length, cfg.train_data)
    prompts = [x["prompt_ids"] for x in problems[:16]]
    torch.manual_seed(0)
    completions = engine.hf_generate(model, tok, prompts, cfg.max_new_tokens, n=cfg.group_size)[0]
    G = cfg.group_size
    groups = [{"prompt_ids": prompt, "completions": completions[i * G:(i + 1) * G], "reward": [0.0] * G,
               "correct": [False] * G} for i, prompt in enumerate(prompts)]
    batch = common.make_batch(groups, tok.pad_token_id)
    model.train()

    def update(pack: bool) -> float:
        flags = da3po.Config(pack=pack)
        t0 = time.process_time()
        for _, mb in common.micro_batches(batch, torch.arange(len(batch["mask"])), 32):
            logp, _ = common.batch_logprobs(model, mb, flags, with_entropy=True)
            (logp * mb["mask"]).sum().backward()
        model.zero_grad(set_to_none=True)
        return time.process_time() - t0

    seconds = {"--pack": [], "--no-pack": []}
    for r in range(args.rounds + 1):
        for side in (list(seconds) if r % 2 else list(seconds)[::-1]):
            s = update(side == "--pack")
            if r:  # the first round warms up
                seconds[side].append(s)
    lengths = batch["mask"].sum(-1).float()
    print(f"--demo {args.workload}: {len(prompts)} prompts x {G}, completions of {lengths.mean():.1f} tokens "
          f"(mean; {int(lengths.min())}-{int(lengths.max())}), micro-batches of 32 rows; CPU seconds per step's "
          f"update, median of {args.rounds} alternating rounds:")
    for side, s in seconds.items():
        print(f"  {side:>9}: {statistics.median(s):.4f} (min {min(s):.4f}, max {max(s):.4f})")


if __name__ == "__main__":
    main()
