"""Benchmark: the fused W12 GEMM (``w12.linear`` on CUDA) against cuBLAS BF16 (``F.linear``).

Both are measured in the same run, on the same GPU, with a cold L2: each kernel rotates over
enough copies of its weight that the copies together are >= 3x the L2 size, so every launch
streams its weight from HBM (activations, which are small, stay cached as in a real decode step).
Launches are captured in a CUDA graph (so Python and launch overhead are out of the numbers);
one replay runs R launches; the figure is the median over many replays of replay time / R.

Shapes are nn.Linear weights [N, K]: the Llama-3.1-8B projections and a 32B-class set.
Output: a table (us, effective TB/s of the bytes each kernel must read, speedup), geometric means
over the Llama shapes, and JSON rows {"kernel", "shape": [N, K], "M", "us", "us_cublas", "speedup", ...}.

``--graph-set llama8b`` also times one CUDA graph replaying all projections of 32 Llama-3.1-8B
layers plus the LM head at M=1, for W12 and for cuBLAS.

Examples:
  python benchmarks/bench_gemm.py                      # full set -> benchmarks/results/gemm_h200.json
  python benchmarks/bench_gemm.py --quick --json /tmp/q.json
  python benchmarks/bench_gemm.py --graph-set llama8b --ctas-per-sm 2,4 --stages 4,6
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import w12  # noqa: E402
from w12 import cuda_ops, layouts  # noqa: E402
from w12.format import RECORD_BYTES, ceil_div  # noqa: E402
from w12.weight import W12Weight  # noqa: E402

LLAMA8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
B32 = {"32b_a": (10240, 5120), "32b_b": (51200, 5120), "32b_c": (5120, 25600)}
MS = [1, 2, 4, 8, 16, 32, 64, 128]
ESCAPE_RATE = 6.5e-5  # measured on a real checkpoint (format spec §2)


def random_w12(n: int, k: int, device, gen: torch.Generator, escape_rate: float = ESCAPE_RATE) -> W12Weight:
    """A W12 weight with random records, realistic bases and escapes (``escape_rate`` of the
    weights, Poisson per row), for timing only.

    The records do not hold code 0x000 at the escaped positions as the format requires, so the
    GEMM's result on them is not decode + F.linear (``refcheck`` uses a packed weight instead).

    Built directly on the GPU: encoding 500M-element weights on the CPU would take minutes and
    the kernel's speed does not depend on which codes it decodes.
    """
    nt, kt = ceil_div(n, 128), ceil_div(k, 64)
    records = torch.randint(0, 256, (nt, kt, RECORD_BYTES), dtype=torch.uint8, device=device, generator=gen)
    base = torch.randint(110, 122, (n,), dtype=torch.uint8, device=device, generator=gen)
    counts = torch.poisson(torch.full((n,), escape_rate * k, device=device), generator=gen).to(torch.int32)
    esc_ptr = torch.zeros(n + 1, dtype=torch.int32, device=device)
    torch.cumsum(counts, 0, out=esc_ptr[1:])
    nnz = int(esc_ptr[-1])
    esc_col = torch.sort(torch.randint(0, k, (nnz,), device=device, generator=gen)).values.to(torch.int32)
    esc_val = torch.zeros(nnz, dtype=torch.int16, device=device)  # exact zeros: the commonest escape
    return W12Weight(records, base, esc_ptr, esc_col, esc_val, (n, k), layout=layouts.MMA_SYNC_LAYOUT)


def in_kernel_layout(w: W12Weight) -> W12Weight:
    """``w`` relabelled with the layout the selected kernel reads (v4: 2, else 1).

    The records are random bytes, valid in any layout, so relabelling stands in for the
    permutation a loader does (timing a per-call permutation would measure the wrong thing).
    """
    lay = cuda_ops.kernel_layout(cuda_ops.kernel_version(w.N, w.K))
    return w if w.layout == lay else W12Weight(*w.tensors(), (w.N, w.K), layout=lay)


def copies_for(nbytes: int, l2: int) -> int:
    return max(2, math.ceil(3 * l2 / nbytes))


def capture_graph(fns, launches_min: int = 8) -> tuple[torch.cuda.CUDAGraph, int]:
    """``fns`` (rotated) captured in one graph of >= launches_min launches, replayed once; the graph
    and its launch count."""
    per_round = len(fns)
    rounds = max(1, math.ceil(launches_min / per_round))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:  # warm-up outside capture: workspace, counters, library load
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(rounds):
            for f in fns:
                f()
    g.replay()
    torch.cuda.synchronize()
    return g, rounds * per_round


def time_graphs(graphs, reps: int) -> list[tuple[float, float, float]]:
    """Median / p25 / p75 microseconds per launch of each (graph, launches), their replays taken
    in turn so that every graph samples the same stretch of the GPU's clock and power state."""
    times = [[] for _ in graphs]
    for _ in range(reps):
        for t, (g, launches) in zip(times, graphs):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            t.append(a.elapsed_time(b) * 1000.0 / launches)
    out = []
    for t in times:
        q = statistics.quantiles(t, n=4)
        out.append((statistics.median(t), q[0], q[2]))
    return out


