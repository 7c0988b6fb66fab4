"""The W12 operators, registered once with ``torch.library``.

Every op has a CPU implementation (the reference in ``w12.reference``, which is also the
fallback on any device without compiled kernels) and a fake implementation, so the whole Python
path runs in CPU CI and ``torch.compile`` can trace it. CUDA implementations are registered by
``w12.cuda_ops`` on top of these definitions; loading the compiled library happens there, lazily,
on the first call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import reference

Tensor = torch.Tensor


@torch.library.custom_op("w12::unpack", mutates_args=())
def unpack_op(
    records: Tensor,
    base: Tensor,
    esc_ptr: Tensor,
    esc_col: Tensor,
    esc_val: Tensor,
    n: int,
    k: int,
    layout: int,
    eight_bit: bool,
) -> Tensor:
    return reference.decode(records, base, esc_ptr, esc_col, esc_val, n, k, layout, eight_bit)


@unpack_op.register_fake
def _(records, base, esc_ptr, esc_col, esc_val, n, k, layout, eight_bit):
    return records.new_empty((*records.shape[:-3], n, k), dtype=torch.bfloat16)


@torch.library.custom_op("w12::linear", mutates_args=())
def linear_op(
    x: Tensor,
    records: Tensor,
    base: Tensor,
    esc_ptr: Tensor,
    esc_col: Tensor,
    esc_val: Tensor,
    n: int,
    k: int,
    layout: int,
    bias: Tensor | None,
) -> Tensor:
    # Decode then the framework's own linear in x's dtype: on the CPU this is bit-identical to
    # the unpatched nn.Linear, which is what patched models promise there.
    w = reference.decode(records, base, esc_ptr, esc_col, esc_val, n, k, layout)
    return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))


@linear_op.register_fake
def _(x, records, base, esc_ptr, esc_col, esc_val, n, k, layout, bias):
    return x.new_empty((*x.shape[:-1], n))


# CUDA kernels register themselves on top of the definitions above; importing these modules
# neither loads the compiled library nor initialises CUDA.
from . import cuda_codec as _cuda_codec  # noqa: E402,F401
from . import cuda_ops as _cuda_ops  # noqa: E402,F401
