"""The schedule of v4's stream-K lanes (SK, kernels_sm120/gemm_w12_mma.cuh: sk_segment), restated:
why no lane waits for another when the lanes run at one pace. The GPU tests
(test_gpu_gemm_sk.py) check the kernel's bits."""

from __future__ import annotations


def test_sk_segments_cover_every_record_once_head_first():
    # The lanes' segments, as the kernel's sk_segment lays them out (restated: the rule is a pure
    # function), for unit counts around the lane count: every record of every chain exactly once,
    # a chain cut at most once with its head first in the earlier lane, and the head's end no later
    # than the tail's start in records run before it (so that no lane waits for another when lanes
    # run at one pace).
    for lanes in (1, 7, 132):
        for units in sorted({lanes + 1, lanes + 3, 2 * lanes - 1, 3 * lanes + 5, 501}):
            for kt in (1, 2, 10, 64, 80):
                seen = [[0] * kt for _ in range(units)]
                head_end = {}
                tail_start = {}
                for lane in range(lanes):
                    t = 0
                    for u, r0, r1, kind in _sk_segments(lane, lanes, units, kt):
                        for r in range(r0, r1):
                            seen[u][r] += 1
                        if kind == 1:
                            head_end[u] = (lane, t + r1 - r0)
                        if kind == 2:
                            tail_start[u] = (lane, t)
                        t += r1 - r0
                assert all(c == 1 for row in seen for c in row), (lanes, units, kt)
                assert head_end.keys() == tail_start.keys()
                for u, (lane, end) in head_end.items():
                    assert tail_start[u][0] == lane + 1 and end <= tail_start[u][1], (lanes, units, kt, u)


def _sk_segments(lane: int, lanes: int, units: int, kt: int):
    f0, f1 = lane * units * kt // lanes, (lane + 1) * units * kt // lanes
    if f1 % kt:
        yield (f1 // kt, 0, f1 % kt, 1)
    for u in range((f0 + kt - 1) // kt, f1 // kt):
        yield (u, 0, kt, 0)
    if f0 % kt:
        yield (f0 // kt, f0 % kt, kt, 2)
