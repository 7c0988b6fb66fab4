"""The byte floor: how fast a kernel that only reads the weights' bytes runs, launch for launch.

A GEMM that streams W12 records cannot be faster than a kernel that streams the same bytes with
the same number of CTAs and does nothing else. This benchmark times such a read kernel
(``benchmarks/read_floor.cu``, 16-byte non-caching loads, 8 in flight per thread) on

* each Llama-3.1-8B projection shape alone (W12 bytes and BF16 bytes, back to back in a CUDA
  graph, rotated over enough copies to defeat L2), and
* the decode-step graph set of ``bench_gemm.py --graph-set llama8b`` (32 layers' projections and
  the LM head, M = 1), optionally with a small "reduce" kernel after each split projection,

next to cuBLAS and the W12 GEMM measured in the same run, so that the W12 GEMM's time splits into
what the bytes and launches cost and what the GEMM adds. ``--ring`` streams a shape's bytes with
the GEMM's own copy ring instead (v4's pieces, its balanced grid, a delay standing for its work
per record, ...: the session-21 probes of docs/perf-notes.md), ``--prefetch`` lets each read
kernel of the graph set prefetch the next launch's first bytes into L2.

  python benchmarks/bench_read_floor.py --ctas-per-sm 2,4,8 --json benchmarks/results/read_floor_h200.json
  python benchmarks/bench_read_floor.py --ring cp:264x256:4,cpg:264x256:4:500,cpg:264x256:4:0:8 --ring-shapes gate_up
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from bench_gemm import LLAMA8B, capture_graph, copies_for, graph_set_llama8b, time_graph, time_graphs  # noqa: E402

SPLIT = {"qkv", "o", "gate_up", "down"}  # split along K by the W12 GEMM (a reduce kernel follows)


def load_lib() -> ctypes.CDLL:
    src = ROOT / "benchmarks" / "read_floor.cu"
    cache = Path(os.environ.get("W12_CACHE_DIR", Path.home() / ".cache" / "w12"))
    cache.mkdir(parents=True, exist_ok=True)
    so = cache / f"read_floor_{int(src.stat().st_mtime)}.so"
    if not so.exists():
        nvcc = shutil.which("nvcc")
        if nvcc is None:
            raise SystemExit(f"error: bench_read_floor needs nvcc on PATH to compile {src}")
        tmp = so.with_suffix(f".{os.getpid()}.tmp")  # renamed only once complete
        cmd = [nvcc, "-O3", "-shared", "-Xcompiler", "-fPIC", "-gencode", "arch=compute_90a,code=sm_90a"]
        r = subprocess.run([*cmd, "-o", str(tmp), str(src)], capture_output=True, text=True)
        if r.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise SystemExit(f"error: nvcc failed on {src}:\n{r.stderr}")
        os.replace(tmp, so)
    lib = ctypes.CDLL(str(so))
    lib.rf_read.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    lib.rf_read_grid.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    lib.rf_read_chunks.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    lib.rf_read_pf.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    lib.rf_ring.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    lib.rf_tail.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    return lib


class Reader:
    def __init__(self, lib: ctypes.CDLL, ctas: int, pdl: bool):
        self.lib, self.ctas, self.pdl = lib, ctas, int(pdl)
        self.sink = torch.zeros(1024, dtype=torch.int32, device="cuda")
        self.scratch = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
        self.out = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")

    def read(self, buf: torch.Tensor) -> None:
        s = torch.cuda.current_stream().cuda_stream
        e = self.lib.rf_read(buf.data_ptr(), buf.numel(), self.ctas, self.sink.data_ptr(), self.pdl, s)
        if e != 0:
            raise RuntimeError(f"read_floor launch failed: CUDA error {e}")

    def read_grid(self, buf: torch.Tensor, threads: int) -> None:
        s = torch.cuda.current_stream().cuda_stream
        e = self.lib.rf_read_grid(buf.data_ptr(), buf.numel(), self.ctas, threads, self.sink.data_ptr(), self.pdl, s)
        if e != 0:
            raise RuntimeError(f"read_floor launch of {self.ctas} x {threads} threads failed: CUDA error {e}")

    def read_chunks(self, buf: torch.Tensor, threads: int, chunk: int) -> None:
        s = torch.cuda.current_stream().cuda_stream
        e = self.lib.rf_read_chunks(
            buf.data_ptr(), buf.numel(), self.ctas, threads, chunk, self.sink.data_ptr(), self.pdl, s
        )
        if e != 0:
            raise RuntimeError(f"read_floor chunked launch of {self.ctas} x {threads} threads failed: CUDA error {e}")

    def read_pf(self, buf: torch.Tensor, nxt: torch.Tensor | None, pf: int) -> None:
        s = torch.cuda.current_stream().cuda_stream
        nptr, nbytes = (nxt.data_ptr(), nxt.numel()) if nxt is not None else (None, 0)
        e = self.lib.rf_read_pf(
            buf.data_ptr(), buf.numel(), nptr, nbytes, pf, self.ctas, self.sink.data_ptr(), self.pdl, s
        )
        if e != 0:
            raise RuntimeError(f"read_floor prefetching launch failed: CUDA error {e}")

    def ring(
        self, buf: torch.Tensor, threads: int, mode: int, depth: int, spin: int = 0, extra: int = 0, kt: int = 0
    ) -> None:
        if mode < 0:
            return self.read_grid(buf, threads)
        s = torch.cuda.current_stream().cuda_stream
        e = self.lib.rf_ring(
            buf.data_ptr(),
            buf.numel(),
            self.ctas,
            threads,
            mode,
            depth,
            spin,
            extra,
            self.scratch.data_ptr(),
            kt,
            self.sink.data_ptr(),
            self.pdl,
            s,
        )
        if e != 0:
            raise RuntimeError(
                f"read_floor ring launch ({self.ctas} x {threads}, mode {mode}, depth {depth}): CUDA error {e}"
            )

    def tail(self, ctas: int) -> None:
        s = torch.cuda.current_stream().cuda_stream
        e = self.lib.rf_tail(self.scratch.data_ptr(), self.out.data_ptr(), ctas, self.pdl, s)
        if e != 0:
            raise RuntimeError(f"read_floor tail launch failed: CUDA error {e}")


def w12_bytes(n: int, k: int) -> int:
    return ((n + 127) // 128) * ((k + 63) // 64) * 12288


RING_MODES = {"ld": -1, "ld16": 0, "cp": 1, "bulk": 2, "cpg": 3, "cpe": 4, "cpge": 5, "cpr": 6, "cpgr": 7, "bulkr": 8}


def parse_ring(ring: str, shapes: str) -> list[tuple]:
    """--ring items as (item, ctas, threads, mode, depth, spin, extra); ValueError naming the item."""
    names = [v for v in shapes.split(",") if v]
    for name in names:
        if name not in LLAMA8B:
            raise ValueError(f"--ring-shapes {name!r}: not one of {sorted(LLAMA8B)}")
    items = []
    for it in (v for v in ring.split(",") if v):
        f = it.split(":")
        try:
            ctas, threads = (int(v) for v in f[1].split("x"))
            depth, spin, extra = (int(f[i]) if len(f) > i else 0 for i in (2, 3, 4))
            mode = RING_MODES[f[0]]
        except (IndexError, KeyError, ValueError):
            raise ValueError(
                f"--ring item {it!r}: expected MODE:CTASxTHREADS[:DEPTH[:SPIN[:EXTRA]]], MODE one of {sorted(RING_MODES)}"
            ) from None
        top = 1024 if mode < 0 else 256  # ld runs read_kernel<1024>, the rest launch bounds of 256
        if ctas < 1 or threads < 32 or threads > top or threads % 32:
            raise ValueError(f"--ring item {it!r}: CTAS >= 1 and THREADS a multiple of 32 up to {top}")
        if mode > 0 and depth not in (3, 4, 6, 8):
            raise ValueError(f"--ring item {it!r}: DEPTH must be 3, 4, 6 or 8")
        if extra & 128 and mode not in (1, 3):
            raise ValueError(f"--ring item {it!r}: EXTRA 128 (a jittered delay) needs MODE cp or cpg")
        if extra & 256 and (mode not in (1, 3, 4, 5, 6, 7) or extra & 8):
            raise ValueError(
                f"--ring item {it!r}: EXTRA 256 (round-robin records) needs MODE cp, cpg, cpe, cpge, cpr or "
                "cpgr, and not EXTRA 8"
            )
        if extra & 8:
            # The balanced grid gives each warp at most one 16-row slice: the CTAs must hold them all.
            for name in names:
                slices = 8 * ((LLAMA8B[name][0] + 127) // 128)
                if -(-slices // ctas) > threads // 32:
                    raise ValueError(
                        f"--ring item {it!r}: {name}'s {slices} slices need >= {-(-slices // (threads // 32))} CTAs "
                        f"of {threads} threads (EXTRA bit 8: one slice per warp)"
                    )
        items.append((it, ctas, threads, mode, depth, spin, extra))
    return items


def ring_probe(a, lib: ctypes.CDLL, l2: int, res: dict, items: list[tuple]) -> int:
    """--ring: the copy mechanisms and ring depths of a GEMM-shaped grid, reading only."""
    res["ring"] = []
    for name in (v for v in a.ring_shapes.split(",") if v):
        nbytes = w12_bytes(*LLAMA8B[name])
        kt = (LLAMA8B[name][1] + 63) // 64
        bufs = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(copies_for(nbytes, l2))]
        readers = [(it, Reader(lib, ctas, True), th, mode, d, sp, ex) for it, ctas, th, mode, d, sp, ex in items]
        graphs = [
            capture_graph(
                [lambda b=b, r=r, th=th, m=m, d=d, sp=sp, ex=ex, kt=kt: r.ring(b, th, m, d, sp, ex, kt) for b in bufs]
            )
            for _, r, th, m, d, sp, ex in readers
        ]
        for (it, *_), (t, _, _) in zip(readers, time_graphs(graphs, a.reps)):
            row = {"shape": name, "item": it, "us": round(t, 2), "tbps": round(nbytes / t / 1e6, 3)}
            res["ring"].append(row)
            print(f"{name:>8} {it:>20} {t:8.2f} us {row['tbps']:6.2f} TB/s")
        del graphs, bufs, readers
        torch.cuda.empty_cache()
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {a.json}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctas-per-sm", default="2,4,8", help="read-kernel CTAs per SM to try (256 threads each)")
    p.add_argument("--reps", type=int, default=30, help="timed graph replays (median taken)")
    p.add_argument("--pdl", action="store_true", help="also launch the read kernels with PDL")
    p.add_argument("--no-gemm", action="store_true", help="skip the same-run cuBLAS / W12 GEMM graph set")
    p.add_argument(
        "--grids",
        default="",
        help="also read each shape's W12 bytes with these fixed grids, CTAS x THREADS, comma list "
        "(e.g. 64x1024,128x512,264x256: how fast fewer, larger CTAs stream); 'only' after the list "
        "skips everything else",
    )
    p.add_argument(
        "--chunk",
        type=int,
        default=0,
        help="with --grids: also read with BYTES-sized chunks dealt round-robin to the CTAs (CTA b "
        "reads chunks b, b + G, ...: one moving window instead of G streams; 12288 = a W12 record)",
    )
    p.add_argument(
        "--prefetch",
        default="",
        help="also time the graph set with each read kernel's CTAs prefetching into L2, at their end, the "
        "first BYTES of what the same CTA of the next launch reads; comma list of BYTES per CTA (0 = the "
        "same kernel without it)",
    )
    p.add_argument(
        "--ring",
        default="",
        help="read --ring-shapes' W12 bytes with MODE:CTASxTHREADS[:DEPTH[:SPIN[:EXTRA]]] items (comma "
        "list), then exit. MODE: ld / ld16 (8 / 16 loads in flight per thread), cp (v4's ring of per-thread "
        "cp.async, DEPTH slots, one barrier per record), bulk (a ring of one bulk copy per 12 KB record by thread 0; bulkr: each slot refilled before SPIN), cpg "
        "(cp with v4's pieces: 16-byte hi, 8-byte lo through L1), cpe / cpge (cp / cpg, each thread refilling "
        "its own pieces before the barrier), cpr / cpgr (the same, the refill issued before SPIN). DEPTH: 3, 4, "
        "6 or 8. SPIN: cycles of delay per record standing for the GEMM's work (negative: -SPIN ns asleep). "
        "EXTRA (cpg), bits: 1 v4's four shared loads, 2 its proxy fence, 4 an activation row's copies, 8 its "
        "balanced grid's slices (CTAS = 2 x SMs), 16 two records per step, 32 (with 8) records stored "
        "slice-major, 64 (cpe...cpgr) no barrier per step, 128 (cp, cpg) each CTA's delay per record drawn "
        "from [0, 2 SPIN), 256 (cp...cpgr, without 8) records dealt round-robin to the CTAs",
    )
    p.add_argument("--ring-shapes", default="gate_up,down,o", help="shapes for --ring")
    p.add_argument("--graph-set-only", action="store_true", help="skip the per-shape reads")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "read_floor_h200.json"))
    a = p.parse_args(argv)
    if a.chunk and (a.chunk < 0 or a.chunk % 16 or not a.grids):
        p.error(f"--chunk {a.chunk}: must be a positive multiple of 16 bytes, used with --grids")
    try:
        prefetch = [int(v) for v in a.prefetch.split(",") if v]
        ring_items = parse_ring(a.ring, a.ring_shapes) if a.ring else []
    except ValueError as e:
        p.error(str(e) if str(e).startswith("--") else f"--prefetch {a.prefetch!r}: expected a comma list of bytes")
    if any(v < 0 or v % 16 for v in prefetch):
        p.error(f"--prefetch {a.prefetch!r}: bytes per CTA must be >= 0 and multiples of 16")
    if not torch.cuda.is_available():
        print("error: bench_read_floor needs a CUDA GPU", file=sys.stderr)
        return 2
    lib = load_lib()
    props = torch.cuda.get_device_properties(0)
    sms, l2 = props.multi_processor_count, props.L2_cache_size
    cps = [int(v) for v in a.ctas_per_sm.split(",") if v]
    pdls = [False, True] if a.pdl else [False]
    gen = torch.Generator(device="cuda").manual_seed(0)
    res: dict = {"gpu": props.name, "sms": sms, "shapes": [], "graph_set": [], "grids": []}
    print(f"# {props.name}, {sms} SMs, L2 {l2 >> 20} MB")
    if a.ring:
        return ring_probe(a, lib, l2, res, ring_items)
    grid_items = [g for g in a.grids.split(",") if g and g != "only"]
    grids_only = "only" in a.grids.split(",")
    try:
        grids = [(int(g.split("x")[0]), int(g.split("x")[1])) for g in grid_items]
    except (IndexError, ValueError):
        print(f"error: --grids {a.grids!r}: expected CTASxTHREADS items such as 64x1024", file=sys.stderr)
        return 2
    for name, (n, k) in LLAMA8B.items() if grids else ():
        nbytes = w12_bytes(n, k)
        bufs = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(copies_for(nbytes, l2))]
        for (ctas, threads), chunk in itertools.product(grids, [0, a.chunk] if a.chunk > 0 else [0]):
            r = Reader(lib, ctas, False)
            if chunk:
                fns = [lambda b=b, r=r, th=threads, c=chunk: r.read_chunks(b, th, c) for b in bufs]
            else:
                fns = [lambda b=b, r=r, th=threads: r.read_grid(b, th) for b in bufs]
            t, _, _ = time_graph(fns, a.reps)
            row = {
                "shape": name,
                "ctas": ctas,
                "threads": threads,
                "chunk": chunk,
                "us": round(t, 2),
                "tbps": round(nbytes / t / 1e6, 3),
            }
            res["grids"].append(row)
            how = f"chunks of {chunk} B round-robin" if chunk else "contiguous per CTA"
            print(f"{name:>8} w12 grid {ctas:4d} x {threads:4d} {t:8.2f} us {row['tbps']:6.2f} TB/s  {how}")
        del bufs
    if grids_only:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {a.json}")
        return 0

    # Per shape, back to back, rotated copies (as bench_gemm times each shape).
    for name, (n, k) in LLAMA8B.items() if not a.graph_set_only else ():
        for kind, nbytes in (("w12", w12_bytes(n, k)), ("bf16", n * k * 2)):
            bufs = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(copies_for(nbytes, l2))]
            for c in cps:
                for pdl in pdls:
                    r = Reader(lib, c * sms, pdl)
                    t, _, _ = time_graph([lambda b=b, r=r: r.read(b) for b in bufs], a.reps)
                    row = {"shape": name, "bytes": kind, "ctas_per_sm": c, "pdl": pdl, "us": round(t, 2)}
                    row["tbps"] = round(nbytes / t / 1e6, 3)
                    res["shapes"].append(row)
                    print(f"{name:>8} {kind:>5} c{c} pdl{int(pdl)} {t:8.2f} us {row['tbps']:6.2f} TB/s")
            del bufs
    torch.cuda.empty_cache()

    # The decode-step set: distinct buffers per layer, W12 bytes, with and without reduce stand-ins.
    names = ["qkv", "o", "gate_up", "down"] * 32 + ["lm_head"]
    bufs = [torch.empty(w12_bytes(*LLAMA8B[nm]), dtype=torch.uint8, device="cuda") for nm in names]
    for c in cps:
        for pdl in pdls:
            for tails in (False, True):
                r = Reader(lib, c * sms, pdl)

                def step(b, nm, r=r, tails=tails):
                    r.read(b)
                    if tails and nm in SPLIT:
                        r.tail((LLAMA8B[nm][0] + 127) // 128)

                t, _, _ = time_graph([lambda b=b, nm=nm: step(b, nm) for b, nm in zip(bufs, names)], a.reps, 1)
                ms = t * len(names) / 1000.0
                row = {"ctas_per_sm": c, "pdl": pdl, "reduce_standins": tails, "ms": round(ms, 4)}
                res["graph_set"].append(row)
                print(f"graph set, W12 bytes: c{c} pdl{int(pdl)} tails{int(tails)} {ms:.3f} ms")
    for c, pf in itertools.product(cps, prefetch):
        for pdl in pdls:
            r = Reader(lib, c * sms, pdl)

            def step_pf(i, r=r, pf=pf, bufs=bufs):
                r.read_pf(bufs[i], bufs[i + 1] if i + 1 < len(bufs) else None, pf)
                if names[i] in SPLIT:
                    r.tail((LLAMA8B[names[i]][0] + 127) // 128)

            t, _, _ = time_graph([lambda i=i: step_pf(i) for i in range(len(bufs))], a.reps, 1)
            ms = t * len(names) / 1000.0
            row = {"ctas_per_sm": c, "pdl": pdl, "reduce_standins": True, "prefetch_bytes": pf, "ms": round(ms, 4)}
            res["graph_set"].append(row)
            print(f"graph set, W12 bytes: c{c} pdl{int(pdl)} tails1 next-prefetch {pf} B/CTA {ms:.3f} ms")
    del bufs
    torch.cuda.empty_cache()
    if not a.no_gemm:
        gs = graph_set_llama8b(gen, max(5, a.reps // 3), [(2, 0, 0, "auto", 0)])
        res["gemm_graph_set"] = gs
        print(f"graph set: cuBLAS {gs['ms_cublas']:.3f} ms, W12 GEMM {gs['ms_w12']:.3f} ms")
        for row in res["graph_set"]:
            row["floor_over_cublas"] = round(row["ms"] / gs["ms_cublas"], 4)
            pf = f" next-prefetch {row['prefetch_bytes']} B/CTA" if "prefetch_bytes" in row else ""
            print(
                f"  read floor c{row['ctas_per_sm']} pdl{int(row['pdl'])} tails{int(row['reduce_standins'])}{pf}: "
                f"{row['ms']:.3f} ms = {row['floor_over_cublas']:.3f} of cuBLAS"
            )
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