def time_graph(fns, reps: int, launches_min: int = 8) -> tuple[float, float, float]:
    """Median / p25 / p75 microseconds per launch of ``fns`` (rotated) captured in one graph."""
    g = capture_graph(fns, launches_min)
    res = time_graphs([g], reps)[0]
    del g
    return res


def pool_instances(timed) -> tuple[float, float, float, list[float]]:
    """One measurement from several captured instances of the same launches: the median of their
    medians (and of their p25 / p75), and the instances' medians.

    Session 42 (docs/perf-notes.md, item 5): timed in turn with up to eleven other graphs, captures
    of the very same split-grid launches (GEMM grid + PDL reduce kernel) read up to 4 % apart,
    consistently over every replay, while whole-K grids without a reduce kernel stayed within
    0.3 %; three captures timed in turn by themselves read within 1.4 %. A single capture is one
    draw of that offset.
    """
    med = statistics.median
    return med(t[0] for t in timed), med(t[1] for t in timed), med(t[2] for t in timed), [t[0] for t in timed]


def refcheck(n: int, k: int, x: torch.Tensor, gen: torch.Generator) -> float:
    """Relative error of the W12 GEMM against F.linear in FP32 on a packed trained-like weight.

    Not on the timed weights: their random records hold arbitrary codes at escaped positions,
    where the format requires 0x000 (format spec §2), and the kernels' escape fix-up relies on
    that, so on them both kernels differ from decode + F.linear by ~1 % (measured in session 7).
    """
    wt = (torch.randn(n, k, device=x.device, generator=gen) * 0.02).to(torch.bfloat16)
    w = w12.pack(wt)
    w = w.with_layout(cuda_ops.kernel_layout(cuda_ops.kernel_version(n, k)))
    ref = F.linear(x.float(), wt.float())
    y = w12.linear(x, w).float()
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))


