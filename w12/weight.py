"""``W12Weight``: the five tensors of one converted weight, plus its shape and record layout."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .format import RECORD_BYTES, TENSOR_SUFFIXES, TILE_K, TILE_N, ceil_div, convert_layout, get_layout

_DTYPES = {
    "w12_records": torch.uint8,
    "w12_base": torch.uint8,
    "w12_esc_ptr": torch.int32,
    "w12_esc_col": torch.int32,
    "w12_esc_val": torch.int16,
}


class W12FormatError(ValueError):
    """A W12 tensor set is inconsistent with itself or with its declared shape."""


@dataclass
class W12Weight:
    records: torch.Tensor  # uint8 [*batch, NT, KT, 12288]
    base: torch.Tensor  # uint8 [B*N]
    esc_ptr: torch.Tensor  # int32 [B*N + 1]
    esc_col: torch.Tensor  # int32 [nnz]
    esc_val: torch.Tensor  # int16 [nnz]
    shape: tuple  # the original [..., N, K]
    layout: int = 0

    def __post_init__(self):
        self.shape = tuple(int(s) for s in self.shape)
        self.validate()

    # -- shape --------------------------------------------------------------------------
    @property
    def N(self) -> int:  # noqa: N802 - the format's own name
        return self.shape[-2]

    @property
    def K(self) -> int:  # noqa: N802
        return self.shape[-1]

    @property
    def batch_shape(self) -> tuple:
        return self.shape[:-2]

    @property
    def num_matrices(self) -> int:
        n = 1
        for s in self.batch_shape:
            n *= s
        return n

    @property
    def numel(self) -> int:
        return self.num_matrices * self.N * self.K

    @property
    def nnz(self) -> int:
        return int(self.esc_col.numel())

    @property
    def device(self) -> torch.device:
        return self.records.device

    # -- size ---------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def bits_per_weight(self) -> float:
        return self.nbytes * 8 / self.numel

    @property
    def escape_rate(self) -> float:
        return self.nnz / self.numel

    def tensors(self) -> tuple:
        return (self.records, self.base, self.esc_ptr, self.esc_col, self.esc_val)

    def validate(self, name: str = "W12 weight") -> None:
        """Checks dtypes and shapes against each other; raises W12FormatError naming ``name``."""
        if len(self.shape) < 2:
            raise W12FormatError(f"{name}: shape {self.shape} must have rank >= 2")
        n, k, b = self.N, self.K, self.num_matrices
        want = {
            "w12_records": (*self.batch_shape, ceil_div(n, TILE_N), ceil_div(k, TILE_K), RECORD_BYTES),
            "w12_base": (b * n,),
            "w12_esc_ptr": (b * n + 1,),
        }
        for suffix, t in zip(TENSOR_SUFFIXES, self.tensors()):
            if t.dtype != _DTYPES[suffix]:
                raise W12FormatError(f"{name}: {suffix} has dtype {t.dtype}, expected {_DTYPES[suffix]}")
            if t.dim() != (len(want[suffix]) if suffix in want else 1):
                raise W12FormatError(f"{name}: {suffix} has shape {tuple(t.shape)}")
            if suffix in want and tuple(t.shape) != want[suffix]:
                raise W12FormatError(
                    f"{name}: {suffix} has shape {tuple(t.shape)}, but shape {list(self.shape)} needs {want[suffix]}"
                )
        if self.esc_col.numel() != self.esc_val.numel():
            raise W12FormatError(
                f"{name}: w12_esc_col has {self.esc_col.numel()} entries but w12_esc_val has {self.esc_val.numel()}"
            )
        get_layout(self.layout)

    def check_escapes(self, name: str = "W12 weight") -> None:
        """Deeper checks of the escape list (host sync; used by loaders and `w12 verify`)."""
        ptr = self.esc_ptr.cpu()
        if int(ptr[0]) != 0 or int(ptr[-1]) != self.nnz or bool((ptr[1:] < ptr[:-1]).any()):
            raise W12FormatError(f"{name}: w12_esc_ptr is not a non-decreasing [0 .. {self.nnz}] offset array")
        col = self.esc_col.cpu()
        if self.nnz and (int(col.min()) < 0 or int(col.max()) >= self.K):
            raise W12FormatError(f"{name}: w12_esc_col holds columns outside [0, {self.K})")
        base = self.base.cpu()
        if base.numel() and (int(base.min()) < 1 or int(base.max()) > 239):
            raise W12FormatError(f"{name}: w12_base holds values outside [1, 239]")

    # -- movement -----------------------------------------------------------------------
    def to(self, device=None, non_blocking: bool = False) -> W12Weight:
        if device is None:
            return self
        return replace(self, **{f: t.to(device, non_blocking=non_blocking) for f, t in self._fields()})

    def cuda(self, device=None) -> W12Weight:
        return self.to(device if device is not None else "cuda")

    def cpu(self) -> W12Weight:
        return self.to("cpu")

    def with_layout(self, layout: int) -> W12Weight:
        """The same weight with records permuted into ``layout`` (on the records' device)."""
        if layout == self.layout:
            return self
        return replace(self, records=convert_layout(self.records, self.layout, layout), layout=layout)

    def _fields(self):
        return zip(("records", "base", "esc_ptr", "esc_col", "esc_val"), self.tensors())

    # -- container ----------------------------------------------------------------------
    def state_dict(self, stem: str) -> dict:
        """The five container tensors (format §6), always in layout 0, keyed ``STEM.w12_*``."""
        w = self.with_layout(0)
        return {f"{stem}.{suffix}": t for suffix, t in zip(TENSOR_SUFFIXES, w.tensors())}

    @classmethod
    def from_state_dict(cls, tensors: dict, stem: str, shape, layout: int = 0) -> W12Weight:
        missing = [f"{stem}.{s}" for s in TENSOR_SUFFIXES if f"{stem}.{s}" not in tensors]
        if missing:
            raise W12FormatError(f"{stem}: missing tensors {missing}")
        return cls(*(tensors[f"{stem}.{s}"] for s in TENSOR_SUFFIXES), shape=tuple(shape), layout=layout)

    def __repr__(self) -> str:
        return (
            f"W12Weight(shape={list(self.shape)}, layout={self.layout}, nnz={self.nnz}, "
            f"bits/weight={self.bits_per_weight:.3f}, device={self.device})"
        )
