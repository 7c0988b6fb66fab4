"""Acceptance (tau = tokens per verify step) of chain vs best-first trees on a real target/drafter pair.

Target Qwen2.5-Coder-1.5B-Instruct, drafter Qwen2.5-Coder-0.5B-Instruct (GGUF, dequantized to FP32;
see benchmarks/_models.py), chat-templated prompts from HumanEval, MBPP, GSM8K and MATH-500.

Exact replay (the models are slow on 2 CPU cores): the target's greedy continuation g is computed
once per prompt; then for each tree the real drafter and tree builder run at every step, and the
step accepts the longest tree path that matches g plus the bonus token (what verify would accept,
since g *is* the target's argmax sequence). Chains need no drafting loop at all: a greedy chain from
position p matches g exactly as long as the drafter's teacher-forced argmax over g matches, so one
drafter forward over prompt + g gives every chain length. A few prompts also run end to end through
`SpecEngine` to check that the engine's tokens equal g and its tau equals the replayed tau; the
engine outputs are audited by token forcing against the autoregressive run.

Writes rows {"dataset", "tree", "nodes", "tau", "prompts", ...} to benchmarks/results/tau_cpu.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _models  # noqa: E402

from spec_engine import BestFirstTree, ChainTree, IndependentTree, ModelDrafter, NgramDrafter, SpecEngine  # noqa: E402
from spec_engine.audit import Scorer, verdict  # noqa: E402


def ar_greedy(model, tok, ids, new_tokens) -> tuple[list[int], float]:
    """The target's greedy continuation (autoregressive `generate`, stops at EOS) and its seconds."""
    t0 = time.perf_counter()
    out = model.generate(
        ids.view(1, -1),
        attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )[0, ids.numel() :]
    return out.tolist(), time.perf_counter() - t0


def walk(tree_batch, g: list[int], pos: int) -> int:
    """Draft tokens accepted at `pos`: the longest tree path equal to g[pos:] (host replay of `accept`)."""
    toks = tree_batch.tokens[0].tolist()
    pars = tree_batch.parents[0].tolist()
    valid = tree_batch.valid[0].tolist()
    children: dict[int, dict[int, int]] = {}
    for i, (t, p, v) in enumerate(zip(toks, pars, valid)):
        if v:
            children.setdefault(p, {}).setdefault(t, i)
    cur, n = -1, 0
    while pos + n < len(g) and g[pos + n] in children.get(cur, {}):
        cur = children[cur][g[pos + n]]
        n += 1
    return n


def replay_tree(drafter, tree, ids, g, lattice_cache) -> list[int]:
    """Tokens committed per step of `tree` on one prompt, by exact replay. Lattices are memoised by (position, request)
    because several trees share one draft request (best-first trees of >= 8 nodes draft the same lattice)."""
    drafter.reset(ids)
    pos, trace = 0, []
    req = tree.draft_request()
    while pos < len(g):
        key = (pos, req)
        if key not in lattice_cache:
            lattice_cache[key] = drafter.propose(req)
        tb = tree.build([lattice_cache[key]])
        n = walk(tb, g, pos)
        new = g[pos : pos + n + 1]
        drafter.commit(new)
        pos += len(new)
        trace.append(len(new))
    return trace


def chain_run_lengths(drafter_model, ids, g) -> list[int]:
    """a[p] = how many drafter greedy tokens from position p match g (teacher-forced drafter, one forward)."""
    seq = torch.cat([ids, torch.tensor(g[:-1], dtype=torch.long)]).view(1, -1)
    with torch.no_grad():
        logits = drafter_model(seq).logits[0, ids.numel() - 1 :]
    m = (logits.argmax(-1) == torch.tensor(g)).tolist()
    runs = [0] * (len(g) + 1)
    for p in range(len(g) - 1, -1, -1):
        runs[p] = runs[p + 1] + 1 if m[p] else 0
    return runs[: len(g)]


def chain_trace_from_runs(runs: list[int], length: int) -> list[int]:
    pos, trace = 0, []
    while pos < len(runs):
        n = min(runs[pos] + 1, length + 1, len(runs) - pos)
        trace.append(n)
        pos += n
    return trace


