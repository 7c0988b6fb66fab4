"""End-to-end decode speed of W12 vs BF16 in Hugging Face Transformers (static cache, CUDA graphs).

One Llama-3.1-8B-configured model with random BF16 weights (std 0.02) is measured as each side of
``--sides`` (default ``bf16,bf16_fused,w12``), converted in place from one side to the next, so all
sides hold the same weights and run the same code except the linear layers:

* ``bf16``: the stock Transformers model (q/k/v and gate/up as five GEMMs per layer);
* ``bf16_fused``: the same after ``w12.fuse_projections`` (one GEMM for q/k/v, one for gate/up):
  the fair BF16 baseline for the fused W12 model;
* ``w12_unfused``: ``w12.patch(model, fuse=False)``;
* ``w12``: ``w12.patch(model)`` as users call it (fused). ``speedup`` is W12 over stock BF16,
  ``speedup_vs_bf16_fused`` W12 over fused BF16.

For each batch size and side:

* ``step_ms`` (the headline): one greedy decode step (forward + argmax) compiled with
  ``torch.compile(mode="reduce-overhead")`` (CUDA graphs) on a ``StaticCache``, timed over
  ``--new-tokens`` consecutive steps after a 512-token prefill; tokens/s = batch / step time.
* ``step_ms_uncompiled`` (``--uncompiled-graph``): the same step, eager, captured once into a
  ``torch.cuda.CUDAGraph`` and replayed (no Python in the loop).
* ``gemm_ms``: every linear layer of one step (same shapes, same order) replayed as one CUDA
  graph: the step's GEMM share; the rest is attention, norms, rotary, sampling.
* ``generate()`` as users call it (batch 1): ``model.generate(..., cache_implementation="static")``,
  which compiles the decode step itself; wall time of prefill + all new tokens.

Memory: weight bytes of BF16 and W12 (fusion adds none), and how many more KV-cache tokens fit in the same GPU memory
(the budget is ``--mem-fraction`` of the device minus the weights; activations are ignored).

``--smoke`` runs a tiny config on the CPU (eager, no graphs) to check the script end to end.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _configs, also when imported by tests
from _configs import HF_CONFIGS  # noqa: E402

LLAMA_8B = {k: v for k, v in HF_CONFIGS["llama-3.1-8b"].items() if k != "family"}
SMOKE = dict(  # head_dim 64: k/v fill whole 128-row W12 tiles, so q/k/v fuse as in the real config
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    tie_word_embeddings=False,
)


_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


def cache_kwarg(model) -> str:
    """Transformers 5.2x renamed ``past_key_values`` to ``cache`` (the old name warns); use what the model takes."""
    import inspect

    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def build_model(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(SMOKE if args.smoke else LLAMA_8B)
    if args.layers:
        kw["num_hidden_layers"] = args.layers
    config = LlamaConfig(**kw)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def weight_bytes(model) -> int:
    # Parameters and buffers as held (not state_dict(): that would copy W12 records back to layout 0).
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_step(model, cache):
    key = cache_kwarg(model)

    def step(tok, pos):
        out = model(input_ids=tok, cache_position=pos, **{key: cache}, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :].argmax(-1, keepdim=True)

    return step


@torch.no_grad()
def prefill(model, cache, prompt):
    pos = torch.arange(prompt.shape[1], device=prompt.device)
    out = model(input_ids=prompt, cache_position=pos, **{cache_kwarg(model): cache}, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :].argmax(-1, keepdim=True)


@torch.no_grad()
def time_compiled_steps(step, first_tok, start, n_steps, device, compile_mode):
    """Runs ``n_steps`` greedy steps through the compiled step; returns (ms per step, tokens [n, B])."""
    tok = first_tok.clone()
    pos = torch.tensor([start], device=device)
    fn = step
    if compile_mode:
        fn = torch.compile(step, mode=compile_mode, fullgraph=True)
        try:
            fn(tok, pos)
        except Exception as e:  # a graph break somewhere in this Transformers version: allow it, say so
            log(f"fullgraph compile failed ({type(e).__name__}: {str(e)[:200]}); compiling with graph breaks")
            torch._dynamo.reset()
            fn = torch.compile(step, mode=compile_mode)
    for _ in range(3):  # compile, record, warm (these steps write cache slots the timed run rewrites)
        if device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        fn(tok, pos)
    toks = torch.empty((n_steps, tok.shape[0]), dtype=torch.long, device=device)
    sync(device)
    t0 = time.perf_counter()
    for i in range(n_steps):
        if device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        out = fn(tok, pos)
        toks[i] = out[:, 0]
        tok.copy_(out)
        pos.add_(1)
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / n_steps, toks


@torch.no_grad()
def time_graph(fn, replays, device) -> float:
    """Captures ``fn`` (eager) into one CUDA graph and returns ms per replay."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    sync(device)
    return start.elapsed_time(end) / replays


