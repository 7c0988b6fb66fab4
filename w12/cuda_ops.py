"""CUDA implementations of the W12 ops, bound through ctypes to ``libw12.so``.

The compiled kernels are a torch-free C-ABI library (see docs/extension.md for why): it is found
at ``$W12_KERNELS_LIB`` or ``w12/_kernels/libw12.so`` and loaded on first use, never at import.

This module registers the CUDA kernel of ``w12::linear`` (the fused W12 GEMM). Importing it
defines Python functions only: no library load, no CUDA initialisation.

Settings (environment, read on each call):
  ``W12_GEMM_KERNEL`` (default ``auto``): ``v1`` = fixed K-split, per-thread cp.async ring;
      ``v2`` = warp-specialised persistent stream-K kernel; ``v3`` = row slabs with the K-split
      inside the CTA (no cross-CTA reduction); ``v4`` = Hopper wgmma (sm_90 only); ``auto`` = v4
      on sm_90 (where the library holds its sm_90a code), elsewhere v1 or v2 per weight shape by
      ``choose_kernel``
      (N, K and SM count only). Every kernel is deterministic and M-independent, but they sum in
      different orders: their bits differ, so the choice never depends on M.
  ``W12_GEMM_CTAS_PER_SM`` (default 2): v2: persistent CTAs per SM (grid = SMs x this); v1: the
      K-split aims at this many CTAs per SM. Either way the summation order is a function of
      (N, K, SM count, this value) only, never of M.
  ``W12_GEMM_STAGES`` (default 0): v2: cap on the shared-memory ring depth (0 = as deep as fits,
      at most 16); v1, v4: async-copy ring depth 3 or 4 (0 = chosen by the grid's waves).
  ``W12_GEMM_FALLBACK_M`` (default: ``fallback_m``'s rule, 128 or 256): above this many token rows
      the op decodes the weight and calls cuBLAS instead of running the fused kernel in passes of
      64 token rows (v1-v3) or 128 (v4) (the kernel's determinism across M holds for M up to this
      value).
  ``W12_GEMM_PDL`` (default ``auto``): programmatic dependent launch (sm_90+) of v3, v1 and v4:
      ``auto`` = v3; v1 at <= 16 and 33-64 tokens where K is split in >= 4 slices; v4 at every M
      up to 128 where K is split in >= 4 slices, on unsplit grids at <= 16 tokens and on every
      grid at <= 8 (what measured faster; see ``_pdl``), ``1`` = always, ``0`` = never. Timing
      only: the bits never change. (v2 never uses it.)
  ``W12_GEMM_DIAG`` (default 0): kernel variants for benchmarks and tests (bit flags, see
      kernels_sm120/gemm_w12_mma.cuh); v1: 1 and 2 skip work and give wrong results on purpose,
      262144 never caps unsplit multi-wave grids at 49-64 tokens to two CTAs per SM, 64 / 128
      the R64 kernel at 33-64 tokens nowhere / wherever it can run (same bits); v4: 1
      and 65536 (no reduce kernel) do, 2 is the unsplit grids' per-output epilogue, 256 / 1024
      the deep loop everywhere up to 16 tokens / nowhere, 512 / 128 the pair grid on every split
      grid up to 64 tokens / nowhere, 4096 one ring instead of the split ring at 65-128 tokens,
      8192 the 128-row CTAs where the balanced unsplit grid runs, 16384 per-thread record copies
      where bulk-copied records run (1-2 tokens on those weights), 32768 the shared-memory
      epilogue's escapes reading x instead of its transpose (33-128 tokens, unsplit) (same bits);
      README lists all.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

from . import layouts
from .format import RECORD_BYTES, TILE_K, TILE_N, ceil_div, convert_layout

_LIB = None
_LIB_ERROR: str | None = None
_LOCK = threading.Lock()
_GEMM_ABI = 16


def library_path() -> Path:
    env = os.environ.get("W12_KERNELS_LIB")
    return Path(env) if env else Path(__file__).resolve().parent / "_kernels" / "libw12.so"


def lib() -> ctypes.CDLL:
    """The loaded kernel library; raises RuntimeError saying why when it cannot be loaded."""
    global _LIB, _LIB_ERROR
    with _LOCK:
        if _LIB is None and _LIB_ERROR is None:
            path = library_path()
            if os.environ.get("W12_DISABLE_KERNELS", "0") == "1":
                _LIB_ERROR = "W12_DISABLE_KERNELS=1"
            elif not path.exists():
                _LIB_ERROR = f"{path} does not exist (build it with `python csrc/build.py`)"
            else:
                try:
                    _LIB = ctypes.CDLL(str(path))
                except OSError as e:
                    _LIB_ERROR = f"cannot load {path}: {e}"
        if _LIB is None:
            raise RuntimeError(f"w12 CUDA kernels unavailable: {_LIB_ERROR}")
        return _LIB


def available() -> bool:
    try:
        lib()
    except RuntimeError:
        return False
    return True


def kernel_layout(kver: int) -> int:
    """The record layout GEMM kernel ``kver`` reads: 3 for v4 (wgmma), 4 for v1-v3 (both split)."""
    return layouts.WGMMA_SPLIT_LAYOUT if kver == 4 else layouts.MMA_SYNC_SPLIT_LAYOUT


def preferred_layout(device=None) -> int:
    """The record layout the CUDA GEMM reads on ``device`` (default: the current GPU); 0 off CUDA.

    Layout 3 where the wgmma kernel runs (``W12_GEMM_KERNEL=v4``, or ``auto`` on sm_90), else
    layout 4 (``w12.layouts``). Loaders store records in this layout, so set the variable before loading a model;
    records in another layout still work, permuted on every call (a warning says so).
    """
    if device is not None and torch.device(device).type != "cuda":
        return 0
    raw = os.environ.get("W12_GEMM_KERNEL", "auto")
    if raw == "v4" or (raw == "auto" and _auto_takes_v4(device)):
        return kernel_layout(4)
    return layouts.MMA_SYNC_SPLIT_LAYOUT


def _device_index(device) -> int:
    dev = torch.device(device if device is not None else "cuda")
    return dev.index if dev.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=64)
def _v4_ready(idx: int) -> bool:
    # sm_90 and real sm_90a code in the library (w12_gemm_v4_ready); asked once per device.
    if torch.cuda.get_device_capability(idx) != (9, 0):
        return False
    with torch.cuda.device(idx):
        return int(_gemm_lib().w12_gemm_v4_ready()) == 0


def _auto_takes_v4(device) -> bool:
    """Whether ``auto`` runs v4 on ``device``: on sm_90, for every weight shape and every M.

    v4's bits differ from v1's (wgmma and mma.sync round the k16 products differently, in about
    2-4e-4 of the outputs), so the choice is per device, never per M. Session 9 (docs/perf-notes.md):
    level with v1 at M = 1 and in the decode-step graph set, ahead from 32 tokens up.
    """
    if not torch.cuda.is_available() or not available():
        return False
    return _v4_ready(_device_index(device))


# ---------------------------------------------------------------------------------------------
# Binding
_GEMM = None
_VP, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _gemm_lib() -> ctypes.CDLL:
    global _GEMM
    if _GEMM is not None:
        return _GEMM
    so = lib()
    if not hasattr(so, "w12_gemm"):
        raise RuntimeError(f"{library_path()} has no W12 GEMM kernel (rebuild with `python csrc/build.py`)")
    so.w12_gemm_abi_version.restype = _INT
    if so.w12_gemm_abi_version() != _GEMM_ABI:
        raise RuntimeError(
            f"{library_path()} has GEMM ABI {so.w12_gemm_abi_version()}, this w12 expects {_GEMM_ABI}: rebuild it"
        )
    so.w12_gemm_kernel_layout.restype = _INT
    so.w12_gemm_kernel_layout.argtypes = [_INT]
    for kv in (1, 2, 3, 4):  # the kernels and w12.layouts must agree on what each reads
        if so.w12_gemm_kernel_layout(kv) != kernel_layout(kv):
            raise RuntimeError(
                f"{library_path()}: GEMM kernel v{kv} reads layout {so.w12_gemm_kernel_layout(kv)}, "
                f"w12.cuda_ops expects {kernel_layout(kv)}: rebuild it"
            )
    so.w12_gemm.restype = _INT
    so.w12_gemm.argtypes = [_VP, _I64, _VP, _VP, _VP, _VP, _VP, _VP, _VP, _I64, _INT, _INT, _INT, _VP, _VP]
    so.w12_gemm.argtypes += [_INT, _INT, _INT, _INT, _VP]
    so.w12_gemm_workspace_bytes.restype = _I64
    so.w12_gemm_workspace_bytes.argtypes = [_INT, _INT, _INT, _INT, _INT, _INT, _INT]
    so.w12_gemm_counters.restype = _INT
    so.w12_gemm_counters.argtypes = [_INT, _INT, _INT, _INT, _INT]
    so.w12_gemm_v4_ready.restype = _INT
    so.w12_gemm_splits.restype = _INT
    so.w12_gemm_splits.argtypes = [_INT, _INT, _INT, _INT, _INT]
    so.w12_gemm_wholek_stages.restype = _INT
    so.w12_gemm_wholek_stages.argtypes = [_INT, _INT, _INT, _INT, _INT]
    so.w12_gemm_wholek_warpgroups.restype = _INT
    so.w12_gemm_wholek_warpgroups.argtypes = [_INT, _INT, _INT, _INT, _INT]
    so.w12_gemm_wholek_cluster.restype = _INT
    so.w12_gemm_wholek_cluster.argtypes = [_INT, _INT, _INT, _INT, _INT]
    so.w12_gemm_pair_grid.restype = _INT
    so.w12_gemm_pair_grid.argtypes = [_INT, _INT, _INT, _INT, _INT, _INT]
    so.w12_gemm_nobar.restype = _INT
    so.w12_gemm_nobar.argtypes = [_INT, _INT, _INT, _INT, _INT, _INT]
    so.w12_gemm_sk_lanes.restype = _INT
    so.w12_gemm_sk_lanes.argtypes = [_INT, _INT, _INT, _INT, _INT, _INT]
    so.w12_gemm_check_device.restype = _INT
    so.w12_gemm_counters_buffer.restype = _VP
    so.w12_gemm_counters_buffer.argtypes = [_INT, _VP, _INT, ctypes.POINTER(_INT)]
    so.w12_gemm_xt_buffer.restype = _VP
    so.w12_gemm_xt_buffer.argtypes = [_INT, _VP, _INT, ctypes.POINTER(_INT)]
    so.w12_gemm_error_string.restype = ctypes.c_char_p
    so.w12_gemm_error_string.argtypes = [_INT]
    _GEMM = so
    return so


def _err(code: int) -> str:
    return _gemm_lib().w12_gemm_error_string(code).decode()


_DEVICE_OK: dict[int, int] = {}
_SM_COUNT: dict[int, int] = {}


def _check_device(device: torch.device) -> int:
    """SM count of ``device`` after checking that the GEMM can run there (cached)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _DEVICE_OK:
        major, minor = torch.cuda.get_device_capability(idx)
        if major < 8:
            raise RuntimeError(
                f"w12.linear: the W12 GEMM needs an sm_80 or newer GPU (mma.sync bf16, cp.async); "
                f"cuda:{idx} ({torch.cuda.get_device_name(idx)}) is sm_{major}{minor}"
            )
        with torch.cuda.device(idx):
            code = _gemm_lib().w12_gemm_check_device()
        if code != 0:
            raise RuntimeError(
                f"w12.linear: {library_path()} holds no GEMM kernel for cuda:{idx} (sm_{major}{minor}): {_err(code)}; "
                "rebuild with W12_CUDA_ARCHS including this architecture"
            )
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        _DEVICE_OK[idx] = 1
    return _SM_COUNT[idx]


