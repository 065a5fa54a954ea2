"""Token log-probs in chunks of positions (--logprob_chunk): equal to the whole logits at once, for every chunk
size, in the forward and the gradient."""
import pytest
import torch

import modeling
import shortcuts
from tests.conftest import random_batch


@pytest.mark.parametrize("chunk", [5, 13, 40])
def test_chunked_logprobs_equal_the_plain_ones(demo_dir, chunk):
    """Values, entropies and gradients of token_logprobs with the output layer applied a chunk at a time (and
    recomputed in the backward) against the whole (B, T, V) logits at once; the demo model ties its output layer
    to its embedding, so both paths of the shared weight's gradient are exercised. In float64, so that 1e-6 measures
    the method, not float32's summation order."""
    model, tok = modeling.load_model(demo_dir, torch.device("cpu"))
    model.double().train()
    batch = random_batch(tok, 6)
    T = batch["mask"].shape[1]
    out = []
    for chunk_tokens in (0, chunk):
        model.zero_grad()
        logp, entropy = shortcuts.token_logprobs(model, batch["input_ids"], batch["attention_mask"], T, 0.9, True,
                                              chunk_tokens)
        (logp * batch["mask"] * torch.linspace(-1, 1, T)).sum().backward()
        out.append((logp.detach(), entropy, [p.grad.clone() for p in model.parameters()]))
    (lp0, ent0, grads0), (lp1, ent1, grads1) = out
    assert torch.allclose(lp0, lp1, atol=1e-6, rtol=0) and torch.allclose(ent0, ent1, atol=1e-6, rtol=0)
    for a, b in zip(grads0, grads1):
        assert (a - b).abs().max() <= 1e-6 * max(1.0, a.abs().max().item())
    with torch.no_grad():  # the no-grad path (old log-probs) too
        again, _ = shortcuts.token_logprobs(model, batch["input_ids"], batch["attention_mask"], T, 0.9, False, chunk)
    assert torch.allclose(again, lp0, atol=1e-6, rtol=0)
