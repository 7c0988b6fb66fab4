"""GPU tests of the fused W12 GEMM (``w12.linear`` on CUDA), every kernel; v4's own variants are in
test_gpu_gemm_v4.py. Run with ``pytest -m gpu``."""

from __future__ import annotations

import warnings

import pytest
import torch
from _gpu_gemm_helpers import (
    DEFAULT_LAYOUT,
    DEV,
    KERNELS,
    _assert_close,
    _kernels_present,  # noqa: F401 (this module's autouse fixture)
    _outputs_per_diag,
    _poison_next_alloc,
    _ref,
    _weight,
)

import w12
from w12 import cuda_ops, layouts
from w12.nn import W12Linear

pytestmark = pytest.mark.gpu


MS = [1, 2, 3, 7, 8, 16, 31, 64, 128, 300]


# At and off the 128x64 tile edges; 512x4096 and 384x1000 exercise the K-split reduction (v1) and
# tiles cut mid-K between stream-K ranges (v2); 256x14336 cuts each tile over ~130 CTAs; the
# small ones leave most v2 CTAs with an empty range.
NKS = [(128, 64), (256, 128), (130, 70), (1, 1), (127, 65), (512, 4096), (384, 1000), (1000, 192), (256, 14336)]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("n,k", NKS)
@pytest.mark.parametrize("m", MS)
def test_gemm_matches_fp64(m, n, k, kernel, monkeypatch):
    monkeypatch.setenv("W12_GEMM_KERNEL", kernel)
    gen = torch.Generator().manual_seed(1000 * m + 7 * n + k)
    wt = _weight(n, k, gen)
    w = w12.pack(wt).to(DEV).with_layout(cuda_ops.preferred_layout(DEV))
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
    _poison_next_alloc(m * n)
    y = w12.linear(x, w)
    _assert_close(y, _ref(x, wt.to(DEV)), x, wt.to(DEV))


def test_bias_and_leading_dims():
    gen = torch.Generator().manual_seed(5)
    wt = _weight(300, 200, gen)
    w = w12.pack(wt).to(DEV).with_layout(DEFAULT_LAYOUT)
    x = torch.randn(2, 3, 200, generator=gen).to(torch.bfloat16).to(DEV)
    b = torch.randn(300, generator=gen).to(DEV)
    y = w12.linear(x, w, b.to(torch.bfloat16))
    assert y.shape == (2, 3, 300)
    ref = _ref(x.view(6, 200), wt.to(DEV), b.to(torch.bfloat16))
    _assert_close(y.view(6, 300), ref, x.view(6, 200), wt.to(DEV))


def test_strided_activations():
    # Transformers hands the LM head hidden[:, -1:, :] of a [B, T, K] tensor: not contiguous.
    gen = torch.Generator().manual_seed(7)
    lin = torch.nn.Linear(256, 384, bias=False, dtype=torch.bfloat16)
    mod = W12Linear.from_linear(lin).to(DEV)
    h = torch.randn(8, 5, 256, generator=gen).to(torch.bfloat16).to(DEV)
    x = h[:, -1:, :]
    assert not x.is_contiguous()
    want = mod(x.contiguous()).view(torch.int16)
    assert torch.equal(mod(x).view(torch.int16), want)
    w = mod.weight_w12()
    assert torch.equal(w12.linear(x, w).view(torch.int16), want)


