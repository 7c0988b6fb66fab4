"""``W12Linear``: an ``nn.Linear`` whose BF16 weight is held in the W12 format.

The five W12 tensors are *buffers* named exactly like the container's tensors (format §6), so
``module.state_dict()`` yields ``STEM.w12_records`` … and ``.to()``, ``device_map`` and
``load_state_dict`` work as for any module. Records on disk and in ``state_dict`` are always
layout 0; on a GPU the records may be kept in the kernels' preferred layout (``self.layout``),
chosen by ``_w12_prepare_for_device`` whenever the module moves.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .format import RECORD_BYTES, TENSOR_SUFFIXES, TILE_K, TILE_N, ceil_div, convert_layout
from .weight import _DTYPES, W12FormatError, W12Weight

__all__ = ["W12Linear"]


def _nonaliased_empty(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor with its own storage.

    Empty tensors normally share the storage pointer 0, and Transformers' ``save_pretrained``
    treats tensors with one storage pointer as tied weights and refuses to save them; a
    zero-length view of a private one-element allocation is distinct and still saves as ``[0]``.
    """
    if t.numel() or t.device.type == "meta":
        return t
    return torch.empty(1, dtype=t.dtype, device=t.device)[:0]


def _kernel_layout(device: torch.device, n: int, k: int) -> int:
    """The record layout the kernels want on ``device`` (0 where there are none)."""
    if device.type != "cuda":
        return 0
    from . import cuda_ops

    preferred = getattr(cuda_ops, "preferred_layout", None)
    if preferred is None:
        return 0
    if hasattr(cuda_ops, "available") and not cuda_ops.available():
        return 0
    # The kernel side owns this function's signature; pass only what it asks for.
    offered = {"device": device, "n": n, "k": k, "shape": (n, k)}
    params = inspect.signature(preferred).parameters
    return int(preferred(**{name: offered[name] for name in params if name in offered}))


def _convert_layout(records: torch.Tensor, src: int, dst: int) -> torch.Tensor:
    """Permutes records between layouts: the codec's GPU kernel on CUDA when it is built, else the
    torch gather of ``w12.format`` (same bytes either way)."""
    if records.is_cuda:
        from . import cuda_codec

        if hasattr(cuda_codec, "convert_layout") and cuda_codec.available():
            try:
                return cuda_codec.convert_layout(records, src, dst)
            except RuntimeError:
                pass  # a kernel library without the permutation kernel: the gather below is equivalent
    return convert_layout(records, src, dst)


