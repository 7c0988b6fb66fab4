"""Public codec API: ``pack``, ``unpack``, ``unpack_8bit`` and ``linear``."""

from __future__ import annotations

import torch

from . import cpu_encoder, ops
from .weight import W12Weight


def pack(weight: torch.Tensor, layout: int = 0) -> W12Weight:
    """Encodes a BF16 tensor ``[N, K]`` or ``[..., N, K]`` losslessly into a ``W12Weight``.

    The result lives on the weight's device. On a GPU with the compiled kernels the encoder runs
    there; otherwise the CPU encoder (``w12.cpu_encoder``, bit-identical to the reference) does.
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"w12.pack expects a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype != torch.bfloat16:
        raise TypeError(
            f"w12.pack expects a bfloat16 tensor, got {weight.dtype}; casting is lossy, so cast "
            "explicitly (weight.to(torch.bfloat16)) if that is what you want"
        )
    if weight.is_cuda:
        from . import cuda_codec

        if cuda_codec.available():
            return cuda_codec.pack(weight).with_layout(layout)
    # The fused C encoder is bit-identical to w12.reference.encode and falls back to it.
    parts = cpu_encoder.encode(weight.detach().cpu())
    w = W12Weight(**parts, shape=tuple(weight.shape), layout=0)
    return w.to(weight.device).with_layout(layout)


def _check(w) -> W12Weight:
    if not isinstance(w, W12Weight):
        raise TypeError(f"expected a W12Weight, got {type(w).__name__}")
    return w


def unpack(w: W12Weight) -> torch.Tensor:
    """Decodes to the exact BF16 tensor (bit for bit), on ``w``'s device."""
    w = _check(w)
    return torch.ops.w12.unpack(*w.tensors(), w.N, w.K, w.layout, False).view(w.shape)


def unpack_8bit(w: W12Weight) -> torch.Tensor:
    """The approximate 8-bit view (hi plane only; format §3), escapes still exact."""
    w = _check(w)
    return torch.ops.w12.unpack(*w.tensors(), w.N, w.K, w.layout, True).view(w.shape)


def linear(x: torch.Tensor, w: W12Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + bias`` with a W12 weight ``[N, K]``; ``x`` is ``[..., K]``."""
    w = _check(w)
    if len(w.shape) != 2:
        raise ValueError(f"w12.linear needs a 2-D weight [N, K], got shape {list(w.shape)}")
    if x.shape[-1] != w.K:
        raise ValueError(f"w12.linear: x has {x.shape[-1]} features (shape {tuple(x.shape)}), weight expects K={w.K}")
    if bias is not None and tuple(bias.shape) != (w.N,):
        raise ValueError(f"w12.linear: bias has shape {tuple(bias.shape)}, expected ({w.N},)")
    # Like F.linear, any strides: the op itself reads a contiguous x.
    return torch.ops.w12.linear(x.contiguous(), *w.tensors(), w.N, w.K, w.layout, bias)


__all__ = ["pack", "unpack", "unpack_8bit", "linear", "ops"]