def _env_int(name: str, default: int, allowed=None) -> int:
    raw = os.environ.get(name, str(default))
    try:
        val = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if allowed is not None and val not in allowed:
        if isinstance(allowed, range):
            raise ValueError(f"{name}={val} must be in {allowed.start}..{allowed.stop - 1}")
        raise ValueError(f"{name}={val} must be one of {sorted(allowed)}")
    if allowed is None and val < 1:
        raise ValueError(f"{name}={val} must be >= 1")
    return val


def target_ctas(device) -> int:
    """The CTA count the K-split aims at on ``device`` (a function of its SM count only)."""
    return _check_device(torch.device(device)) * _env_int("W12_GEMM_CTAS_PER_SM", 2)


_KERNELS = {"v1": 1, "v2": 2, "v3": 3, "v4": 4, "auto": 0}


def choose_kernel(n: int, k: int, sms: int, ctas_per_sm: int, v1_splits: int) -> int:
    """The ``W12_GEMM_KERNEL=auto`` rule: 2 (stream-K) or 1, from (N, K, SM count) only.

    v2 pays a fixed cost per launch and per split tile (its owner's fix-up), and wins where v1
    leaves SMs idle: v1 runs ``NT * v1_splits`` CTAs, all resident at once, so the SMs holding
    ceil(grid / SMs) CTAs set its time. Measured on the H200 (docs/perf-notes.md, final run):
    v2 is faster where it has >= 48 records per persistent CTA and v1's single wave is badly
    imbalanced: 32B [51200, 5120] (v1 imbalance 1.32: 106 vs 125 us at M = 1). gate_up (1.18)
    went back to v1 in session 5: v1 53.8 vs v2 56.3 us at M = 1 and 3.86 vs 4.01 ms for the
    decode-step graph set, though v2 stays ahead at M = 16/32. Never a function of M: the bits of
    a row stay the same for every M.
    """
    nt, kt = ceil_div(n, TILE_N), ceil_div(k, TILE_K)
    per_cta = nt * kt / (sms * ctas_per_sm)
    grid1 = nt * v1_splits
    imbalance = ceil_div(grid1, sms) / (grid1 / sms)
    return 2 if per_cta >= 48 and imbalance >= 1.25 else 1