def test_inf_nan_and_subnormal_weights():
    gen = torch.Generator().manual_seed(6)
    wt = _weight(256, 128, gen)
    wt[3, 5] = float("inf")
    wt[7, 0] = float("-inf")
    wt[9, 127] = float("nan")
    wt[11, 1] = torch.tensor(1e-40).to(torch.bfloat16)  # subnormal
    w = w12.pack(wt).to(DEV).with_layout(DEFAULT_LAYOUT)
    x = torch.randn(5, 128, generator=gen).to(torch.bfloat16).to(DEV)
    x[2, 5] = 0.0  # inf * 0 = NaN in row 3, token 2
    y = w12.linear(x, w).double()
    ref = _ref(x, wt.to(DEV))
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert torch.equal(torch.isinf(y), torch.isinf(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(y[fin], ref[fin], rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("n,k", [(512, 4096), (4096, 4096), (384, 1000), (256, 14336)])
def test_deterministic_and_independent_of_m(n, k, kernel, monkeypatch):
    # The fused kernel's promise (the decode + cuBLAS prefill fallback makes none): keep it on for
    # M = 128, which runs as two 64-token passes (v1-v3) or one 128-token pass (v4).
    monkeypatch.setenv("W12_GEMM_FALLBACK_M", "1000")
    monkeypatch.setenv("W12_GEMM_KERNEL", kernel)
    gen = torch.Generator().manual_seed(11)
    wt = _weight(n, k, gen, spread=False)
    w = w12.pack(wt).to(DEV).with_layout(cuda_ops.preferred_layout(DEV))
    x = torch.randn(128, k, generator=gen).to(torch.bfloat16).to(DEV)
    full = w12.linear(x, w).view(torch.int16)
    again = w12.linear(x, w).view(torch.int16)
    assert torch.equal(full, again), "two runs differ"
    for m in [1, 2, 3, 7, 8, 16, 31, 33, 64]:
        part = w12.linear(x[:m].clone(), w).view(torch.int16)
        assert torch.equal(part, full[:m]), f"rows computed with M={m} differ from M=128"
    # Rows 64.. (v1-v3: the second pass; v4: the same pass) equal those rows computed on their own.
    assert torch.equal(w12.linear(x[64:].clone(), w).view(torch.int16), full[64:])


@pytest.mark.parametrize("kernel", [k for k in KERNELS if k in ("v1", "v4")])
def test_reduce_kernel_staged_and_plain_agree(kernel, monkeypatch):
    # The reduce kernel stages a row tile's escapes in shared memory where its grid (row tiles x
    # 8-token chunks) is one wave, <= 4 CTAs per SM, and reads them from global memory otherwise.
    # Enough row tiles that 64 tokens take the plain path and 8 tokens the staged one; the dense
    # escapes (~520 per row tile) also overflow the staged table. Same bits either way.
    monkeypatch.setenv("W12_GEMM_KERNEL", kernel)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n, k = 128 * ((4 * sms) // 8 + 1), 2048
    assert cuda_ops.splits(n, k, DEV, int(kernel[1])) > 1, "the shape must be split along K"
    gen = torch.Generator().manual_seed(21)
    wt = _weight(n, k, gen, spread=False)
    w = w12.pack(wt).to(DEV).with_layout(cuda_ops.preferred_layout(DEV))
    x = torch.randn(64, k, generator=gen).to(torch.bfloat16).to(DEV)
    full = w12.linear(x, w)
    _assert_close(full, _ref(x, wt.to(DEV)), x, wt.to(DEV))
    for m in (1, 8):
        part = w12.linear(x[:m].clone(), w).view(torch.int16)
        assert torch.equal(part, full[:m].view(torch.int16)), f"rows at M={m} (staged) differ from M=64 (plain)"


@pytest.mark.parametrize("m", [1, 3, 16, 31, 37, 64])
@pytest.mark.parametrize("n,k", [(4096, 4096), (384, 1000)])
@pytest.mark.parametrize(
    "variant",
    [
        "4",
        "8",
        "16",
        "24",
        "512",
        "520",
        "65536",
        "131072",
        "131080",
        "524288",
        "524292",
        "pdl",
        "pdl:256",
        "pdl:1024",
        "pdl:2048",
        "pdl:8192",
        "pdl:61440",
    ],
)
def test_kernel_variants_agree(n, k, m, variant, monkeypatch):
    # Reduction by the reduce kernel (sm_90+) or global memory (4: forced),
    # 4-warp or 8-warp CTAs (8: 8-warp at every M; 524288: never, where the launcher would pick
    # them for these small grids at M <= 32), cluster also at M <= 8 (16), the in-kernel
    # ticket reduction instead of the PDL reduce kernel (512), the cluster reduction above 8 tokens
    # instead of the reduce kernel (65536; not where S > 8), records copied per thread with cp.async
    # instead of one bulk copy (131072, and with 8-warp CTAs: 131080); programmatic dependent
    # launch of the GEMM itself (W12_GEMM_PDL=1) with its trigger after the main loop (256), no
    # L2 prefetch before the wait (1024), padded shared memory (2048), 2 or 15 records prefetched
    # (8192, 61440): every variant adds the same products in the same order, so all must give the
    # same bits. (v1 only.)
    monkeypatch.setenv("W12_GEMM_KERNEL", "v1")
    gen = torch.Generator().manual_seed(21)
    w = w12.pack(_weight(n, k, gen, spread=False)).to(DEV).with_layout(1)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
    a = w12.linear(x, w).view(torch.int16)
    if variant.startswith("pdl"):
        monkeypatch.setenv("W12_GEMM_PDL", "1")
        variant = variant[4:] or "0"
    monkeypatch.setenv("W12_GEMM_DIAG", variant)
    b = w12.linear(x, w).view(torch.int16)
    assert torch.equal(a, b)


def test_cuda_graph_capture_and_replay():
    gen = torch.Generator().manual_seed(12)
    wt = _weight(512, 4096, gen)
    w = w12.pack(wt).to(DEV).with_layout(DEFAULT_LAYOUT)
    x = torch.randn(4, 4096, generator=gen).to(torch.bfloat16).to(DEV)
    eager = w12.linear(x, w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        w12.linear(x, w)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = w12.linear(x, w)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y.view(torch.int16), eager.view(torch.int16))


def test_layout0_records_still_correct():
    gen = torch.Generator().manual_seed(13)
    wt = _weight(256, 256, gen)
    w = w12.pack(wt).to(DEV)  # layout 0
    x = torch.randn(3, 256, generator=gen).to(torch.bfloat16).to(DEV)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = w12.linear(x, w)
    y1 = w12.linear(x, w.with_layout(DEFAULT_LAYOUT))
    assert torch.equal(y.view(torch.int16), y1.view(torch.int16))


def test_zero_rows():
    gen = torch.Generator().manual_seed(14)
    w = w12.pack(_weight(128, 64, gen)).to(DEV).with_layout(DEFAULT_LAYOUT)
    y = w12.linear(torch.empty(0, 64, dtype=torch.bfloat16, device=DEV), w)
    assert y.shape == (0, 128)


def _op_args(x, w, bias=None):
    return (x, *w.tensors(), w.N, w.K, w.layout, bias)


def test_bad_inputs_raise_clear_errors():
    gen = torch.Generator().manual_seed(15)
    w = w12.pack(_weight(130, 70, gen)).to(DEV).with_layout(DEFAULT_LAYOUT)
    x = torch.randn(3, 70, generator=gen).to(torch.bfloat16).to(DEV)
    with pytest.raises(TypeError, match="bfloat16"):
        torch.ops.w12.linear(*_op_args(x.half(), w))
    with pytest.raises(ValueError, match="expected cuda"):
        torch.ops.w12.linear(*_op_args(x.cpu(), w)[:1], *_op_args(x, w)[1:])
    with pytest.raises(ValueError, match="contiguous"):
        xt = torch.randn(70, 3, device=DEV).to(torch.bfloat16).t()
        torch.ops.w12.linear(*_op_args(xt, w))
    with pytest.raises(ValueError, match="needs x"):
        torch.ops.w12.linear(*_op_args(x[:, :69].contiguous(), w))
    with pytest.raises(ValueError, match="w12.linear"):
        w12.linear(x[:, :69], w)
    with pytest.raises(ValueError, match="bias"):
        torch.ops.w12.linear(*_op_args(x, w, torch.zeros(3, device=DEV)))
    with pytest.raises(ValueError, match="base has shape"):
        args = list(_op_args(x, w))
        args[2] = args[2][:-1]
        torch.ops.w12.linear(*args)


def test_splits_do_not_depend_on_m():
    # The reduction order is a function of (N, K, SM count) only: the C side never sees M.
    s = cuda_ops.splits(4096, 4096, DEV)
    assert 2 <= s <= 8
    assert cuda_ops.splits(128256, 4096, DEV) == 1
    want = layouts.WGMMA_SPLIT_LAYOUT if "v4" in KERNELS else layouts.MMA_SYNC_SPLIT_LAYOUT
    assert cuda_ops.preferred_layout(DEV) == want  # auto runs v4 on sm_90, v1/v2 elsewhere


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("n,k", [(4096, 4096), (256, 14336), (130, 70)])
def test_v2_ring_depth_changes_no_bit(n, k, m, monkeypatch):
    # The ring depth (W12_GEMM_STAGES caps it; 2 wraps the mbarrier phases every other record)
    # changes only timing, never which CTA sums what in which order.
    monkeypatch.setenv("W12_GEMM_KERNEL", "v2")
    gen = torch.Generator().manual_seed(31 + m)
    w = w12.pack(_weight(n, k, gen, spread=False)).to(DEV).with_layout(1)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
    a = w12.linear(x, w).view(torch.int16)
    for cap in ("2", "3", "5"):
        monkeypatch.setenv("W12_GEMM_STAGES", cap)
        assert torch.equal(w12.linear(x, w).view(torch.int16), a), f"W12_GEMM_STAGES={cap} changed the result"


@pytest.mark.parametrize("cps", ["1", "2"])
@pytest.mark.parametrize("m", [3, 40])
def test_v2_grid_sizes_correct(cps, m, monkeypatch):
    # Other grid sizes move every range boundary (other bits, still within rounding of FP64).
    monkeypatch.setenv("W12_GEMM_KERNEL", "v2")
    monkeypatch.setenv("W12_GEMM_CTAS_PER_SM", cps)
    gen = torch.Generator().manual_seed(41 + m)
    wt = _weight(640, 3000, gen)
    w = w12.pack(wt).to(DEV).with_layout(1)
    x = torch.randn(m, 3000, generator=gen).to(torch.bfloat16).to(DEV)
    _poison_next_alloc(m * 640)
    y = w12.linear(x, w)
    _assert_close(y, _ref(x, wt.to(DEV)), x, wt.to(DEV))


@pytest.mark.parametrize("kernel", KERNELS)
def test_graph_replays_with_new_inputs(kernel, monkeypatch):
    # Replays must leave the cross-CTA flags reset: new inputs copied into the captured buffer give
    # the same bits as eager calls, replay after replay, and eager calls after replays still work.
    monkeypatch.setenv("W12_GEMM_KERNEL", kernel)
    gen = torch.Generator().manual_seed(51)
    wt = _weight(384, 5000, gen)
    w = w12.pack(wt).to(DEV).with_layout(cuda_ops.preferred_layout(DEV))
    xs = [torch.randn(5, 5000, generator=gen).to(torch.bfloat16).to(DEV) for _ in range(4)]
    eager = [w12.linear(x, w) for x in xs]
    static_x = xs[0].clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        w12.linear(static_x, w)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = w12.linear(static_x, w)
    for rep in range(3):
        for i, x in enumerate(xs):
            static_x.copy_(x)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(y.view(torch.int16), eager[i].view(torch.int16)), f"replay {rep}, input {i}"
    assert torch.equal(w12.linear(xs[1], w).view(torch.int16), eager[1].view(torch.int16))
    _assert_close(eager[2], _ref(xs[2], wt.to(DEV)), xs[2], wt.to(DEV))


def test_every_kernel_correct_with_bias_and_escapes(monkeypatch):
    gen = torch.Generator().manual_seed(61)
    wt = _weight(1000, 2100, gen)
    wt[5, 7] = float("inf")
    wt[900, 2000] = float("nan")
    w = w12.pack(wt).to(DEV).with_layout(1)
    x = torch.randn(9, 2100, generator=gen).to(torch.bfloat16).to(DEV)
    b = torch.randn(1000, generator=gen).to(torch.bfloat16).to(DEV)
    ref = _ref(x, wt.to(DEV), b)
    for kernel in KERNELS:
        monkeypatch.setenv("W12_GEMM_KERNEL", kernel)
        y = w12.linear(x, w, b).double()
        assert torch.equal(torch.isnan(y), torch.isnan(ref)), kernel
        assert torch.equal(torch.isinf(y), torch.isinf(ref)), kernel
        fin = torch.isfinite(ref)
        torch.testing.assert_close(y[fin], ref[fin], rtol=2**-7, atol=1e-3)


def test_bad_kernel_setting(monkeypatch):
    monkeypatch.setenv("W12_GEMM_KERNEL", "v9")
    gen = torch.Generator().manual_seed(71)
    w = w12.pack(_weight(128, 64, gen)).to(DEV).with_layout(1)
    with pytest.raises(ValueError, match="W12_GEMM_KERNEL"):
        w12.linear(torch.randn(1, 64, generator=gen).to(torch.bfloat16).to(DEV), w)


@pytest.mark.parametrize("n,k", [(384, 1000), (4096, 4096)])
def test_auto_kernel_matches_its_choice(n, k, monkeypatch):
    gen = torch.Generator().manual_seed(81)
    w = w12.pack(_weight(n, k, gen, spread=False)).to(DEV).with_layout(DEFAULT_LAYOUT)
    x = torch.randn(7, k, generator=gen).to(torch.bfloat16).to(DEV)
    monkeypatch.setenv("W12_GEMM_KERNEL", "auto")
    chosen = cuda_ops.kernel_version(n, k, DEV)
    assert chosen == 4 if "v4" in KERNELS else chosen in (1, 2)
    y = w12.linear(x, w).view(torch.int16)
    monkeypatch.setenv("W12_GEMM_KERNEL", f"v{chosen}")
    assert torch.equal(w12.linear(x, w).view(torch.int16), y)


@pytest.mark.parametrize("m", [1, 5, 16, 40, 64])
@pytest.mark.parametrize("n,k", [(4096, 4096), (8448, 1000), (130, 70), (256, 14336), (96, 320)])
def test_v3_variants_change_no_bit(n, k, m, monkeypatch):
    # v3's sum is r0 + r1 + ... + r7 over eight K ranges fixed by K alone: programmatic
    # dependent launch (W12_GEMM_DIAG=32 turns it off), one warp per range instead of two at
    # M <= 8 (64), the ring depth and the grid change only timing.
    monkeypatch.setenv("W12_GEMM_KERNEL", "v3")
    gen = torch.Generator().manual_seed(91 + m)
    wt = _weight(n, k, gen, spread=False)
    w = w12.pack(wt).to(DEV).with_layout(1)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
    _poison_next_alloc(m * n)
    a = w12.linear(x, w)
    _assert_close(a, _ref(x, wt.to(DEV)), x, wt.to(DEV))
    a = a.view(torch.int16)
    for diag in ("32", "64"):
        monkeypatch.setenv("W12_GEMM_DIAG", diag)
        assert torch.equal(w12.linear(x, w).view(torch.int16), a), f"W12_GEMM_DIAG={diag} changed the result"
    monkeypatch.setenv("W12_GEMM_DIAG", "0")
    for cap in ("2", "3", "5"):
        monkeypatch.setenv("W12_GEMM_STAGES", cap)
        assert torch.equal(w12.linear(x, w).view(torch.int16), a), f"W12_GEMM_STAGES={cap} changed the result"
    monkeypatch.setenv("W12_GEMM_STAGES", "0")
    monkeypatch.setenv("W12_GEMM_CTAS_PER_SM", "1")
    assert torch.equal(w12.linear(x, w).view(torch.int16), a), "one CTA per SM changed the result"


@pytest.mark.parametrize("pdl", ["auto", "1"])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("kernel", KERNELS)
def test_back_to_back_in_a_graph(kernel, m, pdl, monkeypatch):
    # A chain where each GEMM consumes the previous output, in a graph and eagerly. Under
    # programmatic dependent launch (v1: GEMM -> reduce kernel -> next GEMM at M <= 8, cluster
    # GEMMs back to back at M = 16; v3) each launch may start before the previous one ends and
    # prefetches weights before griddepcontrol.wait: it must still see finished inputs.
    monkeypatch.setenv("W12_GEMM_KERNEL", kernel)
    monkeypatch.setenv("W12_GEMM_PDL", pdl)
    gen = torch.Generator().manual_seed(101)
    ws = [
        w12.pack(_weight(1024, 1024, gen, spread=False) * 0.03).to(DEV).with_layout(cuda_ops.preferred_layout(DEV))
        for _ in range(6)
    ]
    x0 = torch.randn(m, 1024, generator=gen).to(torch.bfloat16).to(DEV)

    def chain(x):
        for w in ws:
            x = w12.linear(x, w)
        return x

    monkeypatch.setenv("W12_GEMM_PDL", "0")
    ref = chain(x0).view(torch.int16).clone()
    monkeypatch.setenv("W12_GEMM_PDL", pdl)
    assert torch.equal(chain(x0).view(torch.int16), ref)
    static_x = x0.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(static_x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = chain(static_x)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y.view(torch.int16), ref)


@pytest.mark.parametrize("m", [33, 64])
@pytest.mark.parametrize("n,k", [(4096, 4096), (384, 1000)])
def test_v1_ring_depth_changes_no_bit(n, k, m, monkeypatch):
    # Above 32 tokens v1 picks 3 or 4 stages by the grid's waves (wave_stages); either depth adds
    # the same products in the same order.
    monkeypatch.setenv("W12_GEMM_KERNEL", "v1")
    gen = torch.Generator().manual_seed(141 + m)
    wt = _weight(n, k, gen, spread=False)
    w = w12.pack(wt).to(DEV).with_layout(1)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
    ys = []
    for stages in ("0", "3", "4"):
        monkeypatch.setenv("W12_GEMM_STAGES", stages)
        ys.append(w12.linear(x, w).view(torch.int16))
    _assert_close(ys[0].view(torch.bfloat16), _ref(x, wt.to(DEV)), x, wt.to(DEV))
    assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2])


@pytest.mark.parametrize("m", [48, 49, 64])
def test_v1_two_ctas_per_sm_changes_no_bit(m, monkeypatch):
    # v1's unsplit grids of more than two 128-row tiles per SM run at most two CTAs per SM at
    # 49-64 tokens on sm_90 (timing only); W12_GEMM_DIAG=262144 never caps. N off the tile edge.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n, k = 128 * (2 * sms + 3) + 77, 256
    assert cuda_ops.splits(n, k, DEV, kernel=1) == 1
    ys = _outputs_per_diag(n, k, m, True, 210 + m, ("0", "262144"), monkeypatch, kernel="v1")
    assert torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16)), "v1 capped against uncapped"


