"""Constants of the W12 v1 format and the registry of in-record layouts.

The format itself is fixed by ``shared/W12_FORMAT.md``; this module is the single place the
numbers live, so the codec, the container code and the kernels' Python bindings agree.

A *layout* is a fixed permutation of the 8192 element slots of one record. ``perm[i]`` is the
layout-0 index (``r * 64 + c``) of the element that the layout stores in hi byte ``i`` and in lo
nibble ``i`` (lo byte ``i // 2``, low nibble for even ``i``). Layout 0 is the identity and is the
only layout ever written to disk; kernels register their own layouts and the loader permutes
records into them on the device.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

FORMAT_VERSION = 1
TILE_N = 128
TILE_K = 64
TILE_ELEMS = TILE_N * TILE_K  # 8192
HI_BYTES = TILE_ELEMS  # 8192
LO_BYTES = TILE_ELEMS // 2  # 4096
RECORD_BYTES = HI_BYTES + LO_BYTES  # 12288
BASE_MIN = 1
BASE_MAX = 239
WINDOW = 16

TENSOR_SUFFIXES = ("w12_records", "w12_base", "w12_esc_ptr", "w12_esc_col", "w12_esc_val")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Layout:
    id: int
    name: str
    perm: torch.Tensor  # int64 [8192]: slot -> layout-0 element index
    inv: torch.Tensor  # int64 [8192]: layout-0 element index -> slot


_LAYOUTS: dict[int, Layout] = {}
_LOCK = threading.Lock()


def register_layout(layout_id: int, name: str, perm: torch.Tensor) -> Layout:
    """Registers a record layout. ``perm`` must be a permutation of ``range(8192)``."""
    perm = torch.as_tensor(perm, dtype=torch.int64).flatten().cpu()
    if perm.numel() != TILE_ELEMS:
        raise ValueError(f"layout {layout_id} ({name}): perm has {perm.numel()} entries, expected {TILE_ELEMS}")
    if not torch.equal(torch.sort(perm).values, torch.arange(TILE_ELEMS)):
        raise ValueError(f"layout {layout_id} ({name}): perm is not a permutation of 0..{TILE_ELEMS - 1}")
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(TILE_ELEMS)
    with _LOCK:
        old = _LAYOUTS.get(layout_id)
        if old is not None and not torch.equal(old.perm, perm):
            raise ValueError(f"layout id {layout_id} is already registered as {old.name!r}")
        layout = Layout(layout_id, name, perm, inv)
        _LAYOUTS[layout_id] = layout
    return layout


def get_layout(layout_id: int) -> Layout:
    try:
        return _LAYOUTS[int(layout_id)]
    except KeyError:
        known = ", ".join(f"{k} ({v.name})" for k, v in sorted(_LAYOUTS.items()))
        raise ValueError(f"unknown W12 record layout {layout_id}; registered layouts: {known}") from None


def registered_layouts() -> dict[int, str]:
    return {k: v.name for k, v in sorted(_LAYOUTS.items())}


register_layout(0, "reference (row-major r*64+c)", torch.arange(TILE_ELEMS))


def _split_planes(records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """records [..., 12288] uint8 -> (hi [..., 8192] uint8, lo nibbles [..., 8192] uint8)."""
    hi = records[..., :HI_BYTES]
    lo_bytes = records[..., HI_BYTES:]
    lo = torch.stack((lo_bytes & 0x0F, lo_bytes >> 4), dim=-1).flatten(-2)
    return hi, lo


def _join_planes(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    lo_bytes = lo[..., 0::2] | (lo[..., 1::2] << 4)
    return torch.cat((hi, lo_bytes), dim=-1)


def convert_layout(records: torch.Tensor, src: int, dst: int) -> torch.Tensor:
    """Permutes every record from layout ``src`` to layout ``dst`` without decoding.

    Works on any device (the permutation is a gather); returns a new tensor.
    """
    if records.dtype != torch.uint8 or records.shape[-1] != RECORD_BYTES:
        raise ValueError(f"records must be uint8 [..., {RECORD_BYTES}], got {records.dtype} {tuple(records.shape)}")
    if src == dst:
        return records.clone()
    if records.is_cuda and records.is_contiguous():
        from . import cuda_codec  # the permutation kernel; imported late to keep format.py a leaf

        if cuda_codec.available():
            return cuda_codec.convert_layout(records, src, dst)
    s, d = get_layout(src), get_layout(dst)
    # slot in dst -> layout-0 element -> slot in src
    gather = s.inv[d.perm].to(records.device)
    hi, lo = _split_planes(records)
    return _join_planes(hi.index_select(-1, gather), lo.index_select(-1, gather))
