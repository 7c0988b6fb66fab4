"""CPU-side tests of the W12 GEMM: layout 1, an emulation of the kernel's register decode and
fragment mapping, the Python wrapper's checks, the fake implementation / torch.compile tracing,
and (when nvcc is present) compiling the CUDA sources."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import w12
from w12 import cuda_ops, layouts, reference
from w12.format import RECORD_BYTES, convert_layout, get_layout, join_record_bits, split_record_bits

ROOT = Path(__file__).resolve().parent.parent
E0 = 112  # kernels_sm120/smxx_w12_decode.cuh kDecodeE0


# ---- emulation of smxx_w12_decode.cuh (bit for bit) ------------------------------------------
M32 = np.uint64(0xFFFFFFFF)


def _prmt(a, b, sel):
    """PTX prmt.b32 (default mode): selector bit 3 of a byte replicates the chosen byte's sign."""
    src = [(a >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)]
    src += [(b >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        s = (sel >> (4 * i)) & 15
        byte = src[s & 7]
        if s & 8:
            byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        out |= byte << np.uint64(8 * i)
    return out


def _decode_pair(hw, nib, p, half):
    t = (_prmt(hw, np.zeros_like(hw), 0xA280 if p == 0 else 0xB391) << np.uint64(4)) & M32
    lo = _prmt(nib, np.full_like(nib, 0x38383838), 0x4140 if half == 0 else 0x4342)
    sel = np.uint64(0x87F087F0)
    return ((t & sel) | (lo & ~sel)) & M32


def _decode16(hi_words, lo_words):
    """hi_words [..., 4], lo_words [..., 2] (uint64 holding u32) -> 8 registers [..., 8].

    The nibble words are passed unmasked, as in the kernel (its final select drops the junk)."""
    e = [lo_words[..., i] for i in range(2)]
    o = [lo_words[..., i] >> np.uint64(4) for i in range(2)]
    regs = []
    for w in range(4):
        for p in range(2):
            regs.append(_decode_pair(hi_words[..., w], (e if p == 0 else o)[w // 2], p, w & 1))
    return np.stack(regs, axis=-1)


def _decode16_split(l_words, n_words):
    """decode16_split: L words [..., 4], N words [..., 2] -> 8 registers [..., 8]."""
    k38 = np.uint64(0x38383838)

    def high(n):
        return (n & np.uint64(0x87878787)) | k38

    regs = []
    for j in range(2):
        n = n_words[..., j]
        rot = ((n << np.uint64(4)) | (n >> np.uint64(28))) & M32
        for lw, h in ((l_words[..., 2 * j], high(n)), (l_words[..., 2 * j + 1], high(rot))):
            regs += [_prmt(lw, h, 0x5140), _prmt(lw, h, 0x7362)]
    return np.stack(regs, axis=-1)


def test_decode16_split_every_code():
    """Every 12-bit code in every slot of a split vector decodes as decode16 would: s<<15 |
    (c+E0)<<7 | m, the same BF16 pattern, whatever the other 15 slots hold."""
    rng = np.random.default_rng(1)
    codes = np.arange(4096)
    for slot in range(16):
        planes = rng.integers(0, 4096, size=(codes.size, 16))
        planes[:, slot] = codes
        hi, lo = (planes >> 4).astype(np.uint8), (planes & 15).astype(np.uint8)
        rec = torch.from_numpy(np.concatenate([hi, lo[:, 0::2] | (lo[:, 1::2] << 4)], axis=1))
        # one vector's worth of a record: 16 slots = 16 L bytes + 8 N bytes
        full = torch.zeros(codes.size, RECORD_BYTES, dtype=torch.uint8)
        full[:, :16], full[:, 8192:8200] = rec[:, :16], rec[:, 16:]
        split = split_record_bits(full).numpy()
        regs = _decode16_split(_words(split[:, :16]), _words(split[:, 8192:8200]))
        got = (regs[:, slot // 2] >> np.uint64(16 * (slot % 2))) & np.uint64(0xFFFF)
        c = codes.astype(np.uint64)
        want = ((c >> np.uint64(11)) << np.uint64(15)) | (
            (((c >> np.uint64(7)) & np.uint64(15)) + np.uint64(E0)) << np.uint64(7)
        )
        want |= c & np.uint64(0x7F)
        assert np.array_equal(got, want), slot
        assert torch.equal(join_record_bits(torch.from_numpy(split)), full)


def _rot8(v, left):
    return (
        ((v << np.uint64(8)) | (v >> np.uint64(24))) if left else ((v >> np.uint64(8)) | (v << np.uint64(24)))
    ) & M32


def _spread(n):
    return (n & 0xF) | ((n & 0xF0) << 4) | ((n & 0xF00) << 8) | ((n & 0xF000) << 12)


def _pack(x):
    return (x & 0xF) | ((x >> 4) & 0xF0) | ((x >> 8) & 0xF00) | ((x >> 12) & 0xF000)


def test_permute_kernel_word_transforms_match_format(rng):
    """kernels_sm120/codec_layout_sm120.cu's split_chunk / join_chunk (emulated word for word on
    each thread's 16 hi bytes and 8 lo bytes) give w12.format's split_record_bits / join_record_bits."""
    rec = torch.randint(0, 256, (3, RECORD_BYTES), dtype=torch.uint8, generator=rng)
    h = _words(rec[:, :8192].numpy().reshape(3, 512, 16))  # [rec, thread, 4]
    lw = _words(rec[:, 8192:].numpy().reshape(3, 512, 8))  # [rec, thread, 2]
    u = np.uint64
    sh, sl = h.copy(), lw.copy()
    for g in range(2):
        a, b, nib = h[..., 2 * g], h[..., 2 * g + 1], lw[..., g]
        sl[..., g] = (a & u(0x80808080)) | ((a >> u(4)) & u(0x07070707)) | ((b >> u(4)) & u(0x08080808))
        sl[..., g] |= _rot8(b, left=False) & u(0x70707070)
        sh[..., 2 * g] = (((a & u(0x0F0F0F0F)) << u(4)) | _spread(nib & u(0xFFFF))) & M32
        sh[..., 2 * g + 1] = (((b & u(0x0F0F0F0F)) << u(4)) | _spread(nib >> u(16))) & M32

    def to_bytes(hw, lw_):
        hb = (hw[..., None] >> (u(8) * np.arange(4, dtype=np.uint64))) & u(0xFF)
        lb = (lw_[..., None] >> (u(8) * np.arange(4, dtype=np.uint64))) & u(0xFF)
        return torch.from_numpy(np.concatenate([hb.reshape(3, -1), lb.reshape(3, -1)], axis=1).astype(np.uint8))

    split = to_bytes(sh, sl)
    assert torch.equal(split, split_record_bits(rec))
    jh, jl = sh.copy(), sl.copy()
    for g in range(2):
        la, lb, n = sh[..., 2 * g], sh[..., 2 * g + 1], sl[..., g]
        jh[..., 2 * g] = (n & u(0x80808080)) | ((n & u(0x07070707)) << u(4)) | ((la >> u(4)) & u(0x0F0F0F0F))
        jh[..., 2 * g + 1] = ((n & u(0x08080808)) << u(4)) | (_rot8(n, left=True) & u(0x70707070))
        jh[..., 2 * g + 1] |= (lb >> u(4)) & u(0x0F0F0F0F)
        jl[..., g] = _pack(la & u(0x0F0F0F0F)) | (_pack(lb & u(0x0F0F0F0F)) << u(16))
    assert torch.equal(to_bytes(jh, jl), rec)
    assert torch.equal(join_record_bits(split), rec)


def test_decode_pair_every_code():
    """Every (hi byte, nibble) in every position of a pair decodes to s<<15 | (c+E0)<<7 | m."""
    h = np.arange(256, dtype=np.uint64)
    n = np.arange(16, dtype=np.uint64)
    hh, nn = [a.ravel() for a in np.meshgrid(h, n, indexing="ij")]
    rng = np.random.default_rng(0)
    want = ((hh >> np.uint64(7)) << np.uint64(15)) | (
        (((hh >> np.uint64(3)) & np.uint64(15)) + np.uint64(E0)) << np.uint64(7)
    )
    want |= ((hh & np.uint64(7)) << np.uint64(4)) | nn
    for p in range(2):
        for half in range(2):
            # the element pair (p, p + 2) of the hi word; junk in every other byte and nibble
            junk = rng.integers(0, 2**32, size=(4, hh.size), dtype=np.uint64)
            hw = junk[0] & ~((np.uint64(0xFF) << np.uint64(8 * p)) | (np.uint64(0xFF) << np.uint64(8 * (p + 2))))
            hw |= (hh << np.uint64(8 * p)) | (junk[1] & np.uint64(0xFF)) << np.uint64(8 * (p + 2))
            hw2 = (hw & ~(np.uint64(0xFF) << np.uint64(8 * (p + 2)))) | (hh << np.uint64(8 * (p + 2)))
            nib = junk[2] & M32
            byte0, byte1 = 2 * half, 2 * half + 1
            nib = (nib & ~(np.uint64(0xF) << np.uint64(8 * byte0))) | (nn << np.uint64(8 * byte0))
            nib = (nib & ~(np.uint64(0xF) << np.uint64(8 * byte1))) | (nn << np.uint64(8 * byte1))
            r = _decode_pair(hw, nib, p, half)
            assert np.array_equal(r & np.uint64(0xFFFF), want), (p, half)
            r2 = _decode_pair(hw2, nib, p, half)
            assert np.array_equal(r2 >> np.uint64(16), want), (p, half)


def _words(b: np.ndarray) -> np.ndarray:
    return b.reshape(*b.shape[:-1], -1, 4).astype(np.uint64) @ (np.uint64(1) << np.arange(0, 32, 8, dtype=np.uint64))


def _bf16_pair_to_f64(reg):
    lo = (reg & np.uint64(0xFFFF)).astype(np.uint32) << 16
    hi = ((reg >> np.uint64(16)) & np.uint64(0xFFFF)).astype(np.uint32) << 16
    return lo.view(np.float32).astype(np.float64), hi.view(np.float32).astype(np.float64)


def emulate_record_gemm(record: np.ndarray, base: np.ndarray, x: np.ndarray, layout: int = 1) -> np.ndarray:
    """What a kernel computes for one record (before escapes): [128 rows, T tokens].

    Walks the kernel's steps: per-thread loads, decode16, the m16n8k16 fragment definitions of the
    PTX ISA (wgmma's register A fragment is the same per warp), the activation columns that meet
    each MMA k index (layout 1: the words the mma.sync thread loads; layouts 2 and 3: column
    16ks + k, the wgmma B tile in column order; layout 3 decodes with decode16_split), then the
    row scale 2^(b - E0).
    """
    T = x.shape[0]
    x16 = x.astype(np.float64)
    out = np.zeros((128, T))
    for w in range(4):
        regs = np.zeros((32, 32), dtype=np.uint64)  # [lane, R]
        for lane in range(32):
            for q in range(4):
                hi = record[2048 * w + 512 * q + 16 * lane : 2048 * w + 512 * q + 16 * lane + 16]
                lo = record[8192 + 1024 * w + 256 * q + 8 * lane : 8192 + 1024 * w + 256 * q + 8 * lane + 8]
                decode = _decode16_split if get_layout(layout).split else _decode16
                regs[lane, 8 * q : 8 * q + 8] = decode(_words(hi), _words(lo))
        for mt in range(2):
            for ks in range(4):
                A = np.zeros((16, 16))
                B = np.zeros((16, T))
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    for r in range(4):
                        v0, v1 = _bf16_pair_to_f64(regs[lane, 16 * mt + 4 * ks + r])
                        row, kk = g + 8 * (r & 1), 2 * t + 8 * (r >> 1)
                        A[row, kk], A[row, kk + 1] = v0, v1
                    # activation words the thread loads: cols 16t .. 16t+15, word 2ks -> b0, 2ks+1 -> b1
                    for n in range(g, T, 8):
                        if layout in (layouts.MMA_SYNC_LAYOUT, layouts.MMA_SYNC_SPLIT_LAYOUT):
                            cols = 16 * t + 4 * ks + np.array([0, 1, 2, 3])
                        else:
                            cols = 16 * ks + 2 * t + np.array([0, 1, 8, 9])
                        B[2 * t, n], B[2 * t + 1, n] = x16[n, cols[0]], x16[n, cols[1]]
                        B[2 * t + 8, n], B[2 * t + 9, n] = x16[n, cols[2]], x16[n, cols[3]]
                out[32 * w + 16 * mt : 32 * w + 16 * mt + 16] += A @ B
    scale = np.exp2(base.astype(np.float64) - E0)
    return out * scale[:, None]


def test_kernel_layouts_registered_and_permutations():
    for lid in range(1, 5):
        lay = get_layout(lid)
        assert torch.equal(torch.sort(lay.perm).values, torch.arange(8192))
        assert lay.split == (lid >= 3)
    assert cuda_ops.preferred_layout() == layouts.MMA_SYNC_SPLIT_LAYOUT
    assert cuda_ops.preferred_layout("cpu") == 0


def test_v4_prefers_layout3(monkeypatch):
    monkeypatch.setenv("W12_GEMM_KERNEL", "v4")
    assert cuda_ops.preferred_layout() == layouts.WGMMA_SPLIT_LAYOUT
    assert cuda_ops.preferred_layout("cpu") == 0
    assert [cuda_ops.kernel_layout(v) for v in (1, 2, 3, 4)] == [4, 4, 4, 3]


KERNEL_LAYOUTS = [
    layouts.MMA_SYNC_LAYOUT,
    layouts.WGMMA_LAYOUT,
    layouts.WGMMA_SPLIT_LAYOUT,
    layouts.MMA_SYNC_SPLIT_LAYOUT,
]


@pytest.mark.parametrize("layout", KERNEL_LAYOUTS)
def test_kernel_emulation_matches_reference_decode(layout, rng):
    # Random codes everywhere (code 0 slots included), random row bases: the emulated kernel must
    # equal W_decoded @ x^T where W_decoded is the reference decode of the same record.
    rec0 = torch.randint(0, 256, (1, 1, RECORD_BYTES), dtype=torch.uint8, generator=rng)
    base = torch.randint(100, 140, (128,), dtype=torch.uint8, generator=rng)
    ptr = torch.zeros(129, dtype=torch.int32)
    empty_i, empty_v = torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int16)
    w = reference.decode(rec0, base, ptr, empty_i, empty_v, 128, 64).double().numpy()
    rec1 = convert_layout(rec0, 0, layout)[0, 0].numpy()
    x = torch.randn(11, 64, generator=rng).to(torch.bfloat16).float().numpy()
    got = emulate_record_gemm(rec1, base.numpy(), x, layout)
    want = w @ x.T.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-30)


@pytest.mark.parametrize("shape", [(1, 1), (128, 64), (130, 65), (300, 200)])
@pytest.mark.parametrize("layout", KERNEL_LAYOUTS)
def test_kernel_layout_roundtrip_and_decode(shape, layout, rng):
    wt = (torch.randn(shape, generator=rng) * 0.05).to(torch.bfloat16)
    wt.view(-1)[:: max(1, wt.numel() // 7)] = 0.0  # a few escapes
    w = w12.pack(wt)
    w1 = w.with_layout(layout)
    assert torch.equal(convert_layout(w1.records, layout, 0), w.records)
    assert torch.equal(w12.unpack(w1).view(torch.int16), wt.view(torch.int16))
    for other in KERNEL_LAYOUTS:  # directly between kernel layouts (split or not, same slots or not)
        assert torch.equal(w1.with_layout(other).with_layout(0).records, w.records)


def _inputs(n=130, k=70, m=3, rng=None):
    wt = torch.randn(n, k, generator=rng).to(torch.bfloat16)
    w = w12.pack(wt)
    x = torch.randn(m, k, generator=rng).to(torch.bfloat16)
    return x, w


def _args(x, w, bias=None):
    return [x, *w.tensors(), w.N, w.K, bias, torch.device("cpu")]


def test_check_linear_inputs_accepts_good(rng):
    x, w = _inputs(rng=rng)
    cuda_ops.check_linear_inputs(*_args(x, w, torch.zeros(w.N)))


@pytest.mark.parametrize(
    "mutate,exc,msg",
    [
        (lambda a: a.__setitem__(0, a[0].float()), TypeError, "bfloat16"),
        (lambda a: a.__setitem__(0, a[0][:, :-1]), ValueError, "needs x"),
        (lambda a: a.__setitem__(0, torch.cat([a[0], a[0]], 1)[:, ::2]), ValueError, "contiguous"),
        (lambda a: a.__setitem__(1, a[1].to(torch.int8)), TypeError, "records"),
        (lambda a: a.__setitem__(1, a[1][:1]), ValueError, "records has shape"),
        (lambda a: a.__setitem__(2, a[2][:-1]), ValueError, "base"),
        (lambda a: a.__setitem__(3, a[3].long()), TypeError, "esc_ptr"),
        (
            lambda a: a.__setitem__(5, a[5][:0] if a[5].numel() else torch.zeros(1, dtype=torch.int16)),
            ValueError,
            "esc_col",
        ),
        (lambda a: a.__setitem__(8, torch.zeros(3)), ValueError, "bias"),
        (lambda a: a.__setitem__(8, torch.zeros(a[6], dtype=torch.int32)), TypeError, "bias"),
        (lambda a: a.__setitem__(9, torch.device("meta")), ValueError, "expected meta"),
    ],
)
def test_check_linear_inputs_errors(mutate, exc, msg, rng):
    x, w = _inputs(rng=rng)
    args = _args(x, w)
    mutate(args)
    with pytest.raises(exc, match=msg):
        cuda_ops.check_linear_inputs(*args)


def test_cuda_kernel_registered_without_cuda_init():
    code = (
        "import torch, w12; "
        "assert torch._C._dispatch_has_kernel_for_dispatch_key('w12::linear', 'CUDA'); "
        "assert not torch.cuda.is_initialized(); "
        "from w12 import cuda_ops; assert cuda_ops._LIB is None; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_fake_impl_and_compile(rng):
    x, w = _inputs(m=5, rng=rng)
    args = (x, *w.tensors(), w.N, w.K, w.layout, None)
    torch.library.opcheck(torch.ops.w12.linear.default, args, test_utils=("test_schema", "test_faketensor"))
    fn = torch.compile(lambda xx: w12.linear(xx, w), backend="aot_eager", fullgraph=True)
    got = fn(x.view(1, 5, -1))
    want = w12.linear(x, w).view(1, 5, -1)
    assert got.shape == (1, 5, w.N)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def _nvcc():
    return shutil.which("nvcc") or (
        os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None
    )


@pytest.mark.slow
@pytest.mark.skipif(_nvcc() is None, reason="nvcc not installed")
def test_cuda_sources_compile(tmp_path):
    """Compiles every CUDA source for sm_80, sm_90a and sm_120a: a compile error fails CI.

    Objects are cached in build/w12_obj, so after `pip install -e .` (which builds the same
    targets) this only links."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "csrc" / "build.py"), "--out", str(tmp_path), "--archs", "80,90a,120a"],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert out.returncode == 0, out.stderr + out.stdout
    so = ctypes.CDLL(str(tmp_path / "libw12.so"))
    so.w12_gemm_splits.restype = ctypes.c_int
    assert so.w12_gemm_record_layout() == layouts.MMA_SYNC_SPLIT_LAYOUT
    assert [so.w12_gemm_kernel_layout(v) for v in (1, 2, 3, 4)] == [cuda_ops.kernel_layout(v) for v in (1, 2, 3, 4)]
    # The split is a function of (N, K, target CTAs, SMs, kernel) only, covers K without empty slices.
    shapes = [(4096, 4096), (28672, 4096), (4096, 14336), (100, 70), (6144, 4096), (128256, 4096), (10240, 5120)]
    more = [(51200, 5120), (5120, 25600), (384, 1000), (8448, 1000), (130, 70), (256, 14336), (22016, 4096)]
    for n, k in shapes + more + [(128 * nt, k) for nt in (23, 27, 45, 53, 71, 172) for k in (1536, 4096, 5120, 14336)]:
        for kernel in (1, 4):
            s = so.w12_gemm_splits(n, k, 264, 132, kernel)
            assert s == _splits(n, k, 264, 132, kernel), (n, k, kernel)
            kt = -(-k // 64)
            assert 1 <= s <= kt
            kper = -(-kt // s)
            assert (s - 1) * kper < kt
    # v4's lower fill leaves a 224-tile weight at 264 target CTAs unsplit; v1 cuts it in two.
    assert [so.w12_gemm_splits(28672, 4096, 264, 132, kernel) for kernel in (1, 4)] == [2, 1]
    # qkv: 8 slices (24 records on the busiest SM) for v1; v4 takes 5 (26: within 10 %, and 5 <= 6);
    # [2048, 14336]: 16 slices for both (15 is within 10 % but cuts only one slice).
    assert [so.w12_gemm_splits(6144, 4096, 264, 132, kernel) for kernel in (1, 4)] == [8, 5]
    assert [so.w12_gemm_splits(2048, 14336, 264, 132, kernel) for kernel in (1, 4)] == [16, 16]
    assert so.w12_gemm_splits(4096, 4096, 264, 132, 2) == 0  # v2 and v3 have no such split


def test_build_embeds_no_ptx_and_keeps_wgmma_off_other_targets():
    # kernels_sm90/ only has real code for sm_90a; in a build without it the files must get the
    # build's own cubin targets, never nvcc's default (compute_75 PTX, which an sm_90 GPU would
    # JIT into a v4 that writes nothing). No target embeds PTX.
    spec = importlib.util.spec_from_file_location("w12_build", ROOT / "csrc" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    assert build.gencode_for("kernels_sm90", ["80", "90a", "120a"]) == ["-gencode=arch=compute_90a,code=sm_90a"]
    assert build.gencode_for("kernels_sm90", ["80"]) == ["-gencode=arch=compute_80,code=sm_80"]
    assert build.gencode_for("kernels_sm120", ["80", "120a"]) == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_120a,code=sm_120a",
    ]
    for src_dir in ("csrc", "kernels_sm120", "kernels_sm90"):
        for archs in (["80"], ["90a"], ["80", "90a", "120a"]):
            flags = build.gencode_for(src_dir, archs)
            assert flags and all(f.split(",code=")[1].startswith("sm_") for f in flags), (src_dir, archs, flags)


def _splits(n, k, target, sms, kernel=1):
    # The split rule of kernels_sm120/gemm_w12_mma_sm120.cu (gemm_splits), restated: enough CTAs
    # for ~target (9/10 of it for v1, 8/10 for v4), then the smallest S whose busiest SM streams
    # within 5 % of the fewest records (one resident wave), or for v4 within 10 % with at most
    # three quarters of the best's slices.
    nt, kt = -(-n // 128), -(-k // 64)
    smax = min(kt, 16 if 10 * nt * 8 < 9 * target else 8)

    def no_empty(s):
        kper = -(-kt // s)
        return -(-kt // kper)

    fill = 8 if kernel == 4 else 9
    s_min = min(max(-(-fill * target // (10 * nt)), 1), smax)
    costs = {}
    for s in range(s_min, smax + 1):
        se = no_empty(s)
        if s > s_min and nt * se > 2 * target:
            break
        costs[s] = -(-nt * se // sms) * -(-kt // se)
    best = min(costs.values())
    best_s = min(s for s, c in costs.items() if c == best)

    def takes(s, c):
        fewer = kernel == 4 and 10 * c <= 11 * best and 4 * no_empty(s) <= 3 * no_empty(best_s)
        return 20 * c <= 21 * best or fewer

    return no_empty(min(s for s, c in costs.items() if takes(s, c)))


def test_auto_kernel_rule_is_shape_only():
    """W12_GEMM_KERNEL=auto: v2 exactly where the H200 measured it faster at M = 1."""
    from w12.cuda_ops import choose_kernel

    want = {
        (6144, 4096): 1,
        (4096, 4096): 1,
        (28672, 4096): 1,
        (4096, 14336): 1,
        (128256, 4096): 1,
        (10240, 5120): 1,
        (51200, 5120): 2,
        (5120, 25600): 1,  # v1's balanced split (S = 6, 240 CTAs) leaves no imbalance for v2 to fix
    }
    for (n, k), kern in want.items():
        assert choose_kernel(n, k, 132, 2, _splits(n, k, 264, 132)) == kern, (n, k)
    # Tiny weights never take the persistent kernel.
    assert choose_kernel(128, 64, 132, 2, _splits(128, 64, 264, 132)) == 1


def test_wgmma_activation_tile_follows_layout1_k_order():
    """v4 (kernels_sm90/gemm_w12_wgmma_sm90.cu) stores the activation tile so that wgmma's B
    operand, read through a no-swizzle K-major descriptor (LBO = T*16, SBO = 128), presents at
    MMA-k index kappa of k-step ks the column that layout 1 decodes into A at that index. The
    A side is taken from the layout's own permutation (w12.layouts), the B side restates the
    kernel's store rule (column pair w of token r -> chunk 2ks + b, byte 4a, w = 8a + 2ks + b)."""
    from w12 import layouts

    perm = layouts.mma_sync_perm()
    # A side: (lane t of row group 0, register R, half h) -> column, for warp 0.
    col_a = {}
    for slot in range(2048):
        q, rem = slot // 512, slot % 512
        lane, e = rem // 16, rem % 16
        if lane // 4 != 0:
            continue
        t = lane % 4
        reg, h = 8 * q + 2 * (e // 4) + (e & 1), (e >> 1) & 1
        col_a[(t, reg, h)] = int(perm[slot]) % 64
    for tokens in (8, 16, 64):
        tile = {}  # byte offset -> column stored there (any token: the rule is the same per token)
        for r in range(tokens):
            for w in range(32):
                a, ks, b = w >> 3, (w >> 1) & 3, w & 1
                base = (2 * ks + b) * tokens * 16 + r * 16 + 4 * a
                tile[base], tile[base + 2] = (r, 2 * w), (r, 2 * w + 1)
        for ks in range(4):
            for kappa in range(16):
                t, hi, h = (kappa & 7) >> 1, kappa >> 3, kappa & 1
                for reg_r in (0, 1):  # rows g and g + 8 share the k index
                    want = col_a[(t, 4 * ks + 2 * hi + reg_r, h)]  # m-tile 0: R = 4ks + r
                    for n in range(tokens):
                        byte = (2 * ks + hi) * tokens * 16 + (n >> 3) * 128 + (n & 7) * 16 + (kappa & 7) * 2
                        assert tile[byte] == (n, want), (tokens, ks, kappa, n)


def test_pdl_rule(monkeypatch):
    # auto: v3 always; v1 at <= 16 and 33-64 tokens with >= 4 K slices; v4 at <= 128 tokens with
    # >= 4 slices (17-32 since session 31), on every grid at <= 8 tokens and on unsplit ones at
    # <= 16 (timing only).
    slices = {(4096, 4096): 8, (28672, 4096): 2, (28672, 1024): 1, (10240, 5120): 3}
    monkeypatch.setattr(cuda_ops, "splits", lambda n, k, device="cuda", kernel=None: slices[(n, k)])
    monkeypatch.delenv("W12_GEMM_PDL", raising=False)
    assert cuda_ops._pdl(1, 4096, 4096, 1, "cuda") and cuda_ops._pdl(1, 4096, 4096, 16, "cuda")
    assert not cuda_ops._pdl(1, 4096, 4096, 17, "cuda")
    assert not cuda_ops._pdl(1, 28672, 4096, 1, "cuda")
    assert cuda_ops._pdl(3, 28672, 4096, 64, "cuda")
    assert cuda_ops._pdl(4, 4096, 4096, 1, "cuda") and cuda_ops._pdl(4, 4096, 4096, 17, "cuda")
    assert cuda_ops._pdl(4, 4096, 4096, 32, "cuda") and cuda_ops._pdl(4, 4096, 4096, 33, "cuda")
    # Three slices: on at <= 8 tokens only (every grid), off at 9-128.
    assert cuda_ops._pdl(4, 10240, 5120, 8, "cuda") and not cuda_ops._pdl(4, 10240, 5120, 16, "cuda")
    assert not cuda_ops._pdl(4, 10240, 5120, 24, "cuda") and not cuda_ops._pdl(4, 10240, 5120, 64, "cuda")
    assert cuda_ops._pdl(4, 4096, 4096, 64, "cuda") and cuda_ops._pdl(4, 4096, 4096, 128, "cuda")
    assert not cuda_ops._pdl(1, 4096, 4096, 65, "cuda") and not cuda_ops._pdl(4, 28672, 4096, 128, "cuda")
    assert cuda_ops._pdl(1, 4096, 4096, 64, "cuda")  # v1 gains at 64 tokens since session 15
    assert not cuda_ops._pdl(1, 4096, 4096, 32, "cuda") and not cuda_ops._pdl(1, 28672, 4096, 64, "cuda")
    assert cuda_ops._pdl(4, 28672, 4096, 1, "cuda") and cuda_ops._pdl(4, 28672, 4096, 8, "cuda")
    assert not cuda_ops._pdl(4, 28672, 4096, 9, "cuda") and not cuda_ops._pdl(4, 28672, 4096, 64, "cuda")
    assert cuda_ops._pdl(4, 28672, 1024, 16, "cuda") and not cuda_ops._pdl(4, 28672, 1024, 17, "cuda")
    assert not cuda_ops._pdl(2, 4096, 4096, 1, "cuda")
    slices[(6144, 4096)] = 8
    assert cuda_ops._pdl(4, 6144, 4096, 17, "cuda") and cuda_ops._pdl(4, 6144, 4096, 32, "cuda")
    assert not cuda_ops._pdl(1, 6144, 4096, 24, "cuda")  # v1: none at 17-32 tokens
    assert cuda_ops._pdl(4, 6144, 4096, 48, "cuda") and cuda_ops._pdl(4, 6144, 4096, 100, "cuda")
    monkeypatch.setenv("W12_GEMM_PDL", "0")
    assert not cuda_ops._pdl(1, 4096, 4096, 1, "cuda")
    monkeypatch.setenv("W12_GEMM_PDL", "1")
    assert cuda_ops._pdl(1, 28672, 4096, 64, "cuda")
    monkeypatch.setenv("W12_GEMM_PDL", "yes")
    with pytest.raises(ValueError, match="W12_GEMM_PDL"):
        cuda_ops._pdl(1, 4096, 4096, 1, "cuda")