class W12Linear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` ([out_features, in_features], BF16) stored losslessly in W12.

    Forward calls the ``w12::linear`` op: on the CPU it decodes and runs ``F.linear`` in x's
    dtype, so outputs are bit-identical to the ``nn.Linear`` it replaced; on a GPU with the
    compiled kernels it runs the fused W12 GEMM. The op has a fake implementation, so
    ``torch.compile`` traces through it.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        nnz: int = 0,
        device=None,
        dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"W12Linear needs positive features, got in={in_features}, out={out_features}")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.layout = 0
        n, k = self.out_features, self.in_features
        shapes = {
            "w12_records": (ceil_div(n, TILE_N), ceil_div(k, TILE_K), RECORD_BYTES),
            "w12_base": (n,),
            "w12_esc_ptr": (n + 1,),
            "w12_esc_col": (nnz,),
            "w12_esc_val": (nnz,),
        }
        for suffix in TENSOR_SUFFIXES:
            self.register_buffer(suffix, torch.zeros(shapes[suffix], dtype=_DTYPES[suffix], device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(n, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_weight(cls, weight: W12Weight, bias: torch.Tensor | None = None) -> W12Linear:
        """Wraps an existing ``W12Weight`` ``[N, K]`` (its tensors are used, not copied)."""
        if not isinstance(weight, W12Weight):
            raise TypeError(f"W12Linear.from_weight expects a W12Weight, got {type(weight).__name__}")
        if len(weight.shape) != 2:
            raise ValueError(f"W12Linear needs a 2-D weight [N, K], got shape {list(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (weight.N,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({weight.N},)")
        m = cls(weight.K, weight.N, bias=bias is not None, nnz=0, device="meta")
        m._set_tensors(weight.tensors(), weight.layout)
        if bias is not None:
            m.bias = nn.Parameter(bias.detach(), requires_grad=False)
        return m

    @classmethod
    def from_linear(cls, linear: nn.Linear, layout: int | None = None) -> W12Linear:
        """Packs ``linear.weight`` (BF16) losslessly; the result lives on the weight's device.

        ``layout=None`` picks the kernels' preferred record layout for that device.
        """
        from .codec import pack

        if not isinstance(linear, nn.Linear):
            raise TypeError(f"W12Linear.from_linear expects an nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        if w.dtype != torch.bfloat16:
            raise TypeError(f"W12Linear.from_linear: weight has dtype {w.dtype}; W12 stores bfloat16 weights only")
        packed = pack(w)
        m = cls.from_weight(packed, None if linear.bias is None else linear.bias.detach())
        if layout is None:
            m._w12_prepare_for_device()
        else:
            m._to_layout(layout)
        return m

    def _set_tensors(self, tensors, layout: int) -> None:
        for suffix, t in zip(TENSOR_SUFFIXES, tensors):
            self._buffers[suffix] = t
        self.layout = int(layout)

    # -- views ----------------------------------------------------------------------------
    def weight_w12(self) -> W12Weight:
        """The module's weight as a ``W12Weight`` (shares the buffers; no copy, no validation)."""
        w = object.__new__(W12Weight)
        w.records, w.base, w.esc_ptr = self.w12_records, self.w12_base, self.w12_esc_ptr
        w.esc_col, w.esc_val = self.w12_esc_col, self.w12_esc_val
        w.shape = (self.out_features, self.in_features)
        w.layout = self.layout
        return w

    def dequantized_weight(self) -> torch.Tensor:
        """The exact BF16 weight ``[out_features, in_features]`` (decoded; bit-identical)."""
        from .codec import unpack

        return unpack(self.weight_w12())

    def to_linear(self) -> nn.Linear:
        """An ``nn.Linear`` with the bit-identical BF16 weight (and the same bias), on this device."""
        w = self.dequantized_weight()
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight = nn.Parameter(w)
        if self.bias is not None:
            lin.bias = nn.Parameter(self.bias.detach().clone())
        return lin

    def validate(self, name: str = "W12Linear", deep: bool = False) -> None:
        """Checks the buffers against the declared shape; ``deep`` also checks the escape list."""
        for suffix in TENSOR_SUFFIXES:
            if getattr(self, suffix).device.type == "meta":
                raise W12FormatError(f"{name}: {suffix} was never loaded (still on the meta device)")
        w = W12Weight(*self.weight_w12().tensors(), shape=(self.out_features, self.in_features), layout=self.layout)
        w.validate(name)
        if deep:
            w.check_escapes(name)

    # -- forward --------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The op directly, not ``w12.linear``: that wrapper's Python checks would run on every
        # call of every layer in eager decoding; the shapes here are fixed by construction.
        # nn.Linear takes any strides (Transformers slices the last position of [B, T, K] hidden
        # states for the LM head); the op reads rows of a contiguous x, so copy when needed.
        return torch.ops.w12.linear(
            x.contiguous(),
            self.w12_records,
            self.w12_base,
            self.w12_esc_ptr,
            self.w12_esc_col,
            self.w12_esc_val,
            self.out_features,
            self.in_features,
            self.layout,
            self.bias,
        )

    # -- device layout --------------------------------------------------------------------
    def _to_layout(self, layout: int) -> None:
        if layout != self.layout and self.w12_records.device.type != "meta":
            self._buffers["w12_records"] = _convert_layout(self.w12_records, self.layout, layout)
            self.layout = int(layout)

    def _w12_prepare_for_device(self) -> None:
        """Permutes the records into the layout the kernels want where the records now live."""
        records = self.w12_records
        if records.device.type == "meta":
            return
        self._to_layout(_kernel_layout(records.device, self.out_features, self.in_features))

    def _apply(self, fn, recurse=True):
        before = self.w12_records.device
        out = super()._apply(fn, recurse)
        if self.w12_records.device != before:
            self._w12_prepare_for_device()
        return out

    # -- state dict (always layout 0) -----------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.layout != 0 and self.w12_records.device.type != "meta":
            records = _convert_layout(self.w12_records, self.layout, 0)
            destination[prefix + "w12_records"] = records if keep_vars else records.detach()
        for suffix in ("w12_esc_col", "w12_esc_val"):
            destination[prefix + suffix] = _nonaliased_empty(destination[prefix + suffix])

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors):
        # A checkpoint's escape count differs from whatever this module held, so the buffers are
        # replaced (on this module's device) rather than copied into; records arrive in layout 0.
        present = [s for s in TENSOR_SUFFIXES if prefix + s in state_dict]
        if present:
            device = self.w12_records.device
            if device.type == "meta":
                device = state_dict[prefix + present[0]].device
            for suffix in present:
                t = state_dict[prefix + suffix]
                if t.dtype != _DTYPES[suffix]:
                    errors.append(f"{prefix}{suffix}: dtype {t.dtype}, expected {_DTYPES[suffix]}")
                    return
                self._buffers[suffix] = torch.empty_like(t, device=device)
            self.layout = 0
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors)
        if present:
            self._w12_prepare_for_device()

    def extra_repr(self) -> str:
        nnz = self.w12_esc_col.numel()
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"escapes={nnz}, layout={self.layout}"
        )
