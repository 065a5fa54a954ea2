"""
Look up when needed: the rollout engines behind one interface,
our sampler here and vLLM in vllm_engine.py.

  engine = make_rollout(cfg, model, tok, dist_info, path)  # HFRollout (our sampler) or VLLMRollout
  engine.calibrate(sharded_model)  # vLLM: the weight-sync probe's start-up gap
  completions, truncated, logps = engine.generate(
      prompts, max_new_tokens, temperature, top_p, n, seed=None)
  engine.sleep(); <updates>; engine.sync_weights(model)  # vLLM frees its GPU memory meanwhile
  engine.exact_logprobs  # True when logps are the trainer's pi_old itself

Every engine samples what the flags say (temperature, top_p), never a checkpoint's generation
settings, and returns log-probs of that distribution: common.rollout_correction turns their gap to
pi_old into importance weights.
"""
import copy

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from common import pad_prompt_completion
from modeling import autocast, eos_ids, full_tensor, nucleus, positions
from partial import CarriedRollouts
from ranks import DistInfo, die, is_dist, print0
from vllm_engine import make_vllm_rollout, vllm_rollout_kind


# --------------------------------------------------------------------------------------------------
# 1. Our sampler, on the transformers model's own forward and KV cache.
def sample_token(logits: torch.Tensor, temperature: float, top_p: float):
    """One token per row of logits (B, V), from softmax(logits / temperature) cut to the top_p
    nucleus (as transformers' TopPLogitsWarper and vLLM cut it), or the argmax at temperature 0.
    Returns tokens (B,) and their log-probs (B,), renormalised over the nucleus as vLLM's are
    (0 when greedy; token_logprobs' at top_p = 1)."""
    if temperature <= 0:
        return logits.argmax(-1), torch.zeros(len(logits), device=logits.device)
    logp = (logits.float() / temperature).log_softmax(-1)  # (B, V)
    if top_p < 1:
        logp = nucleus(logp, top_p).log_softmax(-1)
    token = torch.multinomial(logp.exp(), 1)[:, 0]
    return token, logp.gather(-1, token[:, None])[:, 0]


