"""Where a CUDA-graph replay of GEMMs spends its time between kernels, from an nsys GPU trace.

Reads the CSV of ``nsys stats --report cuda_gpu_trace --format csv`` (a run of
``bench_gemm.py --graph-only --graph-set llama8b`` under ``nsys profile --cuda-graph-trace=node``),
splits the kernels into replays at host-side gaps, and prints per replay the span, the time some
kernel was running (union of intervals) and the idle rest. For the last replay of each W12 GEMM
kernel it also prints, per position in a layer (qkv, o, gate_up, down), the mean GEMM time, the
reduce kernel's time (from its early PDL start, so its wait included) and the gaps GEMM end ->
reduce start, reduce (or GEMM) end -> next GEMM start and GEMM end -> next GEMM start (negative:
overlap under PDL). benchmarks/graph_timeline.py writes such a CSV without nsys.

    python benchmarks/nsys_gaps.py trace_cuda_gpu_trace.csv [--layer 4]
"""

from __future__ import annotations

import argparse
import csv
import statistics


def load(path: str) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every kernel, sorted by start."""
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            name = row.get("Name", "")
            start = row.get("Start (ns)") or row.get("Start")
            dur = row.get("Duration (ns)") or row.get("Duration")
            if not start or not dur or "memcpy" in name.lower() or "memset" in name.lower():
                continue
            s = float(start) / 1000.0
            out.append((s, s + float(dur) / 1000.0, name))
    return sorted(out)


def replays(kernels, split_us: float):
    """Runs of kernels separated by more than split_us of idle GPU time."""
    runs, cur, end = [], [], 0.0
    for k in kernels:
        if cur and k[0] - end > split_us:
            runs.append(cur)
            cur = []
        end = max(end, k[1]) if cur else k[1]  # latest end within the current run
        cur.append(k)
    if cur:
        runs.append(cur)
    return runs


def busy(run) -> float:
    total, s0, e0 = 0.0, None, None
    for s, e, _ in run:
        if e0 is None or s > e0:
            if e0 is not None:
                total += e0 - s0
            s0, e0 = s, e
        else:
            e0 = max(e0, e)
    return total + (e0 - s0 if e0 is not None else 0.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--split-us", type=float, default=100.0, help="idle gap that separates two replays")
    ap.add_argument("--layer", type=int, default=4, help="GEMMs per layer in the graph set")
    a = ap.parse_args(argv)
    ks = load(a.csv)
    runs = [r for r in replays(ks, a.split_us) if len(r) >= 64]
    print(f"{len(ks)} kernels, {len(runs)} replays of >= 64 kernels")
    for r in runs:
        w12 = any("w12" in k[2] for k in r)
        span = r[-1][1] - r[0][0]
        b = busy(r)
        print(
            f"  {'W12   ' if w12 else 'other '} {len(r):4d} kernels  span {span:8.1f} us  busy {b:8.1f}  idle {span - b:7.1f}"
        )
    # The last replay of each W12 GEMM kernel family (e.g. v4's wgmma kernel, v1's mma kernel).
    last = {}
    for r in runs:
        g = next((k[2] for k in r if "w12" in k[2] and "reduce" not in k[2]), None)
        if g:
            name = g[g.find("gemm_w12") :] if "gemm_w12" in g else g
            last[name.split("<")[0].split("(")[0]] = r
    for fam, r in last.items():
        per_position(fam, r, a.layer)
    return 0


def per_position(fam: str, r, layer: int) -> None:
    gemms = [i for i, k in enumerate(r) if "reduce" not in k[2]]
    rows = {p: {"gemm": [], "red": [], "g2r": [], "gap": [], "g2g": []} for p in range(layer)}
    for n, i in enumerate(gemms[: (len(gemms) // layer) * layer]):
        pos = n % layer
        g = r[i]
        red = r[i + 1] if i + 1 < len(r) and "reduce" in r[i + 1][2] else None
        nxt = r[gemms[n + 1]] if n + 1 < len(gemms) else None
        rows[pos]["gemm"].append(g[1] - g[0])
        if red:
            rows[pos]["red"].append(red[1] - red[0])
            rows[pos]["g2r"].append(red[0] - g[1])
        if nxt:
            rows[pos]["gap"].append(nxt[0] - (red[1] if red else g[1]))
            rows[pos]["g2g"].append(nxt[0] - g[1])
    print(
        f"last replay of {fam}, mean per layer position (us): gemm, reduce, gemm end -> reduce start, "
        "reduce (or gemm) end -> next gemm start, gemm end -> next gemm start"
    )
    for p, v in rows.items():
        m = lambda xs: statistics.fmean(xs) if xs else float("nan")  # noqa: E731
        cols = " ".join(f"{m(v[c]):7.2f}" for c in ("gemm", "red", "g2r", "gap", "g2g"))
        print(f"  pos {p}: {cols}")


if __name__ == "__main__":
    raise SystemExit(main())
