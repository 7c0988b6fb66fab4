import os, sys, torch, w12
sys.path.insert(0, "benchmarks")
from bench_gemm import random_w12
g = torch.Generator(device="cuda").manual_seed(0)
n, k = int(sys.argv[1]), int(sys.argv[2])
ws = [random_w12(n, k, torch.device("cuda"), g) for _ in range(4)]
x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
for i in range(8):
    w12.linear(x, ws[i % 4])
torch.cuda.synchronize()
