"""Certified LM head: the exact argmax over the vocabulary from a cheap INT8 screening pass.

``CertifiedHead(weight)`` keeps a per-row-scaled INT8 copy ``q_v`` of the head (``ŵ_v = a_v q_v``)
next to the exact BF16 weights. ``head.argmax(h)`` scores every token with the INT8 copy, brackets
each *exact* score inside ``[ĉ_v − B_v, ĉ_v + B_v]``, drops every token whose upper end is below the
best lower end, and rescores the few survivors with the exact weights. The returned ids are exactly
the argmax (lowest index on ties, like ``torch.argmax``) of the head's own exact routine over the
whole vocabulary; docs/certified_head.md derives the bound. In short, for a hidden row ``h``:

* ``h' = 2^-e h`` with ``max|h'| ∈ [1/2, 1)`` (a power of two, so argmax and rounding are unchanged
  barring underflow; it keeps every FP32 value far from overflow, whatever the norm of ``h``).
* The exact routine: ``s_v = fl32(Σ_k h'_k w_vk)`` in a fixed order (here: FP32 products added in
  k order; the GPU kernel: per-lane FMA chains + a fixed shuffle tree). Any order obeys ``|s_v − h'·w_v| ≤ γ_K Σ|h'_k w_vk| ≤ γ_K ‖h'‖ ‖w_v‖ (+ δ for underflow)``,
  ``γ_K = K u / (1 − K u)``, ``u = 2^-24``.
* The cheap pass quantises ``h'`` to 16-bit integers ``p = rint(2^15 h')`` split into two INT8 digits,
  so ``J_v = Σ p_k q_vk`` is an exact integer (tensor cores on the GPU, FP64 here) and
  ``ĉ_v = fl(fl(a_v fl(J_v)) 2^-15)``. With ``ĥ = 2^-15 p`` and ``r_h = ‖h' − ĥ‖₂``:
  ``|h'·w_v − ĥ·ŵ_v| ≤ ‖h'‖ r_v + r_h ‖ŵ_v‖`` and ``|ĉ_v − ĥ·ŵ_v| ≤ 3u|ĉ_v| + 2^-149``.
* ``B_v = ‖h'‖ (r_v + γ_K ‖w_v‖) + r_h ‖ŵ_v‖ + 4u |ĉ_v| + 2^-100``, every stored norm rounded up and
  every operation of B rounded up. Survivors: ``ĉ_v + B_v ≥ max_u (ĉ_u − B_u)``.

Tiers: ``bits`` (8 by default, 2..8) sets the integer range of ``q`` (``|q| ≤ 2^(bits−1) − 1``). The
GPU kernels implement ``bits=8`` only; fewer bits exist here to measure survivor counts.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

U32 = 2.0**-24  # unit roundoff of FP32 (round to nearest)
DELTA = 2.0**-100  # absolute slack: covers every underflow term of both passes (docs/certified_head.md §4)
HSCALE_BITS = 15  # p = rint(2^15 h'), |h'| < 1
P_CLAMP = 32639  # keeps both INT8 digits of p inside [-128, 127] (p = 256 p_hi + p_lo)
MAX_ABS_WEIGHT = 2.0**64  # beyond this the exact routine could overflow FP32 for large K
KPAD = 64  # the GPU kernels' K granularity; the exact routine's γ uses the padded K


def _f32_up(x: torch.Tensor) -> torch.Tensor:
    """Rounds float64 values up to float32 (the smallest float32 ≥ x)."""
    y = x.to(torch.float32)
    return torch.where(y.double() < x, torch.nextafter(y, torch.full_like(y, math.inf)), y)


def _f32_down(x: torch.Tensor) -> torch.Tensor:
    y = x.to(torch.float32)
    return torch.where(y.double() > x, torch.nextafter(y, torch.full_like(y, -math.inf)), y)


def _norm_up(x64: torch.Tensor) -> torch.Tensor:
    """‖x‖₂ of each row of a float64 matrix, rounded up to float32.

    The squares' sum in FP64 has relative error ≤ (K+1)·2^-53 (any order) and sqrt adds 2^-53; the
    factor below covers both with room to spare before the final upward rounding.
    """
    k = x64.shape[-1]
    ss = (x64 * x64).sum(-1)
    return _f32_up(torch.sqrt(ss * (1.0 + (k + 4) * 2.0**-52)) * (1.0 + 2.0**-50))


def gamma(k: int) -> float:
    """γ_k = k u / (1 − k u) for FP32, rounded up (a float64 with a relative margin)."""
    ku = k * U32
    if ku >= 0.5:
        raise ValueError(f"certified head: K={k} is too large for the FP32 error analysis (needs K·2^-24 < 1/2)")
    return ku / (1.0 - ku) * (1.0 + 1e-12)


def prepare_hidden(h: torch.Tensor, k_pad: int | None = None):
    """The per-row preprocessing shared by both passes (and mirrored by the GPU prep kernel).

    Returns ``hp`` (float32 ``h' = 2^-e h``), ``p`` (float64 integers, |p| ≤ P_CLAMP), ``hn`` = ‖h'‖₂
    and ``rh`` = ‖h' − 2^-15 p‖₂ (both float32, rounded up) and the exponents ``e``.
    """
    h64 = h.to(torch.float64)
    if not torch.isfinite(h64).all():
        raise ValueError("certified head: the hidden states contain inf or NaN")
    amax = h64.abs().amax(-1)
    _, e = torch.frexp(amax)  # amax = f 2^e, f ∈ [1/2, 1); frexp(0) gives e = 0
    e = torch.where(amax > 0, e, torch.zeros_like(e))
    # h·2^-e in FP64 is exact (no FP64 underflow for finite FP32 inputs); one rounding to FP32.
    hp = (h64 * torch.pow(2.0, -e.to(torch.float64)).unsqueeze(-1)).to(torch.float32)
    if k_pad is not None and k_pad > hp.shape[-1]:
        hp = torch.nn.functional.pad(hp, (0, k_pad - hp.shape[-1]))
    p = torch.round(hp.double() * 2.0**HSCALE_BITS).clamp_(-P_CLAMP, P_CLAMP)
    hp64 = hp.double()
    hn = _norm_up(hp64)
    rh = _norm_up(hp64 - p * 2.0**-HSCALE_BITS)  # exact differences in FP64
    return hp, p, hn, rh, e


def exact_dot(hp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The CPU exact routine: ``fl32(Σ_k hp_k w_vk)`` for hp ``[M, K]`` fp32, w ``[n, K]``.

    Recursive summation in k order, each product rounded to FP32 and then added (two roundings,
    no FMA). Every step is one elementwise IEEE operation over the ``[M, n]`` accumulator, so the
    score of a row never depends on which other rows are scored with it. -0 is returned as +0.
    """
    m, k = hp.shape
    out = torch.empty(m, w.shape[0], dtype=torch.float32, device=hp.device)
    step = max(1, (1 << 22) // max(1, m))
    ht = hp.T.contiguous()
    for r0 in range(0, w.shape[0], step):
        wt = w[r0 : r0 + step].to(torch.float32).T.contiguous()  # [K, n]: one contiguous row per step
        acc = torch.zeros(m, wt.shape[1], dtype=torch.float32, device=hp.device)
        prod = torch.empty_like(acc)
        for kk in range(k):
            torch.mul(ht[kk][:, None], wt[kk][None, :], out=prod)
            acc.add_(prod)
        out[:, r0 : r0 + step] = acc + 0.0
    return out


def _quantise_rows(w: torch.Tensor, qmax: int, chunk_rows: int):
    """Per-row INT quantisation and the row constants of the bound, chunked to bound FP64 memory."""
    v, k = w.shape
    k_pad = -(-k // KPAD) * KPAD
    g = gamma(k_pad)
    # Stored padded to the GPU kernels' tiles ([V/16] x [K/64], zeros), so one copy serves both paths.
    q = torch.zeros(-(-v // 16) * 16, k_pad, dtype=torch.int8, device=w.device)
    scale = torch.empty(v, dtype=torch.float32, device=w.device)
    rho = torch.empty(v, dtype=torch.float32, device=w.device)
    qnorm = torch.empty(v, dtype=torch.float32, device=w.device)
    for r0 in range(0, v, chunk_rows):
        w64 = w[r0 : r0 + chunk_rows].to(torch.float64)
        amax = w64.abs().amax(-1)
        a = (amax / qmax).to(torch.float32)  # any FP32 value is a valid scale: r_v is measured below
        a64 = a.double()
        qq = torch.round(w64 / torch.where(a64 > 0, a64, 1.0).unsqueeze(-1)).clamp_(-qmax, qmax)
        what = qq * a64.unsqueeze(-1)  # exact: 8-bit integer times a 24-bit significand
        r = _norm_up(w64 - what)
        wn = _norm_up(w64)
        rho[r0 : r0 + chunk_rows] = _f32_up((r.double() + g * wn.double()) * (1.0 + 2.0**-50))
        qnorm[r0 : r0 + chunk_rows] = _norm_up(what)
        scale[r0 : r0 + chunk_rows] = a
        q[r0 : r0 + qq.shape[0], :k] = qq.to(torch.int8)
    return q, scale, rho, qnorm


def _bias_columns(bias: torch.Tensor, v: int) -> torch.Tensor:
    """An FP32 bias as three BF16 columns whose exact sum is the bias (8 + 8 + 8 significand bits)."""
    if tuple(bias.shape) != (v,):
        raise ValueError(f"CertifiedHead: bias has shape {tuple(bias.shape)}, expected ({v},)")
    b = bias.detach().to(torch.float32)
    if not torch.isfinite(b).all():
        raise ValueError("CertifiedHead: bias contains inf or NaN")
    cols = []
    for _ in range(3):
        hi = b.to(torch.bfloat16)
        cols.append(hi)
        b = b - hi.to(torch.float32)  # exact (Sterbenz-like: the residual has ≤ 16 significant bits)
    if (b != 0).any():
        raise ValueError("CertifiedHead: bias is not representable as three bfloat16 parts")
    return torch.stack(cols, dim=1)


class CertifiedHead:
    """Exact greedy LM head: INT8 screening with certified bounds + exact rescoring of survivors.

    ``weight``: BF16 ``[V, K]`` (an ``nn.Linear`` weight) or a ``W12Weight`` (decoded losslessly once);
    ``bias``: optional ``[V]`` (folded into three exact BF16 columns hit by a constant hidden entry).
    The head lives on ``weight``'s device (or ``device``); on a CUDA device with the compiled
    kernels ``argmax`` runs the fused GPU path, elsewhere this module's reference path. Both
    return the argmax of their own exact routine over the full vocabulary (see the module doc).
    """

    def __init__(self, weight, bias=None, *, bits: int = 8, device=None, chunk_rows: int = 8192):
        from .weight import W12Weight

        if isinstance(weight, W12Weight):
            from .codec import unpack

            if len(weight.shape) != 2:
                raise ValueError(f"CertifiedHead: the W12 weight must be 2-D [V, K], got {list(weight.shape)}")
            weight = unpack(weight)
        if not isinstance(weight, torch.Tensor):
            raise TypeError(
                f"CertifiedHead: weight must be a bfloat16 tensor or W12Weight, got {type(weight).__name__}"
            )
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise ValueError(
                f"CertifiedHead: weight must be a 2-D bfloat16 tensor [V, K], got {weight.dtype} {list(weight.shape)}"
            )
        if not 2 <= bits <= 8:
            raise ValueError(f"CertifiedHead: bits must be in 2..8, got {bits}")
        if weight.shape[0] < 1 or weight.shape[1] < 1:
            raise ValueError(f"CertifiedHead: empty weight {list(weight.shape)}")
        weight = weight.detach()
        if device is not None:
            weight = weight.to(device)
        amax = weight.abs().amax().float().item()
        if not math.isfinite(amax) or amax > MAX_ABS_WEIGHT:
            raise ValueError(
                f"CertifiedHead: weight has non-finite or huge entries (max |w| = {amax}); the FP32 exact "
                f"routine is only analysed for |w| ≤ 2^64"
            )
        self.vocab_size, self.hidden_size = int(weight.shape[0]), int(weight.shape[1])
        self.has_bias = bias is not None
        if bias is not None:
            weight = torch.cat([weight, _bias_columns(bias.to(weight.device), self.vocab_size)], dim=1)
        self.bits = bits
        self.weight = weight.contiguous()  # the exact weights (the caller's tensor when no bias)
        self.q, self.scale, self.rho, self.qnorm = _quantise_rows(self.weight, (1 << (bits - 1)) - 1, chunk_rows)
        self.k_pad = -(-self.weight.shape[1] // KPAD) * KPAD
        self._cuda = None  # per-device GPU state, built on first GPU call (w12.head_cuda)

    # -- properties --------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def nbytes_screen(self) -> int:
        """Bytes the screening pass streams (padded INT8 codes + 16 bytes of row constants a row)."""
        return self.q.numel() + 16 * self.q.shape[0]

    def to(self, device) -> CertifiedHead:
        new = object.__new__(CertifiedHead)
        new.__dict__.update(self.__dict__)
        for name in ("weight", "q", "scale", "rho", "qnorm"):
            setattr(new, name, getattr(self, name).to(device))
        new._cuda = None
        return new

    def _hidden(self, h: torch.Tensor) -> torch.Tensor:
        if not isinstance(h, torch.Tensor) or h.shape[-1] != self.hidden_size:
            shape = tuple(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__
            raise ValueError(f"CertifiedHead: hidden states must be [..., {self.hidden_size}], got {shape}")
        if h.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"CertifiedHead: hidden states must be float32/bfloat16/float16, got {h.dtype}")
        if h.device != self.device:
            raise ValueError(f"CertifiedHead: hidden states on {h.device}, head on {self.device}")
        h = h.reshape(-1, self.hidden_size)
        if self.has_bias:
            h = torch.cat([h.float(), h.new_ones(h.shape[0], 3, dtype=torch.float32)], dim=1)
        return h

    def _use_cuda(self) -> bool:
        if self.device.type != "cuda" or self.bits != 8 or os.environ.get("W12_HEAD_REFERENCE", "0") == "1":
            return False
        from . import head_cuda

        return head_cuda.available()

    # -- reference path ----------------------------------------------------------------------------
    def bounds(self, h: torch.Tensor):
        """Reference screening: cheap scores ``ĉ [M, V]`` and half-widths ``B [M, V]`` (float32).

        Each exact score ``s_v`` of ``exact_scores`` lies in ``[ĉ_v − B_v, ĉ_v + B_v]``.
        """
        return self._bounds(self._hidden(h))

    def _bounds(self, h: torch.Tensor):
        hp, p, hn, rh, _ = prepare_hidden(h, self.k_pad)
        chat = torch.empty(h.shape[0], self.vocab_size, dtype=torch.float32, device=h.device)
        step = max(1, (1 << 24) // max(1, self.weight.shape[1]))
        for r0 in range(0, self.vocab_size, step):
            # integers below 2^53 at every step: exact in FP64 whatever order the BLAS sums in
            j = p @ self.q[r0 : min(r0 + step, self.vocab_size)].to(torch.float64).T
            chat[:, r0 : r0 + step] = (j.to(torch.float32) * self.scale[r0 : r0 + step]) * 2.0**-HSCALE_BITS
        c64 = chat.double()
        b64 = (
            hn.double()[:, None] * self.rho.double()[None]
            + rh.double()[:, None] * self.qnorm.double()[None]
            + 4 * U32 * c64.abs()
            + DELTA
        )
        return chat, _f32_up(b64 * (1.0 + 2.0**-50))

    def _reference_argmax(self, h: torch.Tensor):
        chat, b = self._bounds(h)
        upper = _f32_up(chat.double() + b.double())
        lower = _f32_down(chat.double() - b.double())
        lmax = lower.amax(-1, keepdim=True)
        keep = upper >= lmax
        hp = prepare_hidden(h, self.weight.shape[1])[0]
        ids = torch.empty(h.shape[0], dtype=torch.int64, device=h.device)
        for m in range(h.shape[0]):
            cand = keep[m].nonzero().squeeze(1)  # ascending, so argmax's first-max rule = lowest id
            s = exact_dot(hp[m : m + 1], self.weight[cand])[0]
            ids[m] = cand[torch.argmax(s)]
        return ids, keep.sum(-1)

    def exact_scores(self, h: torch.Tensor) -> torch.Tensor:
        """The head's exact routine over the full vocabulary, ``[M, V]`` float32, scaled by 2^-e.

        ``argmax`` equals ``exact_scores(h).argmax(-1)`` bit for bit on the same device path.
        """
        hx = self._hidden(h)
        if self._use_cuda():
            from . import head_cuda

            return head_cuda.exact_scores(self, hx)
        hp = prepare_hidden(hx, self.weight.shape[1])[0]
        return exact_dot(hp, self.weight)

    def argmax(self, h: torch.Tensor, return_survivors: bool = False):
        """Exact argmax token ids ``[...]`` for hidden states ``[..., K]``; optionally survivor counts.

        On CUDA the call is graph-capturable: no host sync, fixed-size buffers, and a survivor set of
        any size (up to the whole vocabulary) is rescored on the device.
        """
        lead = h.shape[:-1]
        hx = self._hidden(h)
        if hx.shape[0] == 0:
            ids = torch.empty(0, dtype=torch.int64, device=h.device)
            cnt = torch.empty(0, dtype=torch.int64, device=h.device)
        elif self._use_cuda():
            from . import head_cuda

            ids, cnt = head_cuda.argmax(self, hx)
        else:
            ids, cnt = self._reference_argmax(hx)
        ids = ids.reshape(lead)
        return (ids, cnt.reshape(lead)) if return_survivors else ids


class CertifiedLMHead(nn.Module):
    """Wraps a model's ``lm_head``: ``forward`` gives the ordinary logits (for sampling) through the
    original module; ``argmax(h)`` gives the certified exact greedy token ids without full logits."""

    def __init__(self, lm_head: nn.Module, **kwargs):
        super().__init__()
        weight = getattr(lm_head, "weight", None)
        if weight is None:
            raise TypeError(f"CertifiedLMHead: {type(lm_head).__name__} has no .weight")
        from .weight import W12Weight

        if not isinstance(weight, (torch.Tensor, W12Weight)):
            raise TypeError(f"CertifiedLMHead: lm_head.weight is a {type(weight).__name__}")
        self.lm_head = lm_head
        bias = getattr(lm_head, "bias", None)
        self.certified = CertifiedHead(weight.detach() if isinstance(weight, torch.Tensor) else weight, bias, **kwargs)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def argmax(self, hidden_states: torch.Tensor, return_survivors: bool = False):
        return self.certified.argmax(hidden_states, return_survivors=return_survivors)
