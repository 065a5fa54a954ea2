"""Every causal-LM family's output layer through the chunked log-probs (token_logprobs with chunk_tokens > 0, the
default --logprob_chunk): the chunks must compute what the model's own forward computes, including what that
forward does around its output layer (Gemma's final logit soft-cap, Cohere's logit_scale, Granite's logits_scaling,
Falcon-H1's lm_head_multiplier, MiniCPM3's scaled hidden state, ...), and the start-up probe
shortcuts.check_chunked_logprobs must refuse a head it does not know (exit 2, one line).

Tiny random models built in code, in float64, with the output layer's weights drawn large enough that each family's
transform bites (test_each_family_transforms_its_logits_as_surveyed checks that it does)."""
import os
import subprocess
import sys
import types

import pytest
import torch
import transformers
from transformers.modeling_outputs import CausalLMOutputWithPast

import common
import shortcuts
from tests.conftest import ROOT

V, H = 64, 32
BASE = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
SWA = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])

# family (config.model_type): (config class, model class, settings that make its transform bite, what its forward
# does around the output layer beyond `logits = lm_head(hidden)`: "" for nothing)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, ""),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}, ""),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, ""),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}, ""),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}, ""),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}, ""),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, ""),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(final_logit_softcapping=2.0, query_pre_attn_scalar=8, sliding_window=4), "soft-cap"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(final_logit_softcapping=2.0, **SWA), "soft-cap"),
    "gemma3n_text": ("Gemma3nTextConfig", "Gemma3nForCausalLM",
                     dict(final_logit_softcapping=2.0, vocab_size_per_layer_input=V, hidden_size_per_layer_input=8,
                          num_kv_shared_layers=0, laurel_rank=4, intermediate_size=[64, 64], altup_num_inputs=2,
                          activation_sparsity_pattern=[0.0, 0.0], **SWA), "soft-cap"),
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM",
                    dict(final_logit_softcapping=2.0, vocab_size_per_layer_input=V, hidden_size_per_layer_input=8,
                         global_head_dim=8, **SWA), "soft-cap"),
    "vaultgemma": ("VaultGemmaConfig", "VaultGemmaForCausalLM",
                   dict(final_logit_softcapping=2.0, query_pre_attn_scalar=8, sliding_window=4), "soft-cap"),
    "nanochat": ("NanoChatConfig", "NanoChatForCausalLM", dict(final_logit_softcapping=2.0, num_key_value_heads=4),
                 "soft-cap"),
    "recurrent_gemma": ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM",
                        dict(logits_soft_cap=2.0, block_types=["recurrent", "attention"], lru_width=32,
                             attention_window_size=8, num_key_value_heads=4), "soft-cap"),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.25), "scale"),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(logit_scale=0.25, **SWA), "scale"),
    "cohere2_moe": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM",
                    dict(logit_scale=0.25, num_experts=4, num_experts_per_tok=2, mlp_layer_types=["sparse"] * 2,
                         **SWA), "scale"),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(logits_scaling=4.0), "scale"),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(logits_scaling=4.0, **MOE), "scale"),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM",
                         dict(logits_scaling=4.0, shared_intermediate_size=32, **MOE), "scale"),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                         dict(logits_scaling=4.0, shared_intermediate_size=32, layer_types=["mamba", "attention"],
                              mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, **MOE), "scale"),
    "hyperclovax": ("HyperCLOVAXConfig", "HyperCLOVAXForCausalLM", dict(logits_scaling=0.5), "scale"),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM",
                  dict(lm_head_multiplier=0.3, mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=8,
                       mamba_n_groups=1, mamba_chunk_size=8), "scale"),
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM",  # logits_scaling = hidden_size / dim_model_base = 4
                 dict(dim_model_base=8, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                      v_head_dim=8, num_key_value_heads=4), "hidden scaled before the head"),
    "inkling_text": ("InklingTextConfig", "InklingForCausalLM",
                     dict(unpadded_vocab_size=60, logits_mup_width_multiplier=4.0, n_routed_experts=4,
                          num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
                          swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=4,
                          layer_types=["hybrid_sliding", "hybrid"], mlp_layer_types=["dense", "sparse"]),
                     "hidden scaled before the head, vocabulary cut after it"),
    "mllama_text_model": ("MllamaTextConfig", "MllamaForCausalLM", dict(cross_attention_layers=[]), "float32"),
}
UNTIED_ONLY = {"inkling_text", "mllama_text_model"}  # no tied variant (Mllama: 8 more input embeddings)
# Families whose cache cannot serve the shared-prompt path of _predicting_outputs (one prompt forward per group, its
# KV cache indexed out to the group's rows): the exception it raises today, in transformers 5.19.
SHARED_PROMPT_FAILS = {
    "recurrent_gemma": (AttributeError, "has no attribute 'past_key_values'"),  # its outputs carry no cache
    "granitemoehybrid": (AttributeError, "has no attribute 'batch_select_indices'"),  # mamba layers' cache
    "falcon_h1": (RuntimeError, "Sizes of tensors must match"),  # its hybrid cache keeps the prompt's batch size
    "inkling_text": (RuntimeError, "Sizes of tensors must match"),
}
CASES = [(f, tied) for f in FAMILIES for tied in ((False,) if f in UNTIED_ONLY else (True, False))]


