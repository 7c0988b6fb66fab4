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
    assert data["sides"] == ["bf16", "bf16_fused", "w12"]
    # 2 layers: q/k/v and gate/up of each, BF16 and W12 alike (the smoke config's k/v fill whole W12 tiles).
    assert data["fused_groups"] == {"bf16_fused": 4, "w12": 4}
    assert [r["batch"] for r in data["rows"]] == [1, 2]
    for r in data["rows"]:
        for key in ("batch", "tok_s_w12", "tok_s_bf16", "speedup", "weight_gb_w12", "weight_gb_bf16"):
            assert key in r
        for key in ("tok_s_bf16_fused", "speedup_vs_bf16_fused", "step_ms_bf16_fused", "gemm_ms_bf16_fused"):
            assert r[key] is not None, key
        assert r["weight_gb_w12"] < r["weight_gb_bf16"]
        assert r["speedup"] == pytest.approx(r["tok_s_w12"] / r["tok_s_bf16"])
        assert r["speedup_vs_bf16_fused"] == pytest.approx(r["tok_s_w12"] / r["tok_s_bf16_fused"])
        assert "tok_s_w12_unfused" not in r
        # On the CPU every side computes bit-identical logits, so greedy decoding agrees.
        assert r["greedy_first_divergence_row0"] is None
        assert r["greedy_first_divergence_row0_bf16_fused"] is None
    assert not out.with_suffix(".partial.json").exists()


@pytest.mark.slow
def test_bench_smoke_w12_unfused_side(tmp_path):
    out = tmp_path / "e2e.json"
    argv = ["--smoke", "--device", "cpu", "--batches", "1", "--new-tokens", "2", "--no-generate", "--out", str(out)]
    assert load_bench().main([*argv, "--sides", "w12,w12_unfused"]) == 0
    data = json.loads(out.read_text())
    assert data["sides"] == ["w12_unfused", "w12"]  # measured in the fixed order: patch, then fuse
    assert data["fused_groups"] == {"w12_unfused": 0, "w12": 4}
    (r,) = data["rows"]
    assert r["tok_s_bf16"] is None and r["speedup"] is None and r["tok_s_bf16_fused"] is None
    assert r["fusion_gain_w12"] == pytest.approx(r["tok_s_w12"] / r["tok_s_w12_unfused"])
    assert r["step_ms_w12"] > 0 and r["step_ms_w12_unfused"] > 0


def test_bench_rejects_unknown_side():
    with pytest.raises(SystemExit):
        load_bench().main(["--smoke", "--device", "cpu", "--sides", "bf16,fp8"])


def test_bench_refuses_full_run_without_gpu(monkeypatch):
    bench = load_bench()
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu"])
