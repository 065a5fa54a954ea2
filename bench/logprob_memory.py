"""Peak memory and time of one forward + backward of token_logprobs (with the entropy) at Qwen's vocabulary, with
the whole (B, T, V) logits at once vs chunks of positions (--logprob_chunk), on the CPU.
Usage: python -m bench.logprob_memory [--lengths 1024,2048,4096,8192] [--chunk 2048] [--hidden 64] [--out FILE]

The model is Qwen3-shaped with V = 151,936 and a small hidden size (64, 2 layers: 10M parameters, nearly all of them
the tied embedding), so the logits dominate memory as they do at real scale; B = 1, prompts of 64 tokens. Each
measurement runs in a fresh process, and peak memory is the growth of its peak RSS over the step (ru_maxrss after the
step minus the RSS before it). A whole-logits run that would not fit in the machine's free memory is skipped, with
the estimate. Writes a markdown table (bench/results/logprob_memory.md by default)."""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = 151_936


def child(T: int, chunk: int, hidden: int, threads: int):
    """One measurement, printed as JSON: peak RSS growth (MiB) and seconds of a forward + backward."""
    import torch
    import shortcuts
    from transformers import AutoModelForCausalLM, Qwen3Config
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=V, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=T + 128,
                         tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config).train()
    P = 64
    ids = torch.randint(0, V, (1, P + T))
    attn = torch.ones_like(ids)
    rss_before = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    t0 = time.perf_counter()
    logp, entropy = shortcuts.token_logprobs(model, ids, attn, T, 1.0, True, chunk)
    (logp.sum() + 0 * entropy.sum()).backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    print(json.dumps({"peak_mib": peak - rss_before, "seconds": seconds, "logp_sum": logp.sum().item()}))


def free_mib() -> float:
    return next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemAvailable")) / 1024


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--chunk", type=int, default=1024, help="--logprob_chunk of the chunked runs")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "logprob_memory.md"))
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        T, chunk = map(int, args.child.split(","))
        return child(T, chunk, args.hidden, args.threads)
    rows = []
    for T in map(int, args.lengths.split(",")):
        result = {}
        for name, chunk in (("whole", 0), ("chunked", args.chunk)):
            need = 6 * T * V * 4 / 2**20 if chunk == 0 else 0  # ~6 (T, V) float32 tensors live at the peak
            if need > 0.8 * free_mib():
                result[name] = {"skipped": f"needs ~{need / 1024:.0f} GiB, {free_mib() / 1024:.0f} GiB free"}
                continue
            child_args = ["--child", f"{T},{chunk}", "--hidden", str(args.hidden), "--threads", str(args.threads)]
            r = subprocess.run([sys.executable, "-m", "bench.logprob_memory", *child_args],
                               capture_output=True, text=True, cwd=ROOT,
                               env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            result[name] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {
                "skipped": f"failed (exit {r.returncode}): {r.stderr.strip().splitlines()[-1][:80]}"}
        rows.append((T, result))
        print(T, json.dumps(result), flush=True)

    def cell(r, key, fmt):
        return r["skipped"] if "skipped" in r else format(r[key], fmt)
    lines = [f"Forward + backward of `token_logprobs` (with entropy) on one sequence of 64 prompt + T completion "
             f"tokens, Qwen3-shaped model with V = {V:,}, hidden {args.hidden}, 2 layers, float32, CPU, {args.threads} "
             f"thread(s). Peak = growth of the process's peak RSS over the step. Chunked: `--logprob_chunk "
             f"{args.chunk}`.", "",
             "| T | whole logits: peak MiB | whole: s | chunked: peak MiB | chunked: s | logits of one (T, V) "
             "float32 tensor, MiB |", "|---|---|---|---|---|---|"]
    for T, r in rows:
        lines.append(f"| {T:,} | {cell(r['whole'], 'peak_mib', ',.0f')} | {cell(r['whole'], 'seconds', '.2f')} | "
                     f"{cell(r['chunked'], 'peak_mib', ',.0f')} | {cell(r['chunked'], 'seconds', '.2f')} | "
                     f"{T * V * 4 / 2**20:,.0f} |")
    lines.append("")
    command = " ".join(["python -m bench.logprob_memory", *sys.argv[1:]])
    lines.append(f"Command: `{command}`")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    open(args.out, "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