def build(family: str, tied: bool = False, seed: int = 0):
    config_cls, model_cls, settings, _ = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**BASE, **settings, "tie_word_embeddings": tied})
    config._experts_implementation = "eager"  # the grouped-matmul experts take no float64
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).double().train()
    head = model.get_output_embeddings()
    assert (head.weight is model.get_input_embeddings().weight) == tied
    with torch.no_grad():  # logits of a few units: past every soft-cap of 2, and scales that matter
        g = torch.Generator().manual_seed(seed)
        # the input embeddings too, so that no row is zero (the pad token's is): Gemma 3n takes the root of a mean
        # square of it, whose gradient at zero is NaN
        model.get_input_embeddings().weight.normal_(0.0, 1.0, generator=g)
        head.weight.normal_(0.0, 1.0, generator=g)
    return model


def grouped_batch(seed: int = 0):
    """2 prompts (3 and 6 tokens) x 3 completions of 1 to 8 tokens: B = 6 rows, left and right padding."""
    g = torch.Generator().manual_seed(seed)
    groups = [{"prompt_ids": torch.randint(3, 60, (k,), generator=g).tolist(),
               "completions": [torch.randint(3, 60, (int(m),), generator=g).tolist()
                               for m in torch.randint(1, 9, (3,), generator=g)],
               "reward": [0.0] * 3, "correct": [False] * 3} for k in (3, 6)]
    return common.make_batch(groups, BASE["pad_token_id"])


def run(model, batch, temperature, chunk_tokens, groups):
    """log-probs, entropies and parameter gradients of a scalar loss, through token_logprobs."""
    T = batch["mask"].shape[1]
    model.zero_grad()
    logp, entropy = shortcuts.token_logprobs(model, batch["input_ids"], batch["attention_mask"], T, temperature, True,
                                          chunk_tokens, groups)
    (logp * batch["mask"] * torch.linspace(-1, 1, T, dtype=logp.dtype)).sum().backward()
    mask = batch["mask"].bool()
    return logp.detach()[mask], entropy[mask], [p.grad for p in model.parameters()]


def assert_chunked_equals_whole(model, batch, groups):
    """chunk_tokens 13 over B = 6 rows: chunks of 2 positions, the last one shorter."""
    for temperature in (1.0, 0.7):
        (lp0, ent0, grads0), (lp1, ent1, grads1) = (run(model, batch, temperature, c, groups) for c in (0, 13))
        # float64 to 1e-10 relative; a family whose forward casts its logits to float32 (Mllama) to float32's 1e-5
        tol = 1e-10 if lp0.dtype == torch.float64 else 1e-5
        assert (lp0 - lp1).abs().max() <= tol * lp0.abs().max(), (temperature, (lp0 - lp1).abs().max())
        assert (ent0 - ent1).abs().max() <= tol * ent0.abs().max(), (temperature, (ent0 - ent1).abs().max())
        for (name, _), a, b in zip(model.named_parameters(), grads0, grads1):
            assert (a is None) == (b is None), name
            if a is not None:
                assert (a - b).abs().max() <= tol * a.abs().max(), (temperature, name, (a - b).abs().max())


