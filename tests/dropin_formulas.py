"""The formulas both drop-ins copy (integrations/ are one file each, so each carries its own copy): each equals the
project's, bit for bit, on the same random inputs. Used by tests/test_trl.py and tests/test_verl.py."""
import torch

import da3po
import daro

F64 = torch.float64


def check_copied_formulas(drop_in, settings, g: torch.Generator, G: int = 8, B: int = 12, T: int = 7):
    """daa (both scopes), adaptive_lam, bin_token_weights, bin_weights (every weighting), weight_objective and one
    update_weights step (plain and literal). settings(weight_lr, literal): the drop-in's DARO settings object.
    Returns the random advantages, correctness and token mask, for the checks of each drop-in's own formulas."""
    correct = torch.rand(6, G, generator=g) < 0.4
    adv = torch.randn(6, G, generator=g, dtype=F64)
    for lam, scope in ((2.0, "correct"), (3.0, "all")):
        ours = drop_in.daa(adv, correct, lam, 0.5, scope=scope)
        theirs = da3po.daa(adv, correct, lam, 0.5, scope=scope)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    p = torch.tensor([[0.0], [1 / G], [0.3], [0.5], [0.9], [1.0]], dtype=F64)
    assert torch.equal(drop_in.adaptive_lam(p, G, 4.0), da3po.adaptive_lam(p, G, 4.0))

    mask = (torch.arange(T) < torch.randint(0, T + 1, (B, 1), generator=g)).to(F64)
    bins = torch.randint(0, G + 1, (B,), generator=g)
    tokens = drop_in.tokens_per_bin(mask, bins, G)
    assert torch.equal(tokens, daro.tokens_per_bin(mask, bins, G))
    assert torch.equal(drop_in.bin_token_weights(mask, bins, tokens), daro.bin_token_weights(mask, bins, tokens))
    for weighting in ("learned", "uniform", "var"):
        s = [torch.tensor(0.1 * i) for i in range(G - 1)]
        assert torch.equal(drop_in.bin_weights(s, weighting), daro.bin_weights(s, weighting))
    bin_loss = torch.randn(G + 1, generator=g, dtype=F64)
    present = torch.rand(G + 1, generator=g) < 0.7
    for literal in (False, True):
        cfg = settings(0.05, literal)
        s_ours = [torch.tensor(0.1 * i, dtype=F64, requires_grad=True) for i in range(G - 1)]
        s_theirs = [s.detach().clone().requires_grad_() for s in s_ours]
        assert torch.equal(drop_in.weight_objective(s_ours, bin_loss, present, 1e-3, literal),
                           daro.weight_objective(s_theirs, bin_loss, present, 1e-3, literal))
        drop_in.update_weights(s_ours, torch.optim.Adam(s_ours, lr=0.05), bin_loss, present, cfg)
        daro.update_weights(s_theirs, torch.optim.Adam(s_theirs, lr=0.05), bin_loss, present, cfg)
        assert all(torch.equal(a, b) for a, b in zip(s_ours, s_theirs))
    return adv, correct, mask
