"""The end-to-end Transformers benchmark runs (``--smoke``: tiny config, CPU) and writes its JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_e2e_hf.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_e2e_hf", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_bench_smoke_writes_rows(tmp_path):
    out = tmp_path / "e2e.json"
    rc = load_bench().main(
        ["--smoke", "--device", "cpu", "--batches", "1,2", "--new-tokens", "2", "--no-generate", "--out", str(out)]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert [r["batch"] for r in data["rows"]] == [1, 2]
    for r in data["rows"]:
        for key in ("batch", "tok_s_w12", "tok_s_bf16", "speedup", "weight_gb_w12", "weight_gb_bf16"):
            assert key in r
        assert r["weight_gb_w12"] < r["weight_gb_bf16"]
        assert r["speedup"] == pytest.approx(r["tok_s_w12"] / r["tok_s_bf16"])
        # On the CPU both sides compute bit-identical logits, so greedy decoding agrees.
        assert r["greedy_first_divergence_row0"] is None
    assert not out.with_suffix(".partial.json").exists()


def test_bench_refuses_full_run_without_gpu(monkeypatch):
    bench = load_bench()
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu"])
