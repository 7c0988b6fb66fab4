"""CUDA path of ``w12.CertifiedHead``: ctypes binding of the ``w12_head_*`` kernels in libw12.so.

The device state of a head (padded INT8 codes, row constants, the exact BF16 weights with K padded to
64, a workspace) is built on the first GPU call and kept on the head. ``argmax`` launches prep +
screen + rescore on the current stream for each group of ≤ 32 hidden rows and never synchronises,
so it can be captured in a CUDA graph (outputs are new tensors from the caching allocator, which
graph capture handles). One head's workspace serves one stream at a time.
"""

from __future__ import annotations

import ctypes
import os

import torch

from . import cuda_ops

MAX_M = 32
_ARGTYPES = {
    "w12_head_workspace_bytes": [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_longlong)],
    "w12_head_argmax": [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_int,  # h, bf16, m, ldh, k
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # q, rowp, w
        ctypes.c_int, ctypes.c_int, ctypes.c_int,  # v, vpad, kpad
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,  # ws, ids, count, flags, stream
    ],
    "w12_head_exact_scores": [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # w, v, vpad, kpad
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # ws, out, stream
    ],
}  # fmt: skip
_BOUND = False
_ERRORS = {
    1: "invalid argument: shape, alignment or M",
    2: "out of memory",
    98: "invalid device function",
    209: "no kernel image for this GPU",
    700: "illegal address",
}


def _lib():
    global _BOUND
    lib = cuda_ops.lib()
    if not _BOUND:
        for name, args in _ARGTYPES.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int
        _BOUND = True
    return lib


def available() -> bool:
    """True when libw12.so loads and carries the head kernels (no CUDA context is created)."""
    if not cuda_ops.available():
        return False
    return hasattr(cuda_ops.lib(), "w12_head_argmax")


def _check(err: int, what: str) -> None:
    if err != 0:
        name = _ERRORS.get(err, "see cudaError_t")
        raise RuntimeError(f"w12 certified head: {what} failed with CUDA error {err} ({name})")


class _DeviceState:
    def __init__(self, head):
        v, k = head.weight.shape
        self.v, self.k = v, k
        self.kpad = -(-k // 64) * 64
        self.vpad = -(-v // 16) * 16
        dev = head.weight.device
        if tuple(head.q.shape) != (self.vpad, self.kpad):
            raise RuntimeError(
                f"w12 certified head: INT8 codes have shape {tuple(head.q.shape)}, expected padded "
                f"{(self.vpad, self.kpad)}"
            )
        self.q = head.q
        rowp = torch.zeros(self.vpad, 4, dtype=torch.float32, device=dev)
        rowp[:v, 0], rowp[:v, 1], rowp[:v, 2] = head.scale, head.rho, head.qnorm
        self.rowp = rowp
        w = head.weight
        if self.kpad != k or not w.is_contiguous() or w.data_ptr() % 16:
            w = torch.nn.functional.pad(w, (0, self.kpad - k)).contiguous()
        self.w = w
        nbytes = ctypes.c_longlong(0)
        _check(_lib().w12_head_workspace_bytes(self.kpad, self.vpad, ctypes.byref(nbytes)), "workspace size")
        self.ws = torch.zeros(nbytes.value + 256, dtype=torch.uint8, device=dev)
        self.ws_ptr = (self.ws.data_ptr() + 255) // 256 * 256


def state(head) -> _DeviceState:
    if head._cuda is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "w12 certified head: the first GPU call builds device buffers; call argmax once before graph capture"
            )
        head._cuda = _DeviceState(head)
    return head._cuda


def _rows(hx: torch.Tensor):
    if hx.dtype == torch.float16:
        hx = hx.float()  # exact
    hx = hx.contiguous()
    return hx, 1 if hx.dtype == torch.bfloat16 else 0


_FLAG_RESCORE_ALL, _FLAG_PDL, _FLAG_L2_256B = 1, 2, 4  # kernels_sm120/head_common.cuh
_DIAG_NO_L2_HINT = 4  # W12_HEAD_DIAG bit: screen loads without the L2::256B hint (A/B timing only)


def _pdl() -> bool:
    """``W12_HEAD_PDL`` (default ``auto``): programmatic dependent launch of screen and rescore
    (sm_90+; the library ignores it elsewhere). ``0`` turns it off."""
    raw = os.environ.get("W12_HEAD_PDL", "auto")
    if raw not in ("auto", "0", "1"):
        raise ValueError(f"W12_HEAD_PDL={raw!r} must be auto, 0 or 1")
    return raw != "0"


def argmax(head, hx: torch.Tensor, rescore_all: bool = False):
    """ids int64 [M], survivors int64 [M] for hidden rows ``hx [M, K']`` (K' includes bias columns)."""
    st = state(head)
    hx, bf16 = _rows(hx)
    m_all = hx.shape[0]
    ids = torch.empty(m_all, dtype=torch.int64, device=hx.device)
    cnt = torch.empty(m_all, dtype=torch.int32, device=hx.device)
    stream = ctypes.c_void_p(torch.cuda.current_stream(hx.device).cuda_stream)
    lib = _lib()
    flags = (_FLAG_RESCORE_ALL if rescore_all else 0) | (_FLAG_PDL if _pdl() else 0)
    # Whole 256-byte L2 fetches: measured +4-5 % on the screen's stream (docs/certified_head.md).
    raw = os.environ.get("W12_HEAD_DIAG", "0")
    try:
        diag = int(raw)
    except ValueError:
        raise ValueError(f"W12_HEAD_DIAG={raw!r} is not an integer (bit 4: no L2::256B hint)") from None
    if not diag & _DIAG_NO_L2_HINT:
        flags |= _FLAG_L2_256B
    for r0 in range(0, m_all, MAX_M):
        m = min(MAX_M, m_all - r0)
        err = lib.w12_head_argmax(
            hx[r0].data_ptr(), bf16, m, hx.shape[1], st.k,
            st.q.data_ptr(), st.rowp.data_ptr(), st.w.data_ptr(),
            st.v, st.vpad, st.kpad,
            st.ws_ptr, ids[r0].data_ptr(), cnt[r0].data_ptr(), flags, stream,
        )  # fmt: skip
        _check(err, "w12_head_argmax")
    return ids, cnt.to(torch.int64)


def exact_scores(head, hx: torch.Tensor) -> torch.Tensor:
    st = state(head)
    hx, bf16 = _rows(hx)
    out = torch.empty(hx.shape[0], st.v, dtype=torch.float32, device=hx.device)
    stream = ctypes.c_void_p(torch.cuda.current_stream(hx.device).cuda_stream)
    for r0 in range(0, hx.shape[0], MAX_M):
        m = min(MAX_M, hx.shape[0] - r0)
        err = _lib().w12_head_exact_scores(
            hx[r0].data_ptr(), bf16, m, hx.shape[1], st.k, st.w.data_ptr(), st.v, st.vpad, st.kpad,
            st.ws_ptr, out[r0].data_ptr(), stream,
        )  # fmt: skip
        _check(err, "w12_head_exact_scores")
    return out
