"""Fused sibling projections (``w12.fuse_projections``, ``w12.patch(fuse=True)``) on the CPU.

Without ``w12.fuse._FORCE`` CPU inputs take each member's own exact path, so patched + fused models
must stay bit-identical to BF16. With it, the fused GEMM runs on the CPU too (what CUDA inputs
always take), and is compared with the unfused result.
"""

from __future__ import annotations

import copy
import io
import os

import pytest
import torch
from torch import nn

import w12
from w12 import fuse
from w12.fuse import _FusedLinear, _FusedW12Linear, fused_groups
from w12.nn import W12Linear

VOCAB = 512
# head_dim 64 with 2 KV heads: k/v have 128 rows, whole W12 row tiles, so q/k/v fuse.
BASE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {  # class, extra config, fused groups expected in a 2-layer model
    "llama": ("LlamaConfig", {}, 4),
    "mistral": ("MistralConfig", {}, 4),
    "qwen2": ("Qwen2Config", {}, 4),  # q/k/v biases
    "qwen3": ("Qwen3Config", {"head_dim": 64}, 4),
    "gemma2": ("Gemma2Config", {"head_dim": 64}, 4),
    "phi3": ("Phi3Config", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}, 0),  # qkv_proj, gate_up_proj
    "gpt_neox": ("GPTNeoXConfig", {"num_key_value_heads": None}, 0),  # query_key_value
}


def hf():
    return pytest.importorskip("transformers")


def make_model(family: str, seed: int = 0, **over):
    tf = hf()
    cls_name, extra, _ = FAMILIES[family]
    kw = {**BASE, "vocab_size": VOCAB, **extra, **over}
    cfg = getattr(tf, cls_name)(**{k: v for k, v in kw.items() if v is not None})
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@torch.no_grad()
def logits(model, ids):
    return model(ids).logits


def close(a, b, rel=1e-2):
    """Max abs difference within ``rel`` of the reference's scale (the fused GEMM may sum in another order)."""
    return (a.float() - b.float()).abs().max().item() <= rel * b.float().abs().max().item()


@pytest.fixture
def ids():
    return torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))


@pytest.fixture
def forced(monkeypatch):
    """The fused GEMM also for CPU inputs; counts its calls."""
    monkeypatch.setattr(fuse, "_FORCE", True)
    calls = []
    real = fuse._Group._linear

    def spy(self, x):
        calls.append(self.n)
        return real(self, x)

    monkeypatch.setattr(fuse._Group, "_linear", spy)
    return calls


def idle(model) -> bool:
    """No group holds a cached input or output (nothing outlives a forward)."""
    return all(g._cache is None and g._mask == 0 for g in fused_groups(model))


# -- Transformers families ---------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_fused_bit_identical_save_load_unpatch(family, ids, tmp_path):
    tf = hf()
    expected = FAMILIES[family][2]
    ref_model = make_model(family)
    ref = logits(ref_model, ids)
    gen_kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    ref_tokens = ref_model.generate(ids[:1], **gen_kw)

    model = w12.patch(make_model(family), keep_if_larger=True)
    assert model.w12_report.fused_groups == len(fused_groups(model)) == expected
    if expected:
        assert "fused 4 projection groups" in model.w12_report.summary()
    assert same_bits(logits(model, ids), ref)
    assert torch.equal(model.generate(ids[:1], **gen_kw), ref_tokens)
    assert idle(model)

    # The state_dict is that of the unfused model, key for key and bit for bit, and shares no storage.
    plain = w12.patch(make_model(family), keep_if_larger=True, fuse=False)
    assert fused_groups(plain) == []
    sd, sd_plain = model.state_dict(), plain.state_dict()
    assert list(sd) == list(sd_plain)
    for key, t in sd_plain.items():
        assert sd[key].dtype == t.dtype and torch.equal(sd[key], t), key
    members = [f"{n}." for n, m in model.named_modules() if type(m) is _FusedW12Linear]
    assert len(members) == (2 * 5 if expected else 0)  # q, k, v and gate, up of 2 layers
    storages = [t.untyped_storage().data_ptr() for k, t in sd.items() if k.startswith(tuple(members)) and t.numel()]
    assert len(storages) == len(set(storages))  # safetensors refuses tensors that share storage

    model.save_pretrained(tmp_path)
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert len(fused_groups(loaded)) == expected  # from_pretrained of a W12 folder fuses too
    assert same_bits(logits(loaded, ids), ref)

    w12.unpatch(model)
    assert not any(isinstance(m, W12Linear) for m in model.modules()) and fused_groups(model) == []
    for (name, p), (_, q) in zip(ref_model.named_parameters(), model.named_parameters()):
        assert same_bits(p.data, q.data), name


