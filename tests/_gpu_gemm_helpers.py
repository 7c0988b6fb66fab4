"""Shared parts of the GPU GEMM tests (test_gpu_gemm.py, test_gpu_gemm_v4.py): the kernels this GPU
runs, trained-like and escape-heavy weights, the FP64 reference and its tolerance."""

from __future__ import annotations

import pytest
import torch

import w12
from w12 import cuda_ops

DEV = "cuda"


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


class _Ints:
    """n int32 at a raw device pointer, for torch.as_tensor (__cuda_array_interface__)."""

    def __init__(self, ptr: int, n: int):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<i4", "data": (ptr, False), "version": 3}


def _device_ints(ptr: int, n: int) -> list[int]:
    """The n int32 at a raw device pointer (the library's own buffers: counters, XT scratch)."""
    return torch.as_tensor(_Ints(ptr, n), device=DEV).tolist()
