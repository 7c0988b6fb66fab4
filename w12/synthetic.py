"""Synthetic Llama-shaped BF16 checkpoints with trained-like weights, for the demo, tests and benchmarks.

Weights are normal with std 0.02 (seeded), which is what trained linear layers look like to W12:
the escape rate and bits/weight land where real checkpoints do. Norm weights are ones, like at
initialisation. Written with the streaming shard writer, one tensor at a time, so even a
multi-billion-weight checkpoint is built with little memory.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .checkpoint import CONFIG_NAME, INDEX_NAME, TORCH_TO_ST, Planned, ShardWriter

# Shapes of real models; a preset's ``layers`` is a default that callers may override.
PRESETS = {
    # ~20 M weights: seconds to convert, big enough to exercise sharding and odd shapes.
    "demo": dict(hidden=512, intermediate=1376, heads=8, kv_heads=2, vocab=8003, layers=4),
    "tiny": dict(hidden=192, intermediate=520, heads=6, kv_heads=2, vocab=1001, layers=2),
    "llama-3.1-8b": dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256, layers=32),
}


def llama_tensors(hidden, intermediate, heads, kv_heads, vocab, layers, tie_embeddings=False) -> list[tuple]:
    """``(name, shape)`` of a Llama checkpoint in Hugging Face naming, in file order."""
    head_dim = hidden // heads
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
            (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
            (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (intermediate, hidden)),
            (p + "mlp.up_proj.weight", (intermediate, hidden)),
            (p + "mlp.down_proj.weight", (hidden, intermediate)),
        ]
    out.append(("model.norm.weight", (hidden,)))
    if not tie_embeddings:
        out.append(("lm_head.weight", (vocab, hidden)))
    return out


def _config(hidden, intermediate, heads, kv_heads, vocab, layers, tie_embeddings=False) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": tie_embeddings,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _fill(shape, name: str, gen: torch.Generator, std: float) -> torch.Tensor:
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    t = torch.empty(shape, dtype=torch.float32)
    t.normal_(0.0, std, generator=gen)
    return t.to(torch.bfloat16)


def build_llama_checkpoint(
    folder,
    preset: str = "demo",
    layers: int | None = None,
    num_shards: int = 2,
    seed: int = 0,
    std: float = 0.02,
    dtype: torch.dtype = torch.bfloat16,
    tie_embeddings: bool = False,
    progress: bool = False,
    **overrides,
) -> dict:
    """Writes a Llama-shaped checkpoint into ``folder`` (created; must not exist or be empty).

    ``preset`` picks the shapes (``PRESETS``), ``layers`` and ``overrides`` change them. The
    tensors are cut into ``num_shards`` files of about equal size with an index (one file:
    ``model.safetensors``, no index), plus ``config.json`` and a dummy tokenizer. ``dtype``
    other than BF16 casts the BF16 values up (to test ``--cast``). Returns a summary dict.
    """
    shapes = dict(PRESETS[preset], **overrides)
    if layers is not None:
        shapes["layers"] = layers
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.iterdir()):
        raise FileExistsError(f"{folder}: not empty")
    tensors = llama_tensors(**shapes, tie_embeddings=tie_embeddings)
    st_dtype = TORCH_TO_ST[dtype]
    esize = torch.empty((), dtype=dtype).element_size()
    sizes = [math.prod(s) * esize for _, s in tensors]
    total = sum(sizes)
    # Greedy cut at equal byte targets keeps file order, like Hugging Face's own sharding.
    groups: list[list[int]] = [[]]
    acc = 0
    for i, sz in enumerate(sizes):
        if groups[-1] and acc + sz / 2 > total * len(groups) / num_shards and len(groups) < num_shards:
            groups.append([])
        groups[-1].append(i)
        acc += sz
    names = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    gen = torch.Generator().manual_seed(seed)
    weight_map = {}
    numel = sum(math.prod(s) for _, s in tensors)
    bar = tqdm(total=numel, unit="w", unit_scale=True, desc="build", disable=not progress)
    for fname, idx in zip(names, groups):
        plan = [Planned(tensors[i][0], st_dtype, tensors[i][1]) for i in idx]
        w = ShardWriter(folder / fname, plan, {"format": "pt"})
        for i in idx:
            name, shape = tensors[i]
            w.add(name, _fill(shape, name, gen, std).to(dtype))
            weight_map[name] = fname
            bar.update(math.prod(shape))
        w.close()
    bar.close()
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    config = _config(**shapes, tie_embeddings=tie_embeddings)
    config["torch_dtype"] = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    # A stand-in so that conversions show they carry tokenizer files along.
    tok = {"model_max_length": 2048, "tokenizer_class": "PreTrainedTokenizerFast", "note": "w12 synthetic dummy"}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok, indent=2) + "\n")
    return {"folder": str(folder), "files": names, "tensors": len(tensors), "weights": numel, "bytes": total}