def test_forced_fused_path_matches_and_serves_hf_views(ids, forced):
    ref = logits(make_model("qwen2"), ids)
    model = w12.patch(make_model("qwen2"))
    out = logits(model, ids)
    # One fused GEMM per group and forward: q/k/v (256+128+128 rows) and gate/up (512+512).
    assert sorted(forced) == [512, 512, 1024, 1024]
    assert close(out, ref)
    assert idle(model)
    forced.clear()
    gen_kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids[:1], **gen_kw), make_model("qwen2").generate(ids[:1], **gen_kw))
    assert len(forced) == 4 * 4  # prefill + 3 decode steps (the 4th token needs no forward)
    assert idle(model)


def test_forced_slices_are_views_hf_can_reshape(forced):
    attn = w12.patch(make_model("llama")).model.layers[0].self_attn
    x = torch.randn(2, 5, 256).to(torch.bfloat16)
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    assert forced == [512]
    assert q.shape == (2, 5, 256) and k.shape == v.shape == (2, 5, 128)
    assert q._base is not None and q._base is k._base  # slices of one output
    for m, y in ((attn.q_proj, q), (attn.k_proj, k), (attn.v_proj, v)):
        own = W12Linear.forward(m, x)  # the member's own GEMM on its own view tensors
        assert torch.equal(y, own)
        assert torch.equal(y.view(2, 5, -1, 64).transpose(1, 2), own.view(2, 5, -1, 64).transpose(1, 2))


