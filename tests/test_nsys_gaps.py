"""benchmarks/nsys_gaps.py: replay splitting and the per-position gaps (no nsys or GPU needed)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import nsys_gaps  # noqa: E402

GEMM = "void w12::(anonymous namespace)::gemm_w12_wgmma_kernel<1, 3, false, 2>(WParams)"
REDUCE = "void w12::(anonymous namespace)::gemm_w12_reduce_kernel<1, 2>(KParams)"


def _write(path: Path, rows) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Start (ns)", "Duration (ns)", "Name"])
        w.writerows(rows)


def _replay(t0_ns: int, layers: int):
    """One replay: per layer a split GEMM (10 us) whose reduce kernel starts 4 us in and ends 1 us
    after it, then an unsplit GEMM (20 us) starting 2 us after that; 0.5 us before the next layer."""
    rows, t = [], t0_ns
    for _ in range(layers):
        rows.append([t, 10_000, GEMM])
        rows.append([t + 4_000, 7_000, REDUCE])  # ends at t + 11 us
        t += 13_000
        rows.append([t, 20_000, GEMM])
        t += 20_500
    return rows, t


def test_busy_merges_overlaps():
    assert nsys_gaps.busy([(0.0, 10.0, "a"), (4.0, 11.0, "b"), (13.0, 33.0, "c")]) == 31.0


def test_replays_and_positions(tmp_path, capsys):
    rows, t = _replay(0, 40)
    more, _ = _replay(t + 1_000_000, 40)  # 1 ms later: a second replay
    rows += more + [[t + 10_000, 1_000, "memset (device)"]]
    path = tmp_path / "trace.csv"
    _write(path, rows)
    kernels = nsys_gaps.load(str(path))
    assert len(kernels) == 240  # the memset is dropped
    runs = nsys_gaps.replays(kernels, 100.0)
    assert [len(r) for r in runs] == [120, 120]
    assert nsys_gaps.main([str(path), "--layer", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 replays" in out and "last replay of gemm_w12_wgmma_kernel" in out
    pos = {line.split(":")[0].strip(): line.split(":")[1].split() for line in out.splitlines() if "pos " in line}
    gemm, red, g2r, gap, g2g = (float(v) for v in pos["pos 0"])
    assert (gemm, red, g2r, gap, g2g) == (10.0, 7.0, -6.0, 2.0, 3.0)
    gemm, red, _, gap, g2g = pos["pos 1"]
    assert float(gemm) == 20.0 and red == "nan" and float(gap) == 0.5 and float(g2g) == 0.5
