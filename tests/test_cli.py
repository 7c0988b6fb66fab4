"""The ``w12`` command line: subcommands, help, exit codes, JSON output, the demo."""

import json
import subprocess
import sys

import pytest

from converters.cli import main
from w12.synthetic import build_llama_checkpoint


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    build_llama_checkpoint(root / "src", "tiny", num_shards=2, seed=5)
    return root / "src"


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("convert", "verify", "info", "restore", "demo", "W12_CPU_ENCODER"):
        assert cmd in out
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    out = capsys.readouterr().out
    for phrase in ("--include", "--exclude", "--embeddings", "--cast", "--force", "lossy", "embed_tokens", "lm_head"):
        assert phrase in out
    for cmd in ("verify", "info", "restore", "demo"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        assert "usage: w12 " + cmd in capsys.readouterr().out


def test_usage_error():
    with pytest.raises(SystemExit) as e:
        main(["convert"])
    assert e.value.code == 2


def test_convert_verify_info_restore(src, tmp_path, capsys):
    dst = tmp_path / "w12"
    assert main(["convert", str(src), str(dst), "-q", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "bits/weight" in out and "verify: OK" in out
    assert main(["verify", str(src), str(dst), "-q"]) == 0
    assert "bit-identical" in capsys.readouterr().out
    assert main(["info", str(dst), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["totals"]["converted_tensors"] == len(d["tensors"]) > 0
    assert main(["info", str(dst), "--totals"]) == 0
    out = capsys.readouterr().out
    assert "bits/weight" in out and "model.layers.0" not in out
    assert main(["restore", str(dst), str(tmp_path / "back"), "-q"]) == 0
    assert "tensors decoded" in capsys.readouterr().out
    assert main(["convert", str(src), str(tmp_path / "j"), "-q", "--json", "--exclude", "mlp"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["tensors_converted"] == 2 * 4 + 1  # attention projections of 2 layers + lm_head


def test_errors_exit_1_with_one_line(src, tmp_path, capsys):
    dst = tmp_path / "w12"
    dst.mkdir()
    assert main(["convert", str(src), str(dst), "-q"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("w12 convert: error: ") and "already exists" in err and len(err.splitlines()) == 1
    assert main(["info", str(src)]) == 1
    assert "not a W12 shard" in capsys.readouterr().err
    assert main(["convert", str(src), str(dst), "-q", "--force"]) == 0
    capsys.readouterr()
    other = tmp_path / "other"
    build_llama_checkpoint(other, "tiny", num_shards=2, seed=6)
    assert main(["verify", str(other), str(dst), "-q"]) == 1
    assert "MISMATCH" in capsys.readouterr().err
    assert main(["verify", str(other), str(dst), "-q", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False


def test_demo(tmp_path, capsys):
    assert main(["demo", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "demo passed" in out and "bit-identical" in out
    assert (tmp_path / "d" / "w12" / "config.json").exists()
    assert main(["demo", str(tmp_path / "d")]) == 1
    assert "not empty" in capsys.readouterr().err


def test_entry_point_runs(src, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "converters.cli", "convert", str(src), str(tmp_path / "w"), "-q", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tensors_converted"] > 0
