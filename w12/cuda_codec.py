"""CUDA encode/decode/layout kernels for W12 (GPU pack, unpack, record permutation).

The kernels live in the torch-free library loaded by ``w12.cuda_ops.lib()`` (sources:
``kernels_sm120/codec_*.cu``, C ABI in ``csrc/codec_api.cu``). This module checks arguments,
allocates outputs with torch on the input's device and launches on the current torch stream.

Importing it registers the CUDA implementation of ``w12::unpack`` but neither loads the library
nor initialises CUDA: both happen on the first call. Without the library the registered op falls
back to the pure-torch reference decoder, which also runs on the GPU (slowly).
"""

from __future__ import annotations

import ctypes
import math
import threading

import torch

from . import cuda_ops, layouts, reference
from .format import RECORD_BYTES, TILE_K, TILE_N, Layout, ceil_div
from .format import convert_layout as format_convert_layout
from .weight import W12Weight

_ABI_VERSION = 4
_INT32_MAX = 2**31 - 1
_BIND_LOCK = threading.Lock()
_BOUND = False
_TABLES: dict = {}  # (src, dst, device) -> (src Layout, dst Layout, int16 gather table on device)

_P = ctypes.c_void_p
_SIGNATURES = {
    "w12_encode_count": [_P, ctypes.c_int64, ctypes.c_int, _P, _P, _P],
    "w12_encode_write": [_P, ctypes.c_int64, ctypes.c_int, ctypes.c_int, _P, _P, _P, _P, _P, _P],
    "w12_decode": [
        _P,
        _P,
        _P,
        _P,
        _P,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        _P,
        _P,
    ],
    "w12_permute_records": [_P, _P, ctypes.c_int64, _P, ctypes.c_int, _P],
    "w12_decode_layout4": [_P, _P, _P, _P, _P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, _P, _P],
    "w12_decode_layout3": [_P, _P, _P, _P, _P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, _P, _P],
}


def _lib() -> ctypes.CDLL:
    """The kernel library with the codec functions bound; RuntimeError saying why if unusable."""
    global _BOUND
    lib = cuda_ops.lib()
    with _BIND_LOCK:
        if not _BOUND:
            try:
                version = lib.w12_codec_abi_version
            except AttributeError:
                raise RuntimeError(
                    f"{cuda_ops.library_path()} has no W12 codec kernels (rebuild with `python csrc/build.py`)"
                ) from None
            version.restype = ctypes.c_int
            if version() != _ABI_VERSION:
                raise RuntimeError(
                    f"{cuda_ops.library_path()} has codec ABI {version()}, this w12 expects {_ABI_VERSION}: rebuild it"
                )
            for name, argtypes in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes = argtypes
                fn.restype = ctypes.c_int
            lib.w12_codec_error_string.argtypes = [ctypes.c_int]
            lib.w12_codec_error_string.restype = ctypes.c_char_p
            _BOUND = True
    return lib


def available() -> bool:
    """True when the compiled codec kernels can be used (loads the library; no CUDA init)."""
    try:
        _lib()
    except RuntimeError:
        return False
    return True


def _launch(what: str, name: str, *args) -> None:
    lib = _lib()
    err = getattr(lib, name)(*args)
    if err != 0:
        msg = lib.w12_codec_error_string(err).decode(errors="replace")
        raise RuntimeError(f"w12 CUDA {what} failed: {msg} (cudaError {err})")


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _stream(device: torch.device) -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


