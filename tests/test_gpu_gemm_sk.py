"""GPU tests of v4's stream-K lanes (SK, session 44; sm_90 only, each skips elsewhere): NB's row-tile
pairs of a multi-wave unsplit weight run as one persistent CTA an SM, each chain of K records cut
at most once between two lanes and continued from the parked accumulators. The bits must equal one
unit a CTA (diagnostic 8192) and the rows at fewer tokens. Run with ``pytest -m gpu``."""

from __future__ import annotations

import pytest
import torch
from _gpu_gemm_helpers import (
    DEV,
    KERNELS,
    _assert_close,
    _device_ints,
    _escape_weight,
    _kernels_present,  # noqa: F401 (this module's autouse fixture)
    _poison_next_alloc,
    _ref,
)

import w12
from w12 import cuda_ops

pytestmark = pytest.mark.gpu

NO_SK = "8192"  # at 33-128 tokens: one unit a CTA (BAL's bit, which acts at <= 32 tokens only)
SK_ALL = 2097152  # SK at 65-128 tokens on every such weight (by default where rounds idle: below)
SK_MIN_IDLE = 30  # kSkMinIdle
SK_FLAGS0 = 64  # SK's flags: ints 64.. of the stream's XT scratch (kSkFlags0)


def _sk_by_default(units: int, sms: int, m: int) -> bool:
    # nb_sk_lanes' rule, restated: at 33-64 tokens always; at 65-128 where one unit a CTA's rounds
    # hold >= SK_MIN_IDLE % more CTA slots than units.
    rounds = -(-units // sms)
    return m <= 64 or 100 * rounds * sms >= (100 + SK_MIN_IDLE) * units


def _flags_left(sms: int) -> list[int]:
    torch.cuda.synchronize()
    dev = torch.device("cuda", torch.cuda.current_device())
    ptr = cuda_ops._counters(dev, torch.cuda.current_stream(), SK_FLAGS0 + 4 * sms, xt=True)
    return _device_ints(ptr, SK_FLAGS0 + 4 * sms)


# (N, K, token counts): pair units just over the SMs (133 on 132: ranges of KT records and a
# fraction, so nearly every tail waits for its head), N off the tile edge with an odd tile count
# (the last pair's second row tile empty; K = 640: NB only at 33-64 tokens), and 32B [51200, 5120]'s
# row count (200 units: 1.5 per SM) with a short K; 200 tokens run as passes of 128 and 72; lm_head's
# row count (501 units: 3.8 per SM, so SK at 100 tokens on request only) with chains of 16 records.
_CASES = [
    (128 * 266, 1024, (33, 64, 65, 100, 128, 200)),
    (40040, 640, (33, 48, 64)),
    (51200, 1280, (40, 64, 128)),
    (128256, 1024, (100,)),
]


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
@pytest.mark.parametrize("n,k,m", [(n, k, m) for n, k, ms in _CASES for m in ms])
def test_v4_sk_lanes_change_no_bit(n, k, m, monkeypatch):
    monkeypatch.setenv("W12_GEMM_KERNEL", "v4")
    monkeypatch.setenv("W12_GEMM_FALLBACK_M", "1000")
    monkeypatch.delenv("W12_GEMM_DIAG", raising=False)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    units = (n + 255) // 256
    assert cuda_ops.splits(n, k, DEV, 4) == 1, f"[{n}, {k}] must be unsplit"
    if units <= sms:
        pytest.skip(f"{units} pair units fit {sms} SMs in one wave")
    sk = 0 if m <= 64 else SK_ALL
    assert cuda_ops.sk_lanes(n, k, min(m, 128), DEV, diag=sk) == sms, f"[{n}, {k}] at M={m} must take SK"
    assert cuda_ops.sk_lanes(n, k, min(m, 128), DEV, diag=sk | int(NO_SK)) == 0, f"{NO_SK} must turn SK off"
    want = sms if _sk_by_default(units, sms, min(m, 128)) else 0
    assert cuda_ops.sk_lanes(n, k, min(m, 128), DEV, diag=0) == want, f"[{n}, {k}] at M={m}: the default rule"
    if sk:
        monkeypatch.setenv("W12_GEMM_DIAG", str(sk))
    gen = torch.Generator().manual_seed(440 + m)
    wt = _escape_weight(n, k, 1.0, gen).to(DEV)
    w = w12.pack(wt).with_layout(cuda_ops.preferred_layout(DEV))
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV)
    b = torch.randn(n, generator=gen).to(DEV) if m % 2 else None
    _poison_next_alloc(m * n)
    y = w12.linear(x, w, b)
    _assert_close(y, _ref(x, wt, b), x, wt)
    bits = y.view(torch.int16).clone()
    # Back to back (each launch's flags reset by their readers, or the next would not wait).
    for rep in range(2):
        assert torch.equal(w12.linear(x, w, b).view(torch.int16), bits), f"repeat {rep}"
    monkeypatch.setenv("W12_GEMM_DIAG", NO_SK)
    assert torch.equal(w12.linear(x, w, b).view(torch.int16), bits), "one unit a CTA"
    monkeypatch.delenv("W12_GEMM_DIAG")
    assert torch.equal(w12.linear(x[-33:].clone(), w, b).view(torch.int16), bits[-33:]), "rows at 33 tokens"
    if m > 64:  # and the default (at 65-128 tokens SK or not by the rounds' idle slots)
        assert torch.equal(w12.linear(x, w, b).view(torch.int16), bits), "the default"
    assert _flags_left(sms)[SK_FLAGS0:] == [0] * (4 * sms), "SK's flags left set"


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
def test_v4_sk_lanes_in_a_graph(monkeypatch):
    # Captured once, replayed on new inputs: the parked accumulators' workspace comes from the graph's
    # pool and the flags from the stream's XT scratch, both reused by every replay.
    monkeypatch.setenv("W12_GEMM_KERNEL", "v4")
    monkeypatch.delenv("W12_GEMM_DIAG", raising=False)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n, k, m = 51200, 1280, 64
    if (n + 255) // 256 <= sms:
        pytest.skip("one wave on this GPU")
    assert cuda_ops.sk_lanes(n, k, m, DEV, diag=0) == sms
    gen = torch.Generator().manual_seed(450)
    wt = _escape_weight(n, k, 0.5, gen).to(DEV)
    w = w12.pack(wt).with_layout(cuda_ops.preferred_layout(DEV))
    xs = [torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEV) for _ in range(3)]
    monkeypatch.setenv("W12_GEMM_DIAG", NO_SK)
    want = [w12.linear(x, w).view(torch.int16).clone() for x in xs]
    monkeypatch.delenv("W12_GEMM_DIAG")
    xin = xs[0].clone()
    w12.linear(xin, w)  # warm-up before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = w12.linear(xin, w)
    for rnd in range(2):
        for x, ref in zip(xs, want):
            xin.copy_(x)
            graph.replay()
            assert torch.equal(yg.view(torch.int16), ref), f"replay round {rnd}"
    assert _flags_left(sms)[SK_FLAGS0:] == [0] * (4 * sms), "SK's flags left set"


