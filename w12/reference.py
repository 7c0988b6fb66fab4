"""The reference: W12 encode/decode on the CPU and an FP32 linear.

Simple and readable on purpose. Tests, the benchmarks' ``--refcheck`` and the CPU
fallback of every op all use this module, so a kernel is only ever compared with one definition.
All work is vectorised torch on int16 bit patterns (never values: BF16 values lose NaN payloads
and the sign of zero under arithmetic).

The encoder processes a matrix in slabs of whole row tiles, so its peak memory is a small
multiple of one slab plus the output, never a copy of the whole input per intermediate.
"""

from __future__ import annotations

import torch

from .format import (
    BASE_MAX,
    BASE_MIN,
    HI_BYTES,
    RECORD_BYTES,
    TILE_K,
    TILE_N,
    WINDOW,
    ceil_div,
    convert_layout,
)

# Elements per encoder slab: large enough to amortise per-op overhead, small enough that the
# int64 histogram index of one slab stays in the tens of MB.
_SLAB_ELEMS = 1 << 22


def choose_base(x16: torch.Tensor) -> torch.Tensor:
    """Per-row base b (uint8) maximising the in-window count; ties go to the larger b.

    ``x16``: int16 [R, K] bit patterns. Escape-only exponents (0 and 255) can never be inside a
    window [b, b+15] with 1 <= b <= 239, so they need no special case.
    """
    rows = x16.shape[0]
    e = ((x16 >> 7) & 0xFF).to(torch.int32)
    e += (torch.arange(rows, dtype=torch.int32) * 256).unsqueeze(1)
    hist = torch.bincount(e.flatten(), minlength=rows * 256).view(rows, 256)
    cs = torch.nn.functional.pad(hist.cumsum(1), (1, 0))  # cs[:, j] = #elements with e < j
    lo = torch.arange(BASE_MIN, BASE_MAX + 1)
    win = cs[:, lo + WINDOW] - cs[:, lo]  # [R, 239]: in-window count for b = 1..239
    # argmax returns the first maximum; searching the flipped row returns the largest b.
    best = torch.argmax(win.flip(1), dim=1)
    return (BASE_MAX - best).to(torch.uint8)


