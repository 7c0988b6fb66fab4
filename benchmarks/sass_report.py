"""Static SASS report of the compiled kernels: per kernel, its main loop's instruction mix.

Runs on any machine (no GPU): it disassembles ``w12/_kernels/libw12.so`` (or ``--lib``, or a
``.cubin``) with ``cuobjdump -sass`` and, for every kernel whose name matches ``--match``, prints
the total instruction count, local-memory traffic (LDL/STL: spills) and the largest loop that
holds a tensor-core instruction (HMMA/HGMMA/IMMA), with its opcode mix. Session 6 found the v1
GEMM issue-bound per warp, so the main loop's instruction count predicts the small shapes' time
(docs/perf-notes.md): check it before spending device time on a kernel change.

cuobjdump is looked up on PATH, under $CUDA_HOME/bin, then in the ``nvidia-cuda-cuobjdump`` wheel
(``pip download nvidia-cuda-cuobjdump`` and unzip, or install it; this machine's CUDA toolkit has
nvcc but no cuobjdump).

Examples:
  python benchmarks/sass_report.py                                  # GEMM kernels of the library
  python benchmarks/sass_report.py --match 'gemm_w12_mma_kernelILi1ELi3' --top 20
  python benchmarks/sass_report.py --cubin /tmp/k.cubin --json /tmp/sass.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/")
_BRANCH = re.compile(r"\bBRA(?:\.[A-Z.]+)?\s+(0x[0-9a-f]+)")
_TENSOR = ("HMMA", "HGMMA", "IMMA")


def find_cuobjdump() -> str | None:
    """Path of a cuobjdump binary, or None."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "cuobjdump").exists():
        return str(Path(cuda_home) / "bin" / "cuobjdump")
    try:  # the pip wheel nvidia-cuda-cuobjdump puts it under nvidia/cu*/bin
        import nvidia  # noqa: PLC0415

        for base in getattr(nvidia, "__path__", []):
            for cand in sorted(Path(base).glob("cu*/bin/cuobjdump")):
                return str(cand)
    except ImportError:
        pass
    return None


def split_functions(sass: str) -> dict[str, list[str]]:
    """{kernel name: its instruction lines} from ``cuobjdump -sass`` output."""
    out: dict[str, list[str]] = {}
    for chunk in re.split(r"\n\s*Function : ", sass)[1:]:
        name, _, body = chunk.partition("\n")
        out[name.strip()] = [line for line in body.split("\n") if _ADDR.search(line)]
    return out


def opcode(line: str) -> str:
    """The instruction's base opcode (``HMMA`` for ``HMMA.16816.F32.BF16``), predicates skipped."""
    text = re.sub(r"/\*.*?\*/", " ", line).split(";")[0].split()
    for tok in text:
        if not tok.startswith("@"):
            return tok.split(".")[0]
    return ""


def main_loop(lines: list[str]) -> list[str]:
    """The kernel's main loop: the smallest backward-branch range holding the most tensor-core
    instructions; [] when no loop holds one.

    Smallest, not largest: out-of-line blocks placed after the epilogue (an mbarrier wait's retry
    path, for one) branch back into the loop, and their ranges span the whole kernel.
    """
    addrs = [int(_ADDR.search(line).group(1), 16) for line in lines]
    best: list[str] = []
    best_tensor = 0
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target >= addrs[i]:
            continue
        body = [ln for ln, a in zip(lines, addrs) if target <= a <= addrs[i]]
        tensor = sum(opcode(ln) in _TENSOR for ln in body)
        if tensor and (tensor > best_tensor or (tensor == best_tensor and len(body) < len(best))):
            best, best_tensor = body, tensor
    return best


def report(functions: dict[str, list[str]], match: str) -> list[dict]:
    rows = []
    pat = re.compile(match)
    for name, lines in functions.items():
        if not pat.search(name):
            continue
        loop = main_loop(lines)
        mix = Counter(opcode(ln) for ln in loop)
        allops = Counter(opcode(ln) for ln in lines)
        rows.append(
            dict(
                kernel=name,
                instructions=len(lines),
                local_memory=allops["LDL"] + allops["STL"],
                loop_instructions=len(loop),
                loop_tensor=sum(mix[t] for t in _TENSOR),
                loop_barriers=mix["BAR"],
                loop_mix=dict(mix.most_common()),
            )
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--lib", default=str(ROOT / "w12" / "_kernels" / "libw12.so"), help="shared library to read")
    src.add_argument("--cubin", default=None, help="a .cubin (nvcc -cubin) instead of the library")
    p.add_argument("--match", default="gemm_w12", help="regular expression on the (mangled) kernel names")
    p.add_argument("--arch", default=None, help="only this SASS arch of a fat binary, e.g. sm_90a")
    p.add_argument("--top", type=int, default=8, help="opcodes of the loop mix to print")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)

    tool = find_cuobjdump()
    if tool is None:
        print(
            "sass_report: cuobjdump not found (PATH, $CUDA_HOME/bin, or the nvidia-cuda-cuobjdump wheel)",
            file=sys.stderr,
        )
        return 2
    path = Path(args.cubin or args.lib)
    if not path.exists():
        print(f"sass_report: {path} does not exist (build it with `python csrc/build.py`)", file=sys.stderr)
        return 2
    cmd = [tool, "-sass", str(path)]
    if args.arch:
        cmd[2:2] = ["-arch", args.arch]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        print(f"sass_report: {' '.join(cmd)} failed:\n{res.stderr}", file=sys.stderr)
        return 1
    rows = report(split_functions(res.stdout), args.match)
    if not rows:
        print(f"sass_report: no kernel in {path} matches {args.match!r}", file=sys.stderr)
        return 1
    for r in sorted(rows, key=lambda r: r["kernel"]):
        mix = ", ".join(f"{k} {v}" for k, v in list(r["loop_mix"].items())[: args.top])
        spill = f", LOCAL MEMORY {r['local_memory']}" if r["local_memory"] else ""
        print(f"{r['kernel'][-72:]}: {r['instructions']} instr{spill}")
        print(
            f"    main loop {r['loop_instructions']} instr, {r['loop_tensor']} tensor-core, "
            f"{r['loop_barriers']} BAR; {mix}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