def kernel_version(n: int | None = None, k: int | None = None, device="cuda") -> int:
    """1-4: the GEMM kernel ``W12_GEMM_KERNEL`` selects (default ``auto``, which needs n, k)."""
    raw = os.environ.get("W12_GEMM_KERNEL", "auto")
    if raw not in _KERNELS:
        raise ValueError(f"W12_GEMM_KERNEL={raw!r} must be one of {sorted(_KERNELS)}")
    if raw == "v4":
        dev = torch.device(device)
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        cc = torch.cuda.get_device_capability(idx)
        if cc != (9, 0):
            raise RuntimeError(
                f"W12_GEMM_KERNEL=v4 is the Hopper wgmma kernel (sm_90a); cuda:{idx} is sm_{cc[0]}{cc[1]}: "
                "use v1, v2, v3 or auto"
            )
    if _KERNELS[raw] == 0:
        if _auto_takes_v4(device):
            return 4
        if n is None or k is None:
            raise ValueError("W12_GEMM_KERNEL=auto chooses per weight shape: pass n and k")
        sms = _check_device(torch.device(device))
        cps = _env_int("W12_GEMM_CTAS_PER_SM", 2)
        return choose_kernel(n, k, sms, cps, _splits(n, k, sms * cps, sms, 1))
    return _KERNELS[raw]