def bench_shape(
    name, n, k, ms, variants, reps, gen, l2, check, hot=False, interleave=False, escape_rate=ESCAPE_RATE, instances=1
):
    dev = torch.device("cuda")
    rows = []
    w12_bytes = n * k * 1.5  # records dominate; base/escapes add < 0.01%
    bf_bytes = n * k * 2
    ws = [random_w12(n, k, dev, gen, escape_rate) for _ in range(copies_for(int(w12_bytes), l2))]
    wb = [
        (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
        for _ in range(copies_for(bf_bytes, l2))
    ]
    if check:
        x = torch.randn(4, k, device=dev, generator=gen).to(torch.bfloat16)
        for var in variants:
            set_variant(var)
            err = refcheck(n, k, x, gen)
            if not err < 1e-2:
                raise SystemExit(
                    f"{name} [{n}, {k}] {variant_label(var, 2)}: W12 GEMM differs from decode + F.linear "
                    f"(rel err {err:.2e})"
                )

    def cublas_fns(x, wb):
        return [lambda w=w, x=x: F.linear(x, w) for w in wb]

    def w12_fns(x, var, ws):
        set_variant(var)  # the variant's settings are read at capture
        return [lambda w=w, x=x: w12.linear(x, w) for w in (in_kernel_layout(w) for w in ws)]

    def timed_instances(make_fns, *args):
        graphs = [capture_graph(make_fns(*args)) for _ in range(instances)]
        res = time_graphs(graphs, reps)
        del graphs
        return pool_instances(res)

    for m in ms:
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        if interleave:
            # cuBLAS and every variant captured first, instance by instance, then timed replay by
            # replay in turn; result j of `pooled` is cuBLAS (j = 0) or variant j - 1.
            graphs = []
            for _ in range(instances):
                graphs.append(capture_graph(cublas_fns(x, wb)))
                graphs += [capture_graph(w12_fns(x, var, ws)) for var in variants]
            timed = time_graphs(graphs, reps)
            del graphs
            per = len(variants) + 1
            pooled = [pool_instances(timed[j::per]) for j in range(per)]
        else:
            pooled = [timed_instances(cublas_fns, x, wb)]
        t_cb, _, _, cb_inst = pooled[0]
        for vi, var in enumerate(variants):
            if interleave:
                t, p25, p75, inst = pooled[vi + 1]
            else:
                t, p25, p75, inst = timed_instances(w12_fns, x, var, ws)
            set_variant(var)  # for the hot run and the rule queries below
            # --hot: one copy over and over, so that a weight smaller than L2 is read from L2: a
            # grid as slow hot as cold is bound by its CTAs' own per-record work, not by HBM.
            t_hot = None
            if hot:
                w0 = in_kernel_layout(ws[0])
                t_hot = time_graph([lambda w=w0, x=x: w12.linear(x, w)] * 8, reps)[0]
            kver = cuda_ops.kernel_version(n, k)
            rows.append(
                {
                    "kernel": variant_label(var, len(variants)),
                    "shape": [n, k],
                    "name": name,
                    "M": m,
                    "us": round(t, 3),
                    "us_p25": round(p25, 3),
                    "us_p75": round(p75, 3),
                    "us_cublas": round(t_cb, 3),
                    "speedup": round(t_cb / t, 4),
                    "tbps_w12": round(w12_bytes / t / 1e6, 3),
                    "tbps_cublas": round(bf_bytes / t_cb / 1e6, 3),
                    "splits": cuda_ops.splits(n, k, kernel=kver),
                    "kernel_used": kver,
                    # v4's whole-K clusters (ring depth; 0: split grid + reduce kernel, or unsplit)
                    "wholek": cuda_ops.wholek_stages(n, k, m, diag=int(var[2])) if kver == 4 else 0,
                    "wholek_wgs": cuda_ops.wholek_warpgroups(n, k, m, diag=int(var[2])) if kver == 4 else 0,
                    "wholek_cluster": cuda_ops.wholek_cluster(n, k, m, diag=int(var[2])) if kver == 4 else 0,
                    # v4's stream-K lanes on multi-wave unsplit grids at 33-128 tokens (0: none)
                    "sk": cuda_ops.sk_lanes(n, k, min(m, 128), diag=int(var[2])) if kver == 4 else 0,
                }
            )
            if hot:
                rows[-1]["us_hot"] = round(t_hot, 3)
            if instances > 1:
                rows[-1]["us_instances"] = [round(v, 3) for v in inst]
                rows[-1]["us_cublas_instances"] = [round(v, 3) for v in cb_inst]
    del ws, wb
    torch.cuda.empty_cache()
    return rows


def variant_label(var, n_variants: int) -> str:
    cps, stages, diag, kern, fallback = var
    if n_variants == 1:
        return f"w12_{kern}"
    return f"w12_{kern}[c{cps},s{stages}" + (f",d{diag}" if diag else "") + (f",f{fallback}]" if fallback else "]")


def set_variant(var) -> None:
    os.environ["W12_GEMM_CTAS_PER_SM"], os.environ["W12_GEMM_STAGES"] = str(var[0]), str(var[1])
    os.environ["W12_GEMM_DIAG"], os.environ["W12_GEMM_KERNEL"] = str(var[2]), var[3]
    if var[4]:
        os.environ["W12_GEMM_FALLBACK_M"] = str(var[4])
    else:
        os.environ.pop("W12_GEMM_FALLBACK_M", None)


def graph_set_inputs(gen, layers: int = 32, layer=("qkv", "o", "gate_up", "down"), head=True):
    """Shapes of the decode-step graph set, one M = 1 activation per K, trained-like BF16 weights."""
    dev = torch.device("cuda")
    shapes = [LLAMA8B[p] for p in layer] * layers + ([LLAMA8B["lm_head"]] if head else [])
    xs = {k: torch.randn(1, k, device=dev, generator=gen).to(torch.bfloat16) for k in {s[1] for s in shapes}}
    wb = [(torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16) for n, k in shapes]
    return shapes, xs, wb


def graph_set_llama8b(
    gen,
    reps: int,
    variants,
    layers: int = 32,
    layer=("qkv", "o", "gate_up", "down"),
    head=True,
    escape_rate=ESCAPE_RATE,
):
    """One graph: all projections of ``layers`` Llama-3.1-8B layers + LM head at M=1.

    ``layer`` / ``head`` change what one layer holds and whether the LM head ends the set
    (``--graph-layer``: to find which transitions between kernels cost time).

    Timed for cuBLAS once and for every W12 variant (each sets its own environment: before this
    was per variant, the W12 figure silently measured whichever variant the shape loop ran last).
    ``ms_w12`` / ``ratio_w12_over_cublas`` are the first variant's; ``w12`` has them all.
    """
    dev = torch.device("cuda")
    shapes, xs, wb = graph_set_inputs(gen, layers, layer, head)
    t, _, _ = time_graph([lambda w=w: F.linear(xs[w.shape[1]], w) for w in wb], reps, launches_min=1)
    out = {"ms_cublas": round(t * len(shapes) / 1000.0, 4), "w12": {}}
    del wb
    torch.cuda.empty_cache()
    ws = [random_w12(n, k, dev, gen, escape_rate) for n, k in tqdm(shapes, desc="w12 weights", leave=False)]
    for var in variants:
        set_variant(var)
        wv = [in_kernel_layout(w) for w in ws]
        t, _, _ = time_graph([lambda w=w: w12.linear(xs[w.K], w) for w in wv], reps, launches_min=1)
        ms = round(t * len(shapes) / 1000.0, 4)
        out["w12"][variant_label(var, len(variants))] = {
            "ms": ms,
            "ratio_w12_over_cublas": round(ms / out["ms_cublas"], 4),
        }
    del ws
    torch.cuda.empty_cache()
    first = next(iter(out["w12"]))
    out["w12_variant"] = first
    out["ms_w12"] = out["w12"][first]["ms"]
    out["ratio_w12_over_cublas"] = out["w12"][first]["ratio_w12_over_cublas"]
    out["launches"] = len(shapes)
    return out


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="Llama-3.1-8B shapes at M in 1,16,32,64 only")
    p.add_argument("--m", type=_ints, default=None, help=f"token counts (default {','.join(map(str, MS))})")
    p.add_argument(
        "--shapes", default="llama8b,32b", help="comma list of sets (llama8b, 32b) or names (qkv, 32b_a, ...)"
    )
    p.add_argument("--reps", type=int, default=30, help="timed graph replays per measurement (median taken)")
    p.add_argument("--ctas-per-sm", type=_ints, default=None, help="W12_GEMM_CTAS_PER_SM values to try")
    p.add_argument(
        "--stages", type=_ints, default=None, help="W12_GEMM_STAGES values to try (v1: 3, 4; v2: ring cap, 0 = auto)"
    )
    p.add_argument(
        "--fallback-m",
        type=_ints,
        default=None,
        help="W12_GEMM_FALLBACK_M values to try (above it, decode + cuBLAS; 0 = the library's default)",
    )
    p.add_argument("--kernels", default=None, help="W12_GEMM_KERNEL values to try, comma list (auto, v1, v2)")
    p.add_argument(
        "--diag",
        type=_ints,
        default=[0],
        help="W12_GEMM_DIAG values to try (v1: 1 no decode/MMA, 2 no reduction, 4 global reduction, 32 no PDL, "
        "512 in-kernel reduction at M<=8, 1/2 give wrong output; v4: 2 the per-output epilogue, 65536 no reduce kernel; "
        "README lists the rest)",
    )
    p.add_argument("--graph-set", choices=["llama8b"], default=None, help="also time the whole-model graph set")
    p.add_argument("--graph-only", action="store_true", help="only the --graph-set measurement")
    p.add_argument(
        "--graph-layer",
        default="qkv,o,gate_up,down",
        help="projections of one layer in the graph set; ending in ',-' drops the LM head (e.g. o,- or gate_up,down,-)",
    )
    p.add_argument(
        "--instances",
        type=int,
        default=1,
        help="CUDA graphs captured per measurement (cuBLAS and W12 alike), timed in turn; the figure is the "
        "median of their medians (session 42: captures of the same split-grid launches read up to 4 %% apart)",
    )
    p.add_argument("--no-check", action="store_true", help="skip the correctness check of each shape")
    p.add_argument(
        "--escape-rate",
        type=float,
        default=ESCAPE_RATE,
        help=f"escapes per weight of the timed random weights (default {ESCAPE_RATE:g}, a real checkpoint's; "
        "0 times the kernels without escape work, an upper bound on what removing it could save)",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="time cuBLAS and the W12 variants of a shape replay by replay in turn instead of one after "
        "the other (A/B runs: session 18 saw the first variant after cuBLAS read up to 4 %% slow on the "
        "largest shapes at 100-128 tokens). Not for PDL on / off A/Bs: session 30 saw it read PDL 0.3-0.6 us "
        "better than separate processes in both orders did",
    )
    p.add_argument(
        "--hot",
        action="store_true",
        help="also time each W12 variant on one weight copy repeated (L2-resident where it fits: "
        "e.g. 28672x1024 = 44 MB on the H200's 60 MB); JSON field us_hot",
    )
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "gemm_h200.json"), help="output JSON path")
    a = p.parse_args(argv)
    if not 0.0 <= a.escape_rate < 0.5:
        p.error(f"--escape-rate {a.escape_rate}: must be in [0, 0.5)")
    if not 1 <= a.instances <= 16:
        p.error(f"--instances {a.instances}: must be in 1..16")
    if not torch.cuda.is_available():
        print("error: bench_gemm needs a CUDA GPU", file=sys.stderr)
        return 2
    if not cuda_ops.available():
        print(f"error: W12 kernels unavailable: {cuda_ops._LIB_ERROR}", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 60 << 20)
    table = {**LLAMA8B, **B32}
    names = []
    for s in a.shapes.split(","):
        names += list(LLAMA8B) if s == "llama8b" else list(B32) if s == "32b" else [s]
    for s in names:  # ad-hoc shapes written NxK
        if s not in table and "x" in s:
            table[s] = tuple(int(v) for v in s.split("x"))
    if a.quick and a.shapes == "llama8b,32b":
        names = list(LLAMA8B)
    ms = a.m or ([1, 16, 32, 64] if a.quick else MS)
    cps = a.ctas_per_sm or [int(os.environ.get("W12_GEMM_CTAS_PER_SM", "2"))]
    stg = a.stages or [int(os.environ.get("W12_GEMM_STAGES", "0"))]
    kerns = (a.kernels or os.environ.get("W12_GEMM_KERNEL", "auto")).split(",")
    fbs = a.fallback_m or [0]
    variants = [(c, s, d, kv, fb) for kv in kerns for c in cps for s in stg for d in a.diag for fb in fbs]
    print(f"# {props.name}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MB, torch {torch.__version__}")
    rows = []
    if not a.graph_only:
        for name in tqdm(names, desc="shapes"):
            n, k = table[name]
            rows += bench_shape(
                name, n, k, ms, variants, a.reps, gen, l2, not a.no_check, a.hot, a.interleave, a.escape_rate,
                a.instances,
            )  # fmt: skip
        for r in rows:
            r["escape_rate"] = a.escape_rate
        print(
            f"\n{'shape':>10} {'N':>6} {'K':>6} {'M':>4} {'kernel':>22} {'us':>9} {'cuBLAS':>9} {'x':>6} {'TB/s':>6} {'cbTB/s':>6}"
            + (f" {'us hot':>9}" if a.hot else "")
        )
        for r in rows:
            print(
                f"{r['name']:>10} {r['shape'][0]:>6} {r['shape'][1]:>6} {r['M']:>4} {r['kernel']:>22} {r['us']:>9.2f} "
                f"{r['us_cublas']:>9.2f} {r['speedup']:>6.3f} {r['tbps_w12']:>6.2f} {r['tbps_cublas']:>6.2f}"
                + (f" {r['us_hot']:>9.2f}" if a.hot else "")
            )
        print("\n# geometric mean speedup over the Llama-3.1-8B shapes")
        for kern in sorted({r["kernel"] for r in rows}):
            line = []
            for m in ms:
                sp = [r["speedup"] for r in rows if r["kernel"] == kern and r["M"] == m and r["name"] in LLAMA8B]
                if sp:
                    line.append(f"M={m}: {math.exp(sum(map(math.log, sp)) / len(sp)):.3f}")
            worst = min((r["speedup"] for r in rows if r["kernel"] == kern and r["M"] <= 64), default=float("nan"))
            print(f"{kern}: " + ", ".join(line) + f"; min over M<=64: {worst:.3f}")
    result = {"rows": rows}
    if a.graph_set:
        layer = [v for v in a.graph_layer.split(",") if v]
        head = layer[-1] != "-"
        layer = [v for v in layer if v != "-"]
        bad = [v for v in layer if v not in LLAMA8B or v == "lm_head"]
        if bad or not layer:
            p.error(f"--graph-layer {a.graph_layer!r}: names must be among qkv, o, gate_up, down")
        gs = graph_set_llama8b(
            gen, max(5, a.reps // 3), variants, layer=tuple(layer), head=head, escape_rate=a.escape_rate
        )
        gs["layer"], gs["head"], gs["escape_rate"] = layer, head, a.escape_rate
        for label, g in gs["w12"].items():
            print(
                f"\n# graph set {'+'.join(layer)}{' + lm_head' if head else ''} (M=1, {gs['launches']} launches): "
                f"{label} {g['ms']:.3f} ms, "
                f"cuBLAS {gs['ms_cublas']:.3f} ms, W12/cuBLAS = {g['ratio_w12_over_cublas']:.3f}"
            )
        result["graph_set_llama8b"] = gs
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    # The format is a plain list of rows; the graph-set figure goes to a sibling file.
    out.write_text(json.dumps(rows, indent=1) + "\n")
    if a.graph_set:
        out.with_name(out.stem + "_graph_set.json").write_text(json.dumps(result["graph_set_llama8b"], indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
