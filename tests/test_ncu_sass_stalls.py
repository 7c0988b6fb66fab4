"""benchmarks/ncu_sass_stalls.py: the source-page parsing, segments and ranges (no ncu or GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import ncu_sass_stalls  # noqa: E402

HEAD = '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_barrier","stall_long_sb"'
# A kernel body (0-3) that calls a function (4-6, ending in RET), then code after the RET (7).
BODY = [
    ("0x00", "S2R R0, SR_TID.X", 1, 10, 0, 0),
    ("0x10", "BAR.SYNC.DEFER_BLOCKING 0x0", 0, 10, 0, 0),
    ("0x20", "@P0   CALL.REL.NOINC 0x40", 3, 10, 3, 0),
    ("0x30", "EXIT", 0, 10, 0, 0),
    ("0x40", "LDG.E R2, desc[UR4][R2.64]", 2, 20, 0, 2),
    ("0x50", "FADD R2, R2, R3", 10, 20, 0, 10),
    ("0x60", "@!P1  RET.REL.NODEC R4, 0x0", 4, 10, 4, 0),
    ("0x70", "STS [R5], R2", 0, 10, 0, 0),
]


def _write(tmp_path: Path) -> Path:
    lines = ['"Kernel Name","my_kernel(Params)",', HEAD]
    lines += [",".join(f'"{v}"' for v in row) for row in BODY]
    path = tmp_path / "src.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_segments_cut_after_exit_ret_and_call(tmp_path):
    _, rows = ncu_sass_stalls.read_rows(str(_write(tmp_path)))
    segs = ncu_sass_stalls.segments(rows)
    assert [(g["first"], g["last"]) for g in segs] == [(0, 2), (3, 3), (4, 6), (7, 7)]
    assert [g["ends"].split()[0] for g in segs[:3]] == ["CALL.REL.NOINC", "EXIT", "RET.REL.NODEC"]
    assert segs[0]["share"] == pytest.approx(4 / 20) and segs[2]["share"] == pytest.approx(16 / 20)
    assert segs[2]["executed"] == pytest.approx(50 / 100)
    assert sum(g["share"] for g in segs) == pytest.approx(1.0)


def test_ranges_and_their_errors(tmp_path, capsys):
    path = _write(tmp_path)
    assert ncu_sass_stalls.parse_ranges("4-5, 0-0") == [(4, 5), (0, 0)]
    for bad in ("4", "5-4", "a-b", "-3"):
        with pytest.raises(ValueError, match="FIRST-LAST"):
            ncu_sass_stalls.parse_ranges(bad)
    out = tmp_path / "s.json"
    assert ncu_sass_stalls.main([str(path), "--ranges", "4-5", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["ranges"][0]["share"] == pytest.approx(12 / 20)
    assert res["ranges"][0]["executed"] == pytest.approx(40 / 100)
    assert "by segment" in capsys.readouterr().out
    assert ncu_sass_stalls.main([str(path), "--ranges", "4-8"]) == 2
    assert "past the last instruction (7)" in capsys.readouterr().err
    assert ncu_sass_stalls.main([str(path), "--ranges", "x"]) == 2


def test_not_a_source_page(tmp_path, capsys):
    path = tmp_path / "other.csv"
    path.write_text('"a","b"\n"1","2"\n')
    assert ncu_sass_stalls.main([str(path)]) == 2
    assert "no source-page header" in capsys.readouterr().err