def _pdl(kver: int, n: int, k: int, m: int, device) -> bool:
    """Programmatic dependent launch of the GEMM: ``W12_GEMM_PDL`` auto (default) / 1 = on, 0 = off.

    ``auto`` is what the H200 measured faster (docs/perf-notes.md, session 7, run 13): on for v3,
    and for v1 at <= 16 tokens where K is cut into >= 4 slices (qkv, o, down: short CTAs whose
    start-up then overlaps the previous reduce kernel; -2..6 % at M = 1..16); off for v1's
    long-CTA grids (gate_up, lm_head: no gain) and above 16 tokens (qkv +10 % at 32, down +20 %
    at 64). v4 follows v1's rule, its CTAs capped per SM (session 9), and since session 14 also
    takes it at 33-64 tokens (qkv, o, down -0.5..0.65 us at 64; at 32 tokens it lost up to 3 %);
    since session 15 v1 too (call 1, two rounds: qkv 19.0 -> 18.4, o 14.8 -> 14.2, down 33.0 ->
    32.5 us at 64 tokens; qkv +1.5..2 us at 32). Since session 16 v4 also takes it on unsplit
    grids at <= 16 tokens and on every grid at <= 8 (two rounds each: gate_up -0.4..1.1 us at 1-16
    tokens, lm_head level to -1.5, 32B [51200, 5120] -0.2..0.5, 32B [10240, 5120] (3 slices)
    -0.4..0.5 at 1-4 tokens but +0.9 at 16; the decode-step graph set 0.770 -> 0.764), where
    session 11 had measured gate_up 5 % slower with it. Since session 30 v4 also takes it at 17-32
    tokens where its pair grid runs (qkv [6144, 4096]: -0.8 us at 24 tokens; on the other split
    grids at 17-32 tokens it stays off: o level, down +0.35..0.65, 32B [10240, 5120] and [5120,
    25600] +0.1..2 us with it), and at 65-128 tokens on weights of >= 4 slices (qkv, o, down
    -0.7..1.1 us at 100 and 128 tokens; gate_up, unsplit, +1.5..2.1 at 128, so unsplit grids keep
    none). Medians of six runs in separate processes, both orders (perf-notes, session 30 item 6:
    an interleaved A/B favours PDL). Since session 31 v4 takes it on every weight of >= 4 slices
    at 17-32 tokens: with the CTA cap's shared-memory request corrected (it had left the reduce
    kernel's CTAs no room beside the GEMM's), o -0.5..0.6 us, down -1.3..1.5 and 32B [5120,
    25600] -1.8 at 24-32 tokens against the session-30 rule (separate processes, A B B A;
    perf-notes session 31).
    Timing only: the bits never change. v2 has none.
    """
    raw = os.environ.get("W12_GEMM_PDL", "auto")
    if raw not in ("auto", "0", "1"):
        raise ValueError(f"W12_GEMM_PDL={raw!r} must be auto, 0 or 1")
    if raw != "auto":
        return raw == "1"
    if kver == 3:
        return True
    if kver == 4 and (m <= 8 or (m <= 16 and splits(n, k, device, kver) == 1)):
        return True
    if kver == 4 and m > 16:
        return splits(n, k, device, kver) >= 4
    in_band = m <= 16 or 32 < m <= 64
    return kver in (1, 4) and in_band and splits(n, k, device, kver) >= 4


