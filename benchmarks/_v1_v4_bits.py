"""Do v1 (mma.sync, layout 1) and v4 (wgmma, layout 2) give the same bits on the same weight?

Usage: python benchmarks/_v1_v4_bits.py. Prints, per shape and M, the share of output elements
whose BF16 bits differ between the two kernels (and between v1 runs, which must be 0). Decides
whether `auto` may switch between them by M without breaking M-independence (perf-notes s8).
"""

import os

import torch

import w12

torch.manual_seed(0)
dev = torch.device("cuda")


def err(y, ref):
    return (y.view(torch.bfloat16).float() - ref).abs().max().item()


def run(kernel, x, w):
    os.environ["W12_GEMM_KERNEL"] = kernel
    try:
        return w12.linear(x, w).view(torch.int16).clone()
    finally:
        os.environ.pop("W12_GEMM_KERNEL")


for n, k in [(4096, 4096), (6144, 4096), (4096, 14336), (1000, 3000), (28672, 4096)]:
    wt = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
    w = w12.pack(wt)
    w1, w4 = w.with_layout(1), w.with_layout(2)
    for m in (1, 16, 64):
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        a, a2, b = run("v1", x, w1), run("v1", x, w1), run("v4", x, w4)
        ref = x.float() @ wt.float().T
        print(
            f"[{n},{k}] M={m}: v1 vs v1 differ {(a != a2).float().mean().item():.3e}, "
            f"v1 vs v4 differ {(a != b).float().mean().item():.3e}; max err v1 {err(a, ref):.3e} v4 {err(b, ref):.3e}",
            flush=True,
        )
