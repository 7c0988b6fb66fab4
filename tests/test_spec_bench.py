"""The benchmark shortcuts are exact: replayed tau equals the engine's, teacher-forced chains equal drafted ones."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spec_engine import BestFirstTree, ChainTree, ModelDrafter, NgramDrafter, SpecEngine

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def models():
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.3,
    )
    torch.manual_seed(5)
    target = LlamaForCausalLM(cfg).eval()
    drafter = LlamaForCausalLM(cfg).eval()
    drafter.load_state_dict(target.state_dict())
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.03 * torch.randn_like(p))
    return target, drafter


def _greedy(target, prompt, n):
    out = target.generate(
        prompt.view(1, -1),
        attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, prompt.numel() :].tolist()


@pytest.mark.parametrize("length", [1, 3, 8])
def test_chain_runs_equal_drafted_chains(models, length):
    bt = _load("bench_tau")
    target, drafter = models
    g = torch.Generator().manual_seed(length)
    for _ in range(2):
        prompt = torch.randint(0, 64, (6,), generator=g)
        cont = _greedy(target, prompt, 20)
        shortcut = bt.chain_trace_from_runs(bt.chain_run_lengths(drafter, prompt, cont), length)
        replayed = bt.replay_tree(ModelDrafter(drafter), ChainTree(length), prompt, cont, {})
        engine = SpecEngine(target, ModelDrafter(drafter), tree=ChainTree(length)).generate(prompt, 20)
        assert shortcut == replayed == [s.new_tokens for s in engine.steps]


@pytest.mark.parametrize("tree", [BestFirstTree(8, max_depth=4), BestFirstTree(32, max_depth=4)])
@pytest.mark.parametrize("drafter_kind", ["model", "ngram"])
def test_replay_trace_equals_engine_trace(models, tree, drafter_kind):
    bt = _load("bench_tau")
    target, drafter = models
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        prompt = torch.randint(0, 64, (7,), generator=g)
        cont = _greedy(target, prompt, 18)
        mk = (lambda: ModelDrafter(drafter)) if drafter_kind == "model" else NgramDrafter
        replayed = bt.replay_tree(mk(), tree, prompt, cont, {})
        engine = SpecEngine(target, mk(), tree=tree).generate(prompt, 18)
        assert engine.tokens.tolist() == cont
        assert replayed == [s.new_tokens for s in engine.steps]


@pytest.mark.slow
def test_verify_cost_smoke(tmp_path):
    bvc = _load("bench_verify_cost")
    out = tmp_path / "smoke.json"
    assert bvc.main(["--smoke", "--no-w12", "--reps", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["cost"]) == {"tiny-qwen2/bf16", "tiny-llama/bf16"}
    for cv in res["cost"].values():
        assert cv["rows"][0] == 1 and cv["c"][0] == 1.0 and len(cv["t_us"]) == len(cv["rows"])
    assert {s["tree"] for s in res["summary"]} == {"chain/8", "best-first/16", "best-first/32", "best-first/64"}
    assert all(s["replayed_speedup"] > 0 for s in res["summary"])