def _diag_env() -> int:
    """``W12_GEMM_DIAG`` (checked), 0 where unset."""
    return _env_int("W12_GEMM_DIAG", 0, allowed=range(1 << 24)) if "W12_GEMM_DIAG" in os.environ else 0


def pair_grid(n: int, k: int, m: int, device="cuda", diag: int | None = None) -> bool:
    """Whether v4 runs its pair grid (one CTA per two consecutive K slices, session 17) for an
    (N, K) weight at ``m`` token rows on ``device`` (``diag``: ``W12_GEMM_DIAG`` bits, default
    the environment's). Timing only: the bits are the same either way."""
    if diag is None:
        diag = _diag_env()
    dev = torch.device(device)
    return _pair_grid(n, k, m, target_ctas(dev), _check_device(dev), diag)


@functools.lru_cache(maxsize=4096)
def _pair_grid(n: int, k: int, m: int, target: int, sms: int, diag: int) -> bool:
    return bool(_gemm_lib().w12_gemm_pair_grid(n, k, m, target, sms, diag))


def nobar(n: int, k: int, m: int, device="cuda", diag: int | None = None) -> int:
    """The consumer warpgroups v4 runs without a CTA barrier per record (NB, sessions 37-39) for an
    (N, K) weight at ``m`` token rows (one pass) on ``device``: 4 (row-tile pairs), 3 (m-tile
    triples, split weights), or 0 where it runs another form; ``diag`` as in :func:`pair_grid`.
    Timing only: the bits are the same either way."""
    if diag is None:
        diag = _diag_env()
    dev = torch.device(device)
    return int(_gemm_lib().w12_gemm_nobar(n, k, m, target_ctas(dev), _check_device(dev), diag))


def sk_lanes(n: int, k: int, m: int, device="cuda", diag: int | None = None) -> int:
    """The persistent stream-K lanes v4 runs (SK, session 44: a multi-wave unsplit grid of row-tile
    pairs at 33-128 tokens, its K chains cut between lanes and continued from parked accumulators)
    for an (N, K) weight at ``m`` token rows (one pass) on ``device``; 0 where it runs one unit a
    CTA or another form; ``diag`` as in :func:`pair_grid`. Timing only: the bits are the same."""
    if diag is None:
        diag = _diag_env()
    dev = torch.device(device)
    return int(_gemm_lib().w12_gemm_sk_lanes(n, k, m, target_ctas(dev), _check_device(dev), diag))


@functools.lru_cache(maxsize=4096)
def _splits(n: int, k: int, target: int, sms: int, kver: int) -> int:
    # The library's rule is a pure function of these five numbers; eager calls ask it twice each
    # (kernel choice and PDL rule), and a ctypes round trip per ask is host time on every call.
    return int(_gemm_lib().w12_gemm_splits(n, k, target, sms, kver))