def _require(what: str, name: str, t, dtype: torch.dtype, device: torch.device | None = None) -> None:
    """Checks one tensor argument; the message names the op, the argument and what was wrong."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{what}: {name} must be {dtype}, got {t.dtype} with shape {tuple(t.shape)}")
    if not t.is_cuda:
        raise ValueError(f"{what}: {name} must be a CUDA tensor, got one on {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{what}: {name} is on {t.device} but the records are on {device}")
    if not t.is_contiguous():
        raise ValueError(
            f"{what}: {name} (shape {tuple(t.shape)}, strides {t.stride()}) must be contiguous; call .contiguous()"
        )


def pack(weight: torch.Tensor) -> W12Weight:
    """Encodes a contiguous BF16 CUDA tensor ``[..., N, K]`` into a layout-0 ``W12Weight`` on its device.

    Bit-identical to ``w12.reference.encode``. One host sync (the escape count sizes the escape list).
    """
    what = "w12 CUDA pack"
    _require(what, "weight", weight, torch.bfloat16)
    if weight.dim() < 2:
        raise ValueError(f"{what}: weight must have rank >= 2 ([..., N, K]), got shape {tuple(weight.shape)}")
    shape = tuple(int(s) for s in weight.shape)
    n, k = shape[-2], shape[-1]
    if weight.numel() == 0:
        raise ValueError(f"{what}: cannot encode an empty tensor of shape {shape}")
    mats = math.prod(shape[:-2])
    rows = mats * n
    if rows >= _INT32_MAX or k >= _INT32_MAX:
        raise ValueError(f"{what}: shape {shape} has {rows} rows of {k}; W12 indexes rows and columns with int32")
    nt, kt = ceil_div(n, TILE_N), ceil_div(k, TILE_K)
    dev = weight.device
    with torch.cuda.device(dev):
        stream = _stream(dev)
        base = torch.empty(rows, dtype=torch.uint8, device=dev)
        count = torch.empty(rows, dtype=torch.int32, device=dev)
        _launch(
            what + " (pass 1: bases and escape counts)",
            "w12_encode_count",
            _ptr(weight),
            rows,
            k,
            _ptr(base),
            _ptr(count),
            stream,
        )
        # int64 scan so that an adversarial tensor with > 2^31 escapes is reported, not wrapped.
        ends = torch.cumsum(count, 0, dtype=torch.int64)
        nnz = int(ends[-1])  # the one host sync: esc_col / esc_val need their size before pass 2
        if nnz > _INT32_MAX:
            raise ValueError(f"{what}: shape {shape} has {nnz} escapes, more than the int32 esc_ptr can index")
        esc_ptr = torch.zeros(rows + 1, dtype=torch.int32, device=dev)
        esc_ptr[1:] = ends
        records = torch.empty((mats, nt, kt, RECORD_BYTES), dtype=torch.uint8, device=dev)
        esc_col = torch.empty(nnz, dtype=torch.int32, device=dev)
        esc_val = torch.empty(nnz, dtype=torch.int16, device=dev)
        _launch(
            what + " (pass 2: records and escapes)",
            "w12_encode_write",
            _ptr(weight),
            mats,
            n,
            k,
            _ptr(base),
            _ptr(esc_ptr),
            _ptr(records),
            _ptr(esc_col),
            _ptr(esc_val),
            stream,
        )
    records = records.view(*shape[:-2], nt, kt, RECORD_BYTES)
    return W12Weight(records, base, esc_ptr, esc_col, esc_val, shape=shape, layout=0)


def _gather_table(s: Layout, d: Layout, device: torch.device) -> torch.Tensor:
    key = (s.id, d.id, str(device))
    hit = _TABLES.get(key)
    if hit is not None and hit[0] is s and hit[1] is d:
        return hit[2]
    # slot in dst -> layout-0 element -> slot in src (the same table as format.convert_layout)
    table = s.inv[d.perm].to(torch.int16).to(device)
    _TABLES[key] = (s, d, table)
    return table


def permute_records(records: torch.Tensor, s: Layout, d: Layout) -> torch.Tensor:
    """Contiguous CUDA records from layout ``s`` to ``d`` in one kernel: the slot permutation, with
    the split form undone before it (``s.split``) and applied after it (``d.split``)."""
    dev = records.device
    with torch.cuda.device(dev):
        table = _gather_table(s, d, dev)
        out = torch.empty_like(records)
        num = records.numel() // RECORD_BYTES
        _launch(
            f"w12 CUDA convert_layout ({s.id} -> {d.id})",
            "w12_permute_records",
            _ptr(records),
            _ptr(out),
            num,
            _ptr(table),
            int(s.split) | (int(d.split) << 1),
            _stream(dev),
        )
    return out


def convert_layout(records: torch.Tensor, src: int, dst: int) -> torch.Tensor:
    """Moves CUDA records ``[..., 12288]`` from layout ``src`` to ``dst`` on the GPU (a new tensor).

    Same result as ``w12.format.convert_layout`` byte for byte (it is that function, with the
    records checked first so that errors name this call).
    """
    what = "w12 CUDA convert_layout"
    _require(what, "records", records, torch.uint8)
    if records.dim() < 1 or records.shape[-1] != RECORD_BYTES:
        raise ValueError(f"{what}: records must be uint8 [..., {RECORD_BYTES}], got shape {tuple(records.shape)}")
    with torch.cuda.device(records.device):
        return format_convert_layout(records, src, dst)


def unpack(
    records: torch.Tensor,
    base: torch.Tensor,
    esc_ptr: torch.Tensor,
    esc_col: torch.Tensor,
    esc_val: torch.Tensor,
    n: int,
    k: int,
    layout: int = 0,
    eight_bit: bool = False,
    *,
    _variant: int = -1,
) -> torch.Tensor:
    """Decodes CUDA W12 tensors to BF16 ``[..., N, K]`` (exact, or the 8-bit view). No host sync.

    ``_variant`` forces one of the decode kernel's variants (0 or 1; see codec_decode_sm120.cu) for
    benchmarking; the default lets the library choose.
    """
    what = "w12 CUDA unpack"
    _require(what, "records", records, torch.uint8)
    dev = records.device
    for name, t, dt in (
        ("base", base, torch.uint8),
        ("esc_ptr", esc_ptr, torch.int32),
        ("esc_col", esc_col, torch.int32),
        ("esc_val", esc_val, torch.int16),
    ):
        _require(what, name, t, dt, dev)
    n, k = int(n), int(k)
    if n <= 0 or k <= 0:
        raise ValueError(f"{what}: n={n}, k={k} must be positive")
    nt, kt = ceil_div(n, TILE_N), ceil_div(k, TILE_K)
    if records.dim() < 3 or tuple(records.shape[-3:]) != (nt, kt, RECORD_BYTES):
        raise ValueError(
            f"{what}: records have shape {tuple(records.shape)}, but N={n}, K={k} needs [..., {nt}, {kt}, {RECORD_BYTES}]"
        )
    batch = tuple(records.shape[:-3])
    mats = math.prod(batch)
    rows = mats * n
    if tuple(base.shape) != (rows,) or tuple(esc_ptr.shape) != (rows + 1,):
        raise ValueError(
            f"{what}: base {tuple(base.shape)} / esc_ptr {tuple(esc_ptr.shape)} do not match {rows} rows "
            f"(need ({rows},) and ({rows + 1},))"
        )
    if esc_col.dim() != 1 or esc_col.shape != esc_val.shape:
        raise ValueError(
            f"{what}: esc_col {tuple(esc_col.shape)} and esc_val {tuple(esc_val.shape)} must be equal 1-D shapes"
        )
    if rows >= _INT32_MAX or esc_col.numel() > _INT32_MAX:
        raise ValueError(f"{what}: {rows} rows / {esc_col.numel()} escapes exceed the int32 indexing of W12")
    with torch.cuda.device(dev):
        out = torch.empty((*batch, n, k), dtype=torch.bfloat16, device=dev)

        def args(recs):  # the arguments both decode kernels take first, in their order
            return (_ptr(recs), _ptr(base), _ptr(esc_ptr), _ptr(esc_col), _ptr(esc_val), esc_col.numel(), mats, n, k)

        direct = {layouts.MMA_SYNC_SPLIT_LAYOUT: "w12_decode_layout4", layouts.WGMMA_SPLIT_LAYOUT: "w12_decode_layout3"}
        if layout in direct and not eight_bit:
            # The GEMM kernels' own layouts decode in place (the prefill fallback of w12.linear):
            # no permutation back to layout 0 first, a second read and write of every record.
            _launch(what, direct[layout], *args(records), _ptr(out), _stream(dev))
            return out
        if layout != 0:
            records = convert_layout(records, layout, 0)
        what += " (8-bit view)" if eight_bit else ""
        _launch(what, "w12_decode", *args(records), int(bool(eight_bit)), _ptr(out), _stream(dev), int(_variant))
    return out


def _unpack_cuda(records, base, esc_ptr, esc_col, esc_val, n, k, layout, eight_bit):
    if not available():
        # The reference decoder is pure torch, so it runs on the GPU too (slowly) without the library.
        return reference.decode(records, base, esc_ptr, esc_col, esc_val, n, k, layout, eight_bit)
    return unpack(records, base, esc_ptr, esc_col, esc_val, n, k, layout, eight_bit)


torch.library.register_kernel("w12::unpack", "cuda", _unpack_cuda)
