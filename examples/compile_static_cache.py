"""A W12 model under ``torch.compile`` with a static KV cache (CUDA graphs on a GPU).

    python examples/compile_static_cache.py                      # tiny random Llama, CPU, traced
    python examples/compile_static_cache.py --model ~/llama-3.1-8b-w12 --device cuda

Two ways, both shown:
1. ``model.generate(..., cache_implementation="static", compile_config=CompileConfig(...))``:
   Transformers compiles the decode step itself (``mode="reduce-overhead"`` = CUDA graphs).
2. A hand-written decode loop: prefill into a ``StaticCache``, then one compiled function per
   step (forward + argmax), the pattern to use inside your own serving loop.

The ``w12::linear`` op has a fake (meta) implementation, so Dynamo traces through W12Linear
without graph breaks (``fullgraph=True``). On the CPU the example compiles with the
``aot_eager`` backend (it checks the trace without needing a C++ toolchain or CUDA graphs); the
compiled tokens must equal the eager ones there.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import w12


def load(model_path: Path | None, device: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if model_path is not None:  # a W12 folder, or a BF16 one that is patched after loading
        model = AutoModelForCausalLM.from_pretrained(model_path, device_map=device)
    else:
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
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(device)
    if getattr(model, "w12_report", None) is None and not getattr(model, "is_quantized", False):
        w12.patch(model, keep_if_larger=model_path is None)
    return model.eval()


def cache_kwarg(model) -> str:
    """Transformers 5.2x renamed ``past_key_values`` to ``cache`` (the old name warns); use what the model takes."""
    import inspect

    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


@torch.no_grad()
def decode_loop(model, ids, new_tokens: int, backend: str | None, mode: str | None):
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens)
    CACHE_KW = cache_kwarg(model)
    pos = torch.arange(ids.shape[1], device=ids.device)
    tok = model(input_ids=ids, cache_position=pos, **{CACHE_KW: cache}).logits[:, -1:].argmax(-1)

    def step(tok, pos):
        logits = model(input_ids=tok, cache_position=pos, **{CACHE_KW: cache}).logits
        return logits[:, -1:].argmax(-1)

    if backend or mode:
        step = torch.compile(step, fullgraph=True, **({"backend": backend} if backend else {"mode": mode}))
    out = [tok]
    pos = pos[-1:] + 1
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        if ids.is_cuda:
            torch.compiler.cudagraph_mark_step_begin()
        tok = step(tok, pos).clone()
        out.append(tok)
        pos = pos + 1
    if ids.is_cuda:
        torch.cuda.synchronize()
    return torch.cat(out, dim=1)[0], time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a W12 (or BF16) model folder (default: a tiny random Llama)")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto")
    p.add_argument("--new-tokens", type=int, default=16)
    args = p.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    from transformers import CompileConfig

    model = load(args.model, device)
    ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3)).to(device)
    gen_kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)

    eager = model.generate(ids, cache_implementation="static", disable_compile=True, **gen_kw)[0, ids.shape[1] :]
    if device == "cuda":
        cc = CompileConfig(mode="reduce-overhead", fullgraph=True)
        for attempt in ("first call: compiles and captures", "second call: replays"):
            t0 = time.perf_counter()
            out = model.generate(ids, cache_implementation="static", compile_config=cc, **gen_kw)
            torch.cuda.synchronize()
            print(f"generate(static cache, reduce-overhead), {attempt}: {time.perf_counter() - t0:.2f} s")
        print("tokens:", out[0, ids.shape[1] :].tolist())
        loop, secs = decode_loop(model, ids, args.new_tokens, None, "reduce-overhead")
    else:
        loop, secs = decode_loop(model, ids, args.new_tokens, "aot_eager", None)
    print(f"hand-written compiled decode loop: {args.new_tokens} tokens, {secs:.2f} s for the decode steps")
    print("eager tokens   :", eager.tolist())
    print("compiled tokens:", loop.tolist())
    if device == "cpu" and not torch.equal(eager, loop):
        print("error: on the CPU the compiled loop must reproduce the eager tokens")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
