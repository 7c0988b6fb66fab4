"""Builds the torch-free kernel library ``libw12.so`` with nvcc.

Every ``*.cu``/``*.cpp`` under csrc/, kernels_sm120/ and kernels_sm90/ goes into one shared
library with a C ABI (loaded by ``w12.cuda_ops`` through ctypes). kernels_sm90/ holds wgmma/TMA
code that only exists on sm_90a, so those files are compiled for that target alone (in a build
without 90a, for the build's targets, where their bodies are empty); the rest is a fat binary for
every architecture in ``W12_CUDA_ARCHS``. No PTX is embedded: a GPU the build does not name gets
"no kernel image", never a JIT-compiled kernel.

Usage: ``python csrc/build.py [--out DIR] [--jobs N] [--archs 80,90a,120a] [--verbose]``.
Objects are cached in ``build/w12_obj`` and rebuilt when a source or any header is newer.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC_DIRS = ("csrc", "kernels_sm120", "kernels_sm90")
DEFAULT_ARCHS = "80,90a,120a"


def _gencode(arch: str) -> list[str]:
    num = arch.rstrip("a")
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}"] if num else []


def _sources() -> list[Path]:
    out = []
    for d in SRC_DIRS:
        out += sorted((ROOT / d).glob("*.cu")) + sorted((ROOT / d).glob("*.cpp"))
    return out


def _headers() -> list[Path]:
    out = []
    for d in SRC_DIRS:
        for pat in ("*.cuh", "*.h", "*.hpp"):
            out += (ROOT / d).glob(pat)
    return out


def gencode_for(src_dir: str, archs: list[str]) -> list[str]:
    """nvcc -gencode flags for a source under ``src_dir`` in a build for ``archs``.

    kernels_sm90/ gets sm_90a alone when the build has it. Without 90a it gets the build's own
    targets (its kernel bodies are empty there), never nvcc's default: that adds compute_75 PTX,
    which an sm_90 GPU would JIT-compile into a v4 that runs and writes nothing.
    """
    if src_dir == "kernels_sm90" and "90a" in archs:
        return _gencode("90a")
    return [g for a in archs for g in _gencode(a)]


def build(out_dir=None, nvcc: str | None = None, archs: str | None = None, jobs: int | None = None, verbose=False):
    nvcc = nvcc or shutil.which("nvcc")
    if not nvcc:
        raise RuntimeError("nvcc not found: install the CUDA toolkit or set W12_SKIP_CUDA_BUILD=1")
    out_dir = Path(out_dir or ROOT / "w12" / "_kernels")
    archs = (archs or os.environ.get("W12_CUDA_ARCHS", DEFAULT_ARCHS)).replace(" ", "").split(",")
    jobs = jobs or int(os.environ.get("W12_BUILD_JOBS", str(os.cpu_count() or 2)))
    obj_dir = ROOT / "build" / "w12_obj"
    obj_dir.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = _sources()
    if not sources:
        raise RuntimeError(f"no CUDA sources found under {', '.join(SRC_DIRS)}")
    newest_header = max((h.stat().st_mtime for h in _headers()), default=0.0)
    common = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-lineinfo", "--expt-relaxed-constexpr"]
    common += [f"-I{ROOT / d}" for d in SRC_DIRS]
    tag = "_".join(archs)

    def compile_one(src: Path) -> Path:
        obj = obj_dir / f"{src.parent.name}__{src.stem}.{tag}.o"
        if obj.exists() and obj.stat().st_mtime > max(src.stat().st_mtime, newest_header):
            return obj
        gen = gencode_for(src.parent.name, archs)
        cmd = [nvcc, *common, *gen, "-c", str(src), "-o", str(obj)]
        if verbose:
            print(" ".join(cmd), flush=True)
        t0 = time.time()
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed on {src.relative_to(ROOT)}:\n{res.stderr}{res.stdout}")
        if res.stderr.strip() and verbose:
            print(res.stderr, file=sys.stderr)
        print(f"  compiled {src.relative_to(ROOT)} in {time.time() - t0:.1f}s", flush=True)
        return obj

    print(f"w12: building libw12.so for sm_{', sm_'.join(archs)} ({len(sources)} sources, {jobs} jobs)", flush=True)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        objs = list(pool.map(compile_one, sources))
    lib = out_dir / "libw12.so"
    tmp = out_dir / "libw12.so.tmp"
    gen = [g for a in archs for g in _gencode(a)]
    cmd = [nvcc, "-shared", *gen, *map(str, objs), "-o", str(tmp)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"linking libw12.so failed:\n{res.stderr}{res.stdout}")
    os.replace(tmp, lib)  # a half-linked library is never left under the final name
    print(f"w12: wrote {lib}", flush=True)
    return lib


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="output folder for libw12.so (default: w12/_kernels)")
    p.add_argument(
        "--archs", default=None, help=f"comma-separated SM targets (default: $W12_CUDA_ARCHS or {DEFAULT_ARCHS})"
    )
    p.add_argument("--jobs", type=int, default=None, help="parallel nvcc processes (default: CPU count)")
    p.add_argument("--verbose", action="store_true", help="print each nvcc command and its warnings")
    a = p.parse_args(argv)
    try:
        build(a.out, archs=a.archs, jobs=a.jobs, verbose=a.verbose)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
