"""Checkpoint conversion throughput on the CPU, and W12 against today's lossless weight compressors.

1. Builds (once; cached under ``~/.cache/w12/bench``) a synthetic BF16 checkpoint with Llama-3.1-8B
   layer shapes (hidden 4096, MLP 14336, 32/8 heads, vocab 128256), normal weights std 0.02,
   ``--layers`` decoder layers (default 9: 3.0 B weights, 2.5 B of them converted).
2. Runs ``w12 convert`` on it ``--repeat`` times, each in a fresh process (so its peak RSS is the
   converter's own) and reports weights/s end to end (all source weights over the wall time from
   opening the source to the renamed, fsynced destination), GB/s, CPU seconds, the load average
   (the machine may be shared: the median run is the headline) and peak RSS; ``--verify`` also
   times ``w12 verify``.
3. On a named subset of the same tensors, compares size and time with ``zipnn==0.5.4`` and
   ``dfloat11==0.5.0``'s compressor (imported optionally; not dependencies of w12). DFloat11's
   package cannot be imported without CUDA/cupy, so its CPU compressor functions
   (``dfloat11_utils``: Huffman code of the exponents, as ``compress_model`` calls them) are loaded
   from the installed file directly; they are a pure-Python loop, so they get a smaller subset.

Writes ``benchmarks/results/convert_cpu.json``. Example:
    python benchmarks/bench_convert.py --layers 9 --verify
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from w12 import cpu_encoder, reference  # noqa: E402
from w12.checkpoint import open_folder  # noqa: E402
from w12.synthetic import PRESETS, build_llama_checkpoint  # noqa: E402
from w12.weight import W12Weight  # noqa: E402


def machine() -> dict:
    mem = {}
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for ln in f:
            k, v = ln.split(":", 1)
            if k in ("MemTotal", "MemAvailable"):
                mem[k] = int(v.split()[0]) * 1024
    return {
        "cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "loadavg": os.getloadavg(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        **mem,
    }


def build(args) -> Path:
    src = Path(args.workdir) / f"{args.preset}-L{args.layers}-s{args.seed}"
    if (src / "config.json").exists():
        print(f"reusing {src}")
        return src
    part = src.with_name(src.name + ".partial")
    shutil.rmtree(part, ignore_errors=True)
    t0 = time.perf_counter()
    info = build_llama_checkpoint(
        part, args.preset, layers=args.layers, num_shards=args.shards, seed=args.seed, progress=True
    )
    os.replace(part, src)
    print(
        f"built {info['weights'] / 1e9:.2f} B weights ({info['bytes'] / 1e9:.1f} GB) in {time.perf_counter() - t0:.0f} s"
    )
    return src


def run_cli(*argv) -> tuple[dict, float, dict]:
    """Runs ``w12 ARGV --json`` in a fresh process: its JSON, wall seconds and CPU seconds."""
    import resource

    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "converters.cli", *argv, "-q", "--json"], cwd=ROOT, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"w12 {argv[0]} failed ({r.returncode}): {r.stderr.strip()}")
    cpu = {
        "user_s": c1.ru_utime - c0.ru_utime,
        "sys_s": c1.ru_stime - c0.ru_stime,
        "loadavg_1min_before": load0,
        "loadavg_1min_after": os.getloadavg()[0],
    }
    return json.loads(r.stdout), wall, cpu


def load_dfloat11_compressor():
    """DFloat11's CPU compressor functions, or (None, why) if they cannot be loaded."""
    try:
        import dfloat11  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is the finding we report
        why = f"import dfloat11 failed: {type(e).__name__}: {e}"
    else:
        why = None
    spec = importlib.util.find_spec("dfloat11")
    if spec is None or spec.origin is None:
        return None, "dfloat11 is not installed (pip install dfloat11==0.5.0)"
    path = Path(spec.origin).parent / "dfloat11_utils.py"
    try:
        s = importlib.util.spec_from_file_location("dfloat11_cpu_utils", path)
        mod = importlib.util.module_from_spec(s)
        s.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001
        return None, f"{why}; loading {path} failed too: {type(e).__name__}: {e}"
    return mod, why


