"""CPU property tests of the certified LM head (w12.head): exactness of the argmax and of its bound."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import w12
from w12.head import KPAD, CertifiedHead, CertifiedLMHead, exact_dot, gamma, prepare_hidden

# (V, K): vocabularies off the 16-row tile, K off the 64-column chunk and off powers of two
SHAPES = [(1, 1), (17, 7), (300, 64), (1000, 100), (2049, 130), (3001, 257)]


def _weight(v, k, gen, scale=0.02):
    return (torch.randn(v, k, generator=gen) * scale).to(torch.bfloat16)


def fp32_error_bound(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per hidden row: max over v of |exact routine − h·w_v| in h's own scale (docs/certified_head.md §2)."""
    h64, w64 = h.double(), w.double()
    k_pad = -(-w.shape[1] // KPAD) * KPAD
    amax = h64.abs().amax(-1)
    e = torch.frexp(amax)[1].double()
    s = torch.pow(2.0, e)
    rel = gamma(k_pad) * h64.norm(dim=-1) * w64.norm(dim=-1).max()
    tiny = s * (2.0**-150 * w64.abs().sum(-1).max() + w.shape[1] * 2.0**-148 + 2.0**-100)
    return rel + tiny


def check_batch(head: CertifiedHead, w: torch.Tensor, h: torch.Tensor) -> int:
    """argmax == exact path over the full vocabulary (always) and == FP64 argmax when the gap is clear.

    Returns how many rows had a clear FP64 gap (so a test can insist the second claim was exercised).
    """
    ids, surv = head.argmax(h, return_survivors=True)
    exact = head.exact_scores(h)
    assert torch.equal(ids, exact.argmax(-1)), "certified argmax differs from the exact path's argmax"
    assert (surv >= 1).all() and (surv <= w.shape[0]).all()
    l64 = h.double() @ w.double().T
    if w.shape[0] == 1:
        assert (ids == 0).all()
        return h.shape[0]
    top2 = l64.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * fp32_error_bound(h, w)
    assert torch.equal(ids[clear], l64.argmax(-1)[clear]), "argmax differs from FP64 despite a clear gap"
    return int(clear.sum())


@pytest.mark.parametrize("v,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_states(v, k, dtype, rng):
    w = _weight(v, k, rng)
    head = CertifiedHead(w)
    h = torch.randn(160, k, generator=rng).to(dtype)
    clear = check_batch(head, w, h)
    assert clear > (0 if v <= 17 else 100)


def _adversarial(w: torch.Tensor, head: CertifiedHead, gen: torch.Generator) -> torch.Tensor:
    v, k = w.shape
    wf = w.float()
    rows = [torch.zeros(k), torch.full((k,), 1e-45), torch.randn(k, generator=gen) * 1e-40]
    err = wf - head.q[:v, :k].float() * head.scale[:, None]
    for _ in range(24):
        a, b = torch.randint(0, v, (2,), generator=gen).tolist()
        d = wf[a] - wf[b]
        g = wf[a] + wf[b]
        if d.norm() > 0:  # near-tie between a and b: remove the component along their difference
            rows.append(g - (g @ d) / (d @ d) * d + torch.randn(1, generator=gen).item() * 1e-7 * d)
        rows.append(err[b] / err[b].norm().clamp_min(1e-30) + 1e-3 * wf[b])  # Cauchy–Schwarz equality case
        onehot = torch.zeros(k)
        onehot[torch.randint(0, k, (1,), generator=gen)] = 1.0  # logits = one column: many exact ties
        rows.append(onehot)
        rows.append(torch.sign(torch.randn(k, generator=gen)))  # ±1: ties between rows of equal patterns
        big = torch.randn(k, generator=gen)
        rows.append(big * 1e30)
        rows.append(big / big.abs().max() * 3.0e38)  # near FP32 (and BF16) overflow
        rows.append(big * 2.0**-140)  # subnormal entries
    return torch.stack(rows)


@pytest.mark.parametrize("v,k", SHAPES)
def test_adversarial_states(v, k, rng):
    w = _weight(v, k, rng)
    if v >= 20:
        w[v // 2] = w[3]  # exact duplicate rows: ties resolve to the lower id
        w[v - 1] = w[3]
    head = CertifiedHead(w)
    h = _adversarial(w, head, rng)
    for hh in (h, h.to(torch.bfloat16)):
        check_batch(head, w, hh)
    if v >= 20:
        ids = head.argmax(w[3].float()[None] * 1e20)
        assert ids.item() == 3


def test_all_rows_equal_ties_lowest_index(rng):
    w = _weight(1, 96, rng).repeat(500, 1)
    head = CertifiedHead(w)
    h = torch.randn(8, 96, generator=rng)
    ids, surv = head.argmax(h, return_survivors=True)
    assert (ids == 0).all() and (surv == 500).all()  # every row survives and the full rescoring runs


@pytest.mark.parametrize("v,k", SHAPES[2:])
def test_bound_brackets_exact_scores(v, k, rng):
    w = _weight(v, k, rng)
    head = CertifiedHead(w)
    h = torch.cat([torch.randn(64, k, generator=rng), _adversarial(w, head, rng)])
    chat, b = head.bounds(h)
    s = head.exact_scores(h)
    assert ((s - chat).abs() <= b).all()
    # and the exact routine stays within its own FP32 error bound of the FP64 value (h' = 2^-e h scale)
    hp = prepare_hidden(h)[0]
    l64 = hp.double() @ w.double().T
    tol = gamma(head.k_pad) * hp.double().norm(dim=-1, keepdim=True) * w.double().norm(dim=-1) + 2.0**-100
    assert ((s.double() - l64).abs() <= tol).all()


@pytest.mark.parametrize("bits", [2, 4, 6])
def test_lower_tiers_still_exact(bits, rng):
    w = _weight(2000, 96, rng)
    head = CertifiedHead(w, bits=bits)
    check_batch(head, w, torch.randn(96, 96, generator=rng))


def test_survivors_shrink_with_bits(rng):
    w = _weight(4000, 256, rng)
    t = torch.randint(0, 4000, (32,), generator=rng)
    h = torch.randn(32, 256, generator=rng) * 0.02 + w[t].float() * 3
    counts = [CertifiedHead(w, bits=b).argmax(h, return_survivors=True)[1].float().mean().item() for b in (4, 6, 8)]
    assert counts[0] >= counts[1] >= counts[2] >= 1


def test_exact_dot_is_row_independent(rng):
    w = _weight(50, 77, rng)
    hp = prepare_hidden(torch.randn(3, 77, generator=rng))[0]
    full = exact_dot(hp, w)
    for r in (0, 17, 49):
        assert torch.equal(exact_dot(hp, w[r : r + 1])[:, 0].view(torch.int32), full[:, r].view(torch.int32))
    assert not torch.signbit(exact_dot(torch.zeros(1, 77), -w)).any()  # -0 canonicalised to +0


def test_leading_dims_and_empty(rng):
    w = _weight(300, 64, rng)
    head = CertifiedHead(w)
    h = torch.randn(2, 3, 64, generator=rng)
    ids, surv = head.argmax(h, return_survivors=True)
    assert ids.shape == (2, 3) and surv.shape == (2, 3)
    assert torch.equal(ids.reshape(-1), head.argmax(h.reshape(6, 64)))
    assert head.argmax(torch.randn(0, 64)).shape == (0,)


def test_w12_weight_input(rng):
    w = _weight(333, 130, rng)
    a = CertifiedHead(w12.pack(w))
    b = CertifiedHead(w)
    assert torch.equal(a.weight.view(torch.int16), w.view(torch.int16))
    h = torch.randn(20, 130, generator=rng)
    assert torch.equal(a.argmax(h), b.argmax(h))


def test_bias(rng):
    w = _weight(1000, 64, rng)
    bias = torch.randn(1000, generator=rng) * 0.05
    head = CertifiedHead(w, bias)
    h = torch.randn(100, 64, generator=rng)
    ids = head.argmax(h)
    assert torch.equal(ids, head.exact_scores(h).argmax(-1))
    l64 = h.double() @ w.double().T + bias.double()
    top2 = l64.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4
    assert clear.sum() > 80 and torch.equal(ids[clear], l64.argmax(-1)[clear])


def test_module_wrapper(rng):
    lin = nn.Linear(48, 500, bias=False).to(torch.bfloat16)
    mod = CertifiedLMHead(lin)
    h = torch.randn(4, 7, 48, generator=rng).to(torch.bfloat16)
    assert torch.equal(mod(h).view(torch.int16), lin(h).view(torch.int16))
    ids = mod.argmax(h)
    assert ids.shape == (4, 7)
    assert torch.equal(ids, mod.certified.exact_scores(h).argmax(-1).reshape(4, 7))
    assert w12.CertifiedHead is CertifiedHead


def test_errors(rng):
    w = _weight(10, 8, rng)
    with pytest.raises(ValueError, match="bfloat16"):
        CertifiedHead(w.float())
    with pytest.raises(ValueError, match="bits"):
        CertifiedHead(w, bits=9)
    bad = w.clone()
    bad[0, 0] = math.inf
    with pytest.raises(ValueError, match="non-finite"):
        CertifiedHead(bad)
    with pytest.raises(ValueError, match="bias"):
        CertifiedHead(w, torch.zeros(11))
    with pytest.raises(TypeError, match="weight"):
        CertifiedHead([[1.0]])
    head = CertifiedHead(w)
    with pytest.raises(ValueError, match=r"\[\.\.\., 8\]"):
        head.argmax(torch.randn(3, 9))
    with pytest.raises(ValueError, match="inf or NaN"):
        head.argmax(torch.full((1, 8), math.nan))
    with pytest.raises(TypeError, match="float32"):
        head.argmax(torch.ones(1, 8, dtype=torch.int32))
    with pytest.raises(TypeError, match="no .weight"):
        CertifiedLMHead(nn.ReLU())