def _rows_that_fit(model, tokens: int) -> int:
    """Sequences whose KV cache of `tokens` positions fits in half the free GPU memory."""
    text_config = model.config.get_text_config()
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    # K and V, 2 bytes each (bf16 under autocast)
    per_row = 2 * text_config.num_hidden_layers * kv_heads * head_dim * tokens * 2
    free = torch.cuda.mem_get_info()[0]
    return max(1, free // 2 // per_row)


# The sampler's attention. Under a mask, which left padding makes at every decode step,
# transformers' sdpa copies each key/value head of a grouped-query model for its query heads:
# the whole KV cache, at every token. sdpa's enable_gqa reads them in place (docs/results.md gives
# the speed-up). hf_generate registers it in transformers' registries under a name of our own, and
# switches a model on sdpa to it while it samples on a CPU; no other forward runs it.
ROLLOUT_ATTENTION = "rollout_sdpa"


def _rollout_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa, except for grouped-query attention under a mask: there sdpa's enable_gqa
    reads the key/value heads in place, the same output bit for bit on a CPU without gradients, as
    our sampler runs it (tests/test_fast_paths.py). On GPUs enable_gqa under a mask falls back to
    the slow math kernel, and with gradients the key/value gradients are summed in another order."""
    grouped = getattr(module, "num_key_value_groups", 1) != 1
    extras = (kwargs.get("dropout", 0.0) or kwargs.get("position_bias") is not None
              or "cache" in kwargs)
    if not grouped or attention_mask is None or extras:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling"), enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None  # (B, L, heads, d), as transformers returns it


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
    models set repetition_penalty or top_k there: silently off-policy rollouts). Returns
    (completion ids up to and including the first eos, truncated flags, sample_token's log-probs,
    or None when greedy)."""
    device = next(model.parameters()).device
    eos = torch.tensor(eos_ids(model.generation_config.eos_token_id, tok), device=device)
    completions, truncated, logprobs = [], [], []
    was_training = model.training
    model.eval()  # gradient checkpointing is off in eval mode, so the KV cache is kept
    attention = model.config._attn_implementation  # put back after sampling
    if attention == "sdpa" and device.type == "cpu":  # grouped key/value heads read in place
        from transformers import AttentionInterface  # (transformers' model code: loaded by now)
        AttentionInterface.register(ROLLOUT_ATTENTION, _rollout_sdpa)  # (idempotent)
        AttentionMaskInterface.register(ROLLOUT_ATTENTION, sdpa_mask)  # with sdpa's masks
        model.config._attn_implementation = ROLLOUT_ATTENTION
    rows = batch_size
    if device.type == "cuda":  # as many as half the free memory holds the KV cache of
        rows = min(rows, _rows_that_fit(model, max(map(len, prompts)) + max_new_tokens))
    prompts_per_call = max(1, rows // n)
    try:
        for s in range(0, len(prompts), prompts_per_call):
            chunk = prompts[s:s + prompts_per_call]
            ids, attn, _ = pad_prompt_completion(chunk, [[]] * len(chunk), tok.pad_token_id)
            ids, attn = ids[:, :-1].to(device), attn[:, :-1].to(device)  # (N, P): empty column cut
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


# --------------------------------------------------------------------------------------------------
# 2. Our sampler as an engine.
class HFRollout(CarriedRollouts):
    """Our sampler as an engine, in the trainer's --dtype (autocast), on the trained model itself
    in a plain run. Create it before shard_model: under FSDP every rank keeps a full copy in the
    compute dtype and generates without collectives (on the sharded module, ranks that stop at
    different lengths deadlock).

    exact_logprobs: in float32 at the training rollouts' top_p = 1 its log-probs are pi_old (the
    same weights and arithmetic, ~1e-6 off from the KV cache; sample_token renormalises over a
    nucleus), so no old-log-prob pass is needed; in bf16 the kernels' rounding makes them differ.
    With --max_staleness (partial.py) the carried tokens come from older weights than pi_old's:
    exact_current_logprobs then says the same of the tokens pi_old's own weights sampled.
    """

    def __init__(self, model, tok, dist_info: DistInfo, dtype: str = "float32",
                 batch_size: int = 512, top_p: float = 1.0, max_staleness: int = 0):
        self.tok = tok
        self.batch_size = batch_size
        self.dtype = dtype
        self.device = dist_info.device
        self.exact_current_logprobs = dtype == "float32" and top_p == 1  # (class docstring)
        self.exact_logprobs = self.exact_current_logprobs and not max_staleness
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

    def sync_weights(self, model) -> dict:
        """Nothing to sync in a plain run, where the engine's model is the trainer's own; under
        torchrun, copy_weights."""
        if self.model is not model:
            self.copy_weights(model)
        return {}

    @torch.no_grad()
    def copy_weights(self, model):
        """Copy the trainer's trained weights into the copy, a gathered tensor at a time (with
        LoRA the adapters: the frozen base is the same in both)."""
        target = self.model.state_dict()
        for name, value in model.named_parameters():
            if not value.requires_grad:
                continue
            # gathered on the device, in the compute dtype
            new = value.detach().to(target[name].device, target[name].dtype)
            target[name].copy_(full_tensor(new))

    def close(self):
        pass


# --------------------------------------------------------------------------------------------------
# 3. Choosing the engine (--rollout hf | vllm | auto); vLLM's own file is vllm_engine.py.
def resolve_rollout(kind: str, device: torch.device) -> str:
    """--rollout hf|vllm|auto -> 'hf' or 'vllm' (vllm_engine.vllm_rollout_kind decides vLLM's)."""
    assert kind in ("hf", "vllm", "auto"), f"--rollout must be hf, vllm or auto, not {kind!r}"
    return "hf" if kind == "hf" else vllm_rollout_kind(kind, device)


def make_rollout(cfg, model, tok, dist_info: DistInfo, path: str):
    """The engine --rollout asks for: vLLM from the model folder `path`, or our sampler on `model`.
    Call it while the trainer's model is on the CPU, before the sampling seed (vLLM reseeds).
    Sequences are at most --max_model_len tokens (prompt + completion; 0 is resolved from the
    prompts by dataset.resolve_max_model_len), which must fit the model."""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit and cfg.max_model_len > limit:
        die(f"--max_model_len {cfg.max_model_len} (the longest prompt + --max_new_tokens "
            f"{cfg.max_new_tokens}, unless set) exceeds the {limit} positions of --model "
            f"{cfg.model}: lower --max_new_tokens or --max_prompt_length")
    if resolve_rollout(cfg.rollout, dist_info.device) == "hf":
        engine = HFRollout(model, tok, dist_info, cfg.dtype, cfg.rollout_batch_size, cfg.top_p,
                           cfg.max_staleness)
        if engine.exact_logprobs and cfg.rollout_is != "none":
            print0(f"note: --rollout_is {cfg.rollout_is} changes nothing here: our float32 "
                   f"sampler's log-probs are pi_old (weights of 1)")
        return engine
    return make_vllm_rollout(cfg, model, tok, dist_info, path)
