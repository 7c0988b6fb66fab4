"""Constants of the W12 v1 format and the registry of in-record layouts.

The format itself is fixed by ``shared/W12_FORMAT.md``; this module is the single place the
numbers live, so the codec, the container code and the kernels' Python bindings agree.

A *layout* is a fixed permutation of the 8192 element slots of one record. ``perm[i]`` is the
layout-0 index (``r * 64 + c``) of the element that the layout stores in hi byte ``i`` and in lo
nibble ``i`` (lo byte ``i // 2``, low nibble for even ``i``). Layout 0 is the identity and is the
only layout ever written to disk; kernels register their own layouts and the loader permutes
records into them on the device.

A layout may also be *split* (``Layout.split``): after its slot permutation the record's 12 bits an
element are regrouped inside each group of 8 slots (``split_record_bits``) so that a kernel decodes
them with fewer instructions. Like a permutation it moves bits without decoding them, so any layout
still converts to any other exactly (``w12/layouts.py`` says which kernel reads which).
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
    split: bool = False  # bits regrouped per 8 slots after the permutation (split_record_bits)


_LAYOUTS: dict[int, Layout] = {}
_LOCK = threading.Lock()


def register_layout(layout_id: int, name: str, perm: torch.Tensor, split: bool = False) -> Layout:
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
        if old is not None and (not torch.equal(old.perm, perm) or old.split != split):
            raise ValueError(f"layout id {layout_id} is already registered as {old.name!r}")
        layout = Layout(layout_id, name, perm, inv, bool(split))
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


def split_record_bits(records: torch.Tensor) -> torch.Tensor:
    """Planes in slot order -> the split form of a split layout (a new tensor, any device).

    For each slot ``i`` the split record's byte ``i`` is the element's BF16 low byte with the
    fixed offset of the kernels: ``c0 | m`` = ``(hi & 0x0F) << 4 | lo``. The other 4 bits of each
    element (``s`` and ``c3 c2 c1``, the high nibble of its hi byte) go to bytes ``[8192, 12288)``:
    one 32-bit word for the 8 slots ``8j .. 8j+7``, at bytes ``8192 + 4j ..``; with ``A_i`` = slot
    ``8j + i`` and ``B_i`` = slot ``8j + 4 + i`` (``i`` = 0..3), its byte ``i`` is
    ``s(A_i) << 7 | c(B_((i+1)%4)) << 4 | s(B_i) << 3 | c(A_i)``, where ``c`` = ``c3 c2 c1``.
    ``kernels_sm120/smxx_w12_decode.cuh`` (decode16_split) says why this arrangement.
    """
    hi, lo = _split_planes(records)
    low = ((hi & 0x0F) << 4) | lo
    nib = (hi >> 4).unflatten(-1, (-1, 2, 4))  # [..., group j, A/B, i]
    s, c = nib >> 3, nib & 0x07
    s_a, c_a, s_b, c_b = s[..., 0, :], c[..., 0, :], s[..., 1, :], c[..., 1, :]
    n = (s_a << 7) | (c_b.roll(-1, dims=-1) << 4) | (s_b << 3) | c_a
    return torch.cat((low, n.flatten(-2)), dim=-1)


def join_record_bits(records: torch.Tensor) -> torch.Tensor:
    """The inverse of ``split_record_bits``: split form -> hi and lo planes in slot order."""
    low = records[..., :HI_BYTES]
    n = records[..., HI_BYTES:].unflatten(-1, (-1, 4))  # [..., group j, byte i]
    s_a, c_a = n >> 7, n & 0x07
    s_b, c_b = (n >> 3) & 0x01, ((n >> 4) & 0x07).roll(1, dims=-1)
    nib = torch.stack(((s_a << 3) | c_a, (s_b << 3) | c_b), dim=-2).flatten(-3)
    return _join_planes((nib << 4) | (low >> 4), low & 0x0F)


def convert_layout(records: torch.Tensor, src: int, dst: int) -> torch.Tensor:
    """Moves every record from layout ``src`` to layout ``dst`` without decoding.

    Works on any device: contiguous CUDA records go through ``w12.cuda_codec``'s kernel when it is
    built (permutation and regrouping in one pass), others through torch (a gather, and elementwise
    integer ops for split layouts); returns a new tensor.
    """
    if records.dtype != torch.uint8 or records.shape[-1] != RECORD_BYTES:
        raise ValueError(f"records must be uint8 [..., {RECORD_BYTES}], got {records.dtype} {tuple(records.shape)}")
    s, d = get_layout(src), get_layout(dst)
    if src == dst:
        return records.clone()
    if records.is_cuda and records.is_contiguous():
        from . import cuda_codec  # the permutation kernel; imported late to keep format.py a leaf

        if cuda_codec.available():
            return cuda_codec.permute_records(records, s, d)
    if not (s.split or d.split):
        return _permute(records, s, d)
    # The regrouping's integer temporaries are a few times the records' size: a chunk at a time.
    flat = records.reshape(-1, RECORD_BYTES)
    out = torch.empty_like(flat)
    for i in range(0, flat.shape[0], _CHUNK_RECORDS):
        part = flat[i : i + _CHUNK_RECORDS]
        part = join_record_bits(part) if s.split else part
        if not torch.equal(s.perm, d.perm):
            part = _permute(part, s, d)
        out[i : i + _CHUNK_RECORDS] = split_record_bits(part) if d.split else part
    return out.view(records.shape)


_CHUNK_RECORDS = 4096  # 48 MB of records


def _permute(records: torch.Tensor, s: Layout, d: Layout) -> torch.Tensor:
    # slot in dst -> layout-0 element -> slot in src
    gather = s.inv[d.perm].to(records.device)
    hi, lo = _split_planes(records)
    return _join_planes(hi.index_select(-1, gather), lo.index_select(-1, gather))
