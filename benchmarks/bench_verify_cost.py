"""Verify-step cost curve c(N) = T(N)/T(1) on the GPU, and the engine's replayed wall-clock speedup.

Part 1, cost curve: random-weight models with the Qwen2.5-Coder-1.5B and Llama-3.1-8B configurations,
BF16 and W12 (`w12.patch(model)`, imported lazily; its rows are skipped with a message if missing).
A context of `--context` tokens is prefilled into a static KV cache, then a verify forward over R rows
(the root + R-1 tree nodes, tree mask, positions by depth) is captured in a CUDA graph and timed;
R = 1 is the autoregressive step.

Part 2, replayed speedup: the acceptance traces recorded by bench_tau.py on the CPU (tokens committed
per step, per prompt and tree) drive the real engine pieces on the GPU: a random-weight drafter with
the Qwen2.5-Coder-0.5B configuration drafts (ModelDrafter, real cost), the tree is built, the target
verifies the tree's node count in its CUDA graph, the step commits exactly as many tokens as the
trace says (the tree is given a spine deep enough), and the drafter is updated. Wall-clock per
token against the autoregressive loop (1-row graphed verify + argmax + commit) is the measured
speedup, reported next to the predicted tau(N)/c(N).

`--quick` (< 4 min on an H200) trims the row counts, repetitions and traces; `--smoke` runs tiny
configurations on the CPU to test the script. JSON goes to benchmarks/results/verify_cost_h200.json
(`--out` to change; smoke runs write verify_cost_smoke.json in the temp directory).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _configs, also when imported by tests
from _configs import HF_CONFIGS  # noqa: E402

from spec_engine import BestFirstTree, ChainTree, ModelDrafter  # noqa: E402
from spec_engine.graphs import StaticVerifier  # noqa: E402
from spec_engine.tree import TreeBatch  # noqa: E402
from spec_engine.verify import CausalLM, accept, commit  # noqa: E402

CONFIGS = HF_CONFIGS  # real configs (random weights) and tiny ones for --smoke


def build_model(name: str, dtype, device):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    spec = dict(CONFIGS[name])
    family = spec.pop("family")
    cfg_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[family]
    spec["max_position_embeddings"] = 32768
    cfg = cfg_cls(**spec)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def try_w12_patch(model):
    """Returns (patched model, None) or (None, reason) — W12 is built by another part of the project."""
    try:
        import w12
    except Exception as exc:  # pragma: no cover - import failure is reported, not fatal
        return None, f"import w12 failed: {exc}"
    patch = getattr(w12, "patch", None)
    if patch is None:
        try:
            from w12.patch import patch  # type: ignore
        except Exception as exc:
            return None, f"w12.patch is not available ({exc}); W12 rows skipped"
    try:
        out = patch(model)
        return (out if out is not None else model), None
    except Exception as exc:
        return None, f"w12.patch(model) failed: {type(exc).__name__}: {exc}"


def synthetic_tree(nodes: int, spine: int, device, vocab: int) -> TreeBatch:
    """`nodes` nodes: a chain of depth min(spine, nodes) first (the accepted path of a replayed step),
    the rest as a bushy second level (the verify cost depends on the node count, not the shape)."""
    spine = min(spine, nodes)
    parents = [i - 1 for i in range(spine)] + [-1 if spine == 0 else (i % spine) - 1 for i in range(spine, nodes)]
    depths = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    g = torch.Generator().manual_seed(nodes)
    t = lambda x: torch.tensor([x], dtype=torch.long, device=device)  # noqa: E731
    return TreeBatch(
        t(torch.randint(0, vocab, (nodes,), generator=g).tolist()),
        t(parents),
        t(depths),
        torch.zeros(1, nodes, device=device),
        torch.ones(1, nodes, dtype=torch.bool, device=device),
        nodes,
    )


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_verify(sv: StaticVerifier, rows: int, reps: int, vocab: int) -> float:
    """Seconds per verify of `rows` rows (read-only: the committed cache does not move)."""
    dev = sv.lm.device
    tree = synthetic_tree(rows - 1, rows - 1, dev, vocab)
    root = torch.zeros(1, dtype=torch.long, device=dev)
    for _ in range(3):
        sv.verify(root, tree)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        sv.verify(root, tree)
    sync(dev)
    return (time.perf_counter() - t0) / reps


def cost_curve(model, rows_list, context, reps, label) -> dict:
    lm = CausalLM(model)
    vocab = model.config.vocab_size
    sv = StaticVerifier(lm, capacity=context + max(rows_list) + 8)
    sv.prefill(torch.randint(0, vocab, (context,), device=lm.device))
    times = {}
    for r in tqdm(rows_list, desc=f"cost {label}", unit="shape"):
        times[r] = time_verify(sv, r, reps, vocab)
    t1 = times[1]
    return {
        "rows": rows_list,
        "t_us": [times[r] * 1e6 for r in rows_list],
        "c": [times[r] / t1 for r in rows_list],
        "graph_errors": sv.graph_errors,
        "graphs": sv.use_graphs,
    }


def load_traces(path: Path, trees: list[str], max_prompts: int) -> dict:
    """{tree label: [(prompt_len, [tokens per step]), ...]} from bench_tau.py's JSON."""
    data = json.loads(path.read_text())
    out = {}
    for tr in data.get("traces", []):
        label = f"{tr['tree']}/{tr['nodes']}"
        if label in trees and len(out.setdefault(label, [])) < max_prompts:
            out[label].append((tr["prompt_len"], tr["steps"]))
    return out