def test_cross_input_calls_stay_correct_then_stop_fusing(forced):
    attn = w12.patch(make_model("llama")).model.layers[0].self_attn
    g = attn.q_proj._w12_group
    mods = (attn.q_proj, attn.k_proj, attn.v_proj)
    for step in range(4):
        x1 = torch.randn(1, 3, 256, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        x2 = torch.randn(1, 7, 256, generator=torch.Generator().manual_seed(99 + step)).to(torch.bfloat16)
        # Cross-attention pattern: q reads the decoder states, k and v the encoder states.
        for m, x in zip(mods, (x1, x2, x2)):
            assert torch.equal(m(x), W12Linear.forward(m, x))
    # Each new input arrived while the previous one was partly served (q(x1) alone, then k/v(x2)
    # without q): the third such miss, at step 1's k, turns fusion off for good.
    assert not g.active and "different inputs" in g.disabled and g._cache is None
    assert forced == [512] * 3
    assert "inactive" in repr(g)


def test_one_abandoned_input_does_not_stop_fusing(forced):
    attn = w12.patch(make_model("llama")).model.layers[0].self_attn
    x = torch.randn(1, 3, 256).to(torch.bfloat16)
    attn.q_proj(x)  # e.g. an exception in the middle of a forward
    for _ in range(3):
        x = torch.randn(1, 3, 256).to(torch.bfloat16)
        attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    assert attn.q_proj._w12_group.active and idle(attn)


# -- BF16 groups -------------------------------------------------------------------------------
def test_bf16_fuse_projections_exact_and_unfuse(ids, monkeypatch):
    model = make_model("qwen2")
    ref = logits(model, ids)
    keys = list(model.state_dict())
    assert w12.fuse_projections(model) == 4
    assert w12.fuse_projections(model) == 0  # already fused
    q = model.model.layers[0].self_attn.q_proj
    assert type(q) is _FusedLinear and isinstance(q, nn.Linear)
    assert not q.weight.requires_grad  # fusion is for inference
    assert same_bits(logits(model, ids), ref)
    assert list(model.state_dict()) == keys
    monkeypatch.setattr(fuse, "_FORCE", True)
    assert close(logits(model, ids), ref)
    assert w12.unfuse_projections(model) == 4
    assert type(q) is nn.Linear and q.weight.requires_grad and q.bias.requires_grad
    assert q.weight.untyped_storage().nbytes() == q.weight.numel() * 2  # own storage again
    assert same_bits(logits(model, ids), ref)


def test_patch_unfuses_bf16_groups_and_fuses_w12(ids):
    model = make_model("llama")
    ref = logits(model, ids)
    assert w12.fuse_projections(model) == 4
    w12.patch(model)
    assert len(model.w12_report.converted) == 15  # fused BF16 members were converted too
    assert {g.kind for g in fused_groups(model)} == {"w12"} and model.w12_report.fused_groups == 4
    assert same_bits(logits(model, ids), ref)


def test_patch_never_fuses_bf16_layers(ids):
    model = w12.patch(make_model("llama"), exclude="*.mlp.*")
    assert [g.label.rsplit(".", 1)[-1] for g in fused_groups(model)] == ["(q_proj,k_proj,v_proj)"] * 2
    assert type(model.model.layers[0].mlp.up_proj) is nn.Linear


# -- moves, copies, state -----------------------------------------------------------------------
def test_moves_turn_the_group_off_until_every_member_moved(ids, forced):
    model = w12.patch(make_model("llama"))
    ref = logits(model, ids)
    attn = model.model.layers[0].self_attn
    g = attn.q_proj._w12_group
    attn.q_proj._apply(lambda t: t.clone())  # one member moved: the others still view the old storage
    assert not g.active and g.tensors is None
    forced.clear()
    assert same_bits(logits(model, ids), ref)
    assert sorted(forced) == [512, 1024, 1024]  # layer 0's q/k/v ran unfused
    attn.k_proj._apply(lambda t: t.clone())
    attn.v_proj._apply(lambda t: t.clone())
    assert g.active  # every member moved: fused again, from the members' new tensors
    assert attn.k_proj.w12_records.untyped_storage().data_ptr() == g.tensors["records"].untyped_storage().data_ptr()
    model._apply(lambda t: t.clone())  # a whole-model move (as .to()/.cuda() do) keeps every group
    assert all(x.active for x in fused_groups(model)) and len(fused_groups(model)) == 4
    assert same_bits(logits(model, ids), ref)


def test_moves_that_break_the_conditions_dissolve(ids):
    model = make_model("llama")
    w12.fuse_projections(model)
    model.float()  # BF16 groups need BF16 weights
    assert fused_groups(model) == [] and type(model.model.layers[0].mlp.up_proj) is nn.Linear
    patched = w12.patch(make_model("llama"))
    patched.to("meta")
    assert fused_groups(patched) == [] and type(patched.model.layers[0].mlp.up_proj) is W12Linear


def test_bias_cast_refuses_with_the_new_dtype(ids):
    model = w12.patch(make_model("qwen2"))
    ref = logits(w12.patch(make_model("qwen2"), fuse=False).to(torch.float32), ids)
    model.to(torch.float32)  # casts the q/k/v biases; records are integers and stay
    groups = fused_groups(model)
    assert len(groups) == 4 and all(g.active for g in groups)
    qkv = groups[0]
    assert qkv.tensors["bias"].dtype == torch.float32
    assert model.model.layers[0].self_attn.k_proj.bias.dtype == torch.float32
    assert torch.equal(logits(model, ids), ref)


def test_load_state_dict_keeps_the_group_consistent(ids):
    src = w12.patch(make_model("llama", seed=1), fuse=False)
    model = w12.patch(make_model("llama"))
    model.load_state_dict(src.state_dict())  # W12Linear replaces its buffers on load
    groups = fused_groups(model)
    assert len(groups) == 4 and all(g.active for g in groups)
    g = model.model.layers[0].self_attn.q_proj._w12_group
    assert torch.equal(g.tensors["records"][:2], src.model.layers[0].self_attn.q_proj.w12_records)
    assert same_bits(logits(model, ids), logits(src, ids))


def test_deepcopy_and_pickle(ids, forced):
    model = w12.patch(make_model("llama"))
    ref = logits(model, ids)
    dup = copy.deepcopy(model)
    groups = fused_groups(dup)
    assert len(groups) == 4 and groups[0].members()[0] is dup.model.layers[0].self_attn.q_proj
    assert same_bits(logits(dup, ids), ref)
    w12.unfuse_projections(dup)
    assert len(fused_groups(model)) == 4  # the copy's groups are its own

    # Patched HF models do not pickle (their W12Config is a local class); plain modules do.
    block = w12.patch(Block(), keep_if_larger=True)
    buf = io.BytesIO()
    torch.save(block, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    (g,) = fused_groups(back)
    assert g.active and g.members() == [back.q_proj, back.k_proj, back.v_proj]
    x = torch.randn(2, 128).to(torch.bfloat16)
    assert torch.equal(back(x), block(x))


def test_state_dict_keep_vars_gives_the_live_views():
    model = w12.patch(make_model("llama"))
    sd = model.state_dict(keep_vars=True)
    g = model.model.layers[0].self_attn.q_proj._w12_group
    assert sd["model.layers.0.self_attn.k_proj.w12_base"].data_ptr() == g.tensors["base"].data_ptr() + 256


def test_safetensors_save_of_fused_plain_module(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    block = Block()
    assert w12.fuse_projections(block) == 1
    safetensors.save_file(block.state_dict(), str(tmp_path / "b.safetensors"))
    w12.patch(block, keep_if_larger=True)
    safetensors.save_file(block.state_dict(), str(tmp_path / "w.safetensors"))
    assert block.w12_report.fused_groups == 1


def test_state_dict_of_members_without_escapes(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    block = Block()
    with torch.no_grad():
        for m in (block.q_proj, block.k_proj, block.v_proj):  # one binade: no escapes at all
            m.weight.copy_(torch.randn(m.weight.shape).sign() * 0.05)
    w12.patch(block, keep_if_larger=True)
    assert block.w12_report.fused_groups == 1 and block.k_proj.w12_esc_col.numel() == 0
    sd = block.state_dict()
    ptrs = [
        sd[f"{n}.{s}"].untyped_storage().data_ptr()
        for n in ("q_proj", "k_proj", "v_proj")
        for s in ("w12_esc_col", "w12_esc_val")
    ]
    assert 0 not in ptrs and len(set(ptrs)) == 6  # Transformers would take shared empty tensors for tied ones
    safetensors.save_file(sd, str(tmp_path / "w.safetensors"))


# -- group detection ---------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, sizes=(256, 128, 128), k=128, bias=False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        for name, n in zip(("q_proj", "k_proj", "v_proj"), sizes):
            setattr(self, name, nn.Linear(k, n, bias=bias, dtype=torch.bfloat16))

    def forward(self, x):
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)


def test_w12_member_with_partial_tiles_goes_last(forced):
    block = Block(sizes=(256, 64, 128))
    x = torch.randn(3, 128).to(torch.bfloat16)
    ref = block(x)
    w12.patch(block, keep_if_larger=True)
    g = block.q_proj._w12_group
    assert [m._w12_slot for m in (block.q_proj, block.k_proj, block.v_proj)] == [
        (0, 0, 256),
        (2, 384, 448),
        (1, 256, 384),
    ]
    assert g.tensors["records"].shape[0] == 2 + 1 + 1
    assert close(block(x), ref) and forced == [448]


@pytest.mark.parametrize(
    "change,reason",
    [
        (lambda b: setattr(b, "k_proj", nn.Linear(64, 128, bias=False, dtype=torch.bfloat16)), "in_features differ"),
        (lambda b: setattr(b, "k_proj", nn.Linear(128, 128, dtype=torch.bfloat16)), "bias"),
        (lambda b: setattr(b, "k_proj", nn.Linear(128, 128, bias=False)), "bfloat16"),
        (lambda b: delattr(b, "v_proj"), "missing"),
        (lambda b: setattr(b, "k_proj", b.q_proj), "two names"),
        (lambda b: setattr(b, "other", nn.ModuleList([b.k_proj])), "shared"),
        (lambda b: setattr(b, "tied", nn.Linear(128, 128, bias=False, dtype=torch.bfloat16)), None),
    ],
)
def test_groups_that_cannot_fuse_are_left_alone(change, reason, caplog):
    block = Block()
    change(block)
    if reason is None:  # a tied weight
        block.tied.weight = block.v_proj.weight
        reason = "tied"
    with caplog.at_level("DEBUG", logger="w12"):
        assert w12.fuse_projections(block) == 0
    assert reason in caplog.text
    assert not any(type(m) in (_FusedLinear, _FusedW12Linear) for m in block.modules())


def test_w12_groups_need_whole_tiles_and_one_kind(caplog):
    block = w12.patch(Block(sizes=(64, 64, 128)), keep_if_larger=True)  # two members with partial tiles
    assert block.w12_report.fused_groups == 0
    mixed = w12.patch(Block(), include="q_proj", fuse=False)
    with caplog.at_level("DEBUG", logger="w12"):
        assert w12.fuse_projections(mixed) == 0
    assert "not all W12Linear or all nn.Linear" in caplog.text
    assert w12.fuse_projections(w12.patch(Block(), fuse=False), w12=False) == 0


def test_custom_groups_and_argument_errors():
    block = Block()
    assert w12.fuse_projections(block, groups=[("k_proj", "v_proj")]) == 1
    assert type(block.q_proj) is nn.Linear
    with pytest.raises(ValueError, match="two or more"):
        w12.fuse_projections(Block(), groups=[("q_proj",)])
    with pytest.raises(TypeError, match="sequence"):
        w12.fuse_projections(Block(), groups="q_proj")
    with pytest.raises(TypeError, match="nn.Module"):
        w12.fuse_projections("model")
    with pytest.raises(TypeError, match="nn.Module"):
        w12.unfuse_projections(None)


def test_import_stays_light():
    import subprocess
    import sys

    code = "import sys, w12; assert 'transformers' not in sys.modules; assert w12.fuse_projections and w12.unfuse_projections"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    env = {**os.environ, "W12_FUSE_FORCE": "1"}
    subprocess.run([sys.executable, "-c", "import w12.fuse as f; assert f._FORCE"], check=True, timeout=120, env=env)


# -- torch.compile -----------------------------------------------------------------------------
def _decode(model, backend=None, steps=4):
    """Prefill, then ``steps`` greedy decode steps on a StaticCache (compiled with ``backend``)."""
    import inspect

    tf = hf()
    cache = tf.StaticCache(config=model.config, max_cache_len=32)
    # Transformers 5.2x renamed past_key_values to cache (the old name warns).
    kw = {"cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values": cache}
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(input_ids=ids, cache_position=torch.arange(7), use_cache=True, **kw)

    def step(tok, pos):
        return model(input_ids=tok, cache_position=pos, use_cache=True, **kw).logits[:, -1]

    fn = step if backend is None else torch.compile(step, backend=backend, fullgraph=True)
    tok, res = out.logits[:, -1:].argmax(-1), []
    for i in range(steps):
        with torch.no_grad():
            lg = fn(tok, torch.tensor([7 + i]))
        res.append(lg.clone())
        tok = lg.argmax(-1, keepdim=True)
    return res


@pytest.mark.parametrize("backend,force", [("eager", False), ("graphs", True), ("inductor", True)])
def test_compile_fused_decode_one_graph(backend, force, monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setattr(fuse, "_FORCE", force)
    ref = _decode(w12.patch(make_model("llama"), fuse=False))
    model = w12.patch(make_model("llama"))
    graphs = []

    def record(gm, inputs):  # dynamo's graph as it is, run eagerly
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    out = _decode(model, record if backend == "graphs" else backend)
    # One graph for every step: no graph break, no recompilation per step.
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert idle(model)
    if backend == "graphs":
        (gm,) = graphs
        ns = [n.args[6] for n in gm.graph.nodes if n.op == "call_function" and "w12.linear" in str(n.target)]
        assert ns == [512, 256, 1024, 256] * 2 + [512]  # fused qkv, o, fused gate_up, down per layer; head
        # The fused tensors, reached through the member modules, are static inputs like module
        # buffers: CUDA-graph trees then neither copy them in each replay nor re-record.
        fused = [n for n in gm.graph.nodes if n.op == "placeholder" and "w12_group" in n.name]
        assert len(fused) == 4 * 5  # records, base, esc_ptr, esc_col, esc_val of 4 groups (no bias)
        assert all(n.meta["tensor_dict"].get("_dynamo_static_input_type") for n in fused)
    for a, b in zip(out, ref):
        if force:
            assert close(a, b) and torch.equal(a.argmax(-1), b.argmax(-1))
        else:
            assert same_bits(a, b)  # CPU inputs: each member's own exact path, compiled
    torch._dynamo.reset()