def process_prompt(ds, ids, args, target, tok, drafter_model) -> dict:
    """Everything measured on one prompt (a cache record): greedy output, traces, end-to-end runs."""
    g, ar_s = ar_greedy(target, tok, ids, args.new_tokens)
    rec = {"dataset": ds, "prompt_len": ids.numel(), "g": g, "ar_seconds": ar_s, "traces": {}, "e2e": []}
    runs = chain_run_lengths(drafter_model, ids, g)
    for L in sorted(set([args.depth] + list(args.nodes))):
        rec["traces"][f"chain/{L}/model"] = chain_trace_from_runs(runs, L)
    drafter = ModelDrafter(drafter_model)
    cache: dict = {}
    for n in args.nodes:
        rec["traces"][f"best-first/{n}/model"] = replay_tree(
            drafter, BestFirstTree(n, max_depth=args.depth), ids, g, cache
        )
    for n in args.ddtree_nodes:
        rec["traces"][f"ddtree/{n}/model"] = replay_tree(
            drafter, IndependentTree(n, max_depth=args.depth), ids, g, cache
        )
    ngram, ng_cache = NgramDrafter(), {}
    for n in args.nodes:
        rec["traces"][f"chain/{n}/ngram"] = replay_tree(ngram, ChainTree(n), ids, g, ng_cache)
        rec["traces"][f"best-first/{n}/ngram"] = replay_tree(
            ngram, BestFirstTree(n, max_depth=args.depth), ids, g, ng_cache
        )
    return rec


def run_e2e(rec, ids, args, target, tok, drafter_model) -> None:
    """The engine end to end: tokens must equal the AR run's, tau the replay's."""
    trees = {"chain": ChainTree(args.depth), "best-first": BestFirstTree(32, max_depth=args.depth)}
    for name in args.e2e_trees:
        tree = trees[name]
        eng = SpecEngine(target, ModelDrafter(drafter_model), tree=tree)
        t0 = time.perf_counter()
        res = eng.generate(ids, args.new_tokens, stop_token_ids=[tok.eos_token_id])
        dt = time.perf_counter() - t0
        key = f"{name}/{tree.nodes}/model"
        trace = rec["traces"][key]
        rec["e2e"].append(
            {
                "tree": repr(tree),
                "tokens": res.tokens.tolist(),
                "identical_to_ar": res.tokens.tolist() == rec["g"],
                "tau_engine": res.tau,
                "tau_replay": sum(trace) / len(trace),
                "trace_engine": [s.new_tokens for s in res.steps],
                "trace_replay": trace,
                "seconds": dt,
            }
        )


