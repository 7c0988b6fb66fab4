"""Checkpoint conversion: the container of format spec section 6, selection rules, verify, info, restore,
the save/load helpers, and a real trained checkpoint."""

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import w12
from w12 import convert as wc
from w12.checkpoint import (
    INDEX_NAME,
    CheckpointError,
    Planned,
    SafetensorsFile,
    ShardWriter,
    W12Checkpoint,
    is_embedding,
    load_w12_state_dict,
    load_w12_weights,
    open_folder,
    save_w12,
)
from w12.synthetic import PRESETS, build_llama_checkpoint, llama_tensors

SUFFIXES = ("w12_records", "w12_base", "w12_esc_ptr", "w12_esc_col", "w12_esc_val")


def bits(t):
    return t.contiguous().view(torch.int16)


def no_leftovers(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if ".w12-partial" in p.name or ".w12-old" in p.name]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    build_llama_checkpoint(root / "src", "tiny", num_shards=2, seed=1)
    (root / "src" / "sub").mkdir()
    (root / "src" / "sub" / "extra.txt").write_text("side file")
    return root / "src"


@pytest.fixture(scope="module")
def tiny_w12(tiny, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("tinyw12") / "w12"
    wc.convert(tiny, dst, progress=False)
    return dst


def test_container_follows_the_spec(tiny, tiny_w12):
    src_index = json.loads((tiny / INDEX_NAME).read_text())
    index = json.loads((tiny_w12 / INDEX_NAME).read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(set(src_index["weight_map"].values()))
    converted = [n for n in src_index["weight_map"] if n.endswith("proj.weight") or n == "lm_head.weight"]
    assert converted
    for name in src_index["weight_map"]:
        stem = name[: -len(".weight")]
        shard = src_index["weight_map"][name]
        if name in converted:
            assert name not in index["weight_map"]
            for s in SUFFIXES:
                assert index["weight_map"][f"{stem}.{s}"] == shard
        else:
            assert index["weight_map"][name] == shard
    total = 0
    for shard in set(index["weight_map"].values()):
        with safe_open(tiny_w12 / shard, "pt") as f:  # safetensors' own reader accepts our files
            md = f.metadata()
            assert md["format"] == "w12" and md["w12_version"] == "1"
            entries = json.loads(md["w12_tensors"])
            src = load_file(tiny / shard)
            for name, e in entries.items():
                assert e == {"shape": list(src[name].shape), "layout": 0}
                stem = name[: -len(".weight")]
                want = w12.pack(src[name]).state_dict(stem)
                for k, v in want.items():
                    assert torch.equal(f.get_tensor(k), v), k
            for k in f.keys():
                t = f.get_tensor(k)
                total += t.numel() * t.element_size()
                if k in src:
                    assert torch.equal(t.view(-1).view(torch.uint8), src[k].view(-1).view(torch.uint8))
    assert index["metadata"]["total_size"] == total
    config = json.loads((tiny_w12 / "config.json").read_text())
    qc = config.pop("quantization_config")
    assert qc["quant_method"] == "w12" and qc["version"] == w12.FORMAT_VERSION
    assert config == json.loads((tiny / "config.json").read_text())
    assert (tiny_w12 / "tokenizer_config.json").read_text() == (tiny / "tokenizer_config.json").read_text()
    assert (tiny_w12 / "sub" / "extra.txt").read_text() == "side file"


def test_verify_info_restore(tiny, tiny_w12, tmp_path):
    r = wc.verify(tiny, tiny_w12, progress=False)
    assert r.ok, r.message
    assert r.tensors_checked == len(open_folder(tiny).tensor_names())
    d = wc.info(tiny_w12)
    ck = W12Checkpoint(tiny_w12)
    want_bytes = sum(ck.folder.info(f"{n[:-7]}.{s}").nbytes for n in ck.entries for s in SUFFIXES)
    weights = sum(e.numel for e in ck.entries.values())
    assert d["totals"]["bytes"] == want_bytes and d["totals"]["weights"] == weights
    assert d["totals"]["bits_per_weight"] == pytest.approx(want_bytes * 8 / weights)
    assert d["totals"]["escapes"] == sum(e.nnz for e in ck.entries.values())
    assert d["totals"]["file_bytes"] == sum(p.stat().st_size for p in tiny_w12.glob("*.safetensors"))
    assert "bits/weight" in wc.info_table(d)
    out = tmp_path / "restored"
    wc.restore(tiny_w12, out, progress=False)
    assert wc.compare_plain(tiny, out).ok
    for shard in tiny.glob("*.safetensors"):
        a, b = load_file(shard), load_file(out / shard.name)
        assert a.keys() == b.keys() and all(torch.equal(bits(a[k]), bits(b[k])) for k in a)
        with safe_open(out / shard.name, "pt") as f:
            assert f.metadata() == {"format": "pt"}
    assert json.loads((out / "config.json").read_text()) == json.loads((tiny / "config.json").read_text())
    assert json.loads((out / INDEX_NAME).read_text()) == json.loads((tiny / INDEX_NAME).read_text())


def test_default_selection_rule(tiny_w12):
    ck = W12Checkpoint(tiny_w12)
    shapes = dict(llama_tensors(**PRESETS["tiny"]))
    expected = {n for n, s in shapes.items() if len(s) == 2 and "embed" not in n}
    assert set(ck.entries) == expected
    assert "lm_head.weight" in ck.entries and "model.embed_tokens.weight" in ck.plain
    assert all(len(shapes[n]) == 1 or "embed" in n for n in ck.plain)


@pytest.mark.parametrize(
    "name,emb",
    [
        ("model.embed_tokens.weight", True),
        ("embeddings.word_embeddings.weight", True),
        ("transformer.wte.weight", True),
        ("transformer.wpe.weight", True),
        ("shared.weight", True),
        ("gpt_neox.embed_in.weight", True),
        ("lm_head.weight", False),
        ("model.layers.0.self_attn.q_proj.weight", False),
        ("model.shared_expert.up.weight", False),
    ],
)
def test_embedding_names(name, emb):
    assert is_embedding(name) == emb


def test_include_exclude_embeddings(tiny, tmp_path):
    folder = open_folder(tiny)
    sel = wc.select(folder, exclude=[r"mlp\."])
    assert not any(c for n, c in sel.items() if "mlp." in n) and sel["lm_head.weight"]
    sel = wc.select(folder, include=[r"q_proj", r"embed"])
    assert {n for n, c in sel.items() if c} == {n for n in sel if "q_proj" in n} | {"model.embed_tokens.weight"}
    sel = wc.select(folder, include=["norm"])  # 1-D tensors are never converted
    assert not any(sel.values())
    sel = wc.select(folder, embeddings=True, exclude=["lm_head"])
    assert sel["model.embed_tokens.weight"] and not sel["lm_head.weight"]
    s = wc.convert(tiny, tmp_path / "o", embeddings=True, progress=False)
    assert "model.embed_tokens.weight" in W12Checkpoint(tmp_path / "o").entries
    assert wc.verify(tiny, tmp_path / "o", progress=False).ok
    assert s.tensors_converted == sum(wc.select(folder, embeddings=True).values())


@pytest.mark.parametrize("shards", [1, 3])
def test_single_file_and_many_shards(tmp_path, shards):
    src = tmp_path / "src"
    build_llama_checkpoint(src, "tiny", num_shards=shards, layers=3)
    assert (src / INDEX_NAME).exists() == (shards > 1)
    wc.convert(src, tmp_path / "w", progress=False)
    assert (tmp_path / "w" / INDEX_NAME).exists() == (shards > 1)
    assert wc.verify(src, tmp_path / "w", progress=False).ok
    wc.restore(tmp_path / "w", tmp_path / "r", progress=False)
    assert wc.compare_plain(src, tmp_path / "r").ok


def test_one_safetensors_file(tiny, tmp_path):
    shard = sorted(tiny.glob("*.safetensors"))[0]
    wc.convert(shard, tmp_path / "w", progress=False)
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == [shard.name]
    assert wc.verify(shard, tmp_path / "w", progress=False).ok
    assert wc.verify(shard, tmp_path / "w" / shard.name, progress=False).ok
    assert wc.info(tmp_path / "w" / shard.name)["totals"]["converted_tensors"] > 0


def test_stacked_experts_and_odd_tensors(tmp_path, rng):
    src = tmp_path / "src"
    src.mkdir()
    tensors = {
        "experts.gate_up.weight": (torch.randn(3, 130, 70, generator=rng) * 0.02).bfloat16(),
        "odd.weight": (torch.randn(5, 3, generator=rng)).bfloat16(),  # 30 bytes: held back for alignment
        "odd.bias": torch.randn(5, generator=rng).bfloat16(),
        "count": torch.tensor([3], dtype=torch.int64),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty.weight": torch.zeros(0, 4, dtype=torch.bfloat16),
    }
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    wc.convert(src, tmp_path / "w", progress=False)
    ck = W12Checkpoint(tmp_path / "w")
    assert set(ck.entries) == {"experts.gate_up.weight", "odd.weight"}
    assert ck.entries["experts.gate_up.weight"].shape == (3, 130, 70)
    assert wc.verify(src, tmp_path / "w", progress=False).ok
    with safe_open(tmp_path / "w" / "model.safetensors", "pt") as f:
        for k in f.keys():
            f.get_tensor(k)  # every tensor is aligned for safetensors' in-place views
    wc.restore(tmp_path / "w", tmp_path / "r", progress=False)
    back = load_file(tmp_path / "r" / "model.safetensors")
    assert back.keys() == tensors.keys()
    assert all(
        torch.equal(back[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)) for k, v in tensors.items()
    )


def test_cast_fp32(tmp_path):
    src = tmp_path / "src"
    build_llama_checkpoint(src, "tiny", num_shards=1, dtype=torch.float32)
    with pytest.raises(CheckpointError, match=r"F32.*--cast bf16.*lossy"):
        wc.convert(src, tmp_path / "w", progress=False)
    assert not (tmp_path / "w").exists()
    s = wc.convert(src, tmp_path / "w", cast="bf16", progress=False)
    assert s.cast == "bf16"
    assert json.loads((tmp_path / "w" / "config.json").read_text())["quantization_config"]["cast"] == "bf16"
    r = wc.verify(src, tmp_path / "w", progress=False)
    assert r.ok, r.message
    wc.restore(tmp_path / "w", tmp_path / "r", progress=False)
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "r" / "model.safetensors")
    ck = W12Checkpoint(tmp_path / "w")
    for k in a:
        if k in ck.entries:
            assert b[k].dtype == torch.bfloat16 and torch.equal(bits(b[k]), bits(a[k].bfloat16()))
        else:
            assert torch.equal(b[k], a[k])  # not converted: copied as it was
    with pytest.raises(CheckpointError, match="--cast"):
        wc.convert(src, tmp_path / "x", cast="fp8", progress=False)


def test_force_and_existing_destination(tiny, tmp_path):
    dst = tmp_path / "w"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists.*--force"):
        wc.convert(tiny, dst, progress=False)
    assert (dst / "keep.txt").read_text() == "mine"
    wc.convert(tiny, dst, force=True, progress=False)
    assert not (dst / "keep.txt").exists() and wc.verify(tiny, dst, progress=False).ok
    assert no_leftovers(tmp_path)
    with pytest.raises(CheckpointError, match="must not be the source"):
        wc.convert(tiny, tiny / "inside", progress=False)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupted_convert_leaves_nothing(tiny, tmp_path, monkeypatch, exc):
    calls = []

    def boom(t, out=None):
        calls.append(1)
        if len(calls) == 3:
            raise exc("interrupted")
        return w12.cpu_encoder.encode(t, out=out)

    monkeypatch.setattr(wc, "encode_tensor", boom)
    with pytest.raises(exc):
        wc.convert(tiny, tmp_path / "w", progress=False)
    assert not (tmp_path / "w").exists() and no_leftovers(tmp_path)
    # An interrupted --force keeps the old destination whole.
    wc.convert(tiny, tmp_path / "w", progress=False)
    calls.clear()
    before = sorted((p.name, p.stat().st_size) for p in (tmp_path / "w").iterdir())
    with pytest.raises(exc):
        wc.convert(tiny, tmp_path / "w", force=True, progress=False)
    assert sorted((p.name, p.stat().st_size) for p in (tmp_path / "w").iterdir()) == before
    assert no_leftovers(tmp_path)


def test_peak_memory_is_per_tensor_not_per_model(tmp_path):
    """The writer streams: a shard much larger than any tensor is never held (checked on the plan)."""
    src = tmp_path / "src"
    info = build_llama_checkpoint(src, "tiny", num_shards=1, layers=6)
    largest = max(math.prod(s) for _, s in llama_tensors(**dict(PRESETS["tiny"], layers=6))) * 2
    assert info["bytes"] > 8 * largest
    held = []
    orig = ShardWriter.add

    def spy(self, name, t):
        orig(self, name, t)
        held.append(sum(len(d) for _, d in self.held))

    ShardWriter.add = spy
    try:
        wc.convert(src, tmp_path / "w", progress=False)
    finally:
        ShardWriter.add = orig
    assert max(held) < largest  # only small, unaligned tensors wait for the end of the shard


def test_shard_writer_header_bound(tmp_path):
    plan = [Planned("a", "I32", None, max_numel=10**9), Planned("b", "U8", (3,)), Planned("c", "F32", (2,))]
    w = ShardWriter(tmp_path / "x.safetensors", plan, {"format": "pt"})
    w.add("b", torch.tensor([1, 2, 3], dtype=torch.uint8))
    w.add("a", torch.arange(7, dtype=torch.int32))
    w.add("c", torch.tensor([1.5, 2.5]))
    w.close()
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert f.data_start % 8 == 0
    got = load_file(tmp_path / "x.safetensors")
    assert got["a"].tolist() == list(range(7)) and got["b"].tolist() == [1, 2, 3] and got["c"].tolist() == [1.5, 2.5]
    w = ShardWriter(tmp_path / "y.safetensors", plan)
    with pytest.raises(ValueError, match="planned"):
        w.add("b", torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="not planned"):
        w.add("zz", torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="never written"):
        w.close()


def test_save_and_load_helpers(tmp_path, rng):
    a = (torch.randn(300, 200, generator=rng) * 0.02).bfloat16()
    e = (torch.randn(2, 130, 64, generator=rng) * 0.02).bfloat16()
    sd = {
        "model.a.weight": w12.pack(a),
        "model.a.bias": torch.randn(300, generator=rng).bfloat16(),
        "model.experts.weight": w12.pack(e),
        "model.norm.weight": torch.ones(200, dtype=torch.bfloat16),
    }
    files = save_w12(sd, tmp_path / "one")
    assert files == ["model.safetensors"] and not (tmp_path / "one" / INDEX_NAME).exists()
    files = save_w12(sd, tmp_path / "many", max_shard_bytes=60_000)
    assert len(files) > 1 and (tmp_path / "many" / INDEX_NAME).exists()
    for folder in ("one", "many"):
        ws = load_w12_weights(tmp_path / folder)
        assert set(ws) == {"model.a.weight", "model.experts.weight"}
        assert torch.equal(bits(w12.unpack(ws["model.a.weight"])), bits(a))
        assert torch.equal(bits(w12.unpack(ws["model.experts.weight"])), bits(e))
        full = load_w12_state_dict(tmp_path / folder)
        assert list(full) == list(sd)
        assert torch.equal(full["model.a.bias"], sd["model.a.bias"])
        assert isinstance(full["model.experts.weight"], w12.W12Weight)
    assert not [p for p in (tmp_path / "many").iterdir() if "partial" in p.name]
    with pytest.raises(TypeError, match="expected a torch.Tensor or W12Weight"):
        save_w12({"x": 3}, tmp_path / "bad")


def test_progress_bar_and_summary(tiny, tmp_path, capsys):
    s = wc.convert(tiny, tmp_path / "w", progress=True)
    err = capsys.readouterr().err
    assert "convert" in err and "tensors/s" in err and "w/s" in err
    table = s.table()
    for word in ("converted tensors", "copied tensors", "bits/weight", "M weights/s", "peak RSS"):
        assert word in table
    d = s.to_dict()
    assert d["weights_total"] == sum(open_folder(tiny).info(n).numel for n in open_folder(tiny).tensor_names())
    assert d["bits_per_weight"] == pytest.approx(d["w12_bytes"] * 8 / d["weights_converted"])


@pytest.mark.slow
@pytest.mark.parametrize("embeddings", [False, True])
def test_real_checkpoint_minilm(tmp_path, embeddings):
    from _data import minilm_bf16_folder

    src = minilm_bf16_folder()
    dst = tmp_path / "w12"
    s = wc.convert(src, dst, embeddings=embeddings, progress=False)
    assert s.tensors_converted >= 36  # 6 layers x 6 linears (+ pooler, + embeddings)
    r = wc.verify(src, dst, progress=False)
    assert r.ok, r.message
    d = wc.info(dst)
    assert d["totals"]["escape_rate"] < 5e-4
    # Records and escapes cost 12 bits a weight plus 48 bits an escape; the per-row base (uint8) and
    # esc_ptr (int32) of format section 6 add 40 bits a row, i.e. 0.1 bits a weight at MiniLM's K = 384,
    # and padding to 128 x 64 tiles adds the rest. The reported total is exactly that.
    expected, payload = 0, 0
    for r in d["tensors"]:
        rows, k = math.prod(r["shape"][:-1]), r["shape"][-1]
        n = r["shape"][-2]
        padded = rows // n * math.ceil(n / 128) * 128 * math.ceil(k / 64) * 64
        expected += padded * 12 + rows * 40 + 32 + r["escapes"] * 48
        payload += padded * 12 + r["escapes"] * 48
    assert d["totals"]["bits_per_weight"] == pytest.approx(expected / d["totals"]["weights"])
    if not embeddings:  # the linear layers need no padding: codes and escapes alone are <= 12.02
        assert payload == d["totals"]["weights"] * 12 + d["totals"]["escapes"] * 48
        assert payload / d["totals"]["weights"] <= 12.02
    wc.restore(dst, tmp_path / "back", progress=False)
    assert wc.compare_plain(src, tmp_path / "back").ok
    for name in ("tokenizer.json", "modules.json", "1_Pooling/config.json"):
        assert (dst / name).read_bytes() == (src / name).read_bytes()
    assert os.path.getsize(dst / "model.safetensors") < os.path.getsize(src / "model.safetensors")
