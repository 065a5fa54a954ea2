"""Shared fixtures. Run the whole suite with: python -m pytest -q tests"""
import os
import sys

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing in the tests may reach a hub
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
ARITH_MODEL = os.path.join(ROOT, "demo", "arith", "model")  # the sums demo's model (--demo arith)

import torch  # noqa: E402

torch.set_num_threads(1)  # the machine is shared: one thread keeps tests predictable


@pytest.fixture(scope="session")
def demo_dir():
    """The sums demo's model folder (demo/arith/model, built by demo/build.py): what --demo arith runs."""
    return ARITH_MODEL


def run_script(args, cwd=ROOT, timeout=300):
    """Run a script as a user would, with one thread and no hub access; returns the CompletedProcess."""
    import subprocess
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def float64_norms():
    """Make the demo model's (Qwen3's) RMSNorm compute in its input's dtype. transformers casts its input to float32
    (for bf16 stability), so a float64 model still rounds there to float32, at a point that depends on the batch's
    shape: exactness tests (float64, tight tolerances) need the whole model in float64. Test-only; idempotent."""
    from transformers.models.qwen3 import modeling_qwen3

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))
    modeling_qwen3.Qwen3RMSNorm.forward = forward


@pytest.fixture
def float64_model(demo_dir, monkeypatch):
    """The demo model in float64, all of it (float64_norms, undone after the test)."""
    import modeling
    from transformers.models.qwen3 import modeling_qwen3
    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", modeling_qwen3.Qwen3RMSNorm.forward)  # restored after
    float64_norms()
    model, tok = modeling.load_model(demo_dir, torch.device("cpu"))
    return model.double(), tok


def weighted_loss(logp, old_logp, advantages, weights, *args, **kwargs):
    """The scripts' aggregation of common.policy_loss: its token losses weighted (weights (B, T): the mask and the
    aggregation, e.g. common.loss_weights) and summed. Returns (loss, the clipped-token counts)."""
    import common
    token_loss, stats = common.policy_loss(logp, old_logp, advantages, weights > 0, *args, **kwargs)
    return (token_loss * weights).sum(), stats


def docs_block(marker: str, page: str = os.path.join("docs", "integrations.md")) -> str:
    """The ```python block of a docs page that contains `marker` (the snippets a user pastes, tested as written)."""
    import re
    blocks = re.findall(r"```python\n(.*?)```", open(os.path.join(ROOT, page)).read(), re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"one python block in {page} with {marker!r}, found {len(found)}"
    return found[0]


def random_batch(tok, n, seed=0, skew=False):
    """n rows of random prompts and completions; skew: completions of 1 to 40 tokens, most of them short."""
    import common
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, 40, (int(k),), generator=g).tolist() for k in torch.randint(2, 8, (n,), generator=g)]
    lengths = (torch.rand(n, generator=g) ** 4 * 39 + 1).long() if skew else torch.randint(1, 12, (n,), generator=g)
    completions = [torch.randint(10, 40, (int(k),), generator=g).tolist() for k in lengths]
    ids, attn, mask = common.pad_prompt_completion(prompts, completions, tok.pad_token_id)
    return {"input_ids": ids, "attention_mask": attn, "mask": mask,
            "advantage": torch.randn(n, generator=g)}


def off_policy_batch(model, tok, n: int, g: torch.Generator) -> dict:
    """n rows of random prompts (2-7 tokens) and completions (1-8) with old log-probs 0.1 off the model's own (so
    that ratios clip): the micro-batch tests' update, in the model's dtype (float64 there)."""
    import common
    prompts = [torch.randint(10, 40, (int(k),), generator=g).tolist() for k in torch.randint(2, 8, (n,), generator=g)]
    completions = [torch.randint(10, 40, (int(k),), generator=g).tolist()
                   for k in torch.randint(1, 9, (n,), generator=g)]
    ids, attn, mask = common.pad_prompt_completion(prompts, completions, tok.pad_token_id)
    T = mask.shape[1]
    with torch.no_grad():
        old = common.token_logprobs(model, ids, attn, T)[0] + 0.1 * torch.randn(n, T, generator=g, dtype=torch.float64)
    return {"input_ids": ids, "attention_mask": attn, "mask": mask, "old_logp": old}


def accumulate(model, batch: dict, sizes: list[int], weight_of=lambda mb: mb["weight"]):
    """One update as the scripts run it: the rows in consecutive micro-batches of `sizes`, each micro-batch's clipped
    loss (clip 0.2 / 0.28) weighed by weight_of(mb), summed and backward. Returns (the loss, the model's gradients)."""
    import common
    model.zero_grad()
    total, start = 0.0, 0
    for size in sizes:
        rows = torch.arange(start, start + size)
        start += size
        for _, mb in common.micro_batches(batch, rows, size):
            logp, _ = common.token_logprobs(model, mb["input_ids"], mb["attention_mask"], mb["mask"].shape[1])
            loss, _ = weighted_loss(logp, mb["old_logp"], mb["advantage"], weight_of(mb), 0.2, 0.28)
            loss.backward()
            total += loss.item()
    return total, [p.grad.clone() for p in model.parameters()]


class ScriptedEngine:
    """An engine whose k completions of problem i are texts[i] (each 'token' indexes a table of texts), and the
    tokenizer that decodes them: evaluation then scores completions chosen by hand (problem i's prompt_ids: [i])."""

    def __init__(self, texts: list[list[str]]):
        self.table = [t for row in texts for t in row]

    def generate(self, prompt_ids, max_new_tokens, temperature, top_p, n, seed=None):
        ids = [[p[0] * n + j] for p in prompt_ids for j in range(n)]  # prompt_ids [[i]]: problem i
        return ids, [False] * len(ids), None

    def batch_decode(self, ids, skip_special_tokens=True):
        return [self.table[i[0]] for i in ids]
