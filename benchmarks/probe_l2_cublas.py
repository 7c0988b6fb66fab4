"""Probe: can decode-to-L2 + cuBLAS beat the fused W12 GEMM at 65-128 tokens?

The fused kernel's decode and its wgmma add up on an SM (docs/perf-notes.md, session 13 item
12), which caps it at ~0.78 of cuBLAS at 128 tokens. The alternative this measures: decode the
weight in row chunks into a small BF16 scratch that stays in L2 (two buffers, reused) and let
cuBLAS multiply each chunk from L2, the decode of chunk i+1 on one stream while cuBLAS runs chunk
i on another. Its bits are cuBLAS's, not the fused kernel's, so it could only replace the fused
path where M-independence is not required; this probe only asks whether the time is there.

Timed per weight shape at M tokens (CUDA graphs, cold weights by rotation, median of replays):
  cublas      F.linear on BF16 weights (rotated copies)
  fused       w12.linear (the library's choice at this M)
  gemm_hot    cuBLAS on one L2-resident chunk, once per chunk of the weight (GEMM part alone)
  decode      the library's unpack kernel on every chunk into the reused scratch (decode part alone)
  serial      decode chunk, then its GEMM, one stream
  overlap     decode on one stream, GEMMs on another, two scratch buffers

  python benchmarks/probe_l2_cublas.py --m 128 --rows 2048,4096 --json /tmp/p.json

Session 19's answer (docs/perf-notes.md): no. cuBLAS on L2-resident chunks is slower than on the
whole cold weight (a 2048-4096-row GEMM at 128-256 tokens does not fill the GPU), so no overlap
with the decode can win; the decode alone takes about as long as cuBLAS on BF16 weights.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemm import LLAMA8B, capture_graph, copies_for, in_kernel_layout, random_w12, time_graphs  # noqa: E402

import w12  # noqa: E402
from w12 import cuda_codec  # noqa: E402
from w12.weight import W12Weight  # noqa: E402


def decode_rows(w: W12Weight, t0: int, t1: int, out: torch.Tensor) -> None:
    """Row tiles [t0, t1) of ``w`` (random records, read as layout 0) decoded by the library's
    unpack kernel into ``out`` [(t1 - t0) * 128, K] (no checks: a probe)."""
    r0, r1 = t0 * 128, min(t1 * 128, w.N)
    p = cuda_codec._ptr
    cuda_codec._launch(
        "probe decode",
        "w12_decode",
        p(w.records[t0:t1]),
        p(w.base[r0:r1]),
        p(w.esc_ptr[r0 : r1 + 1]),
        p(w.esc_col),
        p(w.esc_val),
        w.esc_col.numel(),
        1,
        r1 - r0,
        w.K,
        0,
        p(out),
        cuda_codec._stream(out.device),
        -1,
    )


def chunk_graphs(xk: torch.Tensor, w0: list, n: int, k: int, rows: int) -> tuple[dict, list]:
    """The four chunked pipelines of one chunk size, captured (one launch = the whole weight), and
    the buffers they write, which the caller must keep alive as long as the graphs (a graph does
    not own memory allocated outside its capture)."""
    dev = xk.device
    nt = math.ceil(n / 128)
    ct = rows // 128
    chunks = [(t, min(t + ct, nt)) for t in range(0, nt, ct)]
    if n % rows:
        raise SystemExit(f"--rows {rows} must divide N = {n}")
    scratch = [torch.empty(rows, k, dtype=torch.bfloat16, device=dev) for _ in range(2)]
    # One [M, rows] output per chunk: x W_c^T, the orientation F.linear gives cuBLAS (W x^T into a
    # [rows, M] slice chose kernels ~1.5x slower in call 2). Assembling y from them is not timed.
    yc = torch.empty(len(chunks), xk.shape[0], rows, dtype=torch.bfloat16, device=dev)

    def gemm(buf, t0, t1):
        torch.mm(xk, buf.t(), out=yc[t0 // ct])

    def gemm_hot():
        for t0, t1 in chunks:
            gemm(scratch[0], t0, t1)

    def decode_only(w):
        for i, (t0, t1) in enumerate(chunks):
            decode_rows(w, t0, t1, scratch[i % 2])

    def serial(w):
        for i, (t0, t1) in enumerate(chunks):
            decode_rows(w, t0, t1, scratch[i % 2])
            gemm(scratch[i % 2], t0, t1)

    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()

    def overlap(w):
        cur = torch.cuda.current_stream()
        sa.wait_stream(cur)
        sb.wait_stream(cur)
        dec = [torch.cuda.Event() for _ in chunks]
        mm = [torch.cuda.Event() for _ in chunks]
        for i, (t0, t1) in enumerate(chunks):
            with torch.cuda.stream(sa):
                if i >= 2:
                    sa.wait_event(mm[i - 2])  # scratch[i % 2] is free once GEMM i-2 is done
                decode_rows(w, t0, t1, scratch[i % 2])
                dec[i].record(sa)
            with torch.cuda.stream(sb):
                sb.wait_event(dec[i])
                gemm(scratch[i % 2], t0, t1)
                mm[i].record(sb)
        cur.wait_stream(sa)
        cur.wait_stream(sb)

    graphs = {
        f"gemm_hot_r{rows}": capture_graph([gemm_hot], launches_min=1),
        f"decode_r{rows}": capture_graph([lambda w=w: decode_only(w) for w in w0]),
        f"serial_r{rows}": capture_graph([lambda w=w: serial(w) for w in w0]),
        f"overlap_r{rows}": capture_graph([lambda w=w: overlap(w) for w in w0]),
    }
    return graphs, [scratch, yc]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=128)
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--rows", default="2048,4096", help="weight rows per chunk (multiples of 128 dividing N)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 60 << 20)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows_list = [int(r) for r in a.rows.split(",") if r]
    out = {"gpu": props.name, "m": a.m, "rows": {}}
    print(f"# {props.name}, M = {a.m}")
    for name in a.shapes.split(","):
        n, k = LLAMA8B[name]
        xk = (0.02 * torch.randn(a.m, k, device=dev, generator=gen)).to(torch.bfloat16)
        nc = copies_for(n * k * 2, l2)
        wb = [(0.02 * torch.randn(n, k, device=dev, generator=gen)).to(torch.bfloat16) for _ in range(nc)]
        graphs = {"cublas": capture_graph([lambda w=w, x=xk: F.linear(x, w) for w in wb])}
        del wb
        ncw = copies_for(n * k * 3 // 2, l2)
        ws = [random_w12(n, k, dev, gen) for _ in range(ncw)]
        wk = [in_kernel_layout(w) for w in ws]
        graphs["fused"] = capture_graph([lambda w=w, x=xk: w12.linear(x, w) for w in wk])
        w0 = [W12Weight(*w.tensors(), (n, k), layout=0) for w in ws]
        keep = []
        for rows in rows_list:
            g, bufs = chunk_graphs(xk, w0, n, k, rows)
            graphs.update(g)
            keep.append(bufs)
        keys = list(graphs)
        res = time_graphs([graphs[k_] for k_ in keys], a.reps)
        base = res[0][0]
        row = {k_: round(r[0], 2) for k_, r in zip(keys, res)}
        out["rows"][name] = {"shape": [n, k], **row}
        print(f"{name:8s} [{n}, {k}] " + "  ".join(f"{k_} {v:.1f} ({base / v:.2f}x)" for k_, v in row.items()))
        del graphs, keep, ws, wk, w0
        torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
