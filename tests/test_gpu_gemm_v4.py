"""GPU tests of the Hopper wgmma kernel v4's variants (sm_90 only; each skips elsewhere): the same bits as
its plain split or unsplit grid, its rules, its epilogues and its scratch. Run with ``pytest -m gpu``."""

from __future__ import annotations

import pytest
import torch
from _gpu_gemm_helpers import (
    DEV,
    KERNELS,
    _assert_close,
    _device_ints,
    _escape_weight,
    _kernels_present,  # noqa: F401 (this module's autouse fixture)
    _outputs_per_diag,
    _poison_next_alloc,
    _ref,
    _weight,
)

import w12
from w12 import cuda_ops, layouts

pytestmark = pytest.mark.gpu


@pytest.mark.skipif("v4" not in KERNELS, reason="the 256-row rule is v4's")
def test_v4_fallback_rule_and_m_independence_to_256(monkeypatch):
    # By default v4 runs the fused kernel up to 256 token rows (two passes) on unsplit weights and
    # on those whose K slices' partials stay small (S * 1024 <= K), and up to 128 elsewhere; the
    # rows of an unsplit weight then have the same bits at every M up to 256, above it decode +
    # cuBLAS.
    monkeypatch.setenv("W12_GEMM_KERNEL", "v4")
    monkeypatch.delenv("W12_GEMM_FALLBACK_M", raising=False)
    n, k = 40000, 256  # 313 row tiles: over two per SM on every sm_90 part, so never split
    assert cuda_ops.splits(n, k, DEV, kernel=4) == 1
    assert cuda_ops.fallback_m(4, n, k, DEV) == 256
    assert cuda_ops.fallback_m(4, 1024, 4096, DEV) == 128  # 8 row tiles: cut into 8-16 slices
    assert cuda_ops.fallback_m(4, 1024, 65536, DEV) == 256  # the same slices of a long K: small partials
    assert cuda_ops.fallback_m(1, n, k, DEV) == 128
    monkeypatch.setenv("W12_GEMM_FALLBACK_M", "77")
    assert cuda_ops.fallback_m(4, n, k, DEV) == 77
    monkeypatch.delenv("W12_GEMM_FALLBACK_M")
    gen = torch.Generator().manual_seed(19)
    wt = _weight(n, k, gen, spread=False)
    w = w12.pack(wt.to(DEV)).with_layout(cuda_ops.preferred_layout(DEV))
    x = torch.randn(300, k, generator=gen).to(torch.bfloat16).to(DEV)
    y256 = w12.linear(x[:256].clone(), w)
    _assert_close(y256, _ref(x[:256], wt.to(DEV)), x[:256], wt.to(DEV))
    y256 = y256.view(torch.int16)
    for m in (1, 5, 129, 200):
        assert torch.equal(w12.linear(x[:m].clone(), w).view(torch.int16), y256[:m]), f"M={m} against M=256"
    assert torch.equal(w12.linear(x[128:256].clone(), w).view(torch.int16), y256[128:])
    y300 = w12.linear(x, w)  # decode + cuBLAS: correct, its own bits
    _assert_close(y300, _ref(x, wt.to(DEV)), x, wt.to(DEV))


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
@pytest.mark.parametrize("m", [65, 100, 128])
@pytest.mark.parametrize("n,k,bias", [(6144, 2048, False), (6144 + 77, 2048, True)])  # N on and off the tile edge
def test_v4_many_tile_split_grid_at_65_128_tokens(n, k, bias, m, monkeypatch):
    # Weights of 8 slices and 48-49 row tiles at 65..128 tokens (qkv [6144, 4096] until session 41,
    # 5 slices since): NB's triples by default; without them (diagnostic 1024) the two-warpgroup
    # grid of 8 partials per row tile, whose reduce grid of 16 token chunks per row tile the 8-slice
    # reduce form cannot hold at once, so it fetches the slices four at a time at 6 CTAs per SM
    # (same adds, same order). The rows must equal the same rows computed in 64-token passes.
    monkeypatch.setenv("W12_GEMM_KERNEL", "v4")
    monkeypatch.setenv("W12_GEMM_FALLBACK_M", "1000")
    assert cuda_ops.splits(n, k, DEV, kernel=4) == 8, "the shape must be cut into 8 slices"
    gen = torch.Generator().manual_seed(300 + m)
    wt = _weight(n, k, gen, spread=False).to(DEV)
    w = w12.pack(wt).with_layout(cuda_ops.preferred_layout(DEV))
    b = torch.randn(n, generator=gen).to(DEV) if bias else None
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
    y = w12.linear(x, w, b)
    _assert_close(y, _ref(x, wt, b), x, wt)
    parts = torch.cat([w12.linear(x[:64].clone(), w, b), w12.linear(x[64:].clone(), w, b)])
    assert torch.equal(y.view(torch.int16), parts.view(torch.int16)), "128-token pass against 64-token passes"
    monkeypatch.setenv("W12_GEMM_DIAG", "1024")
    assert cuda_ops.nobar(n, k, m, DEV, diag=1024) == 0, "diagnostic 1024: the two-warpgroup split grid"
    assert torch.equal(w12.linear(x, w, b).view(torch.int16), y.view(torch.int16)), "without triples"


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
@pytest.mark.parametrize(
    "diag,stages",
    [
        ("64", "0"),
        ("524288", "0"),
        ("524352", "0"),
        ("0", "3"),
        ("0", "4"),
        ("32", "0"),
        ("262144", "0"),
        ("262144", "4"),
        ("2", "0"),
        ("262208", "0"),
        ("16", "0"),
        ("131072", "0"),
        ("133120", "0"),
        ("256", "0"),
        ("272", "0"),
        ("1024", "0"),
        ("266240", "0"),
    ],
)
@pytest.mark.parametrize("m", [1, 9, 17, 33, 64, 100])
@pytest.mark.parametrize("n,k", [(4096, 4096), (384, 1000), (130, 70)])
def test_v4_variants_change_no_bit(n, k, m, diag, stages, monkeypatch):
    # W12_GEMM_DIAG=64: decode of record i overlapping record i-1's wgmma (two A buffers; at
    # 65..128 tokens, where that is the default, the plain loop); 524288: one warpgroup per CTA
    # (each warp decodes both m-tiles) instead of two, up to 64 tokens; 524352: both; 262144: two
    # row tiles per CTA (4 warpgroups) from 33 tokens up (384 rows: an odd tile count, the last
    # pair half empty); 16: the split grid + reduce kernel where whole-K clusters would run;
    # 131072: whole-K clusters for short slices too (4096 x 4096 at 1 and 9 tokens: 8 records),
    # 133120 the same without their early launch_dependents; 2: the unsplit grids' per-output epilogue (row data and escapes reloaded per
    # token) instead of the per-row one (up to 32 tokens) or the shared-memory one (64 and 100);
    # W12_GEMM_STAGES 3 / 4: ring depth; 32: no programmatic dependent launch; 256: the deep loop
    # (record i-1's wgmma in flight while record i is decoded) at every grid up to 16 tokens, 272
    # the same with the split grid where whole-K clusters would run; 1024: never the deep loop
    # (the default since session 42; 4096 x 4096 at 9 tokens took it by default before); 266240:
    # row-tile pairs with the single ring instead of the split ring (262144 takes the split ring
    # at 100 tokens).
    # The same wgmma in the same order for every output element, so the same bits.
    monkeypatch.setenv("W12_GEMM_KERNEL", "v4")
    gen = torch.Generator().manual_seed(111 + m)
    wt = _weight(n, k, gen, spread=False)
    w = w12.pack(wt).to(DEV).with_layout(cuda_ops.preferred_layout(DEV))
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
    a = w12.linear(x, w)
    _assert_close(a, _ref(x, wt.to(DEV)), x, wt.to(DEV))
    monkeypatch.setenv("W12_GEMM_DIAG", diag)
    monkeypatch.setenv("W12_GEMM_STAGES", stages)
    assert torch.equal(w12.linear(x, w).view(torch.int16), a.view(torch.int16)), f"W12_GEMM_DIAG={diag} STAGES={stages}"


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize(
    "n,k,bias,diag",
    [
        (4168, 8192, True, 0),  # 8 slices of 16 records, the last row tile 72 rows
        (3800, 8100, False, 0),  # 8 slices of 16 records, the last of 15; N and K off the tile edges
        (4096, 14336, False, 0),  # down [4096, 14336]: 8 slices of 28 records
        # Short slices (diagnostic 131072), where the epilogue data loads after the loop:
        (4168, 4096, True, 131072),  # 8 slices of 8 records
        (4000, 700, False, 131072),  # 6 slices (three warpgroups per CTA) of 2 records, the last of 1
        (4096, 1000, True, 131072),  # 8 slices of 2 records
    ],
)
def test_v4_wholek_matches_split_grid(n, k, bias, diag, m, monkeypatch):
    # At <= 16 tokens v4 gives weights cut into an even 2-8 K slices of >= 16 records a cluster of
    # two CTAs per 64-row m-tile, one warpgroup per slice, and adds the slices in rank 0's shared
    # memory: the same wgmma per slice and the same adds as the split grid and its reduce kernel
    # (W12_GEMM_DIAG=16), so the same bits.
    monkeypatch.setenv("W12_GEMM_KERNEL", "v4")
    assert cuda_ops.wholek_stages(n, k, m, DEV, diag) >= 3, f"[{n}, {k}] at M={m} must take the whole-K clusters"
    gen = torch.Generator().manual_seed(150 + m)
    wt = _weight(n, k, gen, spread=False)
    w = w12.pack(wt).to(DEV).with_layout(cuda_ops.preferred_layout(DEV))
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
    b = torch.randn(n, generator=gen).to(DEV) if bias else None
    monkeypatch.setenv("W12_GEMM_DIAG", str(diag))
    _poison_next_alloc(m * n)
    y = w12.linear(x, w, b)
    _assert_close(y, _ref(x, wt.to(DEV), b), x, wt.to(DEV))
    monkeypatch.setenv("W12_GEMM_DIAG", "16")
    assert torch.equal(w12.linear(x, w, b).view(torch.int16), y.view(torch.int16))


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize(
    "n,k,slices,diag",
    [
        # Larger clusters with diagnostic 2097152 (not by default: on the H200 they are not all
        # resident at once). qkv: 4 m-tiles per cluster of 5 CTAs, 13-record slices
        (6144, 4096, 5, 131072 | 2097152),
        (5665, 5000, 5, 2097152),  # the last cluster half full, N off the tile edge, the last slice 15
        (8995, 2000, 3, 131072 | 2097152),  # 2 m-tiles per cluster of 3 two-warpgroup CTAs
        (7182, 5000, 4, 0),  # by default: one m-tile per CTA (a cluster of one), N off the tile edge
        (4296, 1000, 6, 131072 | 2097152),  # 2 m-tiles per cluster of 3, slices of 3 records, the last of 1
        (4370, 3000, 7, 131072 | 2097152),  # 4 m-tiles per cluster of 7, the last cluster half full
    ],
)
def test_v4_wholek_packed_matches_split_grid(n, k, slices, diag, m, monkeypatch):
    # Where two CTAs per m-tile would not fit one per SM (odd S, or 4 CTAs per 128-row tile more
    # than the SMs), the whole-K clusters pack W warpgroups per CTA: unit r * W + w streams
    # slice u % S of the cluster's m-tile u / S and writes its partial into the owner rank's
    # shared memory (two warpgroups per CTA, two CTAs per SM, where S < 4). Same wgmma per slice
    # and adds as the split grid + reduce kernel (W12_GEMM_DIAG=16), and as the packed form
    # turned off (1048576).
    monkeypatch.setenv("W12_GEMM_KERNEL", "v4")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert cuda_ops.splits(n, k, DEV, 4) == slices, f"[{n}, {k}]: the case needs {slices} slices on {sms} SMs"
    assert cuda_ops.wholek_stages(n, k, m, DEV, diag) >= 3, f"[{n}, {k}] at M={m} must take the packed form"
    wgs = cuda_ops.wholek_warpgroups(n, k, m, DEV, diag)
    assert wgs in (2, 4)
    cs = cuda_ops.wholek_cluster(n, k, m, DEV, diag)
    assert 1 <= cs <= 8, f"[{n}, {k}] at M={m}: {cs} CTAs per cluster"
    # Exact clusters only: the kernel gives every warpgroup an (m-tile, slice) unit.
    assert cs * wgs % slices == 0, f"[{n}, {k}] at M={m}: {cs} CTAs of {wgs} warpgroups leave one idle"
    assert cuda_ops.wholek_stages(n, k, m, DEV, diag | 1048576) == 0, "1048576 must turn the packed form off"
    gen = torch.Generator().manual_seed(160 + m + slices)
    wt = _weight(n, k, gen, spread=False)
    w = w12.pack(wt).to(DEV).with_layout(cuda_ops.preferred_layout(DEV))
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
    b = torch.randn(n, generator=gen).to(DEV) if m % 2 else None
    monkeypatch.setenv("W12_GEMM_DIAG", str(diag))
    _poison_next_alloc(m * n)
    y = w12.linear(x, w, b)
    _assert_close(y, _ref(x, wt.to(DEV), b), x, wt.to(DEV))
    for other in ("16", str(diag | 1048576)):
        monkeypatch.setenv("W12_GEMM_DIAG", other)
        assert torch.equal(w12.linear(x, w, b).view(torch.int16), y.view(torch.int16)), f"W12_GEMM_DIAG={other}"


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
@pytest.mark.parametrize("m", [1, 9, 17, 33, 64, 100])
@pytest.mark.parametrize(
    "n,k,bias",
    [
        (4096, 4096, False),  # 8 slices of 8 records: 4 pairs
        (1000, 192, True),  # 3 slices of 1 record: a pair and a lone slice; N off the tile edge
        (7168, 3000, False),  # 7 slices, the last short: 3 pairs and a lone slice
    ],
)
def test_v4_pair_grid_changes_no_bit(n, k, bias, m, monkeypatch):
    # At 17..32 tokens v4 gives each pair of consecutive K slices of a split weight (>= 4 slices)
    # one CTA, which runs both from zero, adds them in add_slice's order and parks one partial;
    # W12_GEMM_DIAG=512 does so on every split grid up to 64 tokens, 128 never (at 100 tokens
    # neither runs: the split grid as before). The same adds in the same order as the reduce
    # kernel's, so the same bits.
    ys = _outputs_per_diag(n, k, m, bias, 180 + m, ("0", "512", "128"), monkeypatch)
    assert torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16)), "pair grid everywhere (512)"
    assert torch.equal(ys[0].view(torch.int16), ys[2].view(torch.int16)), "pair grid never (128)"


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
@pytest.mark.parametrize("m", [1, 3, 9, 16, 17, 32, 33])
@pytest.mark.parametrize(
    "tiles_per_sm,k,bias",
    [(1.7, 512, True), (1.62, 320, False), (1.95, 256, True), (3.03, 192, True), (7.6, 128, False), (11.5, 64, True)],
)
def test_v4_balanced_grid_changes_no_bit(tiles_per_sm, k, bias, m, monkeypatch):
    # Unsplit weights of between one and two 128-row tiles per SM (gate_up's 224 on 132 SMs) run at
    # <= 32 tokens as 2 x SMs CTAs dealt 16-row slices evenly, a CTA's warps holding slices of two
    # tiles; from two tiles per SM up the last round of CTAs (four per SM) is dealt out so where
    # it is at least half full (3.03: one round; 7.6 and 11.5: after one and two full rounds of
    # 128-row CTAs); W12_GEMM_DIAG=8192 keeps the 128-row CTAs. N off the 16-row and 128-row edges.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = int(128 * sms * tiles_per_sm) + 37
    assert cuda_ops.splits(n, k, DEV, kernel=4) == 1
    ys = _outputs_per_diag(n, k, m, bias, 170 + m, ("0", "8192"), monkeypatch)
    assert torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16)), "balanced against 128-row CTAs"


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("tiles_per_sm,k,bias", [(1.7, 512, True), (1.62, 320, False), (1.95, 64, True)])
def test_v4_bulk_records_change_no_bit(tiles_per_sm, k, bias, m, monkeypatch):
    # Where the balanced grid would run, 1-2 tokens stream the records by one bulk copy each
    # (the split ring on 128-row CTAs); W12_GEMM_DIAG=16384 keeps the balanced grid, 8192 the
    # 128-row CTAs with per-thread copies. At 3 tokens all three must be the balanced grid's
    # bits too. N off the 16-row and 128-row edges; K of one record included.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = int(128 * sms * tiles_per_sm) + 53
    assert cuda_ops.splits(n, k, DEV, kernel=4) == 1
    ys = _outputs_per_diag(n, k, m, bias, 190 + m, ("0", "16384", "8192"), monkeypatch)
    assert torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16)), "bulk records against the balanced grid"
    assert torch.equal(ys[0].view(torch.int16), ys[2].view(torch.int16)), "bulk records against 128-row CTAs"


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
def test_v4_wholek_rule():
    # Where the whole-K clusters run: at most 16 tokens, 2-8 slices of >= 16 records, at most one
    # CTA per SM: four per 128-row tile for an even S, else (or where those are too many) four
    # warpgroups per CTA packing m-tiles, where the split grid has two CTAs on some SM.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert cuda_ops.wholek_stages(4096, 14336, 16, DEV) >= 3
    assert cuda_ops.wholek_stages(4096, 14336, 17, DEV) == 0
    assert cuda_ops.wholek_stages(4096, 14336, 1, DEV, diag=16) == 0
    if cuda_ops.splits(4096, 4096, DEV, 4) == 8:  # 8 records per slice
        assert cuda_ops.wholek_stages(4096, 4096, 1, DEV) == 0
        assert cuda_ops.wholek_stages(4096, 4096, 1, DEV, diag=131072) >= 3
    assert cuda_ops.wholek_stages(28672, 4096, 1, DEV) == 0  # unsplit
    n_many = 128 * (sms // 4 + 1)
    if 1 < cuda_ops.splits(n_many, 14336, DEV, 4) <= 8:  # two CTAs per m-tile: more than one per SM
        assert cuda_ops.wholek_stages(n_many, 14336, 1, DEV, diag=1048576) == 0
    if cuda_ops.splits(6144, 4096, DEV, 4) == 5 and sms >= 120:  # qkv: 13-record slices
        assert cuda_ops.wholek_stages(6144, 4096, 1, DEV) == 0
        assert cuda_ops.wholek_stages(6144, 4096, 1, DEV, diag=131072) == 0  # clusters of 5: not by default
        assert cuda_ops.wholek_stages(6144, 4096, 16, DEV, diag=131072 | 2097152) >= 3
        assert cuda_ops.wholek_warpgroups(6144, 4096, 16, DEV, diag=131072 | 2097152) == 4
        assert cuda_ops.wholek_cluster(6144, 4096, 16, DEV, diag=131072 | 2097152) == 5
        assert cuda_ops.wholek_stages(6144, 4096, 17, DEV, diag=131072 | 2097152) == 0
    if cuda_ops.splits(8192, 8192, DEV, 4) == 4 and sms >= 128:  # one 4-warpgroup CTA per m-tile
        assert cuda_ops.wholek_stages(8192, 8192, 1, DEV) >= 3
        assert cuda_ops.wholek_warpgroups(8192, 8192, 1, DEV) == 4
        assert cuda_ops.wholek_cluster(8192, 8192, 1, DEV) == 1
        assert cuda_ops.wholek_stages(8192, 8192, 1, DEV, diag=1048576) == 0
    if cuda_ops.splits(512, 4096, DEV, 4) > 8:
        assert cuda_ops.wholek_stages(512, 4096, 1, DEV) == 0  # more slices than warpgroups


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
def test_v4_pair_grid_rule():
    # The pair grid (which the PDL rule asks for at 17-32 tokens): 17-32 tokens, >= 4 slices, and
    # at least one pair CTA per SM; diagnostics 512 / 128 force it on (up to 64 tokens) / off.
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def pairs_cover(n, k):
        # ...and a busiest SM with at most 1.5x the plain grid's records (session 41).
        s, nt = cuda_ops.splits(n, k, DEV, 4), (n + 127) // 128
        pairs, plain = nt * ((s + 1) // 2), nt * s
        return s >= 4 and pairs >= sms and 4 * -(-pairs // sms) <= 3 * -(-plain // sms)

    if sms == 132:
        assert cuda_ops.pair_grid(6144, 2048, 24, DEV, diag=0), "8 slices of 48 tiles: 192 pair CTAs"
        assert not cuda_ops.pair_grid(6144, 4096, 24, DEV, diag=0), "5 slices of 48 tiles: 144 pair CTAs"
    for n, k in [(6144, 4096), (6144, 2048), (4096, 4096), (4096, 14336), (128 * (sms // 2 + 1), 4096)]:
        want = pairs_cover(n, k)
        assert cuda_ops.pair_grid(n, k, 17, DEV, diag=0) == want, (n, k)
        assert cuda_ops.pair_grid(n, k, 32, DEV, diag=0) == want, (n, k)
        assert cuda_ops.pair_grid(n, k, 64, DEV, diag=512) == (cuda_ops.splits(n, k, DEV, 4) >= 2), (n, k)
        assert not any(cuda_ops.pair_grid(n, k, m, DEV, diag=0) for m in (16, 33, 64, 65))
        assert not cuda_ops.pair_grid(n, k, 32, DEV, diag=128)
        assert cuda_ops.pair_grid(n, k, 4, DEV, diag=512) == (cuda_ops.splits(n, k, DEV, 4) >= 2)
    assert not cuda_ops.pair_grid(28672, 4096, 32, DEV, diag=0)  # unsplit


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
def test_v4_row_pairs_match_smaller_m(monkeypatch):
    # 65..128 tokens in one pass, where a CTA streams >= 16 records: two row tiles per CTA (here
    # 129 tiles, the last one 16 rows and alone in its pair; K split in 2). Rows must equal the
    # same rows computed at 1 and 64 tokens (one row tile per CTA) and the FP64 reference.
    monkeypatch.setenv("W12_GEMM_KERNEL", "v4")
    monkeypatch.setenv("W12_GEMM_FALLBACK_M", "1000")
    gen = torch.Generator().manual_seed(140)
    wt = _weight(16400, 2048, gen, spread=False)
    w = w12.pack(wt).to(DEV).with_layout(cuda_ops.preferred_layout(DEV))
    x = torch.randn(128, 2048, generator=gen).to(torch.bfloat16).to(DEV)
    full = w12.linear(x, w)
    _assert_close(full, _ref(x, wt.to(DEV)), x, wt.to(DEV))
    bits = full.view(torch.int16)
    for m in [1, 64, 100]:
        assert torch.equal(w12.linear(x[:m].clone(), w).view(torch.int16), bits[:m]), f"M={m}"
    assert torch.equal(w12.linear(x[64:].clone(), w).view(torch.int16), bits[64:])
    # These grids take the split ring (records and activation tiles in rings of their own);
    # W12_GEMM_DIAG=4096 keeps the single ring: the same wgmma, so the same bits.
    monkeypatch.setenv("W12_GEMM_DIAG", "4096")
    for m in [100, 128]:
        assert torch.equal(w12.linear(x[:m].clone(), w).view(torch.int16), bits[:m]), f"one ring, M={m}"


_NB_SHAPES = {
    "split-2-odd-pair": (16400, 2048, 0.0),
    "unsplit-xt-escapes": (128 * 270 + 40, 1070, 3.0),
    "down-split": (4096, 14336, 0.25),
}


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
@pytest.mark.parametrize(
    "shape,m",
    [(name, m) for name in _NB_SHAPES for m in (65, 100, 127, 128)] + [("unsplit-xt-escapes", m) for m in (33, 40, 64)],
)
def test_v4_nobar_changes_no_bit(shape, m, monkeypatch):
    # NB (sessions 37-38): row-tile pairs at 33..128 tokens without a CTA barrier per record (a
    # producer warpgroup, full and empty mbarriers per stage, activation tiles by TMA). 129 tiles in
    # K slices of 16 records (the last pair half empty: its second row tile's warpgroups keep every
    # barrier and release every stage); 271 unsplit tiles (>= 2 per SM on the H200: NB at 33-64
    # tokens too, in 64-token tiles), K off the 64-column edge (zero columns from the tensor map),
    # 3 escapes a row (the shared-memory epilogue with XT); down's shape, K split (partials and the
    # reduce kernel). The same wgmma in the same order as the loops with the CTA barrier
    # (W12_GEMM_DIAG=256), the single ring (4096) and single row tiles (8), and the same rows as at
    # 16 tokens: the same bits.
    n, k, per_row = _NB_SHAPES[shape]
    monkeypatch.setenv("W12_GEMM_KERNEL", "v4")
    monkeypatch.setenv("W12_GEMM_FALLBACK_M", "1000")
    monkeypatch.delenv("W12_GEMM_DIAG", raising=False)
    assert cuda_ops.nobar(n, k, m, DEV, diag=0) == 4, "the shape must take NB's pairs"
    assert not any(cuda_ops.nobar(n, k, m, DEV, diag=d) for d in (256, 4096, 8))
    gen = torch.Generator().manual_seed(370 + m)
    wt = (_escape_weight(n, k, per_row, gen) if per_row else _weight(n, k, gen, spread=False)).to(DEV)
    w = w12.pack(wt).with_layout(cuda_ops.preferred_layout(DEV))
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
    b = torch.randn(n, generator=gen).to(DEV)
    y = w12.linear(x, w, b)
    _assert_close(y, _ref(x, wt, b), x, wt)
    bits = y.view(torch.int16)
    for diag in ("256", "4096", "8"):
        monkeypatch.setenv("W12_GEMM_DIAG", diag)
        assert torch.equal(w12.linear(x, w, b).view(torch.int16), bits), f"W12_GEMM_DIAG={diag}"
    monkeypatch.delenv("W12_GEMM_DIAG")
    assert torch.equal(w12.linear(x[-16:].clone(), w, b).view(torch.int16), bits[-16:]), "rows at 16 tokens"


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
@pytest.mark.parametrize("m", [33, 64, 65, 128])
def test_v4_nobar_fewer_records_than_stages(m, monkeypatch):
    # Diagnostic 262144 puts row-tile pairs (so NB, in 64- or 128-token tiles) on any weight at
    # 33..128 tokens: here K split into 3 one-record slices, fewer records a CTA than NB's ring
    # stages, so the producer never waits for a release and the consumers end before the ring
    # wraps; an odd pair again. Same bits as the pairs with the CTA barrier (4096) and as the rows
    # at 16 tokens.
    monkeypatch.setenv("W12_GEMM_KERNEL", "v4")
    monkeypatch.setenv("W12_GEMM_FALLBACK_M", "1000")
    n, k = 128 * 19 + 8, 150
    # (1024: not the triples, which this weight's 3 slices would take at 65-128 tokens.)
    assert cuda_ops.nobar(n, k, m, DEV, diag=262144 | 1024) == 4, "the shape must take NB's pairs with 262144"
    gen = torch.Generator().manual_seed(380 + m)
    wt = _escape_weight(n, k, 1.0, gen).to(DEV)
    w = w12.pack(wt).with_layout(cuda_ops.preferred_layout(DEV))
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
    monkeypatch.setenv("W12_GEMM_DIAG", str(262144 | 1024))
    y = w12.linear(x, w)
    _assert_close(y, _ref(x, wt), x, wt)
    bits = y.view(torch.int16)
    monkeypatch.setenv("W12_GEMM_DIAG", str(262144 | 4096 | 1024))
    assert torch.equal(w12.linear(x, w).view(torch.int16), bits), "the pairs with the CTA barrier"
    monkeypatch.delenv("W12_GEMM_DIAG")
    assert torch.equal(w12.linear(x[:16].clone(), w).view(torch.int16), bits[:16]), "rows at 16 tokens"


_NB3_SHAPES = {
    "qkv": (6144, 2048, 0.25),  # qkv-like: 48 row tiles in 8 slices ([6144, 4096] runs 5 since session 41)
    "two-units-a-cta": (9216, 4096, 0.25),
    "odd-last-triple": (128 * 19 + 8, 4096, 3.0),
    "short-slices": (128 * 19 + 8, 150, 1.0),
}


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
@pytest.mark.parametrize("shape,m", [(name, m) for name in _NB3_SHAPES for m in (33, 64, 65, 100, 128)])
def test_v4_nobar_triples_change_no_bit(shape, m, monkeypatch):
    # NB's triples (session 39): three consumer warpgroups on three consecutive 64-row m-tiles of a
    # split weight over a K slice pair, each slice from zero, parking p_2j, then p_2j + p_2j+1 in its
    # place (the reduce kernel's pair mode); at most one CTA an SM, running its units one after
    # another while its producer fills the ring with the next records. [6144, 2048]: 128 units, the
    # default at 65-128 tokens on 132 SMs (and with 262144 row-tile pairs instead: 192 units,
    # some CTAs running two); [9216, 4096]: 5 slices (the last pair a lone slice), 144 units, so
    # on 132 SMs some CTAs run two; 40 m-tiles: the last triple holds one m-tile and a record slot
    # past the last row tile (nothing parked for it), triples of both parities (one from m-tile 1
    # of a row tile, whose record the previous triple copied too); K = 150: 3 slices of one
    # record, fewer steps a unit than the ring's stages. Diagnostic 16384 takes triples on any
    # split weight at 33-128 tokens, 1024 never: the same wgmma per m-tile in the same order and
    # the same sums, so the same bits, and the same rows as at 16 tokens.
    n, k, per_row = _NB3_SHAPES[shape]
    monkeypatch.setenv("W12_GEMM_KERNEL", "v4")
    monkeypatch.setenv("W12_GEMM_FALLBACK_M", "1000")
    monkeypatch.delenv("W12_GEMM_DIAG", raising=False)
    if shape == "qkv" and m > 64 and torch.cuda.get_device_properties(DEV).multi_processor_count == 132:
        assert cuda_ops.nobar(n, k, m, DEV, diag=0) == 3, "qkv takes triples at 65-128 tokens on 132 SMs"
    assert cuda_ops.nobar(n, k, m, DEV, diag=16384) == 3, "diagnostic 16384 must take triples"
    assert cuda_ops.nobar(n, k, m, DEV, diag=16384 | 1024) != 3, "diagnostic 1024 must forbid them"
    gen = torch.Generator().manual_seed(390 + m)
    wt = _escape_weight(n, k, per_row, gen).to(DEV)
    w = w12.pack(wt).with_layout(cuda_ops.preferred_layout(DEV))
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
    b = torch.randn(n, generator=gen).to(DEV)
    monkeypatch.setenv("W12_GEMM_DIAG", "16384")
    y = w12.linear(x, w, b)
    _assert_close(y, _ref(x, wt, b), x, wt)
    bits = y.view(torch.int16)
    monkeypatch.setenv("W12_GEMM_DIAG", "1024")
    assert torch.equal(w12.linear(x, w, b).view(torch.int16), bits), "without triples"
    if shape == "qkv" and m > 64:
        assert cuda_ops.nobar(n, k, m, DEV, diag=262144 | 1024) == 4
        monkeypatch.setenv("W12_GEMM_DIAG", str(262144 | 1024))
        assert torch.equal(w12.linear(x, w, b).view(torch.int16), bits), "row-tile pairs, units back to back"
    monkeypatch.delenv("W12_GEMM_DIAG")
    assert torch.equal(w12.linear(x, w, b).view(torch.int16), bits), "the default forms"
    assert torch.equal(w12.linear(x[-16:].clone(), w, b).view(torch.int16), bits[-16:]), "rows at 16 tokens"


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
@pytest.mark.parametrize("m", [65, 128])
def test_v4_triples_rule_counts_slice_pairs(m):
    # The rule compares the busiest SM's m-tile slices with triples' units as they run (three
    # m-tiles over a slice pair) against pairs' (four m-tiles over one slice). Counting a triple
    # unit as one slice took triples on k/v [1024, 4096] (S = 16) and [9216, 4096] (S = 5), where
    # the forms this rule takes are 28 % and 24 % faster at 128 tokens (docs/perf-notes.md, session
    # 40). Timing only: the bits are the same either way (test_v4_nobar_triples_change_no_bit).
    if torch.cuda.get_device_properties(DEV).multi_processor_count != 132:
        pytest.skip("the counts below are for 132 SMs")
    assert cuda_ops.nobar(6144, 2048, m, DEV, diag=0) == 3, "[6144, 2048]: 128 triple units against 192 pair units"
    assert cuda_ops.nobar(6144, 4096, m, DEV, diag=0) != 3, "qkv in 5 slices: 96 triple units against 120 pair units"
    assert cuda_ops.nobar(1024, 4096, m, DEV, diag=0) != 3, "k/v: 48 triple units of 6 m-tile slices"
    assert cuda_ops.nobar(9216, 4096, m, DEV, diag=0) != 3, "[9216, 4096]: 144 triple units, two on some SMs"


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
@pytest.mark.parametrize("per_row", [0.25, 3.0])
@pytest.mark.parametrize("m", [33, 64, 100, 128])
def test_v4_shared_memory_epilogue_escapes(m, per_row, monkeypatch):
    # Unsplit grids at 33-128 tokens end in the shared-memory epilogue, where the whole CTA applies
    # the escapes of its rows listed in shared memory (the CTA's first 512), a row per warp and its
    # tokens across the lanes, and each row's own threads apply the rest. 0.25 escapes per row lists all of them;
    # 3 per row (~770 per 256-row CTA at 100-128 tokens) leaves rows unlisted. An odd tile count, the last tile 40
    # rows (row-tile pairs at 100-128 tokens, the last pair half empty). Same bits as the rows at 16
    # tokens (the register epilogue), and close to the FP64 reference.
    monkeypatch.setenv("W12_GEMM_KERNEL", "v4")
    monkeypatch.setenv("W12_GEMM_FALLBACK_M", "1000")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n, k = 128 * (2 * sms + 2) + 40, 1280
    assert cuda_ops.splits(n, k, DEV, 4) == 1, "the shape must be unsplit"
    gen = torch.Generator().manual_seed(240 + m)
    wt = _escape_weight(n, k, per_row, gen)
    w = w12.pack(wt).to(DEV).with_layout(cuda_ops.preferred_layout(DEV))
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
    bias = torch.randn(n, generator=gen).to(DEV)
    y = w12.linear(x, w)
    _assert_close(y, _ref(x, wt.to(DEV)), x, wt.to(DEV))
    assert torch.equal(w12.linear(x[:16].clone(), w).view(torch.int16), y[:16].view(torch.int16)), "rows at 16 tokens"
    yb = w12.linear(x, w, bias)
    assert torch.equal(w12.linear(x[-16:].clone(), w, bias).view(torch.int16), yb[-16:].view(torch.int16)), "bias"
    # W12_GEMM_DIAG=32768: the escapes read x itself, never x transposed (XT): the same values.
    monkeypatch.setenv("W12_GEMM_DIAG", "32768")
    assert torch.equal(w12.linear(x, w).view(torch.int16), y.view(torch.int16)), "x instead of x^T"


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
@pytest.mark.parametrize("m", [1, 3, 16, 17, 40, 64])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 2048), (6221, 2048)])
def test_v4_kw_pairs_in_one_cta(n, k, m, monkeypatch):
    # KW (session 34): at <= 16 tokens a split grid of an even number of equal slices at more than
    # two CTAs per SM that would run the plain two-warpgroup loop runs m-tile x pair CTAs instead:
    # warpgroup w takes slice 2j + w of one 64-row m-tile, the pair is added in shared memory and
    # parked once (qkv-like [6144, 2048], 8 slices; 6221 rows: a last tile of 77 rows, its second m-tile
    # partly past N). The o-like [4096, 4096] (two CTAs per SM) and 17-64 tokens run the other
    # forms, and rows at 65-128 tokens park every slice: the same bits as M = 100, with and
    # without bias, and close to the FP64 reference.
    monkeypatch.setenv("W12_GEMM_KERNEL", "v4")
    s = cuda_ops.splits(n, k, DEV, 4)
    if not (s >= 2 and s % 2 == 0 and ((k + 63) // 64) % s == 0):
        pytest.skip(f"[{n}, {k}] runs {s} slices: no KW grid")
    gen = torch.Generator().manual_seed(340 + n + m)
    wt = _escape_weight(n, k, 0.5, gen)
    w = w12.pack(wt).to(DEV).with_layout(cuda_ops.preferred_layout(DEV))
    x = torch.randn(100, k, generator=gen).to(torch.bfloat16).to(DEV)
    bias = torch.randn(n, generator=gen).to(DEV)
    full, fullb = w12.linear(x, w), w12.linear(x, w, bias)
    part, partb = w12.linear(x[:m].clone(), w), w12.linear(x[:m].clone(), w, bias)
    _assert_close(part, _ref(x[:m], wt.to(DEV)), x[:m], wt.to(DEV))
    assert torch.equal(part.view(torch.int16), full[:m].view(torch.int16)), f"rows at M={m} differ from M=100"
    assert torch.equal(partb.view(torch.int16), fullb[:m].view(torch.int16)), f"rows at M={m} with bias"


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
@pytest.mark.parametrize("per_row", [0.5, 3.0])
def test_v4_reduce_escape_slots(per_row, monkeypatch):
    # At <= 32 tokens behind split grids of <= 2 CTAs per SM the reduce kernel adds each row's
    # first two escapes from per-row slots of products filled before its wait, the rest in a loop
    # (session 33). 0.5 escapes per row: mostly 0-2 per row; 3 per row: rows past two, and more
    # than a row tile's staged table holds (256), so slots and loop both read global memory too.
    # The same bits as 64 tokens (no slots) and close to the FP64 reference.
    monkeypatch.setenv("W12_GEMM_KERNEL", "v4")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n, k = 4096, 4096
    s = cuda_ops.splits(n, k, DEV, 4)
    if not (s > 1 and (n // 128) * s <= 2 * sms):
        pytest.skip(f"[{n}, {k}] runs {s} slices of {n // 128} row tiles on {sms} SMs: no slot form here")
    gen = torch.Generator().manual_seed(330 + int(per_row * 2))
    wt = _escape_weight(n, k, per_row, gen)
    w = w12.pack(wt).to(DEV).with_layout(cuda_ops.preferred_layout(DEV))
    x = torch.randn(64, k, generator=gen).to(torch.bfloat16).to(DEV)
    bias = torch.randn(n, generator=gen).to(DEV)
    full, fullb = w12.linear(x, w), w12.linear(x, w, bias)
    _assert_close(full, _ref(x, wt.to(DEV)), x, wt.to(DEV))
    for m in (1, 2, 7, 8, 9, 16, 17, 32):
        assert cuda_ops.wholek_stages(n, k, m, DEV) == 0, f"M={m} runs whole-K clusters, not the reduce kernel"
        part = w12.linear(x[:m].clone(), w).view(torch.int16)
        assert torch.equal(part, full[:m].view(torch.int16)), f"rows at M={m} (slots) differ from M=64"
    assert torch.equal(w12.linear(x[:8].clone(), w, bias).view(torch.int16), fullb[:8].view(torch.int16)), "bias"


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
@pytest.mark.parametrize("m", [1, 3, 17, 40, 128])
@pytest.mark.parametrize("pad", [12, 13, 14])
@pytest.mark.parametrize("tail", [36, 38])
def test_v4_unsplit_epilogue_leading_dimension(m, pad, tail, monkeypatch):
    # The C ABI's ldy (w12.linear always writes a contiguous y): the unsplit grid's epilogues
    # (store_rows at <= 32 tokens, whose 8-byte stores need y and ldy 8-byte aligned, session 29;
    # the shared-memory one at 33-128) writing into a wider buffer: ldy = N + 12, 13 or 14 (8-byte
    # stores where ldy is a multiple of 4), N = 4 or 6 mod 8 (with N + 14: aligned rows that end in
    # a partial group of 4). Same bits as w12.linear (ldy = N), and the padding columns untouched.
    monkeypatch.setenv("W12_GEMM_KERNEL", "v4")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n, k = 128 * (2 * sms + 2) + tail, 1280
    assert cuda_ops.splits(n, k, DEV, 4) == 1, "the shape must be unsplit"
    gen = torch.Generator().manual_seed(260 + m + pad + tail)
    wt = _escape_weight(n, k, 1.0, gen)
    w = w12.pack(wt).to(DEV).with_layout(cuda_ops.preferred_layout(DEV))
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
    bias = torch.randn(n, generator=gen).to(DEV)
    want = w12.linear(x, w, bias).view(torch.int16)
    so = cuda_ops._gemm_lib()
    ldy = n + pad
    y = torch.full((m, ldy), -7.0, dtype=torch.bfloat16, device=DEV)
    tgt = 2 * sms
    stream = torch.cuda.current_stream()
    xt = cuda_ops._counters(x.device, stream, int(so.w12_gemm_counters(n, k, tgt, sms, 4)), xt=True)
    args = (x.data_ptr(), k, w.records.data_ptr(), w.base.data_ptr(), w.esc_ptr.data_ptr(), w.esc_col.data_ptr())
    args += (w.esc_val.data_ptr(), bias.data_ptr(), y.data_ptr(), ldy, m, n, k, None, xt, tgt, 0, 0, 4)
    assert so.w12_gemm(*args, stream.cuda_stream) == 0
    assert torch.equal(y[:, :n].view(torch.int16), want), f"ldy = N + {pad}"
    assert bool((y[:, n:] == -7.0).all()), "columns past N written"


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
def test_v4_xt_scratch_between_launches(monkeypatch):
    # XT: helper CTAs at the start of an unsplit grid at 33-128 tokens transpose x into the stream's XT
    # scratch, the epilogues read it once every block is counted, and the last CTA zeroes the counts.
    # Launches back to back on alternating inputs and two K (stale x^T or counts would show as
    # wrong bits), a captured graph replayed, the per-output epilogue (diagnostic 2, no XT) in
    # between; then the counts must be zero.
    monkeypatch.setenv("W12_GEMM_KERNEL", "v4")
    monkeypatch.setenv("W12_GEMM_FALLBACK_M", "1000")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = 128 * (2 * sms + 2) + 40
    gen = torch.Generator().manual_seed(250)
    ws, xs, want = [], [], []
    for k in (1280, 640):
        assert cuda_ops.splits(n, k, DEV, 4) == 1, "the shapes must be unsplit"
        wt = _escape_weight(n, k, 1.0, gen)
        w = w12.pack(wt).to(DEV).with_layout(cuda_ops.preferred_layout(DEV))
        pair = [torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV) for m in (128, 100)]
        monkeypatch.setenv("W12_GEMM_DIAG", "32768")
        want.append([w12.linear(x, w).view(torch.int16).clone() for x in pair])
        monkeypatch.delenv("W12_GEMM_DIAG")
        ws.append(w)
        xs.append(pair)
    for rnd in range(3):
        for i in (0, 1, 0):
            for j in (0, 1):
                got = w12.linear(xs[i][j], ws[i]).view(torch.int16)
                assert torch.equal(got, want[i][j]), f"round {rnd}, K index {i}, input {j}"
        monkeypatch.setenv("W12_GEMM_DIAG", "2")
        assert torch.equal(w12.linear(xs[1][0], ws[1]).view(torch.int16), want[1][0]), "per-output epilogue"
        monkeypatch.delenv("W12_GEMM_DIAG")
    xin = xs[0][0].clone()
    w12.linear(xin, ws[0])  # warm-up before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = w12.linear(xin, ws[0])
    for x, ref in ((xs[0][0], want[0][0]), (xs[0][1][:100], want[0][1])):
        xin[: x.shape[0]].copy_(x)
        graph.replay()
        assert torch.equal(yg[: x.shape[0]].view(torch.int16), ref), "graph replay"
    torch.cuda.synchronize()
    ptr = cuda_ops._counters(ws[0].records.device, torch.cuda.current_stream(), 2, xt=True)
    assert _device_ints(ptr, 2) == [0, 0], "XT counts left set"


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
@pytest.mark.parametrize("m", [1, 8, 17, 64])
def test_v4_reads_layout3_and_permutes_others(m, monkeypatch):
    # v4 reads layout 3 (MMA k in column order, split bits); records in layouts 2, 1 or 0 are
    # moved on every call, with a warning, and must give the same bits.
    monkeypatch.setenv("W12_GEMM_KERNEL", "v4")
    assert cuda_ops.preferred_layout(DEV) == layouts.WGMMA_SPLIT_LAYOUT
    gen = torch.Generator().manual_seed(131 + m)
    wt = _weight(640, 1000, gen)
    w = w12.pack(wt).to(DEV)
    x = torch.randn(m, 1000, generator=gen).to(torch.bfloat16).to(DEV)
    y2 = w12.linear(x, w.with_layout(layouts.WGMMA_SPLIT_LAYOUT))
    _assert_close(y2, _ref(x, wt.to(DEV)), x, wt.to(DEV))
    cuda_ops._WARNED.clear()
    for lay in (layouts.WGMMA_LAYOUT, layouts.MMA_SYNC_LAYOUT, 0):
        with pytest.warns(RuntimeWarning, match="permuting on every call"):
            y = w12.linear(x, w.with_layout(lay))
        assert torch.equal(y.view(torch.int16), y2.view(torch.int16)), f"layout {lay}"


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
def test_wgmma_building_blocks():
    # v4's operand layouts on their own (register A fragment, no-swizzle K-major B descriptor with
    # distinct LBO and SBO, accumulator layout): one 64x16x16 product of small integers, exact.
    import ctypes

    so = cuda_ops._gemm_lib()
    so.w12_selftest_wgmma.restype = ctypes.c_int
    so.w12_selftest_wgmma.argtypes = [ctypes.c_void_p] * 4
    gen = torch.Generator().manual_seed(121)
    a = torch.randint(-8, 8, (64, 16), generator=gen).to(torch.bfloat16).to(DEV)
    b = torch.randint(-8, 8, (16, 16), generator=gen).to(torch.bfloat16).to(DEV)
    d = torch.full((64, 16), float("nan"), device=DEV)
    code = so.w12_selftest_wgmma(a.data_ptr(), b.data_ptr(), d.data_ptr(), torch.cuda.current_stream().cuda_stream)
    assert code == 0, cuda_ops._err(code)
    torch.cuda.synchronize()
    assert torch.equal(d, a.float() @ b.float().t())
