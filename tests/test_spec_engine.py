"""SpecEngine is lossless: token-identical to `generate(do_sample=False)`, same KV cache, exact stops.

Tiny random FP32 models of two families (Llama, Qwen2). Weights are initialised with a large range so
the logits are peaked (no near-ties that FP32 reduction order could flip), and the drafter is the
target with perturbed weights so that acceptance is partial (some steps accept deep paths, some none).
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from spec_engine import (
    BestFirstTree,
    BlockDrafterAdapter,
    ChainTree,
    IndependentTree,
    MarkovBlockDrafter,
    ModelDrafter,
    NgramDrafter,
    SpecEngine,
)
from spec_engine.tree import DraftRequest
from spec_engine.verify import CausalLM, verify

VOCAB = 96
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}


def _make(family: str, seed: int, layers: int = 2):
    cfg_cls, model_cls = FAMILIES[family]
    cfg = cfg_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Tiny models: threading only adds synchronisation cost (and the CI box has 2 shared cores).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request):
    target = _make(request.param, seed=1)
    drafter = _make(request.param, seed=1)
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for p in drafter.parameters():
            p.add_(0.04 * torch.randn(p.shape, generator=g))
    return request.param, target, drafter


def _prompts(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = [17, 9, 1, 30, 3][i % 5]
        body = torch.randint(0, VOCAB, (length,), generator=g)
        if i % 2 == 1 and length > 4:  # repeated material so the n-gram drafter has something to find
            body = torch.cat([body, body[: length // 2], body])
        out.append(body)
    return out


def _ar(target, prompt, max_new_tokens, eos=None):
    out = target.generate(
        prompt.view(1, -1),
        attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long, device=prompt.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        return_dict_in_generate=True,
    )
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    return out.sequences[0, prompt.numel() :], cache


def _ar_layer(cache, i):
    layer = cache.layers[i]
    return layer.keys, layer.values


@pytest.mark.parametrize("nodes", [1, 4, 16, 64])
@pytest.mark.parametrize("tree_kind", ["chain", "best-first"])
@pytest.mark.parametrize("drafter_kind", ["model", "ngram"])
def test_token_identical_to_generate(pair, nodes, tree_kind, drafter_kind):
    family, target, draft_model = pair
    tree = ChainTree(nodes) if tree_kind == "chain" else BestFirstTree(nodes)
    prompts = _prompts(2 if nodes == 64 else 4, seed=nodes)
    accepted_deep = 0
    for prompt in prompts:
        ref, _ = _ar(target, prompt, 16)
        drafter = ModelDrafter(draft_model) if drafter_kind == "model" else NgramDrafter()
        res = SpecEngine(target, drafter, tree=tree).generate(prompt, 16)
        assert res.tokens.dtype == torch.long and res.tokens.dim() == 1
        assert res.tokens.tolist() == ref.tolist(), f"{family} {tree!r} {drafter_kind}: output differs from AR"
        assert sum(s.new_tokens for s in res.steps) == 16
        assert all(s.nodes <= nodes and s.accepted <= nodes for s in res.steps)
        accepted_deep = max(accepted_deep, max(s.accepted for s in res.steps))
    if drafter_kind == "model" and nodes in (4, 16):
        assert accepted_deep >= 2, "the perturbed drafter should get multi-token acceptances"


@pytest.mark.parametrize("tree", [ChainTree(4), BestFirstTree(64, max_depth=3)])
@pytest.mark.parametrize("budget", [1, 2, 7, 21])
def test_kv_cache_matches_ar_run(pair, tree, budget):
    _, target, draft_model = pair
    for prompt in _prompts(2, seed=budget):
        ref, ar_cache = _ar(target, prompt, budget)
        # The drafter is the target itself: every draft is accepted, so steps overshoot the budget.
        res = SpecEngine(target, ModelDrafter(target), tree=tree).generate(prompt, budget)
        assert res.tokens.tolist() == ref.tolist()
        cache = res.cache
        assert cache.length == prompt.numel() + budget - 1 == ar_cache.get_seq_length()
        for i in range(target.config.num_hidden_layers):
            k, v = cache.layer(i)
            ark, arv = _ar_layer(ar_cache, i)
            torch.testing.assert_close(k, ark, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, arv, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("drafter_kind", ["model", "self", "ngram"])
@pytest.mark.parametrize("stop_at", [0, 9])
def test_stop_tokens_honoured(pair, drafter_kind, stop_at):
    _, target, draft_model = pair
    for prompt in _prompts(2, seed=stop_at + 11):
        free, _ = _ar(target, prompt, 30)
        stop = int(free[stop_at])
        ref, ar_cache = _ar(target, prompt, 30, eos=stop)
        assert int(ref[-1]) == stop and stop not in ref[:-1].tolist()
        drafter = {
            "model": lambda: ModelDrafter(draft_model),
            "self": lambda: ModelDrafter(target),
            "ngram": NgramDrafter,
        }[drafter_kind]()
        engine = SpecEngine(target, drafter, tree=BestFirstTree(16))
        res = engine.generate(prompt, 30, stop_token_ids=[stop, VOCAB + 5])
        assert res.tokens.tolist() == ref.tolist()
        assert res.cache.length == ar_cache.get_seq_length()
        streamed = [t for chunk in engine.stream(prompt, 30, stop_token_ids=stop) for t in chunk]
        assert streamed == ref.tolist()


@pytest.mark.parametrize("tree", [ChainTree(6), BestFirstTree(24, max_depth=6), IndependentTree(24, max_depth=6)])
def test_block_drafter_lossless(pair, tree):
    _, target, _ = pair
    g = torch.Generator().manual_seed(3)
    # A Markov drafter built from the target's own first-step predictions: it often agrees.
    with torch.no_grad():
        table = target(torch.arange(VOCAB).view(-1, 1)).logits[:, -1] + 0.5 * torch.randn(VOCAB, VOCAB, generator=g)
    for prompt in _prompts(3, seed=5):
        ref, _ = _ar(target, prompt, 16)
        res = SpecEngine(target, BlockDrafterAdapter(MarkovBlockDrafter(table)), tree=tree).generate(prompt, 16)
        assert res.tokens.tolist() == ref.tolist()


def test_independent_tree_with_model_drafter(pair):
    _, target, draft_model = pair
    for prompt in _prompts(2, seed=9):
        ref, _ = _ar(target, prompt, 16)
        res = SpecEngine(target, ModelDrafter(draft_model), tree=IndependentTree(16, max_depth=4)).generate(prompt, 16)
        assert res.tokens.tolist() == ref.tolist()


def test_fixed_shapes_and_2d_input(pair):
    _, target, draft_model = pair
    prompt = _prompts(2, seed=4)[1]
    ref, _ = _ar(target, prompt, 16)
    eng = SpecEngine(target, NgramDrafter(), tree=BestFirstTree(8), fixed_shapes=True)
    res = eng.generate(prompt.view(1, -1), 16)
    assert res.tokens.tolist() == ref.tolist()
    assert {s.rows for s in res.steps} == {9}  # one verify shape: root + 8 nodes, padding included


def test_read_only_verify_leaves_cache(pair):
    _, target, draft_model = pair
    lm = CausalLM(target)
    prompt = _prompts(3, seed=1)[0]
    cache = lm.new_cache()
    lm.prefill(cache, prompt[:-1].view(1, -1))
    before = [tuple(t.clone() for t in cache.layer(i)) for i in range(lm.num_layers)]
    drafter = ModelDrafter(draft_model)
    drafter.reset(prompt)
    tree = BestFirstTree(16).build([drafter.propose(DraftRequest(depth=4, beam=4, topk=4))])
    out1 = verify(lm, cache, prompt[-1:], tree)
    out2 = verify(lm, cache, prompt[-1:], tree)  # without commit the first pass left nothing behind
    assert torch.equal(out1.argmax, out2.argmax) and cache.length == prompt.numel() - 1
    for i in range(lm.num_layers):
        assert torch.equal(cache.layer(i)[0], before[i][0]) and torch.equal(cache.layer(i)[1], before[i][1])


def test_zero_budget_and_errors(pair):
    _, target, draft_model = pair
    eng = SpecEngine(target, ModelDrafter(draft_model), tree=ChainTree(2))
    assert eng.generate(torch.tensor([1, 2, 3]), 0).tokens.numel() == 0
    with pytest.raises(ValueError, match="one request"):
        eng.generate(torch.zeros(2, 4, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="non-empty"):
        eng.generate(torch.zeros(0, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate(torch.tensor([1, 2]), -1)
    with pytest.raises(TypeError, match="drafter"):
        SpecEngine(target, object())
    with pytest.raises(TypeError, match="tree"):
        SpecEngine(target, NgramDrafter(), tree="chain")
    with pytest.raises(TypeError, match="per-position"):
        SpecEngine(target, NgramDrafter(), tree=IndependentTree(8)).generate(torch.tensor([1, 2, 1, 2]), 4)


@pytest.mark.parametrize("tree", [ChainTree(3), BestFirstTree(16)])
def test_static_verifier_path_is_lossless(pair, tree):
    """The CUDA-graph path (static cache, full-buffer masks), run eagerly on the CPU."""
    _, target, draft_model = pair
    eng = SpecEngine(target, ModelDrafter(draft_model), tree=tree, static=True, capacity=64)
    for prompt in _prompts(2, seed=21):
        ref, ar_cache = _ar(target, prompt, 14)
        res = eng.generate(prompt, 14)
        assert res.tokens.tolist() == ref.tolist()
        assert {s.rows for s in res.steps} == {tree.nodes + 1}
        for i in range(target.config.num_hidden_layers):
            torch.testing.assert_close(res.cache.layer(i)[0], ar_cache.layers[i].keys, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["nodes", "positions"])
def test_static_drafter_drafts_what_the_dynamic_one_does(pair, kind):
    """ModelDrafter's static path (the CUDA-graph one, run eagerly here) proposes the same lattice
    as the dynamic-cache path, also across a capacity doubling."""
    _, _, draft_model = pair
    req = DraftRequest(kind=kind, depth=5, topk=4, beam=3)
    for prompt in _prompts(3, seed=31):
        dyn = ModelDrafter(draft_model, static=False)
        sta = ModelDrafter(draft_model, capacity=16, static=True, use_graphs=False)
        for d in (dyn, sta):
            d.reset(prompt)
        for step in range(3):
            if step == 1:  # as if the request had outgrown the buffers: copy the context, re-capture
                cap = sta.runner.capacity
                sta._ensure_capacity(cap + 1)
                assert sta.runner.capacity == 2 * cap
            a, b = dyn.propose(req), sta.propose(req)
            if kind == "nodes":
                assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
                torch.testing.assert_close(a.scores, b.scores, rtol=1e-4, atol=1e-4)
            else:
                assert torch.equal(a.tokens, b.tokens)
                torch.testing.assert_close(a.logp, b.logp, rtol=1e-4, atol=1e-4)
            new = [int(a.tokens.view(-1)[0]), step + 5]
            dyn.commit(new)
            sta.commit(new)
        assert sta.runner.capacity >= sta.cache.length


@pytest.mark.gpu
def test_graphed_drafter_on_gpu(pair):
    """On CUDA, ModelDrafter defaults to the static cache with one captured graph per row count;
    replays with new inputs draft what the dynamic path drafts, and the engine stays lossless."""
    _, target, draft_model = pair
    target, draft_model = target.cuda(), draft_model.cuda()
    try:
        req = DraftRequest(kind="nodes", depth=4, topk=4, beam=3)
        sta, dyn = ModelDrafter(draft_model), ModelDrafter(draft_model, static=False)
        assert sta.static
        for prompt in _prompts(3, seed=41):
            prompt = prompt.cuda()
            sta.reset(prompt)
            dyn.reset(prompt)
            for step in range(3):
                a, b = dyn.propose(req), sta.propose(req)
                assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
                torch.testing.assert_close(a.scores, b.scores, rtol=1e-4, atol=1e-4)
                sta.commit([int(a.tokens[0]), step])
                dyn.commit([int(a.tokens[0]), step])
        assert sta.runner._slots and not sta.runner.graph_errors
        prompt = _prompts(1, seed=42)[0]
        ref, _ = _ar(target, prompt.cuda(), 12)
        res = SpecEngine(target, ModelDrafter(draft_model), tree=BestFirstTree(8)).generate(prompt.cuda(), 12)
        assert res.tokens.tolist() == ref.tolist()
    finally:
        target.cpu()
        draft_model.cpu()