def aggregate(records: list[dict], datasets: list[str], depth: int) -> list[dict]:
    """tau = tokens / steps per (dataset, tree, nodes, drafter); `capped` = share of steps that committed
    the most a step of that tree can (every drafted position accepted: the tree's depth was the limit)."""
    acc: dict[tuple, list[int]] = {}
    for rec in records:
        for key, trace in rec["traces"].items():
            name, nodes, drafter = key.split("/")
            cap = int(nodes) + 1 if name == "chain" else min(int(nodes), depth) + 1
            for d in (rec["dataset"], "all"):
                a = acc.setdefault((d, name, int(nodes), drafter), [0, 0, 0, 0])
                a[0] += sum(trace)
                a[1] += len(trace)
                a[2] += 1
                a[3] += sum(1 for t in trace if t == cap)
    order = {d: i for i, d in enumerate(datasets + ["all"])}
    rows = []
    for (d, name, nodes, drafter), (tokens, steps, n, capped) in sorted(
        acc.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1:])
    ):
        rows.append(
            {
                "dataset": d,
                "tree": name,
                "nodes": nodes,
                "drafter": drafter,
                "tau": tokens / steps,
                "prompts": n,
                "tokens": tokens,
                "steps": steps,
                "capped": capped / steps,
            }
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts-per-dataset", type=int, default=5, help="prompts per dataset (default 5)")
    ap.add_argument("--datasets", nargs="*", default=list(_models.DATASETS), help="datasets to use")
    ap.add_argument("--new-tokens", type=int, default=96, help="new tokens per prompt (default 96)")
    ap.add_argument("--nodes", type=int, nargs="*", default=[8, 16, 32, 64], help="tree node budgets")
    ap.add_argument("--depth", type=int, default=8, help="drafting depth of the trees (block size; default 8)")
    ap.add_argument("--ddtree-nodes", type=int, nargs="*", default=[], help="node budgets for DDTree-style rows")
    ap.add_argument(
        "--e2e-prompts",
        type=int,
        default=2,
        help="prompts also run end to end: the first of the first datasets (default 2)",
    )
    ap.add_argument("--e2e-trees", nargs="*", default=["chain", "best-first"], help="chain (depth) / best-first (32)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="model dtype (default bf16)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="process no new prompt: aggregate the cached per-prompt records (and audit them; loads the target)",
    )
    ap.add_argument(
        "--time-budget", type=float, default=None, help="seconds after which no new prompt is started (then report)"
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "tau_cpu.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    settings = {k: getattr(args, k) for k in ("new_tokens", "nodes", "depth", "ddtree_nodes", "e2e_trees", "dtype")}
    tag = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    store_path = _models.cache_dir() / "bench_tau" / f"records_{tag}.json"
    store_path.parent.mkdir(parents=True, exist_ok=True)
    store = json.loads(store_path.read_text()) if store_path.exists() else {}

    target = drafter_model = None
    if not args.report_only:
        print(f"loading {_models.TARGET} and {_models.DRAFTER} ({args.dtype}) ...", flush=True)
        target, tok = _models.load_model(_models.TARGET, dtype=dtype)
        drafter_model, _ = _models.load_model(_models.DRAFTER, dtype=dtype)
    else:
        print(f"loading {_models.TARGET} ({args.dtype}) for the audit ...", flush=True)
        target, tok = _models.load_model(_models.TARGET, dtype=dtype)
    t_start = time.perf_counter()
    # Round-robin over datasets so that a partial run still covers every dataset.
    per_ds = {ds: _models.load_prompts(ds, args.prompts_per_dataset) for ds in args.datasets}
    order = [(ds, i, per_ds[ds][i]) for i in range(args.prompts_per_dataset) for ds in args.datasets]
    prompt_ids = {}
    for ds, i, msg in tqdm(order, desc="prompts", unit="prompt"):
        key = hashlib.sha1(msg.encode()).hexdigest()[:16]
        ids = _models.chat_ids(tok, msg)
        prompt_ids[key] = ids
        if key in store or args.report_only:
            continue
        if args.time_budget is not None and time.perf_counter() - t_start > args.time_budget:
            tqdm.write(f"time budget of {args.time_budget:.0f}s spent: {ds}#{i} and later prompts not run")
            args.report_only = True
            continue
        t0 = time.perf_counter()
        rec = process_prompt(ds, ids, args, target, tok, drafter_model)
        if i == 0 and args.datasets.index(ds) < args.e2e_prompts:
            run_e2e(rec, ids, args, target, tok, drafter_model)
        rec["seconds"] = time.perf_counter() - t0
        store[key] = rec
        tmp = store_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(store))
        tmp.replace(store_path)
        e2e = "; ".join(
            f"{e['tree']} identical={e['identical_to_ar']} tau {e['tau_engine']:.2f}/{e['tau_replay']:.2f}"
            for e in rec["e2e"]
        )
        bf = rec["traces"].get("best-first/32/model")
        ch = rec["traces"].get(f"chain/{args.depth}/model")
        tqdm.write(
            f"{ds}#{i}: {len(rec['g'])} tokens in {rec['seconds']:.0f}s; tau chain/{args.depth} "
            f"{sum(ch) / len(ch):.2f} bf/32 {sum(bf) / len(bf) if bf else float('nan'):.2f} {e2e}"
        )

    records = [dict(store[k], key=k) for k in prompt_ids if k in store]
    if not records:
        print("no records yet", file=sys.stderr)
        return 1
    rows = aggregate(records, args.datasets, args.depth)

    # Audit: the engine's end-to-end outputs vs the autoregressive outputs, through the FP32-head scorer.
    audit_d = None
    e2e_recs = [r for r in records if r["e2e"]]
    if e2e_recs:
        scorer = Scorer(target)
        base = scorer.force_all([prompt_ids[r["key"]] for r in records], [r["g"] for r in records])
        sys_p = [prompt_ids[r["key"]] for r in e2e_recs for _ in r["e2e"]]
        sys_o = [e["tokens"] for r in e2e_recs for e in r["e2e"]]
        audit_d = verdict(scorer.force_all(sys_p, sys_o), base).as_dict()

    summary = {}
    for ds in args.datasets + ["all"]:
        get = {(r["tree"], r["nodes"]): r["tau"] for r in rows if r["dataset"] == ds and r["drafter"] == "model"}
        capped = {(r["tree"], r["nodes"]): r["capped"] for r in rows if r["dataset"] == ds and r["drafter"] == "model"}
        if ("chain", args.depth) in get and ("best-first", 32) in get:
            summary[ds] = {
                "chain_tau": get[("chain", args.depth)],
                "bf32_tau": get[("best-first", 32)],
                "ratio": get[("best-first", 32)] / get[("chain", args.depth)],
                "chain_capped": capped[("chain", args.depth)],
                "bf32_capped": capped[("best-first", 32)],
            }
    traces = [
        {
            "dataset": r["dataset"],
            "prompt_len": r["prompt_len"],
            "tree": k.split("/")[0],
            "nodes": int(k.split("/")[1]),
            "drafter": k.split("/")[2],
            "steps": t,
        }
        for r in records
        for k, t in r["traces"].items()
        if k.endswith("/model")
    ]
    e2e = [dict({k: v for k, v in e.items() if k != "tokens"}, dataset=r["dataset"]) for r in records for e in r["e2e"]]
    ar_tokens = sum(len(r["g"]) for r in records)
    result = {
        "target": _models.TARGET,
        "drafter": _models.DRAFTER,
        "dtype": args.dtype + " (GGUF Q4_K_M dequantized)",
        "new_tokens": args.new_tokens,
        "depth": args.depth,
        "prompts": len(records),
        "method": "exact replay against the target's greedy continuation (AR generate); chain rows from the "
        "teacher-forced drafter; best-first rows from the real ModelDrafter + BestFirstTree at every step",
        "ar_tokens_per_s_cpu": ar_tokens / sum(r["ar_seconds"] for r in records),
        "rows": rows,
        "bf32_vs_chain": summary,
        "end_to_end": e2e,
        "audit": audit_d,
        "traces": traces,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out)

    shown = sorted(set([args.depth] + list(args.nodes)))
    print(f"\n{'dataset':10s} {'tree':11s} {'drafter':7s} " + " ".join(f"N={n:<5d}" for n in shown))
    for ds in args.datasets + ["all"]:
        for name, dn in [
            ("chain", "model"),
            ("best-first", "model"),
            ("ddtree", "model"),
            ("chain", "ngram"),
            ("best-first", "ngram"),
        ]:
            cells = []
            for n in shown:
                r = [
                    x
                    for x in rows
                    if x["dataset"] == ds and x["tree"] == name and x["nodes"] == n and x["drafter"] == dn
                ]
                cells.append(f"{r[0]['tau']:<7.3f}" if r else f"{'-':7s}")
            if any(c.strip() != "-" for c in cells):
                print(f"{ds:10s} {name:11s} {dn:7s} " + " ".join(cells))
    for ds, s in summary.items():
        print(
            f"{ds}: best-first/32 tau {s['bf32_tau']:.3f} vs chain/{args.depth} {s['chain_tau']:.3f} -> {s['ratio']:.3f}x"
            f" (steps at the depth cap: chain {s['chain_capped']:.0%}, best-first {s['bf32_capped']:.0%})"
        )
    for e in e2e:
        print(
            f"e2e {e['dataset']} {e['tree']}: identical={e['identical_to_ar']} tau engine {e['tau_engine']:.3f} replay {e['tau_replay']:.3f}"
        )
    if audit_d:
        print(f"audit verdict: {audit_d['verdict']} {audit_d['reasons']}")
    print(f"wrote {out} ({len(records)} prompts)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
