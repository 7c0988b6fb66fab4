"""Bad input: each case gives one clear error naming the file and tensor, and nothing complete-looking
is left behind (no DST/OUT, no partial folders)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from w12 import convert as wc
from w12.checkpoint import INDEX_NAME, CheckpointError, W12Checkpoint, load_w12_weights, open_folder
from w12.synthetic import build_llama_checkpoint


def rewrite_header(path: Path, edit) -> None:
    """Applies ``edit(header_dict)`` to a safetensors file's header, keeping the data as it is."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n :])


def clean(parent: Path, *names: str) -> bool:
    left = [p.name for p in parent.iterdir() if p.name in names or ".w12-partial" in p.name]
    return not left


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("good")
    build_llama_checkpoint(root / "src", "tiny", num_shards=2, seed=3)
    wc.convert(root / "src", root / "w12", progress=False)
    return root


@pytest.fixture
def src(good, tmp_path):
    shutil.copytree(good / "src", tmp_path / "src")
    return tmp_path / "src"


@pytest.fixture
def w12dir(good, tmp_path):
    shutil.copytree(good / "w12", tmp_path / "w12")
    return tmp_path / "w12"


def shard_of(folder: Path, name: str) -> Path:
    return folder / json.loads((folder / INDEX_NAME).read_text())["weight_map"][name]


def expect_convert_error(src: Path, match: str):
    with pytest.raises(CheckpointError, match=match):
        wc.convert(src, src.parent / "out", progress=False)
    assert clean(src.parent, "out")


