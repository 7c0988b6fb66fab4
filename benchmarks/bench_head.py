"""Benchmark of the certified LM head (w12.CertifiedHead) against cuBLAS BF16 + argmax.

Two modes:

* GPU timing (default): random BF16 heads of the given shapes (entries N(0, 0.02²), like a trained
  head's scale), hidden states of M rows; both paths are captured in CUDA graphs and timed by event
  over many replays (median). Survivor counts are reported for two kinds of hidden states:
  ``random`` (h ~ N(0, I): pessimistic, no token stands out) and ``planted`` (h = g + c·w_t with the
  target token's logit ``--plant-z`` standard deviations above the mean, the statistic measured on a
  real model by ``--real``). Writes ``benchmarks/results/head_h200.json`` rows
  ``{"shape": [V, K], "M", "us", "us_cublas", "speedup", "survivors", ...}``.
* ``--real MODEL`` (CPU): hidden states of a real causal LM (the cached Qwen2.5-Coder GGUFs of
  benchmarks/_models.py) on real prompts, greedy-decoded, through the model's real head; reports the
  survivor counts of the reference path for each quantisation tier and the top-logit z-scores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _shape(s: str):
    v, k = s.lower().split("x")
    return int(v), int(k)


# -- real-model survivor counts (CPU) ------------------------------------------------------------


def real_hidden_states(model_name: str, n_prompts: int, new_tokens: int):
    """Final-norm hidden states (what the head sees) of a real model on real prompts, cached on disk.

    Every prompt position is kept (the model predicting the next token of real text); with
    ``new_tokens > 0`` the positions of a greedy continuation are added.
    """
    from benchmarks import _models

    cache = _models.cache_dir() / f"head_states_{model_name}_{n_prompts}_{new_tokens}.pt"
    if cache.exists():
        d = torch.load(cache)
        return d["h"], d["w"]
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _models.ensure_gguf(model_name)  # read-only use of the cached GGUF
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    prompts = []
    for ds in ("humaneval", "gsm8k"):
        prompts += _models.load_prompts(ds, n_prompts)
    states = []
    for msg in tqdm(prompts, desc="prompts"):
        ids = _models.chat_ids(tok, msg)[None]
        with torch.no_grad():
            if new_tokens > 0:
                ids = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
            full = model(ids, output_hidden_states=True)
        states.append(full.hidden_states[-1][0, :-1])  # after the final norm; the last has no next token
    h = torch.cat(states).float()
    w = model.get_output_embeddings().weight.detach().to(torch.bfloat16)
    torch.save({"h": h, "w": w}, cache)
    return h, w


def run_real(args):
    from w12.head import CertifiedHead

    t0 = time.time()
    h, w = real_hidden_states(args.real, args.prompts, args.new_tokens)
    print(f"{h.shape[0]} hidden states of {args.real} (head {list(w.shape)}) in {time.time() - t0:.0f}s")
    logits = h @ w.float().T
    z = ((logits.amax(-1) - logits.mean(-1)) / logits.std(-1)).tolist()
    rows = []
    for bits in args.bits:
        head = CertifiedHead(w, bits=bits)
        ids, surv = head.argmax(h, return_survivors=True)
        agree = (ids == logits.argmax(-1)).float().mean().item()
        surv = surv.float()
        row = {
            "model": args.real,
            "shape": list(w.shape),
            "bits": bits,
            "states": h.shape[0],
            "survivors_median": surv.median().item(),
            "survivors_mean": surv.mean().item(),
            "survivors_p90": surv.quantile(0.9).item(),
            "survivors_max": surv.max().item(),
            "agree_with_fp32_matmul": agree,
            "top_logit_z_median": statistics.median(z),
        }
        print(json.dumps(row))
        rows.append(row)
    out = Path(args.out_real)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {out}")


# -- GPU timing -----------------------------------------------------------------------------------


def _graph_time(fn, iters: int) -> float:
    """Median µs of one replay of a CUDA graph of ``fn`` (events around each replay)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(5):
        g.replay()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(times)


def planted_hidden(w: torch.Tensor, m: int, z: float, gen: torch.Generator) -> torch.Tensor:
    """h = g + c·w_t: token t's logit sits ``z`` logit standard deviations above the mean."""
    v, k = w.shape
    g = torch.randn(m, k, device=w.device, generator=gen)
    t = torch.randint(0, v, (m,), device=w.device, generator=gen)
    wt = w[t].float()
    sd = w.float().std().item() * g.norm(dim=-1, keepdim=True)  # logit sd of the random part
    c = z * sd / (wt * wt).sum(-1, keepdim=True)
    return g + c * wt


