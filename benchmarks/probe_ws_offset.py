"""Probe: does the K-split workspace's address change the W12 GEMM's time?

Session 42 saw one launch configuration of a split grid ([3584, 18944], 9 K slices) read 0.6 us
(2 %) faster in whichever CUDA graph was captured second, in both orders of an interleaved run,
while the whole-K grid (down, no workspace) showed no such effect. The graphs share the weights
and x; what differs is where each graph's private pool put y and the partials' workspace. This
probe calls the library directly with a workspace at chosen offsets into one buffer (y fixed), so
that only the partials' address differs between the graphs it times in turn.

  python benchmarks/probe_ws_offset.py --shapes qkv,o --m 1,16 --offsets 0,4096,65536,1048576
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_gemm as bg  # noqa: E402

from w12 import cuda_ops  # noqa: E402


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def _shape(name: str) -> tuple[int, int]:
    if name in bg.LLAMA8B:
        return bg.LLAMA8B[name]
    try:
        n, k = (int(v) for v in name.lower().split("x"))
    except ValueError:
        raise ValueError(
            f"--shapes: {name!r} is neither a Llama-3.1-8B name ({', '.join(bg.LLAMA8B)}) nor NxK"
        ) from None
    if n < 1 or k < 64 or k % 64:
        raise ValueError(f"--shapes: {name!r} needs N >= 1 and K a multiple of 64")
    return n, k


def gemm_call(w, x, y, ws_ptr: int):
    """One w12_gemm launch as ``w12.linear`` makes it (no bias, no diagnostics), with the
    workspace pointer given."""
    n, k = w.N, w.K
    dev = x.device
    kver = cuda_ops.kernel_version(n, k, dev)
    tgt = cuda_ops._check_device(dev) * 2
    flags = 0 if cuda_ops._pdl(kver, n, k, x.shape[0], dev) else 32
    rec, base, esc_ptr, esc_col, esc_val = w.tensors()

    def launch():
        # Launches on the stream current at the call: capture_graph warms up on a side stream and
        # captures on torch's capture stream.
        code = cuda_ops.gemm_launch(
            x, rec, base, esc_ptr, esc_col, esc_val, None, y, n, k, ws_ptr or None,
            tgt=tgt, stages=0, flags=flags, kver=kver,
        )  # fmt: skip
        if code != 0:
            raise RuntimeError(f"w12_gemm failed for [{n}, {k}] at M={x.shape[0]}: {cuda_ops._err(code)}")

    return launch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qkv,o", help="Llama-3.1-8B names or NxK")
    p.add_argument("--m", default="1,16", help="token counts")
    p.add_argument("--offsets", default="0,4096,65536,1048576,4194304", help="workspace offsets in bytes")
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    try:
        shapes = [_shape(v) for v in a.shapes.split(",")]
        offs, ms = _ints(a.offsets), _ints(a.m)
    except ValueError as e:
        p.error(str(e))
    # The partials are float4 stores and loads: the workspace must stay 16-byte aligned.
    if not offs or any(o < 0 or o % 16 for o in offs):
        p.error(f"--offsets {a.offsets}: non-negative multiples of 16 bytes")
    if not ms or any(m < 1 or m > 128 for m in ms):
        p.error(f"--m {a.m}: token counts in 1..128 (the GEMM's one-pass range)")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    rows = []
    for name, (n, k) in zip(a.shapes.split(","), shapes):
        ws_copies = [bg.random_w12(n, k, dev, gen) for _ in range(bg.copies_for(int(n * k * 1.5), l2))]
        ws_copies = [bg.in_kernel_layout(w) for w in ws_copies]
        for m in ms:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            y = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            sm = cuda_ops._check_device(dev)
            kver = cuda_ops.kernel_version(n, k, dev)
            need = int(cuda_ops._gemm_lib().w12_gemm_workspace_bytes(m, n, k, sm * 2, sm, kver, 0))
            buf = torch.empty(need + max(offs) + 4096, dtype=torch.uint8, device=dev)
            graphs, labels = [], []
            for rnd in range(2):  # each offset at two positions: forward, then reversed
                for off in offs if rnd == 0 else offs[::-1]:
                    ptr = buf.data_ptr() + off if need else 0
                    graphs.append(bg.capture_graph([gemm_call(w, x, y, ptr) for w in ws_copies]))
                    labels.append(off)
            timed = bg.time_graphs(graphs, a.reps)
            for off, (t, p25, p75) in zip(labels, timed):
                rows.append({"name": name, "shape": [n, k], "M": m, "ws_bytes": need, "offset": off,
                             "addr_mod_2M": (buf.data_ptr() + off) % (1 << 21), "us": round(t, 3),
                             "us_p25": round(p25, 3), "us_p75": round(p75, 3)})  # fmt: skip
                print(f"{name:>10} M={m:<3} ws {need:>9} off {off:>9}  {t:7.2f} us  [{p25:.2f}, {p75:.2f}]")
            del graphs
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
