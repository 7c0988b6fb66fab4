"""A fused CPU encoder (and decoder) for bulk conversion, bit-identical to ``w12.reference``.

The reference encoder is about twenty vectorised torch passes over each weight; converting a
checkpoint on a 2-core machine needs fewer. This module compiles (once, with the system C
compiler, cached under ``~/.cache/w12``) two small C loops that make two passes over the BF16 bits:

1. per row: the exponent histogram, the base that maximises the in-window count (ties: the larger
   b, as the format says) and so the row's escape count;
2. per row: the 12-bit codes written straight into their record slots (layout 0) and the escapes
   into their CSR slots (the offsets come from pass 1, so no list is ever resized).

A third loop decodes layout-0 records back to BF16 for ``w12 verify`` and ``w12 restore``.
Rows are split between threads (``ctypes`` releases the GIL), so both cores work on one tensor
and the memory held is one tensor's input and output. Without a C compiler, or with
``W12_CPU_ENCODER=torch``, the reference codec is used (same output, slower); tests check the
two agree on every bit pattern, odd shapes and stacked tensors.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from . import reference
from .format import RECORD_BYTES, TILE_K, TILE_N, ceil_div

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* Pass 1 for rows [r0, r1) of a [rows, k] int16 matrix: base[r] and nesc[r] (escapes in the row). */
void w12_bases(const uint16_t *x, int64_t k, int64_t r0, int64_t r1, uint8_t *base, int32_t *nesc) {
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *row = x + r * k;
        /* four sub-histograms so that runs of equal exponents do not serialise on one counter */
        uint32_t h[4][256];
        memset(h, 0, sizeof h);
        int64_t j = 0;
        for (; j + 4 <= k; j += 4) {
            h[0][(row[j] >> 7) & 0xFF]++;
            h[1][(row[j + 1] >> 7) & 0xFF]++;
            h[2][(row[j + 2] >> 7) & 0xFF]++;
            h[3][(row[j + 3] >> 7) & 0xFF]++;
        }
        for (; j < k; j++) h[0][(row[j] >> 7) & 0xFF]++;
        uint32_t hist[256];
        for (int e = 0; e < 256; e++) hist[e] = h[0][e] + h[1][e] + h[2][e] + h[3][e];
        uint32_t win = 0;
        for (int e = 1; e <= 16; e++) win += hist[e];
        uint32_t best = win;
        int bestb = 1;
        for (int b = 2; b <= 239; b++) {
            win += hist[b + 15] - hist[b - 1];
            if (win >= best) { best = win; bestb = b; }  /* >=: ties go to the larger b */
        }
        base[r] = (uint8_t)bestb;
        nesc[r] = (int32_t)(k - best);
    }
}

/* Codes of 64 elements (n valid, the rest padding) into one record row: hi bytes and lo nibbles.
   Returns non-zero if any valid element escapes. */
static inline int tile_row(const uint16_t *x, int n, int16_t b7, uint8_t *hi, uint8_t *lo) {
    uint16_t buf[64];
    const uint16_t *v = x;
    if (n < 64) {
        memset(buf, 0, sizeof buf);
        memcpy(buf, x, (size_t)n * 2);
        v = buf;
    }
    uint8_t nib[64];
    int16_t esc = 0;
    for (int c = 0; c < 64; c++) {
        int16_t s = (int16_t)v[c];
        int16_t t = (int16_t)((s & 0x7FFF) - b7);
        int16_t ok = (uint16_t)t < 2048;
        int16_t code = ok ? (int16_t)(t | ((s >> 4) & 0x800)) : 0;
        hi[c] = (uint8_t)(code >> 4);
        nib[c] = (uint8_t)(code & 0xF);
        esc |= (int16_t)(c < n) & (int16_t)!ok;
    }
    for (int c = 0; c < 32; c++) lo[c] = (uint8_t)(nib[2 * c] | (nib[2 * c + 1] << 4));
    return esc;
}

/* Pass 2 for global rows [r0, r1) of a stack of matrices [rows / n, n, k]: records (layout 0) and
   escapes at esc_ptr[r]. */
void w12_codes(const uint16_t *x, int64_t n, int64_t k, int64_t r0, int64_t r1, const uint8_t *base,
               const int32_t *esc_ptr, uint8_t *records, int32_t *esc_col, int16_t *esc_val) {
    const int64_t nt = (n + 127) / 128, kt = (k + 63) / 64;
    for (int64_t g = r0; g < r1; g++) {
        const int64_t m = g / n, r = g % n;
        const uint16_t *row = x + g * k;
        const int16_t b7 = (int16_t)(base[g] << 7);
        uint8_t *tile = records + ((m * nt + r / 128) * kt) * 12288;
        const int64_t rin = r % 128;
        int64_t pos = esc_ptr[g];
        for (int64_t t = 0; t < kt; t++, tile += 12288) {
            const int64_t c0 = t * 64;
            const int cn = (int)(k - c0 < 64 ? k - c0 : 64);
            if (tile_row(row + c0, cn, b7, tile + rin * 64, tile + 8192 + rin * 32)) {
                for (int c = 0; c < cn; c++) {
                    uint16_t s = row[c0 + c];
                    int16_t tt = (int16_t)((s & 0x7FFF) - b7);
                    if ((uint16_t)tt >= 2048) {
                        esc_col[pos] = (int32_t)(c0 + c);
                        esc_val[pos] = (int16_t)s;
                        pos++;
                    }
                }
            }
        }
    }
}

/* Decode global rows [r0, r1) of a stack [rows / n, n, k] from layout-0 records into out (int16
   bit patterns), escapes last. Returns 0, or 1 if an escape column is out of range. */
int w12_decode(const uint8_t *records, int64_t n, int64_t k, int64_t r0, int64_t r1, const uint8_t *base,
               const int32_t *esc_ptr, const int32_t *esc_col, const int16_t *esc_val, int16_t *out) {
    const int64_t nt = (n + 127) / 128, kt = (k + 63) / 64;
    int bad = 0;
    for (int64_t g = r0; g < r1; g++) {
        const int64_t m = g / n, r = g % n, rin = r % 128;
        const uint8_t *tile = records + ((m * nt + r / 128) * kt) * 12288;
        const int16_t b7 = (int16_t)(base[g] << 7);
        int16_t *o = out + g * k;
        for (int64_t t = 0; t < kt; t++, tile += 12288) {
            const uint8_t *hi = tile + rin * 64, *lo = tile + 8192 + rin * 32;
            int16_t buf[64];
            for (int c = 0; c < 32; c++) {
                const int16_t l = lo[c];
                const int16_t a = (int16_t)((hi[2 * c] << 4) | (l & 0xF));
                const int16_t b = (int16_t)((hi[2 * c + 1] << 4) | (l >> 4));
                buf[2 * c] = (int16_t)(((a & 0x7FF) + b7) | ((a & 0x800) << 4));
                buf[2 * c + 1] = (int16_t)(((b & 0x7FF) + b7) | ((b & 0x800) << 4));
            }
            const int64_t c0 = t * 64;
            memcpy(o + c0, buf, (size_t)((k - c0 < 64) ? k - c0 : 64) * 2);
        }
        for (int32_t e = esc_ptr[g]; e < esc_ptr[g + 1]; e++) {
            if (esc_col[e] < 0 || esc_col[e] >= k) { bad = 1; continue; }
            o[esc_col[e]] = esc_val[e];
        }
    }
    return bad;
}
"""

