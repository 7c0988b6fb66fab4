"""CUDA implementations of the W12 ops (filled in by the GPU-path work).

Until the compiled library exists this module reports the kernels as unavailable, so every
caller takes the reference path.
"""

from __future__ import annotations


def available() -> bool:
    return False
