"""GPU tests of the fused W12 GEMM (``w12.linear`` on CUDA). Run with ``pytest -m gpu``."""

from __future__ import annotations

import warnings

import pytest
import torch

import w12
from w12 import cuda_ops, layouts
from w12.nn import W12Linear

pytestmark = pytest.mark.gpu

DEV = "cuda"
MS = [1, 2, 3, 7, 8, 16, 31, 64, 128, 300]
# At and off the 128x64 tile edges; 512x4096 and 384x1000 exercise the K-split reduction (v1) and
# tiles cut mid-K between stream-K ranges (v2); 256x14336 cuts each tile over ~130 CTAs; the
# small ones leave most v2 CTAs with an empty range.
NKS = [(128, 64), (256, 128), (130, 70), (1, 1), (127, 65), (512, 4096), (384, 1000), (1000, 192), (256, 14336)]


def _all_kernels():
    # v4 is the Hopper wgmma kernel: sm_90 only.
    ks = ["v1", "v2", "v3"]
    if torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0):
        ks.append("v4")
    return ks


KERNELS = _all_kernels()
# The layout the default kernel (auto) reads here: 3 where auto runs v4 (sm_90), else 4.
DEFAULT_LAYOUT = cuda_ops.preferred_layout(DEV) if torch.cuda.is_available() else 4


@pytest.fixture(scope="module", autouse=True)
def _kernels_present():
    if not cuda_ops.available():
        pytest.fail(f"libw12.so is not loadable: {cuda_ops._LIB_ERROR}")


