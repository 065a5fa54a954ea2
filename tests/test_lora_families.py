"""LoRA and FSDP2 on the families whose decoder blocks are not at model.model.layers: tiny random GPT-NeoX (Pythia),
GPT-2 (Conv1D layers), Falcon and OPT train only their adapters, merge into the weights they computed with, save and
resume in peft's format, and shard on 2 gloo ranks to the one-process update; a family whose blocks are elsewhere
stops with one line naming its class.
Run: python -m pytest -q tests/test_lora_families.py   (skipped without peft: pip install -r requirements/lora.txt)"""
import json

import pytest
import torch

peft = pytest.importorskip("peft")

import bookkeeping  # noqa: E402
import common  # noqa: E402
import da3po  # noqa: E402
import lora  # noqa: E402
import modeling  # noqa: E402
import ranks  # noqa: E402
from tests.conftest import run_script  # noqa: E402
from tests.dist_lora_families import FAMILIES, save_family  # noqa: E402

TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
# every linear layer of each family's blocks, what LoRA adapts by default
LAYERS = {"gpt_neox": ["dense", "dense_4h_to_h", "dense_h_to_4h", "query_key_value"],
          "gpt2": ["c_attn", "c_fc", "c_proj"],
          "falcon": ["dense", "dense_4h_to_h", "dense_h_to_4h", "query_key_value"],
          "opt": ["fc1", "fc2", "k_proj", "out_proj", "q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """A saved tiny random model of each family (tests/dist_lora_families.py), with the demo's tokenizer."""
    root = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        save_family(family, str(root / family))
    return root


def rows(tok, n=4, seed=0):
    """n random prompt + completion rows, left-padded: (input_ids, attention_mask, completion mask)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, 40, (int(k),), generator=g).tolist() for k in torch.randint(2, 6, (n,), generator=g)]
    completions = [torch.randint(10, 40, (int(k),), generator=g).tolist()
                   for k in torch.randint(1, 8, (n,), generator=g)]
    return common.pad_prompt_completion(prompts, completions, tok.pad_token_id)


def logprobs(model, batch):
    ids, attn, mask = batch
    return common.token_logprobs(model, ids, attn, mask.shape[1])[0] * mask


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_trains_merges_and_resumes_on_each_family(family_dirs, family, tmp_path):
    """Every linear layer of the blocks adapted (GPT-2's Conv1D ones too), only the adapters trained; the merged
    weights (what vLLM gets with --lora_sync merged) compute what the adapted model does; the checkpoint's adapter
    loads back into the trainer and into PeftModel, computing the same."""
    folder = str(family_dirs / family)
    cfg = da3po.Config(lora_rank=4, lora_alpha=8.0)
    model, tok = modeling.load_model(folder)
    model = lora.add_lora(model, cfg).train()
    assert sorted(model.peft_config["default"].target_modules) == LAYERS[family]
    assert model.peft_config["default"].fan_in_fan_out == (family == "gpt2")  # Conv1D's weight is (in, out)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n}
    batch = rows(tok)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        loss = -logprobs(model, batch).sum() / batch[2].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.01, losses
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    model.eval()
    with torch.no_grad():
        expected = logprobs(model, batch)
        plain = modeling.load_model(folder)[0].eval()
        merged = dict(lora.merged_parameters(model, torch.device("cpu"), torch.float32))
        missing = plain.load_state_dict(merged, strict=False).missing_keys
        assert set(missing) <= {"lm_head.weight"}  # tied to the embedding, which is merged's
        assert (logprobs(plain, batch) - expected).abs().max() < 1e-5
        ckpt = str(tmp_path / "step_000001")
        lora.save_adapter(model, lora.adapter_state_dict(model), ckpt)
        resumed = bookkeeping.load_policy(ckpt, folder, cfg)[0].eval()
        assert (logprobs(resumed, batch) - expected).abs().max() < 1e-6
        from transformers import AutoModelForCausalLM
        peft_model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), ckpt).eval()
        assert (logprobs(peft_model, batch) - expected).abs().max() < 1e-5


def test_fsdp_on_two_ranks_updates_each_family_as_one_process(family_dirs, tmp_path):
    """One update of each family, full and with LoRA, on 2 FSDP2 ranks (gloo; a unit per block, found where the
    family keeps them) and in one process: the same loss and weights, float64, to 1e-12."""
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    for args in (["-m", "tests.dist_lora_families", str(family_dirs), str(one)],
                 [*TORCHRUN, "-m", "tests.dist_lora_families", str(family_dirs), str(two)]):
        r = run_script(args)
        assert r.returncode == 0, r.stderr[-3000:]
    a, b = torch.load(one), torch.load(two)
    assert set(a) == set(b) == {(f, kind) for f in FAMILIES for kind in ("full", "lora")}
    for key in a:
        assert abs(a[key]["loss"] - b[key]["loss"]) < 1e-12, key
        assert a[key]["after"].keys() == b[key]["after"].keys(), key
        for name, value in a[key]["after"].items():
            assert value.dtype == torch.float64
            assert torch.allclose(value, b[key]["after"][name], rtol=0, atol=1e-12), (key, name)
        moved = [(a[key]["after"][n] - a[key]["before"][n]).abs().max().item() for n in a[key]["after"]]
        assert max(moved) > 1e-4, key
        if key[1] == "lora":  # every adapter moved, A and B
            assert min(moved) > 0 and all(".lora_" in n for n in a[key]["after"]), key


def test_the_script_runs_gpt2_with_lora_on_two_ranks(family_dirs, tmp_path):
    """da3po.py on 2 FSDP2 ranks with LoRA on a tiny random GPT-2 (Conv1D layers): it trains (a gradient, with
    rewards that differ by length) and its checkpoint is GPT-2's adapter in peft's format. At --demo arith's --lr,
    a full fine-tuning rate, rank 0 says so once."""
    out = tmp_path / "run"
    r = run_script([*TORCHRUN, "da3po.py", "--model", str(family_dirs / "gpt2"), "--demo", "arith", "--lora_rank", "4",
                    "--steps", "1", "--no-dynamic_sampling", "--prompts_per_step", "4", "--updates_per_step", "1",
                    "--eval_size", "4", "--eval_samples", "2", "--out_dir", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("note: --lora_rank 4 trains at --lr 0.0001, a rate chosen for full fine-tuning") == 1
    train = [x for x in map(json.loads, open(out / "metrics.jsonl")) if "train/loss" in x]
    assert len(train) == 1 and train[0]["train/grad_norm"] > 0, train
    adapter = json.load(open(out / "step_000001" / "adapter_config.json"))
    assert sorted(adapter["target_modules"]) == LAYERS["gpt2"] and adapter["fan_in_fan_out"]


def test_a_family_with_its_blocks_elsewhere_stops_with_one_line(capsys):
    """MPT keeps its blocks at transformer.blocks: LoRA and FSDP2 stop with one line naming the class (FSDP2 before
    any collective)."""
    import transformers
    config = transformers.MptConfig(d_model=32, n_heads=4, n_layers=2, vocab_size=64, max_seq_len=64)
    model = transformers.AutoModelForCausalLM.from_config(config)
    for call in (lambda: lora.add_lora(model, da3po.Config(lora_rank=4)),
                 lambda: modeling.fully_shard_model(model, ranks.DistInfo(), "float32", False)):
        with pytest.raises(SystemExit) as stop:
            call()
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: MptForCausalLM: its decoder blocks are at none of "
                                                   "model.layers, gpt_neox.layers, transformer.h"), err
