"""benchmarks/bench_read_floor.py: the --ring items are checked before any GPU work (no GPU needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_read_floor as rf  # noqa: E402


def test_ring_items_parse():
    items = rf.parse_ring("cpg:264x256:4:500:128,bulkr:264x256:8:1000,cpge:264x256:4:0:256,ld:528x256", "gate_up")
    assert [it[3] for it in items] == [3, 8, 5, -1]  # modes
    assert items[0][1:] == (264, 256, 3, 4, 500, 128)
    assert items[1][4:6] == (8, 1000)


@pytest.mark.parametrize(
    "ring,match",
    [
        ("bulk:264x256:4:500:128", "EXTRA 128"),  # jitter exists in the cp / cpg loop only
        ("cpe:264x256:4:500:128", "EXTRA 128"),
        ("bulk:264x256:4:0:256", "EXTRA 256"),  # round-robin records: per-thread copies only
        ("cpg:264x256:4:0:264", "EXTRA 256"),  # not with the balanced grid's slices (8)
        ("cpg:264x256:5", "DEPTH"),
        ("nope:264x256", "MODE one of"),
        ("cp:264x300", "multiple of 32"),
    ],
)
def test_ring_items_rejected(ring, match):
    with pytest.raises(ValueError, match=match):
        rf.parse_ring(ring, "gate_up")