@pytest.mark.parametrize("family,tied", CASES)
def test_chunked_logprobs_equal_the_whole_logits(family, tied):
    """Rows run whole (no groups): log-probs, entropies and all gradients, temperature 1 and 0.7; and the start-up
    probe accepts the family."""
    model = build(family, tied)
    assert_chunked_equals_whole(model, grouped_batch(), None)
    shortcuts.check_chunked_logprobs(model)  # returns (does not exit) for a family the table knows


@pytest.mark.parametrize("family,tied", CASES)
def test_chunked_logprobs_equal_the_whole_logits_shared_prompts(family, tied):
    """The same with each group's prompt run once and its KV cache shared by its rows (_predicting_outputs' shared
    path). Families whose cache cannot do that fail there with the exception SHARED_PROMPT_FAILS records, chunked or
    not; the start-up check (check_logprob_paths) finds exactly those and sets model.shares_prompts = False, after
    which their rows run whole, with the same numbers."""
    model, batch = build(family, tied), grouped_batch()
    if family in SHARED_PROMPT_FAILS:
        error, message = SHARED_PROMPT_FAILS[family]
        for chunk_tokens in (0, 13):
            with pytest.raises(error, match=message):
                run(model, batch, 1.0, chunk_tokens, batch["group"])
    shortcuts.check_logprob_paths(model, types.SimpleNamespace(logprob_chunk=13, dtype="float32"))
    assert model.shares_prompts == (family not in SHARED_PROMPT_FAILS)
    assert_chunked_equals_whole(model, batch, batch["group"])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_transforms_its_logits_as_surveyed(family):
    """The test models are meaningful: a family listed with a transform has logits that differ from the output
    layer applied to the base model's last hidden state by more than 0.5 nats of log-prob (so a chunked path that
    dropped or misplaced the transform would fail the tests above), and a family listed without one has none."""
    model = build(family)
    ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        plain = model.get_output_embeddings()(model.model(input_ids=ids).last_hidden_state)
    gap = (logits.log_softmax(-1) - plain[..., :logits.shape[-1]].log_softmax(-1)).abs().max().item()
    transform = FAMILIES[family][3]
    if transform == "float32":  # a cast: the same values, in float32
        assert logits.dtype == torch.float32 and gap < 1e-5, (logits.dtype, gap)
    elif transform:
        assert gap > 0.5, gap
    else:
        assert logits.dtype == torch.float64 and gap < 1e-12, gap


class SinQwen3(transformers.Qwen3ForCausalLM):
    """A forward that applies a nonlinearity to its logits that shortcuts.head_logits cannot know."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = 3 * torch.sin(out.logits)
        return out


class HeadlessQwen3(transformers.Qwen3ForCausalLM):
    """A forward that computes its logits from the output layer's weight without calling the output layer."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, logits_to_keep=0, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            **kwargs).last_hidden_state
        return CausalLMOutputWithPast(logits=torch.nn.functional.linear(hidden[:, -logits_to_keep:],
                                                                        self.lm_head.weight))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cls", [SinQwen3, HeadlessQwen3])
def test_probe_refuses_a_head_it_does_not_know(cls, dtype, capsys):
    """Exit 2 and one line naming the class and the way out, in float32 and under bfloat16 autocast."""
    config = transformers.Qwen3Config(**BASE, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = cls(config).float().train()
    with pytest.raises(SystemExit) as exit_info:
        shortcuts.check_chunked_logprobs(model, dtype)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and cls.__name__ in err and "--logprob_chunk 0" in err


@pytest.mark.parametrize("family", ["gemma2", "cohere", "granite", "falcon_h1", "minicpm3", "inkling_text"])
def test_probe_accepts_known_heads_under_bfloat16_autocast(family):
    """The probe's tolerance follows the compute dtype: no false refusal of a family the table knows in bfloat16."""
    shortcuts.check_chunked_logprobs(build(family).float(), "bfloat16")


def test_chunked_path_raises_when_the_head_is_not_called():
    """Without the probe, a head that is never called must not pass for one that is: the chunked path raises."""
    model = HeadlessQwen3(transformers.Qwen3Config(**BASE, tie_word_embeddings=False)).double()
    batch = grouped_batch()
    with pytest.raises(RuntimeError, match="HeadlessQwen3"):
        shortcuts.token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["mask"].shape[1],
                              chunk_tokens=13)


