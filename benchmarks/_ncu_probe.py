"""ncu target: a few W12 GEMM launches of one shape on cold weights (used by device runs).

Usage: python benchmarks/_ncu_probe.py N K [M]; the kernel is W12_GEMM_KERNEL's (auto by default).
"""

import sys

import torch
from bench_gemm import in_kernel_layout, random_w12

import w12

n, k, m = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 1
g = torch.Generator(device="cuda").manual_seed(0)
ws = [in_kernel_layout(random_w12(n, k, torch.device("cuda"), g)) for _ in range(4)]
x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
for i in range(8):
    w12.linear(x, ws[i % 4])
torch.cuda.synchronize()