@pytest.mark.parametrize("m", [32, 33, 47, 64, 100])
@pytest.mark.parametrize(
    "n,k,bias",
    [
        (1000, 192, True),  # 3 slices, 8 tiles: N off the tile edge
        (640, 4096, False),  # 5 tiles (the last CTA holds one), split
        (128 * 9 + 77, 256, True),  # unsplit, 10 tiles, N off the tile edge
        ("rule", 256, True),  # unsplit, odd tile count, enough tiles for the default rule
    ],
)
def test_v1_r64_changes_no_bit(n, k, bias, m, monkeypatch):
    # R64 (gemm_w12_rows64_sm120.cu: 64 rows per warp, two row tiles per CTA) at 33-64 tokens
    # gives each accumulator v1's MMAs in v1's order and parks v1's partial map: the same bits as
    # v1's kernel. W12_GEMM_DIAG=64 never runs it, 128 wherever it can (at 32 and 100 tokens
    # neither does: v1's kernel, 100 as 64 + 36).
    if torch.cuda.get_device_capability(0)[0] < 9:
        pytest.skip("R64 runs on sm_90+ only")
    if n == "rule":
        n = 128 * (3 * torch.cuda.get_device_properties(0).multi_processor_count + 2) + 77
        assert cuda_ops.splits(n, k, DEV, kernel=1) == 1
    ys = _outputs_per_diag(n, k, m, bias, 230 + m, ("64", "0", "128"), monkeypatch, kernel="v1")
    for d, y in zip(("0", "128"), ys[1:]):
        assert torch.equal(ys[0].view(torch.int16), y.view(torch.int16)), f"v1 against R64 (diagnostic {d})"