def run_gpu(args):
    from w12.head import CertifiedHead

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    rows = []
    for v, k in args.shapes:
        w = (torch.randn(v, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
        t0 = time.time()
        head = CertifiedHead(w)
        print(f"[{v}x{k}] built the certified head in {time.time() - t0:.1f}s", flush=True)
        for m in args.M:
            hid = {
                "random": torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16),
                "planted": planted_hidden(w, m, args.plant_z, gen).to(torch.bfloat16),
            }
            surv, correct = {}, True
            for name, h in hid.items():
                ids, cnt = head.argmax(h, return_survivors=True)
                ref = head.exact_scores(h).argmax(-1)
                correct &= bool((ids == ref).all())
                surv[name] = cnt.tolist()
            sweep = {}
            for z in args.z_sweep:  # survivor counts only (no timing): how they grow as the winner's lead shrinks
                cnt = head.argmax(planted_hidden(w, m, z, gen).to(torch.bfloat16), return_survivors=True)[1]
                sweep[str(z)] = statistics.median(cnt.tolist())
            h = hid["planted"]
            us = _graph_time(lambda h=h, hd=head: hd.argmax(h), args.iters)
            us_rand = _graph_time(lambda h=hid["random"], hd=head: hd.argmax(h), args.iters)
            us_cublas = _graph_time(lambda h=h, w=w: torch.argmax(h @ w.T, dim=-1), args.iters)
            row = {
                "shape": [v, k],
                "M": m,
                "us": round(us, 2),
                "us_cublas": round(us_cublas, 2),
                "speedup": round(us_cublas / us, 3),
                "survivors": statistics.median(surv["planted"]),
                "survivors_planted": surv["planted"],
                "survivors_random": surv["random"],
                "us_random_h": round(us_rand, 2),
                "screen_GBps": round(head.nbytes_screen / us / 1e3, 1),
                "cublas_GBps": round(2 * v * k / us_cublas / 1e3, 1),
                "plant_z": args.plant_z,
                "survivors_median_by_plant_z": sweep,
                "argmax_matches_exact_path": correct,
            }
            rows.append(row)
            print(
                f"[{v}x{k}] M={m:3d}  certified {us:8.1f} us ({row['screen_GBps']:6.0f} GB/s)  cuBLAS+argmax "
                f"{us_cublas:8.1f} us ({row['cublas_GBps']:6.0f} GB/s)  speedup {row['speedup']:.2f}x  survivors "
                f"planted median {row['survivors']} / random median {statistics.median(surv['random'])}  "
                f"(random-h time {us_rand:.1f} us)  exact={correct}",
                flush=True,
            )
        del head, w
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {out}")
    print("\nshape           M   us      us_cublas  speedup  survivors(planted)")
    for r in rows:
        print(
            f"{str(r['shape']):15s} {r['M']:3d} {r['us']:8.1f} {r['us_cublas']:9.1f} {r['speedup']:7.2f}x  {r['survivors']}"
        )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=_shape, nargs="+", default=[(128256, 4096), (151936, 5120)], help="heads VxK")
    p.add_argument("--M", type=int, nargs="+", default=[1, 8, 32], help="hidden-state rows per call")
    p.add_argument("--iters", type=int, default=200, help="timed graph replays per case (median reported)")
    p.add_argument("--plant-z", type=float, default=9.25, help="planted target logit, in logit std devs above mean")
    p.add_argument("--z-sweep", type=float, nargs="*", default=[4, 6, 8, 12, 16, 24], help="plant z for counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/head_h200.json"), help="JSON output (GPU mode)")
    p.add_argument("--real", default=None, help="CPU mode: a cached model name (benchmarks/_models.py MODELS)")
    p.add_argument("--prompts", type=int, default=3, help="--real: prompts per dataset (humaneval, gsm8k)")
    p.add_argument(
        "--new-tokens", type=int, default=0, help="--real: greedy tokens generated per prompt (0: prompts only)"
    )
    p.add_argument("--bits", type=int, nargs="+", default=[8, 6, 4], help="--real: quantisation tiers to count")
    p.add_argument("--out-real", default=str(ROOT / "benchmarks/results/head_survivors_cpu.json"))
    args = p.parse_args(argv)
    if args.real:
        run_real(args)
    else:
        if not torch.cuda.is_available():
            p.error("GPU mode needs CUDA (use --real MODEL for the CPU survivor counts)")
        run_gpu(args)


if __name__ == "__main__":
    main()