@pytest.mark.skipif("v4" not in KERNELS, reason="v4 is the sm_90 wgmma kernel")
def test_v4_workspace_holds_sk_park_only_where_sk_runs():
    # w12_gemm_workspace_bytes sizes SK's parked accumulators (4 warpgroups a lane, 8 or 16 token
    # chunks of 128 threads x 16 bytes) for the passes that run SK under the call's diagnostics,
    # and nothing on an unsplit weight where none does (before session 46: always, as if 2097152).
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    so = cuda_ops._gemm_lib()
    n, k = 128256, 1024
    units = (n + 255) // 256
    if units <= sms:
        pytest.skip(f"{units} pair units fit {sms} SMs in one wave")

    def ws(m: int, diag: int) -> int:
        return int(so.w12_gemm_workspace_bytes(m, n, k, 2 * sms, sms, 4, diag))

    def park(t: int) -> int:
        return sms * 4 * (16 if t > 64 else 8) * 128 * 16

    def sk(t: int, diag: int) -> bool:
        return cuda_ops.sk_lanes(n, k, t, DEV, diag=diag) > 0

    assert sk(64, 0) and ws(64, 0) == park(64), "SK at 33-64 tokens by default"
    assert ws(16, SK_ALL) == 0, "no SK at <= 32 tokens"
    assert ws(100, int(NO_SK)) == 0 and ws(100, SK_ALL | int(NO_SK)) == 0, f"{NO_SK}: never SK"
    assert ws(100, SK_ALL) == park(100), "SK on request at 65-128 tokens"
    assert ws(100, 0) == (park(100) if sk(100, 0) else 0), "the default rule at 100 tokens"
    # 200 tokens: passes of 128 and 72, the park as large as the largest pass that runs SK.
    for diag in (0, SK_ALL):
        want = max([park(t) for t in (128, 72) if sk(t, diag)], default=0)
        assert ws(200, diag) == want, f"200 tokens, diagnostics {diag}"
    assert ws(40, 0) == (park(40) if sk(40, 0) else 0) and ws(1, 0) == 0
