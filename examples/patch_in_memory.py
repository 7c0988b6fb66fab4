"""Patch a model that is already in memory: ``w12.patch(model)`` swaps its BF16 ``nn.Linear``
layers for ``W12Linear`` in place, layer by layer (peak memory = model + one layer).

    python examples/patch_in_memory.py                          # a tiny random Qwen2, on the CPU
    python examples/patch_in_memory.py --model ~/Qwen2.5-7B --device cuda --exclude "*.lm_head"

Shows the report (what was converted, what was skipped and why), checks the logits against the
BF16 model (bit-identical on the CPU; on the GPU the W12 GEMM sums in another order, so the
largest difference is printed), generates, and restores BF16 with ``w12.unpatch``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import w12


def load(model_path: Path | None, device: str):
    from transformers import AutoModelForCausalLM, Qwen2Config

    if model_path is not None:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, device_map=device)
    cfg = Qwen2Config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a BF16 Hugging Face model folder (default: a tiny random Qwen2)")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto")
    p.add_argument(
        "--lm-head",
        choices=["auto", "yes", "no"],
        default="auto",
        help="convert the LM head: auto = unless it is tied to the input embedding",
    )
    p.add_argument("--exclude", nargs="*", default=None, help="glob patterns of module names to keep BF16")
    p.add_argument(
        "--keep-if-larger",
        action="store_true",
        help="convert layers so small that tile padding makes W12 larger (the tiny demo's k/v_proj)",
    )
    p.add_argument("--max-new-tokens", type=int, default=16)
    args = p.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device

    model = load(args.model, device).eval()
    ids = torch.randint(3, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():
        ref = model(ids).logits
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=0)
    ref_tokens = model.generate(ids, **kw)

    lm_head = {"auto": None, "yes": True, "no": False}[args.lm_head]
    w12.patch(model, exclude=args.exclude, lm_head=lm_head, keep_if_larger=args.keep_if_larger, progress=True)
    print(model.w12_report)

    with torch.no_grad():
        out = model(ids).logits
    if device == "cpu":
        same = torch.equal(out.view(torch.int16), ref.view(torch.int16))
        print(f"logits bit-identical to BF16: {same}")
        if not same:
            return 1
    else:
        print(f"largest logit difference to BF16: {(out.float() - ref.float()).abs().max().item():.4g}")
    tokens = model.generate(ids, **kw)
    print("greedy tokens identical to BF16:", torch.equal(tokens, ref_tokens))

    w12.unpatch(model)
    with torch.no_grad():
        back = model(ids).logits
    print("after w12.unpatch, logits identical to the original:", torch.equal(back, ref))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