_lib = None
_lib_error: str | None = None
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _cache_dir() -> Path:
    return Path(os.environ.get("W12_CACHE_DIR", Path.home() / ".cache" / "w12")) / "cpu_encoder"


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler (cc/gcc/clang) found")
    flags = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c99"]
    key = hashlib.sha256("\0".join([_SOURCE, cc, *flags, platform.machine(), _cpu_id()]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"w12_cpu_encoder_{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as d:
            src = Path(d) / "enc.c"
            src.write_text(_SOURCE)
            tmp = Path(d) / out.name
            r = subprocess.run([cc, *flags, str(src), "-o", str(tmp)], capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[:500]}")
            os.replace(tmp, out)  # atomic: concurrent builders each install a complete library
    lib = ctypes.CDLL(str(out))
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.w12_bases.argtypes = [p, i64, i64, i64, p, p]
    lib.w12_bases.restype = None
    lib.w12_codes.argtypes = [p, i64, i64, i64, i64, p, p, p, p, p]
    lib.w12_codes.restype = None
    lib.w12_decode.argtypes = [p, i64, i64, i64, i64, p, p, p, p, p]
    lib.w12_decode.restype = ctypes.c_int
    return lib


def _load():
    global _lib, _lib_error
    with _lock:
        if _lib is None and _lib_error is None:
            try:
                _lib = _build()
            except (OSError, RuntimeError) as e:
                _lib_error = str(e)
    return _lib


def backend() -> str:
    """``"c"`` or ``"torch"``: what ``encode`` uses, by ``W12_CPU_ENCODER`` (auto|c|torch)."""
    want = os.environ.get("W12_CPU_ENCODER", "auto").strip().lower()
    if want not in ("auto", "c", "torch"):
        raise ValueError(f"W12_CPU_ENCODER={want!r}: expected auto, c or torch")
    if want == "torch":
        return "torch"
    if _load() is not None:
        return "c"
    if want == "c":
        raise RuntimeError(f"W12_CPU_ENCODER=c but the C encoder could not be built: {_lib_error}")
    warnings.warn(
        f"w12: the fused CPU encoder is unavailable ({_lib_error}); using the slower reference encoder",
        stacklevel=3,
    )
    return "torch"


def _threads() -> int:
    n = int(os.environ.get("W12_ENCODE_THREADS", "0"))
    return n if n > 0 else max(1, min(os.cpu_count() or 1, 8))


def _run_split(fn, rows: int, threads: int, align: int):
    """Runs ``fn(r0, r1)`` over [0, rows) cut into ``threads`` pieces (multiples of ``align``)."""
    global _pool
    step = max(align, ceil_div(ceil_div(rows, threads), align) * align)
    spans = [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]
    if len(spans) == 1:
        fn(*spans[0])
        return
    with _lock:
        if _pool is None or _pool._max_workers < len(spans):
            _pool = ThreadPoolExecutor(len(spans), thread_name_prefix="w12-enc")
        pool = _pool
    for f in [pool.submit(fn, a, b) for a, b in spans]:
        f.result()


def records_nbytes(shape) -> int:
    *batch, n, k = shape
    return math.prod(batch) * ceil_div(n, TILE_N) * ceil_div(k, TILE_K) * RECORD_BYTES


def encode(weight: torch.Tensor, threads: int | None = None, out: torch.Tensor | None = None) -> dict:
    """Same contract and output as ``w12.reference.encode`` (a BF16 CPU tensor ``[..., N, K]``).

    ``out``: an optional uint8 buffer of at least ``records_nbytes(shape)`` bytes to hold the
    records (reusing memory saves the page faults of a fresh allocation); every byte of the
    records is written, whatever the buffer held.
    """
    if backend() == "torch":
        return reference.encode(weight)
    shape = reference.check_encodable(weight)
    n, k = shape[-2], shape[-1]
    x = weight.detach().cpu().contiguous().view(torch.int16)
    mats = x.numel() // (n * k)
    rows = mats * n
    nt, kt = ceil_div(n, TILE_N), ceil_div(k, TILE_K)
    need = mats * nt * kt * RECORD_BYTES
    if out is not None:
        if out.dtype != torch.uint8 or out.device.type != "cpu" or not out.is_contiguous() or out.numel() < need:
            raise ValueError(f"out must be a contiguous CPU uint8 buffer of at least {need} bytes")
        records = out.view(-1)[:need].view(mats, nt, kt, RECORD_BYTES)
    else:
        records = torch.empty((mats, nt, kt, RECORD_BYTES), dtype=torch.uint8)
    if n % TILE_N:  # padding rows of the last row tile are never written by the C loop
        rin = n % TILE_N
        records[:, -1, :, rin * TILE_K : TILE_N * TILE_K] = 0
        records[:, -1, :, TILE_N * TILE_K + rin * TILE_K // 2 :] = 0
    base = torch.empty(rows, dtype=torch.uint8)
    nesc = torch.empty(rows, dtype=torch.int32)
    lib = _lib
    threads = threads or _threads()
    xp, bp = x.data_ptr(), base.data_ptr()
    _run_split(lambda a, b: lib.w12_bases(xp, k, a, b, bp, nesc.data_ptr()), rows, threads, 1)
    esc_ptr = torch.zeros(rows + 1, dtype=torch.int32)
    torch.cumsum(nesc, 0, out=esc_ptr[1:])
    nnz = int(esc_ptr[-1])
    esc_col = torch.empty(nnz, dtype=torch.int32)
    esc_val = torch.empty(nnz, dtype=torch.int16)
    # Rows write disjoint bytes, so any split is correct; row-tile multiples keep threads off
    # each other's cache lines.
    args = (n, k)
    ptrs = (bp, esc_ptr.data_ptr(), records.data_ptr(), esc_col.data_ptr(), esc_val.data_ptr())
    _run_split(lambda a, b: lib.w12_codes(xp, *args, a, b, *ptrs), rows, threads, TILE_N)
    return dict(
        records=records.reshape(*shape[:-2], nt, kt, RECORD_BYTES),
        base=base,
        esc_ptr=esc_ptr,
        esc_col=esc_col,
        esc_val=esc_val,
    )


def decode(w) -> torch.Tensor:
    """The exact BF16 tensor of a ``W12Weight`` on the CPU: same result as ``w12.unpack``.

    The fused loop serves layout-0 CPU weights (what checkpoints hold); anything else, or no C
    compiler, goes to the reference decoder. Raises ``W12FormatError`` on out-of-range escapes.
    """
    from .weight import W12FormatError

    if w.layout != 0 or w.records.device.type != "cpu" or backend() == "torch":
        return torch.ops.w12.unpack(*w.tensors(), w.N, w.K, w.layout, False).view(w.shape)
    n, k, rows = w.N, w.K, w.num_matrices * w.N
    out = torch.empty(w.shape, dtype=torch.int16)
    tensors = [t.contiguous() for t in w.tensors()]
    ptrs = [t.data_ptr() for t in tensors]
    bad = []
    lib = _lib

    def run(a, b):
        if lib.w12_decode(ptrs[0], n, k, a, b, *ptrs[1:], out.data_ptr()):
            bad.append((a, b))

    _run_split(run, rows, _threads(), TILE_N)
    if bad:
        raise W12FormatError(f"W12 weight {list(w.shape)}: w12_esc_col holds columns outside [0, {k})")
    return out.view(torch.bfloat16)