def fallback_m(kver: int, n: int, k: int, device="cuda") -> int:
    """Token rows up to which ``w12.linear`` runs the fused kernel (in passes) rather than decode +
    cuBLAS: ``W12_GEMM_FALLBACK_M`` where set, else 256 for v4 on weights it does not cut into K
    slices (gate_up, lm_head) or whose slices' partial sums at 128 tokens stay within a third of the
    weight's bytes (S * 128 * 4 B per row <= K / 2 B: down, the 32B shapes), 128 otherwise.

    Measured on the H200 (docs/perf-notes.md, session 19; ``bench_gemm.py --fallback-m``), v4's two
    fused 128-token passes against the direct layout-3 decode + cuBLAS: gate_up 129 / 177 against
    172 / 201 us at 129 / 256 tokens, down 67 / 78 against 96 / 103, lm_head 528 / 742 against 742 /
    869; level at 384 (gate_up 273 against 238); qkv and o (8 slices: the reduce kernel's partials
    at 128 tokens weigh as much as the weight) 46 / 60 against 42 / 45 (qkv) from 129 tokens on.
    v1's 64-token passes won only at 129 tokens on two shapes, so it keeps 128. The bits are the
    fused kernel's up to this M and cuBLAS's above, so a weight's rows are M-independent up to it.
    """
    if "W12_GEMM_FALLBACK_M" in os.environ:
        return _env_int("W12_GEMM_FALLBACK_M", 128)
    if kver == 4:
        s = splits(n, k, device, kernel=4)
        if s <= 1 or s * 1024 <= k:
            return 256
    return 128


def splits(n: int, k: int, device="cuda", kernel: int | None = None) -> int:
    """Number of K slices GEMM kernel ``kernel`` (1 = v1, 4 = v4; default: the one ``w12.linear``
    runs for this shape) cuts an (N, K) weight into on ``device``, independent of M.

    v1 and v4 share the rule except its CTA fill (v4 leaves a few more weights unsplit); v2 and
    v3 have no such split (0)."""
    kver = kernel_version(n, k, device) if kernel is None else kernel
    return _splits(n, k, target_ctas(device), _check_device(torch.device(device)), kver)


def wholek_stages(n: int, k: int, m: int, device="cuda", diag: int = 0) -> int:
    """Ring depth of v4's whole-K clusters for an (N, K) weight at ``m`` token rows on ``device``
    with ``W12_GEMM_DIAG`` bits ``diag``, or 0 where v4 runs its K-split grid and reduce kernel (or an
    unsplit grid) instead. They run at <= 16 tokens on weights cut into 2-8 slices of >= 16 records
    each (any length with diagnostic 131072) where one warpgroup per (64-row m-tile, slice) fits
    the SMs in one wave (:func:`wholek_warpgroups` says how they are packed); the bits are the same
    either way."""
    return _wholek_query("w12_gemm_wholek_stages", n, k, m, device, diag)


def wholek_warpgroups(n: int, k: int, m: int, device="cuda", diag: int = 0) -> int:
    """Warpgroups per CTA of v4's whole-K clusters (arguments as :func:`wholek_stages`): S / 2 where
    two CTAs hold one m-tile's S slices, 4 (or 2, two CTAs per SM, with diagnostic 2097152) where
    whole m-tiles are packed into each cluster, 0 where they do not run."""
    return _wholek_query("w12_gemm_wholek_warpgroups", n, k, m, device, diag)


def wholek_cluster(n: int, k: int, m: int, device="cuda", diag: int = 0) -> int:
    """CTAs per cluster of v4's whole-K clusters (arguments as :func:`wholek_stages`): 2 where two
    CTAs hold one m-tile's slices; with packed m-tiles S / gcd(S, W) (by default only 1: S = 4 in
    four-warpgroup CTAs; more with diagnostic 2097152); 0 where they do not run."""
    return _wholek_query("w12_gemm_wholek_cluster", n, k, m, device, diag)


def _wholek_query(fn: str, n: int, k: int, m: int, device, diag: int) -> int:
    dev = torch.device(device)
    _check_device(dev)
    with torch.cuda.device(dev):
        v = int(getattr(_gemm_lib(), fn)(n, k, m, target_ctas(dev), diag))
    if v < 0:
        raise RuntimeError(f"w12: cannot query {dev} for v4's whole-K clusters")
    return v


# Ticket counters of the K-split reduction: zero between calls (each call leaves them zero), one
# array per (device, stream) so calls on different streams never share one. The library owns
# them (cudaMalloc outside torch's allocator, legal during graph capture): a torch tensor created
# during a capture would live in that graph's private pool, which torch.compile's CUDA-graph
# trees reject and may hand to other tensors after the capture.
def _counters(device: torch.device, stream: torch.cuda.Stream, need: int, xt: bool = False) -> int:
    """The stream's zeroed K-split counters, or (xt) v4's XT scratch: a buffer of its own."""
    so = _gemm_lib()
    err = ctypes.c_int(0)
    get = so.w12_gemm_xt_buffer if xt else so.w12_gemm_counters_buffer
    ptr = get(device.index, stream.cuda_stream, need, ctypes.byref(err))
    if not ptr:
        what = "XT scratch" if xt else "counters"
        raise RuntimeError(f"w12.linear: cannot allocate GEMM {what} on {device}: {_err(err.value)}")
    return ptr


