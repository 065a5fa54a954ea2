"""Tiny random models of the families whose decoder blocks are not at model.model.layers (GPT-NeoX, GPT-2, Falcon,
OPT), and one update of each, full and with LoRA, in a plain process or under torchrun (FSDP2 on gloo).
Used by tests/test_lora_families.py: python -m tests.dist_lora_families FOLDER OUT.pt
                                   | torchrun --nproc_per_node=2 -m tests.dist_lora_families FOLDER OUT.pt
FOLDER holds a model folder per family (save_family). Rank 0 writes, per family and kind, the summed loss, the
weights before and after the update (full: every weight; LoRA: the adapters)."""
import os
import sys

import torch

# the families (transformers' config class and its own settings) and where each keeps its blocks
FAMILIES = {
    "gpt_neox": ("GPTNeoXConfig", dict(intermediate_size=64, rotary_pct=0.5)),  # gpt_neox.layers
    "gpt2": ("GPT2Config", {}),  # transformer.h, of Conv1D layers
    "falcon": ("FalconConfig", {}),  # transformer.h
    "opt": ("OPTConfig", dict(ffn_dim=64, word_embed_proj_dim=32)),  # model.decoder.layers
}


def save_family(family: str, folder: str):
    """A tiny random model of `family` (2 blocks of width 32) with the demo's tokenizer, saved to `folder`."""
    import transformers
    import modeling
    tok = modeling.build_demo_tokenizer()
    config_cls, settings = FAMILIES[family]
    config = getattr(transformers, config_cls)(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, **settings)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)


def update(model_dir: str, with_lora: bool, d) -> dict:
    """One SGD step (lr 1: the update is the gradient) of the mean log-likelihood of 8 fixed random rows, each
    rank its stride of them, in float64. Returns the summed loss and the trained weights before and after, whole."""
    import common
    import da3po
    import lora
    import modeling
    import ranks
    model, tok = modeling.load_model(model_dir)
    if with_lora:
        torch.manual_seed(0)  # A's initialisation, the same on every rank
        model = lora.add_lora(model, da3po.Config(lora_rank=4, lora_alpha=8.0))
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():  # B != 0: A gets a gradient too
            if ".lora_B." in name:
                p.data = 0.1 * torch.randn(p.shape, generator=g)
    model = modeling.shard_model(model.double(), d, "float64")
    state_dict = lora.adapter_state_dict if with_lora else modeling.full_state_dict

    def trained(model):  # (copies: in one process the state dicts hold the parameters themselves)
        return {name: value.clone() for name, value in state_dict(model).items()}
    before = trained(model)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 40, (int(n),), generator=g).tolist() for n in torch.randint(2, 6, (8,), generator=g)]
    completions = [torch.randint(10, 40, (int(n),), generator=g).tolist()
                   for n in torch.randint(1, 8, (8,), generator=g)]
    ids, attn, mask = common.pad_prompt_completion(prompts[d.rank::d.world_size], completions[d.rank::d.world_size],
                                                   tok.pad_token_id)
    total_tokens = sum(map(len, completions))
    logp = common.token_logprobs(model, ids, attn, mask.shape[1])[0]
    loss = -(logp * mask).sum() / total_tokens
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return {"loss": ranks.all_reduce_sum(loss.detach()).item(), "before": before, "after": trained(model)}


def main(folder: str, out: str):
    import ranks
    torch.use_deterministic_algorithms(True)
    d = ranks.setup_dist("cpu")
    results = {(family, kind): update(os.path.join(folder, family), kind == "lora", d)
               for family in FAMILIES for kind in ("full", "lora")}
    if d.is_main:
        torch.save(results, out)
    ranks.cleanup_dist()
    ranks.end_process()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
