"""GPU tests of v4's parked partials at token counts off the tile's edge (sm_90 only; each skips
elsewhere). A pass of M tokens runs a tile of 8, 16, 32, 64 or 128 tokens; since session 47 the
GEMM parks only the 8-token chunks that hold a token of the pass (K-split partials, the triples'
pair sums, SK's heads) and the reduce kernel has no CTA for the others. Each case runs once with
the workspace filled with NaN bytes: a live chunk left unparked would carry NaN into the output,
a padding chunk parked would overwrite them (diagnostic 131072 parks them, as before). Run with
``pytest -m gpu``."""

from __future__ import annotations

import pytest
import torch
from _gpu_gemm_helpers import (
    DEV,
    KERNELS,
    _escape_weight,
    _kernels_present,  # noqa: F401 (this module's autouse fixture)
)

import w12
from w12 import cuda_ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")]

SK_ALL = 2097152  # SK at 65-128 tokens on every unsplit weight of more row-tile pairs than SMs
ONE_RING = 4096  # row-tile pairs with a CTA barrier per record (the wgmma kernel's park), not NB
PAIRS_ALL = 512  # the pair grid on every split grid up to 64 tokens
TRIPLES_ALL = 16384  # NB's triples on every split weight at 33-128 tokens
PARK_ALL = 131072  # at 17-128 tokens: every chunk parked and reduced (kParkEveryChunk)

# (N, K, tokens, diagnostics, NB's consumer warpgroups or None at <= 32 tokens, what runs): o-,
# qkv- and [6144, 2048]-like split weights in every form that parks a partial, an unsplit weight
# under SK; token counts one past a tile edge and in between.
_CASES = [
    (4096, 4096, 20, 0, None, "plain split grid, 32-token tile"),
    (4096, 4096, 20, PAIRS_ALL, None, "pair grid"),
    (4096, 4096, 33, 0, 0, "plain split grid, 64-token tile"),
    (4096, 4096, 47, TRIPLES_ALL, 3, "NB triples, 64-token tile"),
    (6144, 4096, 65, 0, 0, "single-row-tile split grid, 128-token tile"),
    (6144, 4096, 100, 0, 0, "single-row-tile split grid, 128-token tile"),
    (6144, 2048, 65, 0, 3, "NB triples"),
    (6144, 2048, 100, 0, 3, "NB triples"),
    (4096, 8192, 65, 0, 4, "NB row-tile pairs"),
    (4096, 8192, 100, 0, 4, "NB row-tile pairs"),
    (4096, 4096, 73, 0, 0, "single-row-tile split grid, 8 slices"),
    (4096, 8192, 73, ONE_RING, 0, "row-tile pairs with a CTA barrier"),
    (128 * 266, 1024, 65, SK_ALL, 4, "SK heads and tails"),
    (128 * 266, 1024, 100, SK_ALL, 4, "SK heads and tails"),
    # Diagnostic 131072: every chunk parked, as before session 47 (the check below must see it).
    (4096, 4096, 33, PARK_ALL, 0, "plain split grid, every chunk"),
    (6144, 4096, 65, PARK_ALL, 0, "single-row-tile split grid, every chunk"),
    (6144, 2048, 100, PARK_ALL, 3, "NB triples, every chunk"),
    (4096, 8192, 100, PARK_ALL, 4, "NB row-tile pairs, every chunk"),
    (128 * 266, 1024, 100, SK_ALL | PARK_ALL, 4, "SK heads and tails, every chunk"),
]


def _chunks_per_tile(m: int) -> int:
    return 1 if m <= 8 else 2 if m <= 16 else 4 if m <= 32 else 8 if m <= 64 else 16


@pytest.mark.parametrize("n,k,m,diag,nb,form", _CASES, ids=[f"{c[0]}x{c[1]}-m{c[2]}-{c[3]}" for c in _CASES])
def test_v4_parks_only_live_chunks(n, k, m, diag, nb, form, monkeypatch):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if sms != 132:
        pytest.skip("the forms named are the rules' choices on 132 SMs")
    if nb is not None:
        assert cuda_ops.nobar(n, k, m, DEV, diag=diag) == nb, f"[{n}, {k}] at {m} tokens does not run {form}"
    if diag & SK_ALL:
        assert cuda_ops.sk_lanes(n, k, m, DEV, diag=diag) > 0, f"[{n}, {k}] at {m} tokens runs no SK"
    gen = torch.Generator().manual_seed(470 + m)
    wt = _escape_weight(n, k, 0.5, gen)
    w = w12.pack(wt).to(DEV).with_layout(cuda_ops.preferred_layout(DEV))
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
    monkeypatch.setenv("W12_GEMM_KERNEL", "v4")
    monkeypatch.setenv("W12_GEMM_DIAG", str(diag))
    want = w12.linear(x, w).view(torch.int16)

    so = cuda_ops._gemm_lib()
    tgt = 2 * sms
    ws_bytes = int(so.w12_gemm_workspace_bytes(m, n, k, tgt, sms, 4, diag))
    assert ws_bytes > 0, f"{form}: [{n}, {k}] at {m} tokens parks nothing"
    ws = torch.full((ws_bytes,), 0xFF, dtype=torch.uint8, device=DEV)  # 0xFFFFFFFF: an FP32 NaN
    y = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
    rec, base, esc_ptr, esc_col, esc_val = w.tensors()
    flags = diag | (0 if cuda_ops._pdl(4, n, k, m, DEV) else 32)
    code = cuda_ops.gemm_launch(
        x, rec, base, esc_ptr, esc_col, esc_val, None, y, n, k, ws.data_ptr(),
        tgt=tgt, stages=0, flags=flags, kver=4,
    )  # fmt: skip
    assert code == 0, cuda_ops._err(code)
    torch.cuda.synchronize()
    nan = int(torch.isnan(y).sum())
    assert nan == 0, f"{form}: {nan} NaN outputs (a live chunk's partial never parked?)"
    diff = int((y.view(torch.int16) != want).sum())
    assert diff == 0, f"{form}: {diff} outputs differ from the default workspace's"

    # Every park is laid out as [...][chunk j][128 threads] float4, 2 KB per (chunk, warpgroup or
    # m-tile); the chunks past the pass's last token must still hold the NaN bytes.
    nch, live = _chunks_per_tile(m), -(-m // 8)
    assert live < nch, "a case off the tile's edge"
    per = nch * 2048
    parks = ws[: ws_bytes // per * per].view(-1, nch, 2048)
    # (SK parks per lane and warpgroup: a lane whose range ends on a chain's end parks nothing.)
    written = parks != 0xFF
    assert bool(written[:, :live].any()), f"{form}: nothing parked"
    pad = int(written[:, live:].sum())
    if diag & PARK_ALL:
        assert pad > 0, f"{form}: {PARK_ALL} parks the padding chunks too"
    else:
        assert pad == 0, f"{form}: {pad} bytes of padding chunks parked"
