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
from spec_engine.tree import PositionLattice  # noqa: E402


def greedy_cache_path(args) -> Path:
    root = _models.cache_dir() / "bench_tau"
    root.mkdir(parents=True, exist_ok=True)
    return root / f"greedy_{_models.TARGET}_{args.new_tokens}.json"


def target_greedy(model, tok, prompts, args) -> dict:
    """Greedy continuation per prompt (cached on disk by prompt hash, since it dominates the run time)."""
    path = greedy_cache_path(args)
    store = json.loads(path.read_text()) if path.exists() else {}
    eos = tok.eos_token_id
    for key, ids in tqdm(prompts, desc="target greedy (AR)", unit="prompt"):
        if key in store:
            continue
        t0 = time.perf_counter()
        out = model.generate(
            ids.view(1, -1),
            attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
            max_new_tokens=args.new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )[0, ids.numel() :]
        store[key] = {"tokens": out.tolist(), "seconds": time.perf_counter() - t0}
        path.write_text(json.dumps(store))
    return store


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


def replay_tree(drafter, tree, ids, g, lattice_cache) -> tuple[int, int]:
    """(tokens, steps) of `tree` on one prompt by exact replay. Lattices are memoised by (position, request)
    because several trees share one draft request (best-first trees of >= 8 nodes draft the same lattice)."""
    drafter.reset(ids)
    pos, steps = 0, 0
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
        steps += 1
    return len(g), steps


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