def _weight(n, k, gen, escapes=True, spread=True):
    """BF16 weight with per-row scales over many binades and a sprinkling of escapes."""
    w = torch.randn(n, k, generator=gen)
    if spread:
        w *= torch.exp2(torch.randint(-20, 8, (n, 1), generator=gen).float())
    w = w.to(torch.bfloat16)
    if escapes and n * k > 4:
        flat = w.view(-1)
        idx = torch.randint(0, n * k, (max(1, n * k // 500),), generator=gen)
        flat[idx[0::3]] = 0.0  # zeros: escapes
        flat[idx[1::3]] = (flat[idx[1::3]].float() * 2.0**30).to(torch.bfloat16)  # far above the window
        flat[idx[2::3]] = (flat[idx[2::3]].float() * 2.0**-30).to(torch.bfloat16)  # far below
    return w


def _ref(x, wt, bias=None):
    y = x.double() @ wt.double().t()
    return y if bias is None else y + bias.double()


def _assert_close(y, ref, x, wt):
    """Output within BF16 rounding of the FP64 result plus an FP32-accumulation allowance."""
    assert y.dtype == torch.bfloat16
    mag = x.double().abs() @ wt.double().abs().t()
    err = (y.double() - ref).abs()
    bound = 2.0**-8 * ref.abs() + 2.0**-14 * mag + 1e-30
    bad = err > bound
    assert not torch.isnan(y).any(), "NaN in the output"
    assert not bad.any(), f"{int(bad.sum())} elements off; worst excess {float((err - bound).max()):.3e}"
    rel = float((y.double() - ref).norm() / ref.norm().clamp_min(1e-300))
    assert rel < 4e-3, f"relative error {rel:.2e}"


def _poison_next_alloc(numel):
    # Fill a block of the output's size with NaN and free it: the caching allocator hands the
    # same block to the next allocation of that size, so unwritten outputs show up as NaN.
    torch.full((numel,), float("nan"), dtype=torch.bfloat16, device=DEV)


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


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
@pytest.mark.parametrize("m", [65, 100, 128])
@pytest.mark.parametrize("n,k,bias", [(6144, 4096, False), (6144 + 77, 4096, True)])  # N on and off the tile edge
def test_v4_many_tile_split_grid_at_65_128_tokens(n, k, bias, m, monkeypatch):
    # qkv-like weights (8 slices, 48-49 row tiles) at 65..128 tokens: two GEMM waves, and a reduce
    # grid of 16 token chunks per row tile that the 8-slice reduce form cannot hold at once, so it
    # fetches the slices four at a time at 6 CTAs per SM (same adds, same order). The rows must
    # equal the same rows computed in 64-token passes (8 chunks per row tile: the 8-slice form).
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
    # (4096 x 4096 at 9 tokens takes it by default); 266240: row-tile pairs with the single ring
    # instead of the split ring (262144 takes the split ring at 100 tokens).
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


def _outputs_per_diag(n, k, m, bias, seed, diags, monkeypatch, kernel="v4"):
    """``kernel``'s output for one weight and input under each W12_GEMM_DIAG value; the first
    checked against the FP64 reference (the rest are compared bit for bit by the caller)."""
    monkeypatch.setenv("W12_GEMM_KERNEL", kernel)
    gen = torch.Generator().manual_seed(seed)
    wt = _weight(n, k, gen, spread=False).to(DEV)
    w = w12.pack(wt).with_layout(cuda_ops.preferred_layout(DEV))
    b = torch.randn(n, generator=gen).to(DEV) if bias else None
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
    ys = []
    for diag in diags:
        monkeypatch.setenv("W12_GEMM_DIAG", diag)
        _poison_next_alloc(m * n)
        ys.append(w12.linear(x, w, b))
    _assert_close(ys[0], _ref(x, wt, b), x, wt)
    return ys


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
    # At 17..64 tokens v4 gives each pair of consecutive K slices of a split weight (>= 4 slices)
    # one CTA, which runs both from zero, adds them in add_slice's order and parks one partial;
    # W12_GEMM_DIAG=512 does so on every split grid up to 64 tokens, 128 never (at 100 tokens
    # neither runs: the split grid as before). The same adds in the same order as the reduce
    # kernel's, so the same bits.
    ys = _outputs_per_diag(n, k, m, bias, 180 + m, ("0", "512", "128"), monkeypatch)
    assert torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16)), "pair grid everywhere (512)"
    assert torch.equal(ys[0].view(torch.int16), ys[2].view(torch.int16)), "pair grid never (128)"


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
@pytest.mark.parametrize("m", [1, 3, 9, 16, 17, 32])
@pytest.mark.parametrize("tiles_per_sm,k,bias", [(1.7, 512, True), (1.62, 320, False), (1.95, 256, True)])
def test_v4_balanced_grid_changes_no_bit(tiles_per_sm, k, bias, m, monkeypatch):
    # Unsplit weights of between one and two 128-row tiles per SM (gate_up's 224 on 132 SMs) run at
    # <= 32 tokens as 2 x SMs CTAs dealt 16-row slices evenly, a CTA's warps holding slices of two
    # tiles; W12_GEMM_DIAG=8192 keeps the 128-row CTAs. N off the 16-row and 128-row edges.
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
    # Where the whole-K clusters run: at most 16 tokens, an even 2-8 slices of >= 16 records, at
    # most one CTA per SM (four per 128-row tile).
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert cuda_ops.wholek_stages(4096, 14336, 16, DEV) >= 3
    assert cuda_ops.wholek_stages(4096, 14336, 17, DEV) == 0
    assert cuda_ops.wholek_stages(4096, 14336, 1, DEV, diag=16) == 0
    if cuda_ops.splits(4096, 4096, DEV, 4) == 8:  # 8 records per slice
        assert cuda_ops.wholek_stages(4096, 4096, 1, DEV) == 0
        assert cuda_ops.wholek_stages(4096, 4096, 1, DEV, diag=131072) >= 3
    assert cuda_ops.wholek_stages(28672, 4096, 1, DEV) == 0  # unsplit
    n_many = 128 * (sms // 4 + 1)
    if 1 < cuda_ops.splits(n_many, 14336, DEV, 4) <= 8:
        assert cuda_ops.wholek_stages(n_many, 14336, 1, DEV) == 0  # more than one CTA per SM
    if cuda_ops.splits(512, 4096, DEV, 4) > 8:
        assert cuda_ops.wholek_stages(512, 4096, 1, DEV) == 0  # more slices than warpgroups


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


def _escape_weight(n, k, per_row, gen):
    """N(0, 0.02) BF16 weight with about `per_row` escapes per row (zeros and values far below the
    row's window, at random columns) and a fixed set: columns 0, 63, 64, 127 and k - 1, one column
    shared by consecutive rows, one row with many escapes, escapes in the last row."""
    w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
    cnt = int(per_row * n)
    rows, cols = torch.randint(0, n, (cnt,), generator=gen), torch.randint(0, k, (cnt,), generator=gen)
    w[rows[0::2], cols[0::2]] = 0.0
    w[rows[1::2], cols[1::2]] = (w[rows[1::2], cols[1::2]].float() * 2.0**-40).to(torch.bfloat16)
    for r, c in [(0, 0), (0, 63), (0, 64), (1, 127), (1, k - 1), (2, 5), (3, 5), (4, 5), (130, 64), (n - 1, k - 1)]:
        w[r, c] = 0.0
    w[5, :40:3] = 0.0
    return w


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


class _Ints:
    """n int32 at a raw device pointer, for torch.as_tensor (__cuda_array_interface__)."""

    def __init__(self, ptr: int, n: int):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<i4", "data": (ptr, False), "version": 3}


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
    assert torch.as_tensor(_Ints(ptr, 2), device=DEV).tolist() == [0, 0], "XT counts left set"


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