# -- sources ---------------------------------------------------------------------------------------
def test_truncated_source_shard(src):
    shard = shard_of(src, "lm_head.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    expect_convert_error(src, rf"{shard.name}: truncated: tensor 'lm_head.weight' needs bytes up to")


def test_source_cut_inside_the_header(src):
    shard = shard_of(src, "lm_head.weight")
    shard.write_bytes(shard.read_bytes()[:100])
    expect_convert_error(src, rf"{shard.name}: corrupt or truncated: the header claims")
    shard.write_bytes(b"\x01\x02")
    expect_convert_error(src, rf"{shard.name}: truncated \(2 bytes\)")


def test_corrupt_source_header(src):
    shard = shard_of(src, "lm_head.weight")
    raw = bytearray(shard.read_bytes())
    raw[8:12] = b"!!!!"
    shard.write_bytes(bytes(raw))
    expect_convert_error(src, rf"{shard.name}: corrupt safetensors header \(not valid JSON")


def test_unknown_dtype_in_header(src):
    shard = shard_of(src, "lm_head.weight")
    rewrite_header(shard, lambda h: h["lm_head.weight"].update(dtype="Q4"))
    expect_convert_error(src, r"tensor 'lm_head.weight': unknown dtype 'Q4'")


def test_shape_disagrees_with_offsets(src):
    shard = shard_of(src, "lm_head.weight")

    def edit(h):
        h["lm_head.weight"]["shape"][0] += 1

    rewrite_header(shard, edit)
    expect_convert_error(
        src, r"tensor 'lm_head.weight': shape \[\d+, \d+\] of BF16 needs \d+ bytes but its data_offsets"
    )


def test_overlapping_tensors(src):
    shard = shard_of(src, "lm_head.weight")

    def edit(h):
        names = [k for k in h if k != "__metadata__"]
        first = min(names, key=lambda k: h[k]["data_offsets"][0])
        h[first]["data_offsets"] = [x + 2 for x in h[first]["data_offsets"]]

    rewrite_header(shard, edit)
    expect_convert_error(src, rf"{shard.name}: corrupt header: tensor .* overlaps another or leaves a gap")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_wrong_dtype_refused_without_cast(tmp_path, dtype):
    build_llama_checkpoint(tmp_path / "src", "tiny", num_shards=1, dtype=dtype)
    name = {torch.float32: "F32", torch.float16: "F16"}[dtype]
    expect_convert_error(
        tmp_path / "src",
        rf"model.safetensors: tensor '.*proj.weight' \(and \d+ more tensors\) has dtype {name}.*--cast bf16",
    )


def test_integer_tensor_cannot_be_included(tmp_path):
    (tmp_path / "src").mkdir()
    save_file({"q.weight": torch.zeros(4, 4, dtype=torch.int8)}, tmp_path / "src" / "model.safetensors")
    assert not any(wc.select(open_folder(tmp_path / "src")).values())  # not chosen by default
    with pytest.raises(CheckpointError, match=r"'q.weight' has dtype I8; W12 converts floating weights only"):
        wc.convert(tmp_path / "src", tmp_path / "out", include=["q"], progress=False)
    assert clean(tmp_path, "out")


def test_index_lists_a_tensor_the_shard_lacks(src):
    index = json.loads((src / INDEX_NAME).read_text())
    shard = index["weight_map"]["lm_head.weight"]
    index["weight_map"]["model.ghost.weight"] = shard
    (src / INDEX_NAME).write_text(json.dumps(index))
    expect_convert_error(src, rf"lists tensor 'model.ghost.weight' in {shard}, but that file has no such tensor")


def test_shard_holds_a_tensor_the_index_lacks(src):
    index = json.loads((src / INDEX_NAME).read_text())
    shard = index["weight_map"].pop("model.norm.weight")
    (src / INDEX_NAME).write_text(json.dumps(index))
    expect_convert_error(src, rf"{shard}: holds tensor 'model.norm.weight', which {INDEX_NAME} does not list")


def test_index_names_a_missing_shard(src):
    shard = shard_of(src, "lm_head.weight")
    shard.unlink()
    expect_convert_error(src, rf"lists tensor '.*' in {shard.name}, but .* is missing")


def test_corrupt_index_and_config(src):
    (src / INDEX_NAME).write_text("{not json")
    expect_convert_error(src, rf"{INDEX_NAME}: corrupt index")
    (src / INDEX_NAME).write_text(json.dumps({"weight_map": 3}))
    expect_convert_error(src, rf"{INDEX_NAME}: corrupt index \(no weight_map")


def test_already_quantized_or_converted(src, good):
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq"}
    (src / "config.json").write_text(json.dumps(cfg))
    expect_convert_error(src, r"config.json: the model is already quantized \(quant_method 'gptq'\)")
    expect_convert_error(good / "w12", r"already a W12 checkpoint")


def test_folder_without_safetensors(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "pytorch_model.bin").write_bytes(b"x")
    expect_convert_error(tmp_path / "src", r"no \*.safetensors files \(found pytorch_model.bin")
    with pytest.raises(CheckpointError, match="no such file or folder"):
        wc.convert(tmp_path / "nope", tmp_path / "out", progress=False)


def test_bad_regex(src):
    with pytest.raises(CheckpointError, match=r"--include '\(': not a valid regular expression"):
        wc.convert(src, src.parent / "out", include=["("], progress=False)


# -- W12 folders -----------------------------------------------------------------------------------
def all_readers(src: Path, w: Path, match: str):
    """verify, restore, info and the loader all refuse the folder, naming the problem."""
    with pytest.raises(CheckpointError, match=match):
        wc.verify(src, w, progress=False)
    with pytest.raises(CheckpointError, match=match):
        wc.restore(w, w.parent / "restored", progress=False)
    assert clean(w.parent, "restored")
    with pytest.raises(CheckpointError, match=match):
        load_w12_weights(w)


def test_unknown_w12_version(good, w12dir):
    shard = shard_of(w12dir, "lm_head.w12_records")
    rewrite_header(shard, lambda h: h["__metadata__"].update(w12_version="2"))
    all_readers(good / "src", w12dir, rf"{shard.name}: unknown W12 format version '2'")
    with pytest.raises(CheckpointError, match="unknown W12 format version"):
        wc.info(w12dir)


def test_unknown_config_version(good, w12dir):
    cfg = json.loads((w12dir / "config.json").read_text())
    cfg["quantization_config"]["version"] = 7
    (w12dir / "config.json").write_text(json.dumps(cfg))
    all_readers(good / "src", w12dir, r"config.json: unknown W12 format version 7")


def test_w12_shape_disagrees_with_metadata(good, w12dir):
    shard = shard_of(w12dir, "lm_head.w12_records")

    def edit(h):
        m = json.loads(h["__metadata__"]["w12_tensors"])
        m["lm_head.weight"]["shape"][0] += 200
        h["__metadata__"]["w12_tensors"] = json.dumps(m)

    rewrite_header(shard, edit)
    all_readers(
        good / "src",
        w12dir,
        rf"{shard.name}: tensor 'lm_head.w12_records' is U8 .* but w12_tensors gives 'lm_head.weight' shape",
    )


def test_w12_wrong_dtype(good, w12dir):
    shard = shard_of(w12dir, "lm_head.w12_esc_val")
    rewrite_header(shard, lambda h: h["lm_head.w12_esc_val"].update(dtype="U16"))
    all_readers(good / "src", w12dir, r"tensor 'lm_head.w12_esc_val' is U16 .* needs I16")


def test_w12_missing_part_and_stray_part(good, w12dir):
    shard = shard_of(w12dir, "lm_head.w12_base")

    def rename(h):
        h["lm_head.w12_basis"] = h.pop("lm_head.w12_base")

    rewrite_header(shard, rename)
    index = json.loads((w12dir / INDEX_NAME).read_text())
    index["weight_map"]["lm_head.w12_basis"] = index["weight_map"].pop("lm_head.w12_base")
    (w12dir / INDEX_NAME).write_text(json.dumps(index))
    all_readers(good / "src", w12dir, r"W12 tensor 'lm_head.weight' lacks 'lm_head.w12_base'")


def test_w12_truncated(good, w12dir):
    shard = shard_of(w12dir, "lm_head.w12_records")
    shard.write_bytes(shard.read_bytes()[:-7])
    all_readers(good / "src", w12dir, rf"{shard.name}: truncated: tensor '.*' needs bytes up to")


def test_w12_corrupt_escape_list(good, w12dir):
    """Escape columns out of range are caught before decoding."""
    ck = W12Checkpoint(w12dir)
    name = next(n for n, e in ck.entries.items() if e.nnz > 0)
    info = ck.folder.info(name[: -len(".weight")] + ".w12_esc_col")
    path = ck.folder.file_of(info.name).path
    raw = bytearray(path.read_bytes())
    raw[info.start : info.start + 4] = (10**6).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    all_readers(good / "src", w12dir, rf"{path.name}: {name}: w12_esc_col holds columns outside")


def test_w12_bit_flip_is_a_mismatch(good, w12dir):
    """A corrupt but well-formed record decodes to different bits: verify names tensor, row and column."""
    ck = W12Checkpoint(w12dir)
    name = "model.layers.1.mlp.down_proj.weight"
    info = ck.folder.info("model.layers.1.mlp.down_proj.w12_records")
    path = ck.folder.file_of(info.name).path
    raw = bytearray(path.read_bytes())
    kt = info.shape[1]
    # hi byte of element (row 130, column 70): row tile 1, column tile 1, slot (2, 6)
    raw[info.start + (1 * kt + 1) * 12288 + 2 * 64 + 6] ^= 0x01
    path.write_bytes(bytes(raw))
    r = wc.verify(good / "src", w12dir, progress=False)
    assert not r.ok
    assert r.mismatch["tensor"] == name and (r.mismatch["row"], r.mismatch["column"]) == (130, 70)
    assert f"{path.name}: {name}: row 130, column 70" in r.message


def test_verify_detects_a_different_source(good, tmp_path):
    other = tmp_path / "other"
    build_llama_checkpoint(other, "tiny", num_shards=2, seed=99)
    r = wc.verify(other, good / "w12", progress=False)
    assert not r.ok and r.mismatch["tensor"] == "model.embed_tokens.weight" and "byte" in r.mismatch
    (tmp_path / "fewer").mkdir()
    save_file({"x.weight": torch.zeros(4, 4, dtype=torch.bfloat16)}, tmp_path / "fewer" / "model.safetensors")
    r = wc.verify(tmp_path / "fewer", good / "w12", progress=False)
    assert not r.ok and "'x.weight' is in SRC but missing from DST" in r.message


def test_not_a_w12_folder(good):
    with pytest.raises(CheckpointError, match=r"not a W12 shard \(its metadata has format='pt'"):
        wc.info(good / "src")
    with pytest.raises(CheckpointError, match="not a W12 shard"):
        wc.restore(good / "src", good / "restored", progress=False)
    assert clean(good, "restored")