@torch.no_grad()
def time_eager(fn, reps, device) -> float:
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / reps


def gemm_fn(model, batch, device):
    """All linear layers of one decode step, in order, on fixed inputs [batch, 1, K]."""
    from w12.nn import W12Linear

    lins = [m for m in model.modules() if isinstance(m, (nn.Linear, W12Linear))]
    xs = {}
    for m in lins:
        if m.in_features not in xs:
            xs[m.in_features] = torch.randn(batch, 1, m.in_features, device=device).to(torch.bfloat16)

    def run():
        for m in lins:
            m(xs[m.in_features])

    return run


def cudagraph_skips() -> int:
    """How often inductor has declined to use CUDA graphs in this process (0 when not counted)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["inductor"].get("cudagraph_skips", 0))
    except Exception:
        return 0


def save_partial(args, side: str, res: dict) -> None:
    """Each measured row goes to ``<out>.partial.json`` at once, so a run cut short by a time
    limit still leaves its numbers (under a name that says they are incomplete)."""
    path = args.partial_path
    data = json.loads(path.read_text()) if path.exists() else {}
    data[side] = {str(k): {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in res.items()}
    path.write_text(json.dumps(data, indent=2) + "\n")


def measure_side(model, args, device, side: str) -> dict:
    from transformers import StaticCache

    on_gpu = device.type == "cuda"
    res = {}
    for batch in args.batches:
        cache = StaticCache(config=model.config, max_cache_len=args.prompt_len + args.new_tokens + 8)
        gen = torch.Generator(device="cpu").manual_seed(args.seed + batch)
        prompt = torch.randint(0, model.config.vocab_size, (batch, args.prompt_len), generator=gen).to(device)
        first = prefill(model, cache, prompt)
        step = make_step(model, cache)
        row = {"batch": batch}
        mode = args.compile_mode if args.compile else None
        t = time.perf_counter()
        row["step_ms"], toks = time_compiled_steps(step, first, args.prompt_len, args.new_tokens, device, mode)
        row["tokens"] = toks[:, 0].tolist()
        log(
            f"{side} batch {batch}: step {row['step_ms']:.3f} ms ({'compiled ' + mode if mode else 'eager'}; "
            f"{time.perf_counter() - t:.0f} s with compilation)"
        )
        if on_gpu and args.uncompiled_graph:
            tok = first.clone()
            pos = torch.tensor([args.prompt_len], device=device)

            def eager_step(tok=tok, pos=pos, step=step):
                tok.copy_(step(tok, pos))
                pos.add_(1)

            try:
                row["step_ms_uncompiled"] = time_graph(eager_step, min(args.new_tokens, 64), device)
            except Exception as e:  # an eager step that syncs the host cannot be captured; say so
                row["step_ms_uncompiled"] = None
                row["uncompiled_error"] = f"{type(e).__name__}: {e}"[:300]
        elif on_gpu:
            row["step_ms_uncompiled"] = None
        if on_gpu:
            row["gemm_ms"] = time_graph(gemm_fn(model, batch, device), 50, device)
        else:
            pos = torch.tensor([args.prompt_len])
            row["step_ms_uncompiled"] = time_eager(lambda step=step, first=first, pos=pos: step(first, pos), 3, device)
            row["gemm_ms"] = time_eager(gemm_fn(model, batch, device), 3, device)
        row["tok_s"] = batch * 1e3 / row["step_ms"]
        row["cudagraph_skips"] = cudagraph_skips()
        if on_gpu and mode == "reduce-overhead" and row["cudagraph_skips"]:
            log(
                f"warning: inductor skipped CUDA graphs {row['cudagraph_skips']} times so far (see TORCH_LOGS=perf_hints)"
            )
        log(f"{side} batch {batch}: gemm {row['gemm_ms']:.3f} ms, uncompiled graph step {row['step_ms_uncompiled']}")
        res[batch] = row
        save_partial(args, side, res)
        del cache
        if on_gpu:
            torch.cuda.empty_cache()
    if args.generate:
        res["generate"] = measure_generate(model, args, device, side)
        save_partial(args, side, res)
    return res


@torch.no_grad()
def measure_generate(model, args, device, side) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=gen).to(device)
    kw = dict(
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        do_sample=False,
        cache_implementation="static",
        pad_token_id=0,
    )
    if device.type != "cuda":
        kw["disable_compile"] = True
    times = []
    for _ in range(2):  # the first call compiles
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(prompt, **kw)
        sync(device)
        times.append(time.perf_counter() - t0)
    new = out.shape[1] - prompt.shape[1]
    r = {"seconds": times[-1], "first_call_seconds": times[0], "new_tokens": new, "tok_s": new / times[-1]}
    log(f"{side} generate(): {r['tok_s']:.1f} tok/s end to end (prefill + {new} tokens; first call {times[0]:.0f} s)")
    return r


def kv_bytes_per_token(config) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2


# Measured in this order whatever --sides says: each side converts the one model in place from the
# previous one (same weights throughout; one model's memory on the GPU at a time).
SIDES = ("bf16", "bf16_fused", "w12_unfused", "w12")
SIDE_NAMES = {"bf16": "BF16", "bf16_fused": "BF16 fused", "w12_unfused": "W12 unfused", "w12": "W12"}


def convert_to(model, side: str, device, info: dict) -> None:
    """Turns the model into ``side`` in place (see SIDES); records the seconds spent in ``info``."""
    import w12

    sync(device)
    t = time.perf_counter()
    if side == "bf16_fused":
        info["fused_groups"][side] = w12.fuse_projections(model)
        info["fuse_seconds"][side] = time.perf_counter() - t
    elif side == "w12_unfused" or (side == "w12" and not hasattr(model, "w12_report")):
        w12.patch(model, progress=True, fuse=side == "w12")  # patch unfuses BF16 groups before converting
        sync(device)
        info["patch_seconds"] = time.perf_counter() - t
        info["fused_groups"][side] = model.w12_report.fused_groups
        log(f"w12.patch: {info['patch_seconds']:.1f} s; {model.w12_report.summary().splitlines()[0]}")
    elif side == "w12":  # already patched without fusion
        info["fused_groups"][side] = w12.fuse_projections(model, bf16=False)
        sync(device)
        info["fuse_seconds"][side] = time.perf_counter() - t
    if side != "bf16":
        log(f"{side}: {info['fused_groups'][side]} fused projection groups")


def first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def ratio(a, b):
    return None if a is None or b is None else a / b


def build_rows(args, res: dict, wb: dict) -> list[dict]:
    def get(side, batch, key):
        return res[side][batch][key] if side in res else None

    wb_w12 = wb.get("w12", wb.get("w12_unfused"))
    rows = []
    for b in args.batches:
        tok = {s: get(s, b, "tok_s") for s in SIDES}
        toks = {s: get(s, b, "tokens") for s in SIDES}
        row = {
            "batch": b,
            "tok_s_w12": tok["w12"],
            "tok_s_bf16": tok["bf16"],
            "speedup": ratio(tok["w12"], tok["bf16"]),  # W12 (fused, as w12.patch leaves it) over stock BF16
            "weight_gb_w12": None if wb_w12 is None else wb_w12 / 1e9,
            "weight_gb_bf16": wb["bf16"] / 1e9,
            "tok_s_bf16_fused": tok["bf16_fused"],
            "speedup_vs_bf16_fused": ratio(tok["w12"], tok["bf16_fused"]),
        }
        if "w12_unfused" in res:
            row["tok_s_w12_unfused"] = tok["w12_unfused"]
            row["speedup_w12_unfused"] = ratio(tok["w12_unfused"], tok["bf16"])
            row["fusion_gain_w12"] = ratio(tok["w12"], tok["w12_unfused"])
        if "bf16_fused" in res:
            row["fusion_gain_bf16"] = ratio(tok["bf16_fused"], tok["bf16"])
        for side in SIDES:
            if side not in res:
                continue
            r = res[side][b]
            row[f"step_ms_{side}"] = r["step_ms"]
            row[f"gemm_ms_{side}"] = r["gemm_ms"]
            row[f"rest_ms_{side}"] = r["step_ms"] - r["gemm_ms"]
            row[f"step_ms_uncompiled_{side}"] = r["step_ms_uncompiled"]
            row[f"cudagraph_skips_{side}"] = r["cudagraph_skips"]
        # Token streams against stock BF16 (row 0 of the batch); None = identical (or not measured).
        row["greedy_first_divergence_row0"] = (
            first_divergence(toks["bf16"], toks["w12"]) if toks["bf16"] and toks["w12"] else None
        )
        for side in ("bf16_fused", "w12_unfused"):
            if toks["bf16"] and toks[side]:
                row[f"greedy_first_divergence_row0_{side}"] = first_divergence(toks["bf16"], toks[side])
        rows.append(row)
    return rows


def print_table(rows, sides) -> None:
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    names = "/".join(SIDE_NAMES[s] for s in sides)
    print(f"columns per side: {names}")
    print(
        f"{'batch':>5} {'tok/s':>28} {'W12/BF16':>9} {'W12/BF16f':>9} | {'step ms':>28} {'GEMM ms':>28} {'rest ms':>28}"
    )
    for r in rows:
        per = {k: "/".join(fmt(r.get(f"{k}_{s}"), ".2f") for s in sides) for k in ("tok_s", "step_ms", "gemm_ms")}
        rest = "/".join(fmt(r.get(f"rest_ms_{s}"), ".3f") for s in sides)
        print(
            f"{r['batch']:>5} {per['tok_s']:>28} {fmt(r['speedup'], '.3f'):>9} {fmt(r['speedup_vs_bf16_fused'], '.3f'):>9}"
            f" | {per['step_ms']:>28} {per['gemm_ms']:>28} {rest:>28}"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny config, short run (works on the CPU)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32; smoke 1,2)")
    p.add_argument(
        "--sides",
        default="bf16,bf16_fused,w12",
        help=f"comma-separated sides to measure, from {','.join(SIDES)} (always measured in that order)",
    )
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 512; smoke 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="decode steps timed (default 256; smoke 4)")
    p.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="time the eager step instead")
    p.add_argument("--compile-mode", default="reduce-overhead", help="torch.compile mode (default reduce-overhead)")
    p.add_argument(
        "--uncompiled-graph",
        action="store_true",
        help="also capture the eager (uncompiled) step in a CUDA graph; fails if the model syncs the host",
    )
    p.add_argument("--no-generate", dest="generate", action="store_false", help="skip the generate() measurement")
    p.add_argument("--mem-fraction", type=float, default=0.9, help="share of GPU memory for weights + KV cache")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/e2e_hf_h200.json; smoke: _smoke)")
    args = p.parse_args(argv)

    wanted = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SIDES))
    if unknown or not wanted:
        p.error(f"--sides: unknown {unknown}; choose from {', '.join(SIDES)}")
    sides = [s for s in SIDES if s in wanted]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not args.smoke and device.type != "cuda":
        p.error("the full benchmark needs a CUDA GPU; use --smoke on the CPU")
    if args.smoke and device.type == "cpu":
        args.compile = False  # CPU inductor would measure a C++ compiler, not W12
    args.batches = [int(b) for b in (args.batches or ("1,2" if args.smoke else "1,8,32")).split(",")]
    args.prompt_len = args.prompt_len or (16 if args.smoke else 512)
    args.new_tokens = args.new_tokens or (4 if args.smoke else 256)
    name = "e2e_hf_smoke.json" if args.smoke else "e2e_hf_h200.json"
    out_path = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / name
    out_path.parent.mkdir(parents=True, exist_ok=True)
    args.partial_path = out_path.with_suffix(".partial.json")
    args.partial_path.unlink(missing_ok=True)

    from w12 import cuda_ops

    kernels = device.type == "cuda" and cuda_ops.available()
    log(
        f"device {device}{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}; "
        f"W12 kernels {'available' if kernels else 'NOT available: the W12 side runs the reference path'}; "
        f"sides {', '.join(sides)}"
    )
    model = build_model(args, device)
    wb = {"bf16": weight_bytes(model)}
    log(f"model built: {wb['bf16'] / 1e9:.2f} GB of BF16 weights")
    info = {"patch_seconds": None, "fuse_seconds": {}, "fused_groups": {}}
    res = {}
    for side in sides:
        convert_to(model, side, device, info)
        wb[side] = weight_bytes(model)
        torch._dynamo.reset()  # the previous side's graphs hold references to replaced weights
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        res[side] = measure_side(model, args, device, side)

    per_tok = kv_bytes_per_token(model.config)
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    budget = total * args.mem_fraction if total else None
    wb_w12 = wb.get("w12", wb.get("w12_unfused"))
    kv_bf16 = int((budget - wb["bf16"]) // per_tok) if budget else None
    kv_w12 = int((budget - wb_w12) // per_tok) if budget and wb_w12 else None

    rows = build_rows(args, res, wb)
    result = {
        "bench": "e2e_hf",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "smoke": args.smoke,
        "kernels": kernels,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "sides": sides,
        "config": {
            "layers": model.config.num_hidden_layers,
            "hidden": model.config.hidden_size,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "compile": args.compile_mode if args.compile else None,
        },
        "patch_seconds": info["patch_seconds"],
        "fuse_seconds": info["fuse_seconds"],
        "fused_groups": info["fused_groups"],
        "kv": {
            "bytes_per_token": per_tok,
            "mem_fraction": args.mem_fraction,
            "tokens_bf16": kv_bf16,
            "tokens_w12": kv_w12,
            "extra_tokens": (kv_w12 - kv_bf16) if kv_w12 is not None else None,
            "gain": (kv_w12 / kv_bf16) if kv_w12 is not None and kv_bf16 > 0 else None,
        },
        "generate": {side: res[side].get("generate") for side in sides},
        "rows": rows,
    }
    print()
    print_table(rows, sides)
    if wb_w12:
        print(
            f"weights: W12 {wb_w12 / 1e9:.2f} GB vs BF16 {wb['bf16'] / 1e9:.2f} GB "
            f"({100 * (1 - wb_w12 / wb['bf16']):.1f} % smaller); patch took {info['patch_seconds']:.1f} s"
        )
    if kv_w12 is not None:
        print(
            f"KV cache in {args.mem_fraction:.0%} of {total / 2**30:.0f} GiB: {kv_bf16} tokens with BF16 weights, "
            f"{kv_w12} with W12 (+{kv_w12 - kv_bf16}, {kv_w12 / kv_bf16:.2f}x)"
        )
    for side in sides:
        g = result["generate"][side]
        if g:
            print(
                f"generate() {side}: {g['tok_s']:.1f} tok/s end to end (batch 1, prefill {args.prompt_len} + {g['new_tokens']})"
            )
    ratios = [r[k] for r in rows for k in ("speedup", "speedup_vs_bf16_fused") if r.get(k) is not None]
    if any(math.isnan(v) for v in ratios):
        print("error: NaN speedup", file=sys.stderr)
        return 1
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    args.partial_path.unlink(missing_ok=True)
    log(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
