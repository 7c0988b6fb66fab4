"""Convert a BF16 Hugging Face folder to W12, load it with Transformers, generate.

    python examples/convert_and_generate.py                      # a tiny random Llama, on the CPU
    python examples/convert_and_generate.py --model ~/llama-3.1-8b --out ~/llama-3.1-8b-w12 \
        --device cuda --prompt "The capital of France is"

The conversion is what ``w12 convert SRC DST`` does on the command line. Loading needs only
``import w12`` before ``from_pretrained``: W12 weights load straight into ``W12Linear`` modules
on the target device (BF16 weights are never materialised there). ``--check`` also loads the BF16
source and compares the greedy tokens.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import w12  # registers the "w12" quantization method with Transformers


def tiny_bf16_folder(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
    return path


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def prompt_ids(folder: Path, text: str | None, vocab: int, device) -> tuple[torch.Tensor, object]:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder)
        return tok(text or "W12 stores BF16 weights in twelve bits", return_tensors="pt").input_ids.to(device), tok
    except (OSError, ValueError):  # the tiny random model has no tokenizer
        g = torch.Generator().manual_seed(1)
        return torch.randint(3, vocab, (1, 12), generator=g).to(device), None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a BF16 Hugging Face model folder (default: a tiny random Llama)")
    p.add_argument("--out", type=Path, help="where to write the W12 folder (default: a temporary folder)")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when available)")
    p.add_argument("--prompt", help="prompt text (needs a tokenizer in the model folder)")
    p.add_argument("--max-new-tokens", type=int, default=20)
    p.add_argument("--check", action="store_true", help="also generate with the BF16 source and compare")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    args = p.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device

    from transformers import AutoModelForCausalLM

    from w12.convert import convert

    with tempfile.TemporaryDirectory() as tmp:
        src = args.model or tiny_bf16_folder(Path(tmp) / "bf16")
        dst = args.out or Path(tmp) / "w12"
        t0 = time.perf_counter()
        convert(src, dst, force=args.force)
        print(
            f"converted {src} -> {dst} in {time.perf_counter() - t0:.1f} s: "
            f"{folder_bytes(src) / 1e6:.1f} MB -> {folder_bytes(dst) / 1e6:.1f} MB of safetensors"
        )

        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(dst, device_map=device)
        n = sum(isinstance(m, w12.W12Linear) for m in model.modules())  # fused q/k/v, gate/up members too
        print(f"loaded on {device} in {time.perf_counter() - t0:.1f} s with {n} W12Linear modules")

        ids, tok = prompt_ids(Path(src), args.prompt, model.config.vocab_size, device)
        kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=model.config.eos_token_id or 0)
        out = model.generate(ids, **kw)[0, ids.shape[1] :]
        print("W12 :", tok.decode(out) if tok else out.tolist())
        if args.check:
            ref_model = AutoModelForCausalLM.from_pretrained(src, device_map=device, dtype=torch.bfloat16)
            ref = ref_model.generate(ids, **kw)[0, ids.shape[1] :]
            print("BF16:", tok.decode(ref) if tok else ref.tolist())
            same = torch.equal(ref, out)
            print("greedy tokens identical" if same else "greedy tokens differ (GPU kernels sum in another order)")
            if device == "cpu" and not same:
                return 1  # on the CPU W12 is bit-identical to BF16, so this would be a bug
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
