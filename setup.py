"""Packaging for w12.

The CUDA kernels are optional: they are compiled into a torch-free shared library
(``w12/_kernels/libw12.so``) with nvcc when nvcc is found and ``W12_SKIP_CUDA_BUILD`` is not 1.
The library has a C ABI and is loaded with ctypes, so one binary built here runs under any torch
version on the GPU machine (see docs/extension.md for why).
"""

import os
import runpy
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class BuildKernels(build_ext):
    """Builds libw12.so with nvcc in place of a regular extension."""

    def run(self):
        out_dir = ROOT / "w12" / "_kernels" if self.inplace else Path(self.build_lib) / "w12" / "_kernels"
        skip = os.environ.get("W12_SKIP_CUDA_BUILD", "0") == "1"
        nvcc = shutil.which("nvcc") or (
            os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None
        )
        if skip or not nvcc or not os.path.exists(nvcc) or not (ROOT / "csrc" / "build.py").exists():
            why = "W12_SKIP_CUDA_BUILD=1" if skip else "nvcc not found"
            print(f"w12: skipping the CUDA kernel build ({why}); the CPU reference path will be used", file=sys.stderr)
            return
        build = runpy.run_path(str(ROOT / "csrc" / "build.py"))["build"]
        build(out_dir=out_dir, nvcc=nvcc)

    def get_outputs(self):
        return []


setup(
    ext_modules=[Extension("w12._kernels_placeholder", sources=[])],
    cmdclass={"build_ext": BuildKernels},
)