def encode_codes(x16: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12-bit codes (int16, 0 at escapes) and the in-window mask for int16 rows ``x16``."""
    t = (x16 & 0x7FFF) - (base.to(torch.int16) << 7).unsqueeze(1)  # (e-b)<<7 | m when in window
    inwin = (t >> 11) == 0  # 0 <= t < 2048, i.e. 0 <= e-b < 16
    code = (t | ((x16 >> 4) & 0x800)) * inwin
    return code, inwin


def _encode_matrix(x16: torch.Tensor, rec: torch.Tensor, base_out: torch.Tensor):
    """Encodes one [N, K] int16 matrix into ``rec`` ([NT, KT, 12288], zero-filled) and ``base_out``.

    Returns (rows, cols, vals) of the escapes, row-major.
    """
    n, k = x16.shape
    kt = rec.shape[1]
    kp = kt * TILE_K
    slab_rows = max(TILE_N, (_SLAB_ELEMS // max(k, 1)) // TILE_N * TILE_N)
    esc_r, esc_c, esc_v = [], [], []
    for r0 in range(0, n, slab_rows):
        r1 = min(n, r0 + slab_rows)
        x = x16[r0:r1]
        b = choose_base(x)
        base_out[r0:r1] = b
        code, inwin = encode_codes(x, b)
        esc = (~inwin).nonzero()
        if esc.numel():
            esc_r.append(esc[:, 0] + r0)
            esc_c.append(esc[:, 1])
            esc_v.append(x[esc[:, 0], esc[:, 1]])
        rows_p = ceil_div(r1 - r0, TILE_N) * TILE_N
        if rows_p != r1 - r0 or kp != k:
            code = torch.nn.functional.pad(code, (0, kp - k, 0, rows_p - (r1 - r0)))
        nt = rows_p // TILE_N
        hi = (code >> 4).to(torch.uint8)
        lo = (code[:, 0::2] & 0xF) | ((code[:, 1::2] & 0xF) << 4)
        out = rec[r0 // TILE_N : r0 // TILE_N + nt]
        out[..., :HI_BYTES].unflatten(-1, (TILE_N, TILE_K)).copy_(hi.view(nt, TILE_N, kt, TILE_K).transpose(1, 2))
        out[..., HI_BYTES:].unflatten(-1, (TILE_N, TILE_K // 2)).copy_(
            lo.to(torch.uint8).view(nt, TILE_N, kt, TILE_K // 2).transpose(1, 2)
        )
    if esc_r:
        return torch.cat(esc_r), torch.cat(esc_c), torch.cat(esc_v)
    empty = torch.empty(0, dtype=torch.int64)
    return empty, empty, torch.empty(0, dtype=torch.int16)


def check_encodable(weight: torch.Tensor) -> tuple:
    """Raises for tensors W12 cannot encode; returns the shape."""
    if weight.dtype != torch.bfloat16:
        raise TypeError(f"W12 encodes bfloat16 tensors only, got {weight.dtype}")
    if weight.dim() < 2:
        raise ValueError(f"W12 encodes tensors of rank >= 2 ([..., N, K]), got shape {tuple(weight.shape)}")
    shape = tuple(weight.shape)
    if shape[-2] == 0 or shape[-1] == 0:
        raise ValueError(f"cannot encode an empty tensor of shape {shape}")
    return shape


def encode(weight: torch.Tensor) -> dict:
    """Encodes a BF16 tensor [..., N, K] (CPU) into the five W12 tensors (layout 0)."""
    shape = check_encodable(weight)
    n, k = shape[-2], shape[-1]
    mats = weight.detach().cpu().contiguous().view(torch.int16).reshape(-1, n, k)
    nt, kt = ceil_div(n, TILE_N), ceil_div(k, TILE_K)
    records = torch.zeros((mats.shape[0], nt, kt, RECORD_BYTES), dtype=torch.uint8)
    base = torch.empty(mats.shape[0] * n, dtype=torch.uint8)
    rows, cols, vals = [], [], []
    for i in range(mats.shape[0]):
        r, c, v = _encode_matrix(mats[i], records[i], base[i * n : (i + 1) * n])
        rows.append(r + i * n)
        cols.append(c)
        vals.append(v)
    rows_all = torch.cat(rows)
    counts = torch.bincount(rows_all, minlength=mats.shape[0] * n)
    esc_ptr = torch.zeros(mats.shape[0] * n + 1, dtype=torch.int32)
    torch.cumsum(counts, 0, out=esc_ptr[1:])
    return dict(
        records=records.reshape(*shape[:-2], nt, kt, RECORD_BYTES),
        base=base,
        esc_ptr=esc_ptr,
        esc_col=torch.cat(cols).to(torch.int32),
        esc_val=torch.cat(vals),
    )


def _records_to_codes(records: torch.Tensor, hi_only: bool = False) -> torch.Tensor:
    """[NT, KT, 12288] layout-0 records -> int16 codes [NT*128, KT*64] (hi<<4|lo, or hi alone)."""
    nt, kt = records.shape[0], records.shape[1]
    hi = records[..., :HI_BYTES].unflatten(-1, (TILE_N, TILE_K)).transpose(1, 2)
    hi = hi.reshape(nt * TILE_N, kt * TILE_K).to(torch.int16)
    if hi_only:
        return hi
    lo = records[..., HI_BYTES:].unflatten(-1, (TILE_N, TILE_K // 2)).transpose(1, 2)
    lo = lo.reshape(nt * TILE_N, kt * TILE_K // 2)
    lo = torch.stack((lo & 0xF, lo >> 4), dim=-1).flatten(-2).to(torch.int16)
    return (hi << 4) | lo


def decode(
    records: torch.Tensor,
    base: torch.Tensor,
    esc_ptr: torch.Tensor,
    esc_col: torch.Tensor,
    esc_val: torch.Tensor,
    n: int,
    k: int,
    layout: int = 0,
    eight_bit: bool = False,
) -> torch.Tensor:
    """Decodes W12 tensors back to BF16 [..., N, K] (exact), or the approximate 8-bit view.

    Pure torch, so it also runs (slowly) on a GPU when the compiled kernels are missing.

    The 8-bit view puts the dropped mantissa bits at their midpoint (``| 0b1000``); escaped
    elements are still taken from the escape list, exactly, because the escape list is tiny and
    an approximate pass gains nothing by getting zeros, infs and NaNs wrong.
    """
    if layout != 0:
        records = convert_layout(records, layout, 0)
    batch = tuple(records.shape[:-3])
    nt, kt = records.shape[-3], records.shape[-2]
    mats = records.reshape(-1, nt, kt, RECORD_BYTES)
    out = torch.empty((mats.shape[0], n, k), dtype=torch.int16, device=records.device)
    base16 = base.to(torch.int16).view(mats.shape[0], n)
    for i in range(mats.shape[0]):
        code = _records_to_codes(mats[i], hi_only=eight_bit)[:n, :k]
        b7 = (base16[i] << 7).unsqueeze(1)
        if eight_bit:
            bits = (((code & 0x7F) << 4) + b7) | ((code & 0x80) << 8) | 0x8
        else:
            bits = ((code & 0x7FF) + b7) | ((code & 0x800) << 4)
        out[i] = bits
    flat = out.view(-1, k)
    nnz = int(esc_col.numel())
    if nnz:
        counts = (esc_ptr[1:] - esc_ptr[:-1]).to(torch.int64)
        rows = torch.repeat_interleave(torch.arange(flat.shape[0], device=flat.device), counts, output_size=nnz)
        flat[rows, esc_col.to(torch.int64)] = esc_val
    return out.view(*batch, n, k).view(torch.bfloat16)


def linear_fp32(x: torch.Tensor, weight_bf16: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """FP32 reference of ``x @ W^T (+ bias)``: the yardstick for every GEMM kernel."""
    y = x.float() @ weight_bf16.float().t()
    if bias is not None:
        y = y + bias.float()
    return y