def make_tree(label: str, depth: int):
    name, n = label.split("/")
    return ChainTree(int(n)) if name == "chain" else BestFirstTree(int(n), max_depth=depth)


@torch.no_grad()
def replay(target, drafter_model, traces: dict, depth: int, vocab: int) -> dict:
    """Engine wall-clock per token on the recorded traces vs the autoregressive loop."""
    dev = target.device
    lm = CausalLM(target)
    need = max(pl + sum(steps) for trs in traces.values() for pl, steps in trs) + 200
    sv = StaticVerifier(lm, capacity=need)
    drafter = ModelDrafter(drafter_model)
    results = {}
    empty = synthetic_tree(0, 0, dev, vocab)
    for label, trs in traces.items():
        tree_shape = make_tree(label, depth)
        spine_tree = synthetic_tree(tree_shape.nodes, tree_shape.nodes, dev, vocab)
        spine_rows = list(range(tree_shape.nodes + 1))
        # Warm up outside the timed loops: graph capture for both shapes, the drafter's first calls.
        warm = torch.randint(0, vocab, (16,), device=dev)
        sv.cache.length = 0
        sv.prefill(warm[:-1])
        sv.verify(warm[-1:], empty)
        sv.verify(warm[-1:], spine_tree)
        drafter.reset(warm)
        tree_shape.build([drafter.propose(tree_shape.draft_request())])
        spec_s = ar_s = 0.0
        tokens = steps_n = 0
        for prompt_len, steps in tqdm(trs, desc=f"replay {label}", unit="prompt"):
            prompt = torch.randint(0, vocab, (prompt_len,), device=dev)
            for mode in ("ar", "spec"):
                sv.cache.length = 0
                sv.prefill(prompt[:-1])
                root = prompt[-1:].clone()
                drafter.reset(prompt)
                sync(dev)
                t0 = time.perf_counter()
                if mode == "ar":
                    for _ in range(sum(steps)):
                        out = sv.verify(root, empty)
                        tok = out.argmax[0, :1]
                        int(tok)  # the host needs the token each step (stop checks), as in a real loop
                        commit(sv.cache, out.base, [0])
                        root = tok
                else:
                    for n_new in steps:
                        tree_shape.build([drafter.propose(tree_shape.draft_request())])
                        out = sv.verify(root, spine_tree)
                        accept(spine_tree, out)  # the real acceptance work and its sync ...
                        rows = spine_rows[:n_new]  # ... but the trace decides what is committed
                        commit(sv.cache, out.base, rows)
                        new = spine_tree.tokens[0, : n_new - 1].tolist() + [int(out.argmax[0, rows[-1]])]
                        drafter.commit(new)
                        root = torch.tensor(new[-1:], device=dev)
                sync(dev)
                dt = time.perf_counter() - t0
                if mode == "ar":
                    ar_s += dt
                else:
                    spec_s += dt
                    tokens += sum(steps)
                    steps_n += len(steps)
        results[label] = {
            "prompts": len(trs),
            "tau": tokens / max(1, steps_n),
            "ar_ms_per_token": 1e3 * ar_s / max(1, tokens),
            "spec_ms_per_token": 1e3 * spec_s / max(1, tokens),
            "speedup": ar_s / max(spec_s, 1e-12),
        }
    return {"per_tree": results, "graph_errors": sv.graph_errors}