# ---------------------------------------------------------------------------------------------
# Checks (pure metadata: no sync, usable on any device; tests call them on CPU tensors)
_WEIGHT_DTYPES = (
    ("records", torch.uint8),
    ("base", torch.uint8),
    ("esc_ptr", torch.int32),
    ("esc_col", torch.int32),
    ("esc_val", torch.int16),
)


def check_linear_inputs(x, records, base, esc_ptr, esc_col, esc_val, n: int, k: int, bias, device) -> None:
    """Raises TypeError/ValueError naming the argument when the inputs of ``w12::linear`` are bad."""
    device = torch.device(device)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"w12.linear: x must be a tensor, got {type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise TypeError(
            f"w12.linear: the CUDA W12 GEMM takes bfloat16 activations, got x of dtype {x.dtype} "
            f"and shape {tuple(x.shape)}; cast with x.to(torch.bfloat16)"
        )
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"w12.linear: x has shape {tuple(x.shape)}, but the weight [N={n}, K={k}] needs x[..., {k}]")
    if not x.is_contiguous():
        raise ValueError(
            f"w12.linear: x (shape {tuple(x.shape)}, strides {x.stride()}) must be contiguous; call x.contiguous()"
        )
    tensors = dict(
        zip(("records", "base", "esc_ptr", "esc_col", "esc_val"), (records, base, esc_ptr, esc_col, esc_val))
    )
    for name, t in (("x", x), *tensors.items(), *((("bias", bias),) if bias is not None else ())):
        if t.device != device:
            raise ValueError(f"w12.linear: {name} is on {t.device}, expected {device} (all inputs on one device)")
    for name, dtype in _WEIGHT_DTYPES:
        t = tensors[name]
        if t.dtype != dtype:
            raise TypeError(f"w12.linear: {name} has dtype {t.dtype}, expected {dtype}")
        if not t.is_contiguous():
            raise ValueError(f"w12.linear: {name} (shape {tuple(t.shape)}) must be contiguous")
    want = (ceil_div(n, TILE_N), ceil_div(k, TILE_K), RECORD_BYTES)
    if tuple(records.shape) != want:
        raise ValueError(
            f"w12.linear: records has shape {tuple(records.shape)}, a 2-D weight [{n}, {k}] needs {want} "
            "(stacked weights go through w12.linear one matrix at a time)"
        )
    if tuple(base.shape) != (n,):
        raise ValueError(f"w12.linear: base has shape {tuple(base.shape)}, expected ({n},)")
    if tuple(esc_ptr.shape) != (n + 1,):
        raise ValueError(f"w12.linear: esc_ptr has shape {tuple(esc_ptr.shape)}, expected ({n + 1},)")
    if esc_col.dim() != 1 or esc_val.dim() != 1 or esc_col.numel() != esc_val.numel():
        raise ValueError(
            f"w12.linear: esc_col {tuple(esc_col.shape)} and esc_val {tuple(esc_val.shape)} must be 1-D of one length"
        )
    if bias is not None:
        if not bias.is_floating_point():
            raise TypeError(f"w12.linear: bias must be a floating tensor, got {bias.dtype}")
        if tuple(bias.shape) != (n,):
            raise ValueError(f"w12.linear: bias has shape {tuple(bias.shape)}, expected ({n},)")


# ---------------------------------------------------------------------------------------------
# The CUDA kernel of w12::linear
_WARNED: set = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _reference_linear(x, records, base, esc_ptr, esc_col, esc_val, n, k, layout, bias):
    from . import reference

    w = reference.decode(records, base, esc_ptr, esc_col, esc_val, n, k, layout)
    return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))


def _permute(records, src: int, dst: int):
    from . import cuda_codec

    if hasattr(cuda_codec, "convert_layout") and cuda_codec.available():
        try:
            return cuda_codec.convert_layout(records, src, dst)  # the codec's GPU permutation kernel
        except RuntimeError:
            pass  # a library without the codec kernels: the torch gather below is equivalent
    return convert_layout(records, src, dst)


