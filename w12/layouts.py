"""Record layouts of the W12 GPU kernels, registered with ``w12.format`` at import.

Layout 1, ``mma_sync_m16n8k16``: the order in which the portable GEMM kernel
(``kernels_sm120/gemm_w12_mma_sm120.cu``) consumed a record until session 14 (it reads layout 4
now, layout 1's registers split). It is defined by the formulas below
and, identically, in ``kernels_sm120/smxx_w12_decode.cuh``; ``tests/test_gemm_cpu.py`` checks the
two against each other by emulating the kernel's bit operations.

Slot ``i = 2048*w + 512*q + 16*lane + e`` (warp w, lane = 4g + t, vector q, byte e of a
16-byte hi vector) holds the element that the thread decodes into A-fragment register
``R = 8q + 2*(e // 4) + (e & 1)``, half ``h = (e >> 1) & 1``; register ``R = 16*mt + 4*ks + r``
is operand ``a_r`` of ``mma.m16n8k16`` for m-tile mt and k-step ks, i.e. element
``row = 32w + 16mt + g + 8*(r & 1)``, ``col = 16t + 4ks + 2*(r >> 1) + h`` of the 128x64 tile.
That column map keeps a thread's activation operand contiguous (columns 16t..16t+15 over the four
k-steps), which is what the mma.sync kernels load from shared memory.

Layout 2, ``wgmma_natural_k``: the same slots and the same decode, but MMA-k index kappa of k-step
ks is column ``16ks + kappa`` (``col = 16ks + 2t + 8*(r >> 1) + h``). The Hopper kernel
(``kernels_sm90/gemm_w12_wgmma_sm90.cu``) reads its activation operand from shared memory through
a wgmma descriptor whose 16-byte core-matrix rows are 8 consecutive k: with layout 1 those rows
gather four column pairs 16 apart (4-byte copies); with layout 2 each is 16 contiguous bytes of x.

Layouts 3 and 4, ``wgmma_split`` and ``mma_sync_split``: what v4 and v1-v3 read since session
14. Layout 2's (3) or layout 1's (4) registers and columns, but byte ``p`` of a thread's 16-byte
vector holds register ``R = 8q + p // 2``, half ``p % 2`` (the register order itself), and the
record is *split* (``w12.format.split_record_bits``): the 16-byte vector holds the elements' BF16
low bytes, the 8-byte vector their signs and top exponent bits in the arrangement
``decode16_split`` turns into 8 registers with 7 instructions (decode16: 17).
"""

from __future__ import annotations

import torch

from .format import TILE_ELEMS, TILE_K, register_layout

MMA_SYNC_LAYOUT = 1
MMA_SYNC_NAME = "mma_sync_m16n8k16 (4 warps x 32 rows, A fragments contiguous per thread)"
WGMMA_LAYOUT = 2
WGMMA_NAME = "wgmma_natural_k (layout 1's slots, MMA k in column order)"
WGMMA_SPLIT_LAYOUT = 3
MMA_SYNC_SPLIT_LAYOUT = 4
MMA_SYNC_SPLIT_NAME = "mma_sync_split (layout 1's registers in register order, bits split per 8 slots)"
WGMMA_SPLIT_NAME = "wgmma_split (layout 2's registers in register order, bits split per 8 slots)"


def _fragment_perm(natural_k: bool, register_order: bool = False) -> torch.Tensor:
    i = torch.arange(TILE_ELEMS)
    w, rem = i // 2048, i % 2048
    q, rem = rem // 512, rem % 512
    lane, e = rem // 16, rem % 16
    g, t = lane // 4, lane % 4
    if register_order:  # the split decode's order: byte e is register e // 2, half e % 2
        reg, h = 8 * q + e // 2, e & 1
    else:  # decode16's order: elements (0, 2) and (1, 3) of each hi word share a register
        reg, h = 8 * q + 2 * (e // 4) + (e & 1), (e >> 1) & 1
    mt, ks, r = reg // 16, (reg % 16) // 4, reg % 4
    row = 32 * w + 16 * mt + g + 8 * (r & 1)
    if natural_k:
        col = 16 * ks + 2 * t + 8 * (r >> 1) + h
    else:
        col = 16 * t + 4 * ks + 2 * (r >> 1) + h
    return row * TILE_K + col


def mma_sync_perm() -> torch.Tensor:
    """``perm[slot]`` = layout-0 index ``row * 64 + col`` of layout 1 (int64 [8192])."""
    return _fragment_perm(natural_k=False)


def wgmma_perm() -> torch.Tensor:
    """``perm[slot]`` = layout-0 index ``row * 64 + col`` of layout 2 (int64 [8192])."""
    return _fragment_perm(natural_k=True)


def mma_sync_split_perm() -> torch.Tensor:
    """``perm[slot]`` = layout-0 index ``row * 64 + col`` of layout 4 (int64 [8192])."""
    return _fragment_perm(natural_k=False, register_order=True)


def wgmma_split_perm() -> torch.Tensor:
    """``perm[slot]`` = layout-0 index ``row * 64 + col`` of layout 3 (int64 [8192])."""
    return _fragment_perm(natural_k=True, register_order=True)


register_layout(MMA_SYNC_LAYOUT, MMA_SYNC_NAME, mma_sync_perm())
register_layout(WGMMA_LAYOUT, WGMMA_NAME, wgmma_perm())
register_layout(WGMMA_SPLIT_LAYOUT, WGMMA_SPLIT_NAME, wgmma_split_perm(), split=True)
register_layout(MMA_SYNC_SPLIT_LAYOUT, MMA_SYNC_SPLIT_NAME, mma_sync_split_perm(), split=True)
