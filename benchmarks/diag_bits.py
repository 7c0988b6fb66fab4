"""Do two W12_GEMM_DIAG variants of ``w12.linear`` give the same bits? (GPU only.)

For each weight shape and token count, packs a trained-like BF16 weight (normal, std 0.02), runs
``w12.linear`` once with ``W12_GEMM_DIAG=<base>`` and once with ``W12_GEMM_DIAG=<other>``, and
prints the share of equal output bits and both variants' largest error against an FP32
reference. Used to check a diagnostic kernel form before timing it (session 13: the SS-wgmma,
split-roles and pair-loop forms, all bit-identical to the default).

    PYTHONPATH=. python benchmarks/diag_bits.py --other 131072 --m 64,100,128
"""

from __future__ import annotations

import argparse
import os

import torch

import w12
from w12 import cuda_ops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="0", help="W12_GEMM_DIAG of the reference variant (default 0)")
    ap.add_argument("--other", required=True, help="W12_GEMM_DIAG of the variant under test")
    ap.add_argument("--m", default="64,100,128", help="token counts")
    ap.add_argument("--shapes", default="4096x4096,384x1000,28672x4096", help="weights as NxK, comma list")
    a = ap.parse_args(argv)
    try:
        shapes = [tuple(int(v) for v in sh.lower().split("x")) for sh in a.shapes.split(",")]
        ms = [int(v) for v in a.m.split(",")]
    except ValueError:
        ap.error(f"--shapes must be NxK pairs and --m integers, comma-separated (got {a.shapes!r}, {a.m!r})")
    if any(len(sh) != 2 or min(sh) < 1 for sh in shapes) or min(ms) < 1:
        ap.error(f"--shapes must be positive NxK pairs and --m positive (got {a.shapes!r}, {a.m!r})")
    if not torch.cuda.is_available():
        raise SystemExit("diag_bits.py needs a CUDA GPU")
    torch.manual_seed(0)
    saved = os.environ.get("W12_GEMM_DIAG")
    worst = 1.0
    try:
        for n, k in shapes:
            wt = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
            w = w12.pack(wt).to("cuda").with_layout(cuda_ops.preferred_layout("cuda"))
            for m in ms:
                x = torch.randn(m, k).to(torch.bfloat16).cuda()
                ref = x.float() @ wt.cuda().float().T
                os.environ["W12_GEMM_DIAG"] = a.base
                y0 = w12.linear(x, w)
                os.environ["W12_GEMM_DIAG"] = a.other
                y1 = w12.linear(x, w)
                same = (y0.view(torch.int16) == y1.view(torch.int16)).float().mean().item()
                worst = min(worst, same)
                e0 = (y0.float() - ref).abs().max().item()
                e1 = (y1.float() - ref).abs().max().item()
                print(
                    f"[{n}, {k}] M={m}: equal bits {same:.6f}; max |err| diag {a.base} {e0:.3e}, "
                    f"diag {a.other} {e1:.3e} (|ref| max {ref.abs().max().item():.3e})",
                    flush=True,
                )
    finally:
        if saved is None:
            os.environ.pop("W12_GEMM_DIAG", None)
        else:
            os.environ["W12_GEMM_DIAG"] = saved
    print("all bits equal" if worst == 1.0 else f"bits differ (lowest share equal {worst:.6f})")
    return 0 if worst == 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
