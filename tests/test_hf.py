"""W12 in Hugging Face Transformers on the CPU: patch, save, from_pretrained, generate, per family.

Every comparison is bitwise. Reference models are built with ``from_config(dtype=bfloat16)`` so
non-persistent buffers (rotary inv_freq) stay float32 exactly as ``from_pretrained`` leaves them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import w12  # noqa: E402
from w12.nn import W12Linear  # noqa: E402

AutoModelForCausalLM = transformers.AutoModelForCausalLM

BASE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
VOCAB = 512
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "gemma2": ("Gemma2Config", {"head_dim": 32}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 32}),
    "phi3": ("Phi3Config", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "gpt_neox": ("GPTNeoXConfig", {"num_key_value_heads": None}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}),
}


def make_config(family: str, **over):
    cls_name, extra = FAMILIES[family]
    kw = {**BASE, "vocab_size": VOCAB, **extra, **over}
    kw = {k: v for k, v in kw.items() if v is not None}
    return getattr(transformers, cls_name)(**kw)


def make_model(family: str, seed: int = 0, **over):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(make_config(family, **over), dtype=torch.bfloat16).eval()


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@torch.no_grad()
def logits(model, ids):
    return model(ids).logits


def n_w12(model):
    return sum(isinstance(m, W12Linear) for m in model.modules())


@pytest.fixture
def ids():
    return torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_patch_save_load_generate(family, ids, tmp_path):
    model = make_model(family)
    ref = logits(model, ids)
    gen_kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    ref_tokens = model.generate(ids[:1], **gen_kw)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())

    w12.patch(model, keep_if_larger=True)
    rep = model.w12_report
    tied = model.config.tie_word_embeddings
    assert len(rep.converted) == linears - (1 if tied else 0)
    assert n_w12(model) == len(rep.converted)
    assert same_bits(logits(model, ids), ref), "patched logits differ from BF16"

    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "w12"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert n_w12(loaded) == len(rep.converted)
    assert same_bits(logits(loaded, ids), ref), "loaded logits differ from BF16"
    assert torch.equal(loaded.generate(ids[:1], **gen_kw), ref_tokens)

    w12.unpatch(loaded)
    assert n_w12(loaded) == 0 and getattr(loaded, "hf_quantizer", None) is None
    assert "quantization_config" not in loaded.config.to_dict()
    assert same_bits(logits(loaded, ids), ref)


def test_moe_experts_reported_not_converted():
    model = make_model("qwen3_moe")
    w12.patch(model)
    skipped = dict(model.w12_report.skipped)
    stacks = [n for n, why in skipped.items() if "stacked (expert) weight" in why]
    assert len(stacks) == 4  # gate_up_proj and down_proj of two layers


def test_shard_metadata_matches_format_spec(tmp_path):
    from safetensors import safe_open

    model = make_model("llama")
    w12.patch(model, keep_if_larger=True)
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 1
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    listed = set()
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            md, keys = f.metadata(), set(f.keys())
            assert md["format"] == "w12" and md["w12_version"] == "1"
            entries = json.loads(md["w12_tensors"])
            for name, info in entries.items():
                stem = name.removesuffix(".weight")
                assert info["layout"] == 0
                mod = model.get_submodule(stem)
                assert info["shape"] == [mod.out_features, mod.in_features]
                for suffix in ("w12_records", "w12_base", "w12_esc_ptr", "w12_esc_col", "w12_esc_val"):
                    assert f"{stem}.{suffix}" in keys
                    assert index[f"{stem}.{suffix}"] == shard.name
                assert torch.equal(f.get_tensor(f"{stem}.w12_records"), mod.w12_records)
            listed |= set(entries)
    assert listed == {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, W12Linear)}
    ids = torch.randint(0, VOCAB, (1, 9))
    assert same_bits(logits(AutoModelForCausalLM.from_pretrained(tmp_path), ids), logits(model, ids))


def test_folder_readable_by_checkpoint_module(tmp_path):
    checkpoint = pytest.importorskip("w12.checkpoint")
    model = make_model("qwen2")
    w12.patch(model, keep_if_larger=True)
    model.save_pretrained(tmp_path, max_shard_size="300KB")
    ck = checkpoint.W12Checkpoint(tmp_path)
    assert set(ck.entries) == {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, W12Linear)}
    for name in ck.entries:
        mod = model.get_submodule(name.removesuffix(".weight"))
        assert same_bits(w12.unpack(ck.load(name, check_escapes=True)), mod.dequantized_weight())


def test_tied_head_kept_or_converted(ids, tmp_path):
    model = make_model("gemma2")
    assert model.config.tie_word_embeddings
    ref = logits(model, ids)
    w12.patch(model)
    assert "tied" in dict(model.w12_report.skipped)["lm_head"]
    assert type(model.lm_head) is torch.nn.Linear

    model = make_model("gemma2")
    w12.patch(model, lm_head=True, keep_if_larger=True)
    assert isinstance(model.lm_head, W12Linear)
    assert isinstance(model.get_input_embeddings(), torch.nn.Embedding)
    assert same_bits(logits(model, ids), ref)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded.lm_head, W12Linear)
    assert same_bits(logits(loaded, ids), ref)


def test_quantize_on_load(ids, tmp_path):
    model = make_model("mistral")
    ref = logits(model, ids)
    model.save_pretrained(tmp_path)
    from w12.hf import W12Config

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=W12Config())
    assert n_w12(loaded) > 0
    assert same_bits(logits(loaded, ids), ref)


def test_missing_w12_tensor_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    model = make_model("llama")
    w12.patch(model, keep_if_larger=True)
    model.save_pretrained(tmp_path)
    path = str(tmp_path / "model.safetensors")
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        md = f.metadata()
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.w12_esc_ptr"]
    save_file(tensors, path, metadata=md)
    with pytest.raises(w12.W12FormatError, match=r"model\.layers\.1\.mlp\.up_proj\.w12_esc_ptr"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_shape_mismatch_is_an_error(tmp_path):
    model = make_model("llama")
    w12.patch(model, keep_if_larger=True)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 384
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(w12.W12FormatError, match=r"mlp\.\w+_proj\.weight: checkpoint shape"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_unknown_version_is_an_error(tmp_path):
    model = make_model("llama")
    w12.patch(model, keep_if_larger=True)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["version"] = 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="version 2"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_import_w12_does_not_import_transformers_but_registers_on_use():
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    code = (
        "import sys, w12\n"
        "assert 'transformers' not in sys.modules, 'import w12 imported transformers'\n"
        "from transformers.quantizers import auto\n"
        "assert 'w12' in auto.AUTO_QUANTIZER_MAPPING and 'w12' in auto.AUTO_QUANTIZATION_CONFIG_MAPPING\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    code_after = (
        "import transformers.quantizers.auto as auto, w12\n"
        "assert auto.AUTO_QUANTIZER_MAPPING['w12'].__name__ == 'W12HfQuantizer'\n"
    )
    subprocess.run([sys.executable, "-c", code_after], check=True, env=env, timeout=120)


def test_state_dict_keys_are_container_names():
    model = make_model("llama")
    w12.patch(model, keep_if_larger=True)
    keys = set(model.state_dict())
    for suffix in ("w12_records", "w12_base", "w12_esc_ptr", "w12_esc_col", "w12_esc_val"):
        assert f"model.layers.0.self_attn.q_proj.{suffix}" in keys
    assert "model.layers.0.self_attn.q_proj.weight" not in keys


def test_loaded_model_saves_again(ids, tmp_path):
    model = make_model("qwen3")
    ref = logits(model, ids)
    w12.patch(model, keep_if_larger=True)
    model.save_pretrained(tmp_path / "a")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    loaded.save_pretrained(tmp_path / "b")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "b")
    assert same_bits(logits(again, ids), ref)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "a" / "model.safetensors"), framework="pt") as fa:
        with safe_open(str(tmp_path / "b" / "model.safetensors"), framework="pt") as fb:
            assert fa.metadata() == fb.metadata()
            assert set(fa.keys()) == set(fb.keys())
            for k in fa.keys():
                assert torch.equal(fa.get_tensor(k).view(torch.uint8), fb.get_tensor(k).view(torch.uint8)), k