DIST_PROBE = r"""
import torch
import modeling
import ranks
import shortcuts
from tests import test_heads

d = ranks.setup_dist("cpu")
model = test_heads.build("gemma2", tied=True).float()  # the same seed, so the same weights, on every rank
model = modeling.shard_model(model, d)
shortcuts.check_chunked_logprobs(model)  # every rank, in the same order: forwards of the sharded model
batch = test_heads.grouped_batch()
T = batch["mask"].shape[1]
out = []
for chunk_tokens in (0, 13):
    model.zero_grad()
    logp, _ = shortcuts.token_logprobs(model, batch["input_ids"], batch["attention_mask"], T, 0.7, False, chunk_tokens,
                                    batch["group"])
    (logp * batch["mask"]).sum().backward()
    out.append((logp.detach(), [modeling.full_tensor(p.grad) for p in model.parameters()]))
gap = max([(out[0][0] - out[1][0]).abs().max().item()]
          + [((a - b).abs().max() / a.abs().max()).item() for a, b in zip(out[0][1], out[1][1])])
print(f"rank {d.rank}: gemma2 accepted, chunked gap {gap:.1e}", flush=True)
assert gap < 1e-5, gap
refused = modeling.shard_model(test_heads.SinQwen3(test_heads.transformers.Qwen3Config(**test_heads.BASE)), d)
shortcuts.check_chunked_logprobs(refused)  # exits 2 on every rank
print("not refused", flush=True)
"""


def test_probe_under_fsdp2(tmp_path):
    """Under torchrun (2 CPU ranks, FSDP2): the probe runs on every rank, accepts Gemma 2 (whose chunked log-probs and
    gradients then match the whole logits) and refuses an unknown head on every rank."""
    script = tmp_path / "probe.py"
    script.write_text(DIST_PROBE)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT})
    assert r.returncode != 0 and "not refused" not in r.stdout, r.stdout + r.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: gemma2 accepted" in r.stdout, r.stdout + r.stderr[-3000:]
    assert r.stderr.count("error: --logprob_chunk") == 2 and "SinQwen3" in r.stderr, r.stderr[-3000:]


# Families whose packed forward mixes its sequences: their recurrent (RecurrentGemma's RG-LRU) or Mamba layers carry a
# state from one packed sequence into the next (transformers' padding-free guide: such layers ignore position_ids);
# the start-up check finds them and they run padded.
PACK_REFUSED = {"recurrent_gemma", "granitemoehybrid", "falcon_h1", "inkling_text"}


def _own_logprobs(model, batch):
    """Each row's completion log-probs from its own forward (no padding), at the batch's (B, T) places."""
    out = torch.zeros(batch["mask"].shape, dtype=torch.float64)
    for i, (ids, attn) in enumerate(zip(batch["input_ids"], batch["attention_mask"])):
        n = int(batch["mask"][i].sum())
        if n:
            out[i, :n] = shortcuts.token_logprobs(model, ids[attn.bool()][None], attn[attn.bool()][None], n)[0][0]
    return out * batch["mask"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_start_up_check_packs_a_family_or_refuses_it(family, capsys):
    """--pack: the start-up check lets every family with attention layers only pack, and then its packed log-probs
    are each row's own (float64); the families whose layers carry a state across sequences (PACK_REFUSED) are
    refused with one line and run padded."""
    model, batch = build(family, family not in UNTIED_ONLY), grouped_batch()
    shortcuts.check_logprob_paths(model, types.SimpleNamespace(logprob_chunk=13, dtype="float32", pack=True))
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: --pack:")]
    assert bool(model.pack_refusal) == (family in PACK_REFUSED) == (len(notes) == 1), (model.pack_refusal, notes)
    if family in PACK_REFUSED:
        return
    T = batch["mask"].shape[1]
    with torch.no_grad():  # (the batch's second group is left padded)
        own = _own_logprobs(model, batch)
        packed = shortcuts.token_logprobs(model, batch["input_ids"], batch["attention_mask"], T, pack=True)[0]
        padded = shortcuts.token_logprobs(model, batch["input_ids"], batch["attention_mask"], T)[0] * batch["mask"]
    tol = 1e-10 if own.dtype == packed.dtype else 1e-5  # (Mllama: float32 logits)
    assert (packed - own).abs().max().item() <= tol * own.abs().max().item()
    assert (packed - padded).abs().max().item() <= tol * own.abs().max().item()