def gemm_launch(x2, records, base, esc_ptr, esc_col, esc_val, bias32, y, n, k, ws_ptr, *, tgt, stages, flags, kver):
    """One ``w12_gemm`` launch on the current stream (``y = x2 @ W.T``, x2 [m, K] padded to whole
    64-column tiles, records in kernel ``kver``'s layout, ``ws_ptr`` a workspace of
    ``w12_gemm_workspace_bytes`` or None); returns the library's error code (0 = launched).
    ``w12.linear`` is the checked entry point; benchmark probes call this to choose the workspace.
    """
    so = _gemm_lib()
    device = records.device
    stream = torch.cuda.current_stream(device)
    m = x2.shape[0]
    n_counters = int(so.w12_gemm_counters(n, k, tgt, _check_device(device), kver))
    if kver == 4:  # its counters argument is the stream's XT scratch (unsplit weights: x transposed)
        counters = _counters(device, stream, n_counters, xt=True) if n_counters else None
    else:
        counters = _counters(device, stream, n_counters) if ws_ptr else None
    return so.w12_gemm(
        x2.data_ptr(), x2.stride(0), records.data_ptr(), base.data_ptr(), esc_ptr.data_ptr(),
        esc_col.data_ptr(), esc_val.data_ptr(), None if bias32 is None else bias32.data_ptr(),
        y.data_ptr(), n, m, n, k, ws_ptr, counters, tgt, stages, flags, kver, stream.cuda_stream,
    )  # fmt: skip


@torch.library.register_kernel("w12::linear", "cuda")
def _linear_cuda(x, records, base, esc_ptr, esc_col, esc_val, n, k, layout, bias):
    if not available():
        _warn_once("nolib", f"w12.linear: CUDA kernels unavailable ({_LIB_ERROR}); using the slow torch path")
        return _reference_linear(x, records, base, esc_ptr, esc_col, esc_val, n, k, layout, bias)
    device = records.device
    check_linear_inputs(x, records, base, esc_ptr, esc_col, esc_val, n, k, bias, device)
    sm = _check_device(device)
    so = _gemm_lib()
    out_shape = (*x.shape[:-1], n)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(out_shape)
    kver = kernel_version(n, k, device)
    need = kernel_layout(kver)
    if layout != need:
        # Loaders keep records in preferred_layout(); permuting on every call is correct but slow.
        _warn_once(
            f"layout{layout}->{need}",
            f"w12.linear: records in layout {layout}, GEMM kernel v{kver} reads layout {need}; "
            "permuting on every call (store them with W12Weight.with_layout(w12.cuda_ops.preferred_layout()))",
        )
        records = _permute(records, layout, need)
    # The default rule never falls back at <= 128 rows: no shape query on the decode path.
    if (m > 128 or "W12_GEMM_FALLBACK_M" in os.environ) and m > fallback_m(kver, n, k, device):
        # Prefill: decode once and let cuBLAS run the GEMM (documented in docs/perf-notes.md).
        w = torch.ops.w12.unpack(records, base, esc_ptr, esc_col, esc_val, n, k, need, False)
        return F.linear(x2, w, None if bias is None else bias.to(torch.bfloat16)).view(out_shape)
    kp = ceil_div(k, TILE_K) * TILE_K
    if kp != k or x2.data_ptr() % 16:
        # The kernel reads whole 64-column tiles of x with 16-byte copies: zero columns past K.
        x2 = F.pad(x2, (0, kp - k))
    bias32 = None if bias is None else bias.to(torch.float32).contiguous()
    y = torch.empty((m, n), dtype=torch.bfloat16, device=device)
    tgt = sm * _env_int("W12_GEMM_CTAS_PER_SM", 2)
    stages = _env_int("W12_GEMM_STAGES", 0, allowed={0, *range(2, 17)})
    flags = _diag_env()
    ws_bytes = int(so.w12_gemm_workspace_bytes(m, n, k, tgt, sm, kver, flags))
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=device) if ws_bytes else None
    if not _pdl(kver, n, k, m, device):  # read (and checked) on every call; v1, v3 and v4 use the bit
        flags |= 32
    code = gemm_launch(
        x2, records, base, esc_ptr, esc_col, esc_val, bias32, y, n, k,
        None if ws is None else ws.data_ptr(), tgt=tgt, stages=stages, flags=flags, kver=kver,
    )  # fmt: skip
    if code != 0:
        raise RuntimeError(
            f"w12.linear: GEMM launch failed for x {tuple(x.shape)} and weight [{n}, {k}]: {_err(code)} (error {code})"
        )
    return y.view(out_shape)
