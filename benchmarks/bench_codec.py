"""Throughput of the GPU codec: pack (encode), unpack (decode, exact and 8-bit view) and record-layout
permutation, at several tensor sizes, against a plain device-to-device copy as the bandwidth yardstick.

Byte counts (each input read once, each output written once):
  copy        2 x BF16 bytes (read + write)
  pack        BF16 input bytes (the target is quoted per byte of input; it also writes 0.75 x that)
  unpack      W12 bytes read (records, base, esc_ptr, escapes) + BF16 bytes written
  unpack_8bit hi plane + base + esc_ptr + escapes read + BF16 bytes written
  permute     2 x record bytes
  unpack_layout3 / unpack_layout4   unpack's bytes, from the GEMM kernels' own layouts (in place)
unpack is also timed against the pure-torch reference decoder on the same GPU (sizes <= 256 MiB).
Weights are Gaussian rows with per-row scales (trained-weight-like, ~1e-4 escapes), never zeros.
Inputs rotate over several buffers so that small sizes do not run out of L2. unpack, permute and copy
are timed as CUDA-graph replays (so Python launch overhead is not counted); pack contains one host
sync by design and is timed call by call with events. Every size is checked: unpack(pack(w)) == w
bitwise, the permutation round-trips, and sizes up to --refcheck-mb are compared with the CPU reference.

Usage: python benchmarks/bench_codec.py [--sizes-mb 16,64,256,1024] [--k 4096] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import w12  # noqa: E402
from w12 import cuda_codec, reference  # noqa: E402
from w12.format import TILE_ELEMS, register_layout, registered_layouts  # noqa: E402

BENCH_LAYOUT_ID = 251  # bench-only random permutation, used when no kernel layout is registered


def make_weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    scale = torch.exp2(torch.randint(-12, -2, (n, 1), device="cuda", generator=g).float())
    return (torch.randn(n, k, device="cuda", generator=g) * scale).to(torch.bfloat16)


def time_events(fn, sets: int, repeat: int) -> float:
    """Median seconds of one call, each call timed on its own with events (for ops that sync)."""
    for i in range(sets):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for r in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(r % sets)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(times)


def time_graph(fn, sets: int, repeat: int) -> tuple[float, str]:
    """Median seconds of one call from graph replays of one call per buffer set; falls back to
    back-to-back event timing if the op cannot be captured."""
    for i in range(sets):
        fn(i)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(sets):
                fn(i)
        graph.replay()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - any capture failure: measure without a graph
        print(f"  (graph capture failed: {type(e).__name__}: {e}; timing eager calls)", flush=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(repeat):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for i in range(sets):
                fn(i)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3 / sets)
        return statistics.median(times), "eager"
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3 / sets)
    del graph
    return statistics.median(times), "graph"


def pick_layout() -> int:
    try:  # the GEMM kernels' layouts register themselves here when that module exists
        import w12.layouts  # noqa: F401
    except ImportError:
        pass
    others = [i for i in registered_layouts() if i not in (0, BENCH_LAYOUT_ID)]
    if others:
        return min(others)
    perm = torch.randperm(TILE_ELEMS, generator=torch.Generator().manual_seed(BENCH_LAYOUT_ID))
    register_layout(BENCH_LAYOUT_ID, "bench: random permutation", perm)
    return BENCH_LAYOUT_ID


def check_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype == torch.bfloat16:
        got, want = got.view(torch.int16), want.view(torch.int16)
    if got.shape != want.shape or not torch.equal(got, want):
        raise SystemExit(f"FAILED: {what} differs")


def bench_size(mb: int, k: int, repeat: int, layout: int, refcheck_mb: int, min_rotate_mb: int) -> dict:
    n = max(1, (mb << 20) // (2 * k))
    sets = max(1, math.ceil(min_rotate_mb / mb))
    ws = [make_weight(n, k, seed) for seed in range(sets)]
    in_bytes = n * k * 2

    # correctness first, on the first buffer
    w0 = cuda_codec.pack(ws[0])
    check_bits(w12.unpack(w0), ws[0], f"unpack(pack(w)) at {mb} MB")
    moved = cuda_codec.convert_layout(w0.records, 0, layout)
    check_bits(cuda_codec.convert_layout(moved, layout, 0), w0.records, f"layout 0 -> {layout} -> 0 at {mb} MB")
    if mb <= refcheck_mb:
        ref = reference.encode(ws[0].cpu())
        for name in ("records", "base", "esc_ptr", "esc_col", "esc_val"):
            check_bits(getattr(w0, name).cpu(), ref[name], f"pack {name} vs the CPU reference at {mb} MB")
    del moved

    packed = [cuda_codec.pack(w) for w in ws]
    w12_bytes = packed[0].nbytes
    nnz = packed[0].nnz
    rec_bytes = packed[0].records.numel()
    outs = [torch.empty_like(w) for w in ws]

    t_copy, mode = time_graph(lambda i: outs[i].copy_(ws[i]), sets, repeat)
    t_pack = time_events(lambda i: cuda_codec.pack(ws[i]), sets, repeat)
    t_unpack, _ = time_graph(lambda i: cuda_codec.unpack(*packed[i].tensors(), n, k, 0, False), sets, repeat)
    # the other decode kernel variant, kept for comparison (codec_decode_sm120.cu)
    t_unpack_v0, _ = time_graph(
        lambda i: cuda_codec.unpack(*packed[i].tensors(), n, k, 0, False, _variant=0), sets, repeat
    )
    t_unpack8, _ = time_graph(lambda i: cuda_codec.unpack(*packed[i].tensors(), n, k, 0, True), sets, repeat)
    t_perm, _ = time_graph(lambda i: cuda_codec.convert_layout(packed[i].records, 0, layout), sets, repeat)
    # The GEMM kernels' own layouts decoded in place (w12.linear's prefill fallback); before session
    # 19 layout 3 went through a permutation back to layout 0 first (permute + unpack above).
    t_direct = {}
    for lay in (3, 4):
        if lay not in registered_layouts():
            continue
        recs = [cuda_codec.convert_layout(p.records, 0, lay) for p in packed]
        check_bits(cuda_codec.unpack(recs[0], *packed[0].tensors()[1:], n, k, lay), ws[0], f"layout-{lay} unpack")
        t_direct[lay], _ = time_graph(
            lambda i, r=recs, lay=lay: cuda_codec.unpack(r[i], *packed[i].tensors()[1:], n, k, lay), sets, repeat
        )
        del recs
    # the pure-torch reference decoder on the same GPU: what unpack costs without these kernels
    t_ref = time_events(lambda i: reference.decode(*packed[i].tensors(), n, k), min(sets, 2), 3) if mb <= 256 else None

    esc_bytes = w12_bytes - rec_bytes  # base + esc_ptr + esc_col + esc_val
    res = {
        "size_mb": mb,
        "shape": [n, k],
        "bf16_bytes": in_bytes,
        "w12_bytes": w12_bytes,
        "escape_rate": nnz / (n * k),
        "rotating_sets": sets,
        "timing": mode,
        "copy": {"us": t_copy * 1e6, "GBps": 2 * in_bytes / t_copy / 1e9},
        "pack": {"us": t_pack * 1e6, "GBps_input": in_bytes / t_pack / 1e9},
        "unpack": {"us": t_unpack * 1e6, "GBps": (w12_bytes + in_bytes) / t_unpack / 1e9},
        "unpack_variant0": {"us": t_unpack_v0 * 1e6, "GBps": (w12_bytes + in_bytes) / t_unpack_v0 / 1e9},
        "unpack_8bit": {"us": t_unpack8 * 1e6, "GBps": (rec_bytes * 2 // 3 + esc_bytes + in_bytes) / t_unpack8 / 1e9},
        "permute": {"us": t_perm * 1e6, "GBps": 2 * rec_bytes / t_perm / 1e9, "layout": layout},
    }
    for lay, t in t_direct.items():
        res[f"unpack_layout{lay}"] = {"us": t * 1e6, "GBps": (w12_bytes + in_bytes) / t / 1e9}
    if t_ref is not None:
        res["unpack_torch_reference"] = {"us": t_ref * 1e6, "GBps": (w12_bytes + in_bytes) / t_ref / 1e9}
        res["unpack"]["speedup_vs_torch_reference"] = t_ref / t_unpack
    for key in ("unpack", "unpack_variant0", "unpack_8bit", "permute", *(f"unpack_layout{lay}" for lay in t_direct)):
        res[key]["fraction_of_copy"] = res[key]["GBps"] / res["copy"]["GBps"]
    res["pack"]["fraction_of_copy"] = res["pack"]["GBps_input"] / res["copy"]["GBps"]
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", default="16,64,256,1024", help="BF16 input sizes in MiB (default 16,64,256,1024)")
    p.add_argument("--k", type=int, default=4096, help="columns K of the [N, K] weights (default 4096)")
    p.add_argument("--repeat", type=int, default=20, help="timed repetitions; the median is reported (default 20)")
    p.add_argument("--refcheck-mb", type=int, default=16, help="compare pack with the CPU reference up to this size")
    p.add_argument("--rotate-mb", type=int, default=256, help="rotate input buffers until they total this many MiB")
    p.add_argument(
        "--layout",
        type=int,
        default=None,
        help="layout the permute row moves records into (default: the lowest kernel layout)",
    )
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "codec_h200.json"), help="JSON output")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench_codec needs a CUDA GPU", file=sys.stderr)
        return 1
    if not cuda_codec.available():
        print("error: the w12 CUDA codec kernels are not built (python csrc/build.py)", file=sys.stderr)
        return 1
    layout = pick_layout() if a.layout is None else a.layout
    sizes = [int(s) for s in a.sizes_mb.split(",") if s.strip()]
    results = []
    t0 = time.time()
    for mb in sizes:
        r = bench_size(mb, a.k, a.repeat, layout, a.refcheck_mb, a.rotate_mb)
        results.append(r)
        torch.cuda.empty_cache()  # the buffers of this size are gone; give the next size room
        print(
            f"{mb:5d} MB [{r['shape'][0]}x{r['shape'][1]}] esc {r['escape_rate']:.1e}: "
            f"copy {r['copy']['GBps']:.0f} GB/s ({r['copy']['us']:.1f} us) | "
            f"pack {r['pack']['GBps_input']:.0f} GB/s in ({r['pack']['us']:.1f} us) | "
            f"unpack {r['unpack']['GBps']:.0f} GB/s ({r['unpack']['us']:.1f} us; variant 0 "
            f"{r['unpack_variant0']['GBps']:.0f}) | "
            f"8-bit {r['unpack_8bit']['GBps']:.0f} GB/s | permute->{layout} {r['permute']['GBps']:.0f} GB/s | "
            + "".join(
                f"layout-{ly} unpack {r[f'unpack_layout{ly}']['GBps']:.0f} GB/s | "
                for ly in (3, 4)
                if f"unpack_layout{ly}" in r
            )
            + (
                f"unpack x{r['unpack']['speedup_vs_torch_reference']:.1f} vs the torch reference decoder"
                if "speedup_vs_torch_reference" in r["unpack"]
                else "torch reference decoder not timed at this size"
            ),
            flush=True,
        )
    doc = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "k": a.k,
        "repeat": a.repeat,
        "seconds": time.time() - t0,
        "results": results,
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(doc, indent=1))
    print(f"\n{'MB':>6} {'copy GB/s':>10} {'pack GB/s':>10} {'unpack GB/s':>12} {'x copy':>7} {'8bit GB/s':>10}"
          f" {'perm GB/s':>10} {'unpack us':>10}")  # fmt: skip
    for r in results:
        print(
            f"{r['size_mb']:>6} {r['copy']['GBps']:>10.0f} {r['pack']['GBps_input']:>10.0f} "
            f"{r['unpack']['GBps']:>12.0f} {r['unpack']['fraction_of_copy']:>7.2f} {r['unpack_8bit']['GBps']:>10.0f} "
            f"{r['permute']['GBps']:>10.0f} {r['unpack']['us']:>10.1f}"
        )
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
