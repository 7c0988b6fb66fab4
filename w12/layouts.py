"""Record layouts of the W12 GPU kernels, registered with ``w12.format`` at import.

Layout 1, ``mma_sync_m16n8k16``: the order in which the portable GEMM kernel
(``kernels_sm120/gemm_w12_mma_sm120.cu``) consumes a record. It is defined by the formulas below
and, identically, in ``kernels_sm120/smxx_w12_decode.cuh``; ``tests/test_gemm_cpu.py`` checks the
two against each other by emulating the kernel's bit operations.

Slot ``i = 2048*w + 512*q + 16*lane + e`` (warp w, lane = 4g + t, vector q, byte e of a
16-byte hi vector) holds the element that the thread decodes into A-fragment register
``R = 8q + 2*(e // 4) + (e & 1)``, half ``h = (e >> 1) & 1``; register ``R = 16*mt + 4*ks + r``
is operand ``a_r`` of ``mma.m16n8k16`` for m-tile mt and k-step ks, i.e. element
``row = 32w + 16mt + g + 8*(r & 1)``, ``col = 16t + 4ks + 2*(r >> 1) + h`` of the 128x64 tile.
"""

from __future__ import annotations

import torch

from .format import TILE_ELEMS, TILE_K, register_layout

MMA_SYNC_LAYOUT = 1
MMA_SYNC_NAME = "mma_sync_m16n8k16 (4 warps x 32 rows, A fragments contiguous per thread)"


def mma_sync_perm() -> torch.Tensor:
    """``perm[slot]`` = layout-0 index ``row * 64 + col`` of layout 1 (int64 [8192])."""
    i = torch.arange(TILE_ELEMS)
    w, rem = i // 2048, i % 2048
    q, rem = rem // 512, rem % 512
    lane, e = rem // 16, rem % 16
    g, t = lane // 4, lane % 4
    reg = 8 * q + 2 * (e // 4) + (e & 1)
    h = (e >> 1) & 1
    mt, ks, r = reg // 16, (reg % 16) // 4, reg % 4
    row = 32 * w + 16 * mt + g + 8 * (r & 1)
    col = 16 * t + 4 * ks + 2 * (r >> 1) + h
    return row * TILE_K + col


register_layout(MMA_SYNC_LAYOUT, MMA_SYNC_NAME, mma_sync_perm())