def dfloat11_compress(mod, tensors: list[torch.Tensor]) -> tuple[int, float]:
    """Compressed bytes and seconds of DFloat11's compressor on one block of tensors (one codec)."""
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        flat = [t.flatten() for t in tensors]
        _, counter = mod.get_codec(torch.cat(flat))
        codec, _, table = mod.get_32bit_codec(counter)
        luts = mod.get_luts(table)
        # bytes_per_thread=8, threads_per_block=512: dfloat11 0.5.0's module constants
        encoded, other, outpos, gaps, _ = mod.encode_weights(flat, codec, 8, 512)
    dt = time.perf_counter() - t0
    nbytes = encoded.numel() + other.numel() + outpos.numel() * 4 + gaps.numel() + luts.numel()
    return nbytes, dt


def compare(src: Path, names: list[str], df11_names: list[str]) -> dict:
    folder = open_folder(src)
    tensors = {n: folder.read(n) for n in names}
    weights = sum(t.numel() for t in tensors.values())
    out = {"tensors": names, "weights": weights, "bf16_bytes": weights * 2}

    def timed(fn):
        t0 = time.perf_counter()
        r = fn()
        return r, time.perf_counter() - t0

    one = next(iter(tensors.values()))
    parts, enc_s = timed(lambda: [cpu_encoder.encode(t) for t in tensors.values()])
    w12_bytes = sum(v.numel() * v.element_size() for p in parts for v in p.values())
    weights12 = [W12Weight(**p, shape=t.shape) for p, t in zip(parts, tensors.values())]
    _, dec_s = timed(lambda: [cpu_encoder.decode(w) for w in weights12])
    _, ref_dec_s = timed(lambda: reference.decode(*weights12[0].tensors(), *one.shape))
    _, ref_s = timed(lambda: reference.encode(one))
    out["w12"] = {
        "bytes": w12_bytes,
        "bits_per_weight": w12_bytes * 8 / weights,
        "ratio": w12_bytes / (weights * 2),
        "compress_s": enc_s,
        "compress_weights_per_s": weights / enc_s,
        "decompress_cpu_s": dec_s,
        "decompress_cpu_weights_per_s": weights / dec_s,
        "reference_encoder_weights_per_s": one.numel() / ref_s,
        "reference_decoder_weights_per_s": one.numel() / ref_dec_s,
        "note": "CPU (de)compress = the fused C codec; on a GPU W12 is decoded inside the GEMM",
    }
    parts = weights12 = None  # free the encoded tensors before the other compressors run
    try:
        import zipnn

        z = zipnn.ZipNN(input_format="torch", bytearray_dtype="bfloat16")
        comp, c_s, d_s, ok = 0, 0.0, 0.0, True
        for t in tensors.values():
            x = t.clone()  # zipnn's compress reorders the input tensor's bytes in place
            blob, dt = timed(lambda x=x: z.compress(x))
            c_s += dt
            back, dt = timed(lambda blob=blob: z.decompress(blob))
            d_s += dt
            ok &= torch.equal(back.reshape(t.shape).view(torch.int16), t.view(torch.int16))
            comp += len(blob)
        out["zipnn"] = {
            "version": getattr(zipnn, "__version__", "0.5.4"),
            "bytes": comp,
            "bits_per_weight": comp * 8 / weights,
            "ratio": comp / (weights * 2),
            "compress_s": c_s,
            "compress_weights_per_s": weights / c_s,
            "decompress_cpu_s": d_s,
            "decompress_cpu_weights_per_s": weights / d_s,
            "lossless_checked": bool(ok),
        }
    except ImportError as e:
        out["zipnn"] = {"error": f"{type(e).__name__}: {e} (pip install zipnn==0.5.4)"}
    mod, why = load_dfloat11_compressor()
    if mod is None:
        out["dfloat11"] = {"error": why}
    else:
        sub = [tensors[n] for n in df11_names]
        sub_w = sum(t.numel() for t in sub)
        nbytes, dt = dfloat11_compress(mod, sub)
        w12_sub = sum(v.numel() * v.element_size() for t in sub for v in cpu_encoder.encode(t).values())
        _, w12_dt = timed(lambda: [cpu_encoder.encode(t) for t in sub])
        out["dfloat11"] = {
            "subset": df11_names,
            "weights": sub_w,
            "bytes": nbytes,
            "bits_per_weight": nbytes * 8 / sub_w,
            "ratio": nbytes / (sub_w * 2),
            "compress_s": dt,
            "compress_weights_per_s": sub_w / dt,
            "w12_bits_per_weight_same_subset": w12_sub * 8 / sub_w,
            "w12_compress_weights_per_s_same_subset": sub_w / w12_dt,
            "package_import": why or "ok",
            "note": "CPU compressor functions only; decompression needs CUDA (cupy kernel), not run here",
        }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-3.1-8b", choices=sorted(PRESETS), help="layer shapes")
    p.add_argument("--layers", type=int, default=9, help="decoder layers (9: 3.0 B weights with Llama-3.1-8B shapes)")
    p.add_argument("--shards", type=int, default=2, help="source shard files")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=str(Path.home() / ".cache" / "w12" / "bench"), help="where checkpoints go")
    p.add_argument("--verify", action="store_true", help="also time 'w12 verify' (reference decoder: slow)")
    p.add_argument("--no-compare", action="store_true", help="skip the zipnn/dfloat11 comparison")
    p.add_argument("--compare-layer", type=int, default=0, help="the decoder layer whose 7 linears are compared")
    p.add_argument("--keep", action="store_true", help="keep the converted folder")
    p.add_argument("--repeat", type=int, default=3, help="convert runs (the machine may be shared: median reported)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "convert_cpu.json"))
    args = p.parse_args(argv)

    result = {"machine_before": machine(), "args": vars(args)}
    src = build(args)
    dst = Path(args.workdir) / (src.name + "-w12")
    shutil.rmtree(dst, ignore_errors=True)
    weights = sum(open_folder(src).info(n).numel for n in open_folder(src).tensor_names())
    if weights < 2e9 and args.preset == "llama-3.1-8b":
        print(f"note: {weights / 1e9:.2f} B weights is below the 2 B the target is stated for")
    runs = []
    for i in range(args.repeat):
        shutil.rmtree(dst, ignore_errors=True)
        os.sync()  # earlier dirty pages (the build's, the last run's) are not this run's to write back
        summary, wall, cpu = run_cli("convert", str(src), str(dst))
        run = {
            **summary,
            "process_wall_s": wall,
            "cpu": cpu,
            "weights_per_cpu_s": summary["weights_total"] / (cpu["user_s"] + cpu["sys_s"]),
            "source_gb_per_s": summary["source_bytes"] / summary["seconds"] / 1e9,
            "time_for_8b_weights_s": 8.03e9 / summary["weights_per_s"],
        }
        runs.append(run)
        print(
            f"convert {i + 1}/{args.repeat}: {summary['weights_total'] / 1e9:.2f} B weights "
            f"({summary['weights_converted'] / 1e9:.2f} B converted) in {summary['seconds']:.1f} s = "
            f"{summary['weights_per_s'] / 1e6:.1f} M weights/s ({run['source_gb_per_s']:.2f} GB/s of BF16); "
            f"peak RSS {summary['peak_rss_bytes'] / 1e9:.2f} GB; {summary['bits_per_weight']:.4f} bits/weight; "
            f"CPU {cpu['user_s']:.1f} s user + {cpu['sys_s']:.1f} s sys "
            f"({run['weights_per_cpu_s'] / 1e6:.0f} M weights per CPU-second); "
            f"load average {cpu['loadavg_1min_before']:.1f} -> {cpu['loadavg_1min_after']:.1f} on {os.cpu_count()} CPUs"
        )
    rates = sorted(r["weights_per_s"] for r in runs)
    median = rates[len(rates) // 2]
    result["convert"] = {
        "runs": runs,
        "median_weights_per_s": median,
        "best_weights_per_s": rates[-1],
        "worst_weights_per_s": rates[0],
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs),
        "encoder": cpu_encoder.backend(),
        "median_time_for_8b_weights_s": 8.03e9 / median,
    }
    print(
        f"convert median {median / 1e6:.1f} M weights/s (range {rates[0] / 1e6:.1f}-{rates[-1] / 1e6:.1f}) over "
        f"{len(runs)} runs: an 8 B model in {8.03e9 / median:.0f} s; peak RSS "
        f"{result['convert']['peak_rss_bytes'] / 1e9:.2f} GB"
    )
    if args.verify:
        v, vwall, vcpu = run_cli("verify", str(src), str(dst))
        result["verify"] = {**v, "process_wall_s": vwall, "cpu": vcpu, "weights_per_s": v["weights"] / v["seconds"]}
        print(f"verify: {v['message']} in {v['seconds']:.1f} s ({v['weights'] / v['seconds'] / 1e6:.1f} M weights/s)")
    if not args.keep:
        shutil.rmtree(dst, ignore_errors=True)
    if not args.no_compare:
        L = f"model.layers.{args.compare_layer}."
        names = [
            L + s
            for s in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            )
        ]
        names = [n + ".weight" for n in names]
        df11 = [L + "self_attn.k_proj.weight", L + "self_attn.v_proj.weight"]
        c = compare(src, names, df11)
        result["compare"] = c
        print(
            f"\nsame tensors ({len(names)} linears of layer {args.compare_layer}, {c['weights'] / 1e6:.0f} M weights):"
        )
        print(f"{'method':<10} {'bits/w':>7} {'size':>7} {'compress M w/s':>15} {'CPU decompress M w/s':>21}")
        for k in ("w12", "zipnn"):
            r = c.get(k, {})
            if "error" in r:
                print(f"{k:<10} unavailable: {r['error']}")
                continue
            print(
                f"{k:<10} {r['bits_per_weight']:>7.3f} {r['ratio']:>7.1%} {r['compress_weights_per_s'] / 1e6:>15.1f} "
                f"{r['decompress_cpu_weights_per_s'] / 1e6:>21.1f}"
            )
        d = c["dfloat11"]
        if "error" in d:
            print(f"dfloat11   unavailable: {d['error']}")
        else:
            print(
                f"dfloat11   {d['bits_per_weight']:>7.3f} {d['ratio']:>7.1%} {d['compress_weights_per_s'] / 1e6:>15.2f} "
                f"{'(CUDA only)':>21}   on {d['weights'] / 1e6:.1f} M weights (k/v proj); W12 there: "
                f"{d['w12_bits_per_weight_same_subset']:.3f} bits/w, {d['w12_compress_weights_per_s_same_subset'] / 1e6:.0f} M w/s"
            )
            print(f"           ({d['package_import']})")
        if "zipnn" in c and "error" not in c["zipnn"]:
            z, w = c["zipnn"], c["w12"]
            print(
                f"\nW12 trades {w['bits_per_weight'] - z['bits_per_weight']:.2f} bits/weight against zipnn "
                f"({w['bytes'] / z['bytes'] - 1:+.1%} size) for a fixed-rate format a GPU GEMM decodes in registers; "
                f"compression speed: W12 {w['compress_weights_per_s'] / z['compress_weights_per_s']:.2f}x zipnn"
            )
    result["machine_after"] = machine()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
