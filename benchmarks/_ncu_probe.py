"""ncu target: a few W12 GEMM launches of one shape on cold weights (used by device runs).

Usage: python benchmarks/_ncu_probe.py N K [M] [COPIES]; the kernel is W12_GEMM_KERNEL's (auto by
default); COPIES weight copies are rotated (4 by default; 1 keeps a weight smaller than L2 hot).
"""

import sys

import torch
from bench_gemm import in_kernel_layout, random_w12

import w12

n, k, m = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 1
g = torch.Generator(device="cuda").manual_seed(0)
copies = int(sys.argv[4]) if len(sys.argv) > 4 else 4
ws = [in_kernel_layout(random_w12(n, k, torch.device("cuda"), g)) for _ in range(copies)]
x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
for i in range(8):
    w12.linear(x, ws[i % copies])
torch.cuda.synchronize()