def smoke_traces(trees: list[str]) -> dict:
    g = torch.Generator().manual_seed(0)
    out = {}
    for label in trees:
        n = int(label.split("/")[1])
        steps = [int(torch.randint(1, min(n, 8) + 2, (1,), generator=g)) for _ in range(6)]
        out[label] = [(12, steps), (5, steps[::-1])]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes/reps/traces: < 4 min on an H200")
    ap.add_argument("--smoke", action="store_true", help="tiny configs on the CPU (tests the script)")
    ap.add_argument("--models", nargs="*", default=None, help=f"cost-curve configs (known: {sorted(CONFIGS)})")
    ap.add_argument("--context", type=int, default=None, help="tokens in the KV cache before verify (default 512)")
    ap.add_argument("--reps", type=int, default=None, help="timed verifies per shape (default 50, quick 20)")
    ap.add_argument("--no-w12", action="store_true", help="skip the W12 rows")
    ap.add_argument(
        "--w12-models",
        nargs="*",
        default=None,
        help="configs that also get W12 rows (default: all of --models; w12.patch of the 8B on the GPU takes < 1 s)",
    )
    ap.add_argument("--tau-json", default=str(Path(__file__).parent / "results" / "tau_cpu.json"))
    ap.add_argument("--replay-trees", nargs="*", default=["chain/8", "best-first/16", "best-first/32", "best-first/64"])
    ap.add_argument("--replay-prompts", type=int, default=None, help="traces per tree (default 8, quick 3)")
    ap.add_argument("--depth", type=int, default=8, help="drafting depth of the replayed trees (as in bench_tau)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    smoke = args.smoke
    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    if device.type != "cuda" and not smoke:
        print("no CUDA device: use --smoke for the CPU test run", file=sys.stderr)
        return 2
    dtype = torch.float32 if smoke else torch.bfloat16
    models = args.models or (["tiny-qwen2", "tiny-llama"] if smoke else ["qwen2.5-coder-1.5b", "llama-3.1-8b"])
    pair = ("tiny-qwen2", "tiny-qwen2") if smoke else ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    rows_list = [1, 2, 4, 8, 16, 32, 64, 128]
    extra = [9, 17, 33, 65]  # root + 8/16/32/64 nodes: the tree sizes of bench_tau
    if args.quick or smoke:
        rows_list = [1, 2, 4, 8, 16, 32, 64, 128]
    rows_list = sorted(set(rows_list + extra))
    context = args.context or (32 if smoke else 512)
    reps = args.reps or (3 if smoke else (20 if args.quick else 50))
    n_replay = args.replay_prompts or (2 if smoke else (3 if args.quick else 8))
    default_out = (
        Path(tempfile.gettempdir()) / "verify_cost_smoke.json"
        if smoke
        else Path(__file__).parent / "results" / "verify_cost_h200.json"
    )
    out_path = Path(args.out or default_out)
    torch.manual_seed(0)

    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "context": context,
        "reps": reps,
        "dtype": str(dtype),
        "cost": {},
        "replay": {},
        "notes": [],
    }
    variants = ["bf16"] + ([] if args.no_w12 else ["w12"])
    w12_models = args.w12_models
    if w12_models is None:
        w12_models = models
    for name in models:
        for var in variants:
            if var == "w12" and name not in w12_models:
                result["notes"].append(f"{name} w12 not run (--w12-models)")
                continue
            model = build_model(name, dtype, device)
            if var == "w12":
                t0 = time.perf_counter()
                model, why = try_w12_patch(model)
                if model is None:
                    print(f"[{name} w12] skipped: {why}")
                    result["notes"].append(f"{name} w12 skipped: {why}")
                    continue
                result.setdefault("w12_patch_seconds", {})[name] = time.perf_counter() - t0
            result["cost"][f"{name}/{var}"] = cost_curve(model, rows_list, context, reps, f"{name}/{var}")
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()

    # Part 2: replay the CPU acceptance traces.
    if smoke:
        traces = smoke_traces(args.replay_trees)
    elif Path(args.tau_json).exists():
        traces = load_traces(Path(args.tau_json), args.replay_trees, n_replay)
    else:
        traces = {}
        result["notes"].append(f"{args.tau_json} missing: run benchmarks/bench_tau.py first; replay skipped")
    if traces:
        for var in variants:
            target = build_model(pair[0], dtype, device)
            if var == "w12":
                target, why = try_w12_patch(target)
                if target is None:
                    result["notes"].append(f"replay w12 skipped: {why}")
                    continue
            drafter_model = build_model(pair[1], dtype, device)
            result["replay"][var] = replay(target, drafter_model, traces, args.depth, target.config.vocab_size)
            del target, drafter_model

    # Side by side: predicted tau/c vs measured replay speedup.
    summary = []
    for var, rep in result["replay"].items():
        cost = result["cost"].get(f"{pair[0]}/{var}")
        for label, r in rep["per_tree"].items():
            nodes = int(label.split("/")[1])
            c = None
            if cost and (nodes + 1) in cost["rows"]:
                c = cost["c"][cost["rows"].index(nodes + 1)]
            summary.append(
                {
                    "variant": var,
                    "tree": label,
                    "tau": r["tau"],
                    "c": c,
                    "predicted_speedup": (r["tau"] / c) if c else None,
                    "replayed_speedup": r["speedup"],
                }
            )
    result["summary"] = summary
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1))

    for key, cv in result["cost"].items():
        print(f"\n{key}: T(R) and c(R) = T(R)/T(1), context {context}, graphs={cv['graphs']}")
        for r, t, c in zip(cv["rows"], cv["t_us"], cv["c"]):
            print(f"  R={r:4d}  {t:9.1f} us  c={c:5.2f}")
        if cv["graph_errors"]:
            print(f"  graph capture failed for {sorted(cv['graph_errors'])}: {next(iter(cv['graph_errors'].values()))}")
    print(f"\n{'variant':8s} {'tree':16s} {'tau':>6s} {'c':>6s} {'tau/c':>7s} {'replayed':>9s}")
    for s in summary:
        c = f"{s['c']:.2f}" if s["c"] else "-"
        p = f"{s['predicted_speedup']:.2f}" if s["predicted_speedup"] else "-"
        print(f"{s['variant']:8s} {s['tree']:16s} {s['tau']:6.2f} {c:>6s} {p:>7s} {s['replayed_speedup']:9.2f}")
    for n in result["notes"]:
        print("note:", n)
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