def chain_tau_from_runs(runs: list[int], length: int) -> tuple[int, int]:
    pos, steps = 0, 0
    while pos < len(runs):
        pos += min(runs[pos], length) + 1
        steps += 1
    return len(runs), steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts-per-dataset", type=int, default=5, help="prompts per dataset (default 5)")
    ap.add_argument("--datasets", nargs="*", default=list(_models.DATASETS), help="datasets to use")
    ap.add_argument("--new-tokens", type=int, default=96, help="new tokens per prompt (default 96)")
    ap.add_argument("--nodes", type=int, nargs="*", default=[8, 16, 32, 64], help="tree node budgets")
    ap.add_argument("--depth", type=int, default=8, help="drafting depth of the trees (block size; default 8)")
    ap.add_argument("--ddtree-nodes", type=int, nargs="*", default=[32], help="node budgets for the DDTree-style rows")
    ap.add_argument("--e2e-prompts", type=int, default=1, help="prompts per dataset also run end to end (default 1)")
    ap.add_argument("--e2e-trees", nargs="*", default=["chain8", "bf32"], help="trees for the end-to-end runs")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "tau_cpu.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    print(f"loading {_models.TARGET} and {_models.DRAFTER} (FP32) ...", flush=True)
    target, tok = _models.load_model(_models.TARGET)
    drafter_model, _ = _models.load_model(_models.DRAFTER)
    prompts = []  # (dataset, key, ids)
    for ds in args.datasets:
        for msg in _models.load_prompts(ds, args.prompts_per_dataset):
            ids = _models.chat_ids(tok, msg)
            prompts.append((ds, hashlib.sha1(msg.encode()).hexdigest()[:16], ids))
    store = target_greedy(target, tok, [(k, ids) for _, k, ids in prompts], args)
    gs = {k: store[k]["tokens"] for _, k, _ in prompts}
    ar_tok_s = sum(len(store[k]["tokens"]) for _, k, _ in prompts) / sum(store[k]["seconds"] for _, k, _ in prompts)

    trees = {f"best-first/{n}": BestFirstTree(n, max_depth=args.depth) for n in args.nodes}
    trees.update({f"ddtree/{n}": IndependentTree(n, max_depth=args.depth) for n in args.ddtree_nodes})
    # (dataset, tree, nodes, drafter) -> [tokens, steps, prompts]
    acc: dict[tuple, list[int]] = {}

    def add(ds, name, nodes, drafter, tokens, steps):
        for d in (ds, "all"):
            a = acc.setdefault((d, name, nodes, drafter), [0, 0, 0])
            a[0] += tokens
            a[1] += steps
            a[2] += 1

    drafter = ModelDrafter(drafter_model)
    ngram = NgramDrafter()
    chain_lengths = sorted(set([args.depth] + list(args.nodes)))
    t_start = time.perf_counter()
    for ds, key, ids in tqdm(prompts, desc="replay", unit="prompt"):
        g = gs[key]
        runs = chain_run_lengths(drafter_model, ids, g)
        for L in chain_lengths:
            add(ds, "chain", L, "model", *chain_tau_from_runs(runs, L))
        cache: dict = {}
        for name, tree in trees.items():
            add(ds, name.split("/")[0], tree.nodes, "model", *replay_tree(drafter, tree, ids, g, cache))
        ng_cache: dict = {}
        for L in chain_lengths:
            add(ds, "chain", L, "ngram", *replay_tree(ngram, ChainTree(L), ids, g, ng_cache))
        for n in args.nodes:
            add(ds, "best-first", n, "ngram", *replay_tree(ngram, BestFirstTree(n, max_depth=args.depth), ids, g, ng_cache))
    replay_s = time.perf_counter() - t_start

    # End-to-end runs through the engine: same tokens as the AR run, same tau as the replay.
    e2e_trees = {"chain8": ChainTree(args.depth), "bf32": BestFirstTree(32, max_depth=args.depth)}
    e2e, sys_prompts, sys_outputs, base_outputs = [], [], [], []
    picked = [p for i, p in enumerate(prompts) if i % args.prompts_per_dataset < args.e2e_prompts]
    for ds, key, ids in tqdm(picked, desc="end-to-end", unit="prompt"):
        g = gs[key]
        for tname in args.e2e_trees:
            tree = e2e_trees[tname]
            eng = SpecEngine(target, ModelDrafter(drafter_model), tree=tree)
            t0 = time.perf_counter()
            res = eng.generate(ids, args.new_tokens, stop_token_ids=[tok.eos_token_id])
            dt = time.perf_counter() - t0
            out = res.tokens.tolist()
            if tname.startswith("chain"):
                rt, rs = chain_tau_from_runs(chain_run_lengths(drafter_model, ids, g), args.depth)
            else:
                rt, rs = replay_tree(ModelDrafter(drafter_model), tree, ids, g, {})
            e2e.append(
                {
                    "dataset": ds,
                    "tree": repr(tree),
                    "identical_to_ar": out == g,
                    "tau_engine": res.tau,
                    "tau_replay": rt / rs,
                    "steps": len(res.steps),
                    "seconds": dt,
                    "tok_per_s": len(out) / dt,
                    "accepted_trace": [s.new_tokens for s in res.steps],
                }
            )
            print(f"  e2e {ds} {tree!r}: identical={out == g} tau engine {res.tau:.3f} replay {rt / rs:.3f}", flush=True)
            sys_prompts.append(ids)
            sys_outputs.append(out)
            base_outputs.append(g)

    print("audit: forcing outputs through the target with an FP32 LM head ...", flush=True)
    scorer = Scorer(target)
    base_stats = scorer.force_all([p[2] for p in prompts], [gs[p[1]] for p in prompts])
    sys_stats = scorer.force_all(sys_prompts, sys_outputs)
    v = verdict(sys_stats, base_stats)

    rows = []
    for (ds, name, nodes, drafter_name), (tokens, steps, n) in sorted(acc.items()):
        rows.append(
            {"dataset": ds, "tree": name, "nodes": nodes, "drafter": drafter_name, "tau": tokens / steps, "prompts": n,
             "tokens": tokens, "steps": steps, "depth": args.depth}
        )
    summary = {}
    for ds in args.datasets + ["all"]:
        get = {(r["tree"], r["nodes"]): r["tau"] for r in rows if r["dataset"] == ds and r["drafter"] == "model"}
        chain = get.get(("chain", args.depth))
        if chain and ("best-first", 32) in get:
            summary[ds] = {"chain_depth_tau": chain, "bf32_tau": get[("best-first", 32)], "ratio": get[("best-first", 32)] / chain}
    result = {
        "target": _models.TARGET,
        "drafter": _models.DRAFTER,
        "dtype": "float32 (GGUF Q4_K_M dequantized)",
        "new_tokens": args.new_tokens,
        "depth": args.depth,
        "method": "exact replay against the target's greedy continuation; chain rows from the teacher-forced drafter",
        "ar_tokens_per_s_cpu": ar_tok_s,
        "replay_seconds": replay_s,
        "rows": rows,
        "bf32_vs_chain": summary,
        "end_to_end": e2e,
        "audit": v.as_dict(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out)

    print(f"\n{'dataset':10s} {'tree':12s} {'drafter':7s} " + " ".join(f"N={n:<5d}" for n in chain_lengths))
    for ds in args.datasets + ["all"]:
        for name, dn in [("chain", "model"), ("best-first", "model"), ("ddtree", "model"), ("chain", "ngram"), ("best-first", "ngram")]:
            cells = []
            for n in chain_lengths:
                r = [x for x in rows if x["dataset"] == ds and x["tree"] == name and x["nodes"] == n and x["drafter"] == dn]
                cells.append(f"{r[0]['tau']:<7.3f}" if r else f"{'-':7s}")
            print(f"{ds:10s} {name:12s} {dn:7s} " + " ".join(cells))
    for ds, s in summary.items():
        print(f"{ds}: best-first/32 tau {s['bf32_tau']:.3f} vs chain/{args.depth} {s['chain_depth_tau']:.3f} -> {s['ratio']:.3f}x")
    print(f"audit verdict: {v.as_dict()['verdict']} {v.reasons}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
