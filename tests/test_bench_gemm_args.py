"""benchmarks/bench_gemm.py (pooling of graph instances) and probe_ws_offset.py: argument checks (no GPU needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_gemm as bg  # noqa: E402


def test_pool_instances_takes_medians_of_each_statistic():
    timed = [(12.6, 12.5, 12.7), (12.2, 12.1, 12.3), (12.4, 12.0, 12.9)]
    t, p25, p75, inst = bg.pool_instances(timed)
    assert (t, p25, p75) == (12.4, 12.1, 12.7)
    assert inst == [12.6, 12.2, 12.4]  # in capture order, for the JSON row


def test_pool_instances_of_one_is_that_instance():
    assert bg.pool_instances([(9.5, 9.4, 9.6)]) == (9.5, 9.4, 9.6, [9.5])


@pytest.mark.parametrize("n", ["0", "17", "-1"])
def test_instances_out_of_range_rejected(n, capsys):
    with pytest.raises(SystemExit) as e:
        bg.main(["--instances", n, "--shapes", "qkv"])
    assert e.value.code == 2
    assert f"--instances {n}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,match",
    [
        (["--offsets", "0,-16"], "--offsets"),
        (["--offsets", "0,8"], "multiples of 16"),
        (["--m", "0"], "--m 0"),
        (["--shapes", "qkv,banana"], "'banana' is neither"),
        (["--shapes", "4096x100"], "multiple of 64"),
    ],
)
def test_probe_ws_offset_rejects_bad_arguments(args, match, capsys):
    import probe_ws_offset

    with pytest.raises(SystemExit) as e:
        probe_ws_offset.main(args)
    assert e.value.code == 2
    assert match in capsys.readouterr().err
