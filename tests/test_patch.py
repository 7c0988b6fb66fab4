"""W12Linear and w12.patch / w12.unpatch on plain PyTorch modules (CPU reference path)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import w12
from w12.format import TENSOR_SUFFIXES, register_layout
from w12.nn import W12Linear
from w12.patch import PatchReport


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t.view(torch.int32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def make_linear(n, k, bias, rng, special=False):
    lin = nn.Linear(k, n, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        w = torch.randn(n, k, generator=rng) * 0.05
        if special:
            # Every awkward bit pattern: both zeros, subnormals, infinities, NaN payloads, far-out exponents.
            flat = w.view(-1)
            vals = [0.0, -0.0, float("inf"), float("-inf"), 1e-40, -3e-39, 3e38, 1e-30]
            for i, v in enumerate(vals):
                if i < flat.numel():
                    flat[i * 7 % flat.numel()] = v
        lin.weight.copy_(w.to(torch.bfloat16))
        if special and n * k > 3:
            lin.weight.view(torch.int16).view(-1)[3] = 0x7FC1  # a NaN with a payload
        if bias:
            lin.bias.copy_((torch.randn(n, generator=rng) * 0.1).to(torch.bfloat16))
    return lin


SHAPES = [(1, 1), (3, 5), (127, 65), (128, 64), (130, 200), (256, 128)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_w12linear_forward_bit_identical(n, k, bias, rng):
    lin = make_linear(n, k, bias, rng)
    m = W12Linear.from_linear(lin)
    for xshape in [(k,), (3, k), (2, 5, k)]:
        x = torch.randn(*xshape, generator=rng).to(torch.bfloat16)
        assert same_bits(m(x), lin(x)), xshape
    x32 = torch.randn(4, k, generator=rng)
    assert torch.equal(
        m(x32), nn.functional.linear(x32, lin.weight.float(), None if lin.bias is None else lin.bias.float())
    )


@pytest.mark.parametrize("n,k", [(5, 7), (130, 200)])
def test_special_values_roundtrip(n, k, rng):
    lin = make_linear(n, k, True, rng, special=True)
    m = W12Linear.from_linear(lin)
    assert m.w12_esc_col.numel() > 0
    back = m.to_linear()
    assert same_bits(back.weight.data, lin.weight.data)
    assert same_bits(back.bias.data, lin.bias.data)
    assert same_bits(m.dequantized_weight(), lin.weight.data)


def test_state_dict_names_and_reload(rng):
    lin = make_linear(130, 200, True, rng, special=True)
    m = W12Linear.from_linear(lin)
    sd = m.state_dict()
    assert sorted(sd) == sorted([*TENSOR_SUFFIXES, "bias"])
    assert sd["w12_records"].shape == (2, 4, 12288) and sd["w12_records"].dtype == torch.uint8
    # A fresh module with a different escape count takes the checkpoint's tensors.
    fresh = W12Linear(200, 130, bias=True, nnz=0)
    fresh.load_state_dict(sd)
    x = torch.randn(3, 200, generator=rng).to(torch.bfloat16)
    assert same_bits(fresh(x), m(x))
    assert fresh.w12_esc_col.numel() == m.w12_esc_col.numel()


def test_state_dict_wrong_dtype_is_an_error(rng):
    m = W12Linear.from_linear(make_linear(128, 64, False, rng))
    sd = m.state_dict()
    sd["w12_base"] = sd["w12_base"].to(torch.int32)
    with pytest.raises(RuntimeError, match="w12_base"):
        W12Linear(64, 128, bias=False).load_state_dict(sd)


def test_empty_escape_tensors_do_not_alias(rng):
    m = W12Linear.from_linear(make_linear(128, 64, False, rng))
    assert m.w12_esc_col.numel() == 0
    sd = m.state_dict()
    ptrs = {sd[k].untyped_storage().data_ptr() for k in ("w12_esc_col", "w12_esc_val")}
    assert 0 not in ptrs and len(ptrs) == 2


def test_state_dict_is_layout0_whatever_the_device_layout(rng):
    perm = torch.arange(8192).view(128, 64).t().reshape(-1)  # column-major slots
    register_layout(201, "test column-major", perm)
    lin = make_linear(130, 200, True, rng, special=True)
    ref = W12Linear.from_linear(lin, layout=0)
    m = W12Linear.from_linear(lin, layout=201)
    assert m.layout == 201 and not torch.equal(m.w12_records, ref.w12_records)
    assert torch.equal(m.state_dict()["w12_records"], ref.w12_records)
    x = torch.randn(2, 200, generator=rng).to(torch.bfloat16)
    assert same_bits(m(x), lin(x))
    fresh = W12Linear(200, 130)
    fresh.load_state_dict(m.state_dict())
    assert fresh.layout == 0 and same_bits(fresh(x), lin(x))


def test_from_weight_and_errors(rng):
    w = w12.pack(torch.randn(4, 3, 8, generator=rng).to(torch.bfloat16))
    with pytest.raises(ValueError, match="2-D"):
        W12Linear.from_weight(w)
    with pytest.raises(TypeError, match="W12Weight"):
        W12Linear.from_weight(torch.zeros(3, 3))
    w2 = w12.pack(torch.randn(6, 8, generator=rng).to(torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        W12Linear.from_weight(w2, bias=torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16"):
        W12Linear.from_linear(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="positive"):
        W12Linear(0, 4)


def test_meta_module_fails_validation():
    m = W12Linear(64, 128, device="meta")
    with pytest.raises(w12.W12FormatError, match="meta"):
        m.validate("x.y")


class Tiny(nn.Module):
    def __init__(self, rng):
        super().__init__()
        self.emb = nn.Embedding(50, 128, dtype=torch.bfloat16)
        self.up = make_linear(256, 128, True, rng)
        self.down = make_linear(128, 256, False, rng)
        self.small = make_linear(16, 128, False, rng)
        self.f32 = nn.Linear(128, 128)
        self.head = nn.Linear(128, 50, bias=False, dtype=torch.bfloat16)
        self.head.weight = self.emb.weight  # tied
        self.shared = self.down  # the same module under two names

    def get_input_embeddings(self):
        return self.emb

    def get_output_embeddings(self):
        return self.head

    def forward(self, ids):
        h = self.emb(ids)
        h = self.down(torch.relu(self.up(h))) + self.small(h).sum(-1, keepdim=True)
        h = h + self.f32(h.float()).to(h.dtype)
        return self.head(h)


def test_patch_plain_module(rng):
    model = Tiny(rng).eval()
    ids = torch.randint(0, 50, (2, 7), generator=rng)
    ref = model(ids)
    out_model = w12.patch(model)
    assert out_model is model
    rep = model.w12_report
    assert isinstance(rep, PatchReport)
    assert {c["name"] for c in rep.converted} == {"up", "down"}
    reasons = dict(rep.skipped)
    assert "too small" in reasons["small"]
    assert "float32" in reasons["f32"]
    assert "tied" in reasons["head"]
    assert isinstance(model.shared, W12Linear) and model.shared is model.down
    assert same_bits(model(ids), ref)
    assert "converted 2" in str(rep)
    w12.unpatch(model)
    assert type(model.up) is nn.Linear and model.shared is model.down
    assert not hasattr(model, "w12_report")
    assert same_bits(model(ids), ref)


def test_patch_tied_head_on_request(rng):
    model = Tiny(rng).eval()
    ids = torch.randint(0, 50, (2, 7), generator=rng)
    ref = model(ids)
    w12.patch(model, lm_head=True, keep_if_larger=True)
    assert isinstance(model.head, W12Linear) and isinstance(model.emb, nn.Embedding)
    assert isinstance(model.small, W12Linear)
    assert same_bits(model(ids), ref)


@pytest.mark.parametrize(
    "kwargs,converted",
    [
        (dict(include="up"), {"up"}),
        (dict(include=["u*", "d*"]), {"up", "down"}),
        (dict(exclude="d*"), {"up"}),
        (dict(include=lambda name, m: m.out_features == 128), {"down"}),
        (dict(lm_head=False, keep_if_larger=True), {"up", "down", "small"}),
    ],
)
def test_patch_selection(kwargs, converted, rng):
    model = Tiny(rng)
    w12.patch(model, **kwargs)
    assert {c["name"] for c in model.w12_report.converted} == converted
    skipped = dict(model.w12_report.skipped)
    for name in {"up", "down", "small", "head", "f32"} - converted:
        assert name in skipped, name


def test_patch_errors(rng):
    with pytest.raises(TypeError, match="nn.Module"):
        w12.patch(torch.zeros(3))
    with pytest.raises(ValueError, match="lm_head"):
        w12.patch(Tiny(rng), lm_head="yes")
    with pytest.raises(TypeError, match="glob"):
        w12.patch(Tiny(rng), include=[3])
    with pytest.raises(TypeError, match="nn.Module"):
        w12.unpatch("model")


def test_patch_meta_and_subclass_skipped():
    seq = nn.Sequential(nn.Linear(128, 256, dtype=torch.bfloat16, device="meta"))
    w12.patch(seq)
    assert "meta" in dict(seq.w12_report.skipped)["0"]
    mha = nn.MultiheadAttention(128, 4, dtype=torch.bfloat16)
    w12.patch(mha)
    assert "reads .weight" in dict(mha.w12_report.skipped)["out_proj"]


def test_patch_twice_accumulates_report(rng):
    model = Tiny(rng)
    w12.patch(model, include="up")
    w12.patch(model, include="down")
    assert {c["name"] for c in model.w12_report.converted} == {"up", "down"}


def test_compile_traces_through_the_op(rng):
    lin = make_linear(256, 128, True, rng)
    m = W12Linear.from_linear(lin)
    x = torch.randn(3, 128, generator=rng).to(torch.bfloat16)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    assert same_bits(compiled(x), lin(x))
