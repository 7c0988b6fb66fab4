"""The W12 codec on the CPU: pack/unpack bit for bit, escapes, layouts, the 8-bit view, W12Weight,
error paths, w12.linear; and the converter's fused encoder against the reference, bit for bit."""

import pytest
import torch
from torch.nn.functional import linear as f_linear

import w12
from w12 import cpu_encoder, reference
from w12.format import BASE_MAX, BASE_MIN, HI_BYTES, RECORD_BYTES, TILE_ELEMS, TILE_K, TILE_N, WINDOW
from w12.weight import W12FormatError, W12Weight

ALL_BITS = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)  # every BF16 pattern


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def assert_roundtrip(t: torch.Tensor) -> W12Weight:
    w = w12.pack(t)
    assert w.shape == tuple(t.shape)
    out = w12.unpack(w)
    assert out.dtype == torch.bfloat16 and out.shape == t.shape
    assert torch.equal(bits(out), bits(t))
    fused = cpu_encoder.encode(t)
    for name, ref in zip(("records", "base", "esc_ptr", "esc_col", "esc_val"), w.tensors()):
        assert torch.equal(fused[name], ref), f"fused encoder differs from the reference in {name}"
    assert torch.equal(bits(cpu_encoder.decode(w)), bits(t)), "fused decoder differs"
    return w


def brute_base(row16: torch.Tensor) -> int:
    """The format's rule, spelled out: the b in [1, 239] with the most in-window elements, ties to the larger."""
    e = ((row16.to(torch.int32) >> 7) & 0xFF).tolist()
    best, best_b = -1, None
    for b in range(BASE_MIN, BASE_MAX + 1):
        n = sum(b <= x < b + WINDOW for x in e)
        if n >= best:
            best, best_b = n, b
    return best_b


def normal(shape, rng, std=0.02):
    return (torch.randn(shape, generator=rng) * std).to(torch.bfloat16)


# -- every bit pattern ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(256, 256), (1, 65536), (65536, 1), (128, 512), (512, 128)])
def test_all_bit_patterns_roundtrip(shape):
    assert_roundtrip(ALL_BITS.view(torch.bfloat16).reshape(shape))


def test_all_bit_patterns_transposed_rows():
    # Rows of [256, 256].T hold every exponent at once: most elements escape.
    t = ALL_BITS.view(torch.bfloat16).reshape(256, 256).t().contiguous()
    w = assert_roundtrip(t)
    assert w.escape_rate > 0.5


def test_all_bit_patterns_permuted_odd_shape(rng):
    perm = torch.randperm(65536, generator=rng)
    filler = normal(129 * 509 - 65536, rng)
    t = torch.cat([ALL_BITS[perm].view(torch.bfloat16), filler]).reshape(129, 509)
    assert_roundtrip(t)


@pytest.mark.parametrize("std", [0.02, 3e3, 1e-30])
def test_all_bit_patterns_inside_trained_rows(rng, std):
    """Each pattern sits in a row of trained-like weights whose window it may or may not fall in."""
    rows, per_row, k = 1024, 64, 333
    t = normal((rows, k), rng, std)
    cols = torch.stack([torch.randperm(k, generator=rng)[:per_row] for _ in range(rows)])
    t.view(torch.int16).scatter_(1, cols, ALL_BITS.reshape(rows, per_row))
    w = assert_roundtrip(t)
    assert 0 < w.nnz < t.numel()


# -- base choice, escapes ------------------------------------------------------------------------
def test_base_choice_matches_the_rule(rng):
    rows = []
    for i in range(40):
        # Two clusters of exponents whose windows compete; equal sizes exercise the tie rule.
        a, b = torch.randint(1, 250, (2,), generator=rng).tolist()
        na = int(torch.randint(1, 20, (1,), generator=rng))
        nb = na if i % 2 else int(torch.randint(1, 20, (1,), generator=rng))
        e = torch.tensor([a] * na + [b] * nb + [0, 255])
        m = torch.randint(0, 128, (e.numel(),), generator=rng)
        s = torch.randint(0, 2, (e.numel(),), generator=rng)
        row = (s << 15) | (e << 7) | m
        rows.append(torch.nn.functional.pad(row, (0, 44 - row.numel())).to(torch.int32).to(torch.int16))
    x = torch.stack(rows)
    w = assert_roundtrip(x.view(torch.bfloat16))
    assert w.base.tolist() == [brute_base(r) for r in x]


def test_all_zero_rows_escape_everywhere():
    """Zero rows escape in every slot of a record: every tile position goes through the escape path."""
    t = torch.zeros(TILE_N, TILE_K, dtype=torch.bfloat16)
    t[::2] = -0.0
    w = assert_roundtrip(t)
    assert w.nnz == TILE_ELEMS
    assert torch.equal(w.records, torch.zeros_like(w.records))
    assert w.esc_col.tolist() == list(range(TILE_K)) * TILE_N
    assert torch.equal(w.esc_ptr, torch.arange(0, TILE_ELEMS + 1, TILE_K, dtype=torch.int32))


@pytest.mark.parametrize("shift", [0, 1, 37, 63])
def test_escapes_in_every_tile_position(rng, shift):
    n, k = 2 * TILE_N + 3, 2 * TILE_K + 5
    t = normal((n, k), rng)
    r = torch.arange(n).unsqueeze(1)
    c = torch.arange(k).unsqueeze(0)
    mask = (r + c + shift) % 7 == 0
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, 1e30]).to(torch.bfloat16)
    vals = specials[torch.randint(0, specials.numel(), (n, k), generator=rng)]
    t = torch.where(mask, vals, t)
    w = assert_roundtrip(t)
    x16 = bits(t)
    # The escape list is exactly the out-of-window elements, columns ascending in each row.
    e = ((x16.to(torch.int32) >> 7) & 0xFF) - w.base.to(torch.int32).unsqueeze(1)
    outside = (e < 0) | (e >= WINDOW)
    assert w.nnz == int(outside.sum())
    for row in range(n):
        cols = w.esc_col[w.esc_ptr[row] : w.esc_ptr[row + 1]]
        assert cols.tolist() == outside[row].nonzero().flatten().tolist()
        assert torch.equal(w.esc_val[w.esc_ptr[row] : w.esc_ptr[row + 1]], x16[row, cols.long()])


def test_nan_payloads_and_signed_zero_survive():
    payloads = torch.tensor([0x7FC0, 0x7F81, 0xFFFF - 65536, 0x7FFF, 0x8000 - 65536, 0x0001, 0x8001 - 65536])
    t = payloads.to(torch.int16).view(torch.bfloat16).reshape(1, -1)
    assert_roundtrip(t)


# -- shapes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape",
    [(1, 1), (1, 63), (127, 65), (128, 64), (129, 64), (300, 77), (2, 130, 70), (3, 2, 5, 200), (4, 128, 129)],
)
def test_odd_shapes(rng, shape):
    t = normal(shape, rng)
    w = assert_roundtrip(t)
    *batch, n, k = shape
    assert tuple(w.records.shape) == (*batch, -(-n // TILE_N), -(-k // TILE_K), RECORD_BYTES)
    assert w.base.numel() == w.num_matrices * n and w.esc_ptr.numel() == w.num_matrices * n + 1


def test_stacked_matrices_are_independent(rng):
    """[E, N, K] encodes as E matrices: each slice equals packing that matrix alone."""
    t = normal((3, 131, 70), rng)
    t[1] *= 1e6  # a different window per matrix
    w = w12.pack(t)
    for e in range(3):
        one = w12.pack(t[e].contiguous())
        assert torch.equal(w.records[e], one.records)
        assert torch.equal(w.base[e * 131 : (e + 1) * 131], one.base)


def test_padding_slots_are_zero(rng):
    t = normal((130, 70), rng)
    w = w12.pack(t)
    codes = reference._records_to_codes(w.records)
    assert codes[130:].eq(0).all() and codes[:, 70:].eq(0).all()


# -- layouts ----------------------------------------------------------------------------------------
@pytest.fixture
def random_layout():
    perm = torch.randperm(TILE_ELEMS, generator=torch.Generator().manual_seed(4242))
    return w12.register_layout(9042, "test: random permutation", perm)


def test_layout_permutations_invert(rng, random_layout):
    t = normal((200, 150), rng)
    w = w12.pack(t)
    other = w12.convert_layout(w.records, 0, random_layout.id)
    assert not torch.equal(other, w.records)
    assert torch.equal(w12.convert_layout(other, random_layout.id, 0), w.records)
    # Slot i of the layout holds layout-0 element perm[i], in both planes.
    hi0, hiL = w.records[..., :HI_BYTES], other[..., :HI_BYTES]
    assert torch.equal(hiL, hi0[..., random_layout.perm])
    lo0 = torch.stack((w.records[..., HI_BYTES:] & 0xF, w.records[..., HI_BYTES:] >> 4), -1).flatten(-2)
    loL = torch.stack((other[..., HI_BYTES:] & 0xF, other[..., HI_BYTES:] >> 4), -1).flatten(-2)
    assert torch.equal(loL, lo0[..., random_layout.perm])


def test_unpack_in_any_layout(rng, random_layout):
    t = normal((2, 140, 90), rng)
    w = w12.pack(t, layout=random_layout.id)
    assert w.layout == random_layout.id
    assert torch.equal(bits(w12.unpack(w)), bits(t))
    assert torch.equal(w.with_layout(0).records, w12.pack(t).records)


def test_layout_registry_errors():
    with pytest.raises(ValueError, match="not a permutation"):
        w12.register_layout(9043, "bad", torch.zeros(TILE_ELEMS, dtype=torch.int64))
    with pytest.raises(ValueError, match="expected 8192"):
        w12.register_layout(9044, "short", torch.arange(10))
    with pytest.raises(ValueError, match="already registered"):
        w12.register_layout(0, "clash", torch.arange(TILE_ELEMS).flip(0))
    with pytest.raises(ValueError, match="unknown W12 record layout"):
        w12.get_layout(123456)


# -- 8-bit view -------------------------------------------------------------------------------------
def test_8bit_view_within_half_a_step(rng):
    t = normal((257, 130), rng)
    t[0, :10] = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e-39, 1e30, -1e30, 5.0, -7.0, 1e-8])
    w = w12.pack(t)
    approx, exact = bits(w12.unpack_8bit(w)), bits(t)
    esc = torch.zeros_like(exact, dtype=torch.bool)
    rows = torch.repeat_interleave(torch.arange(t.shape[0]), (w.esc_ptr[1:] - w.esc_ptr[:-1]).long())
    esc[rows, w.esc_col.long()] = True
    assert torch.equal(approx[esc], exact[esc])  # escapes stay exact
    inw = ~esc
    assert torch.equal(approx[inw] & ~0xF, exact[inw] & ~0xF)
    assert (approx[inw] & 0xF).eq(0x8).all()
    a = w12.unpack_8bit(w)[inw].double()
    e = t[inw].double()
    step = torch.ldexp(torch.ones_like(e), torch.frexp(e).exponent - 1 - 7 + 4)  # 16 mantissa ulps
    assert ((a - e).abs() <= step / 2).all()


# -- W12Weight --------------------------------------------------------------------------------------
def test_state_dict_roundtrip(rng, random_layout):
    t = normal((3, 150, 100), rng)
    w = w12.pack(t, layout=random_layout.id)
    sd = w.state_dict("model.layers.0.mlp.experts")
    assert sorted(sd) == sorted(
        f"model.layers.0.mlp.experts.w12_{s}" for s in ("records", "base", "esc_ptr", "esc_col", "esc_val")
    )
    assert torch.equal(sd["model.layers.0.mlp.experts.w12_records"], w12.pack(t).records)  # disk is layout 0
    back = W12Weight.from_state_dict(sd, "model.layers.0.mlp.experts", t.shape)
    assert torch.equal(bits(w12.unpack(back)), bits(t))
    assert w.to("cpu") is w or torch.equal(w.to("cpu").records, w.records)
    assert w.nbytes == sum(x.numel() * x.element_size() for x in w.tensors())
    assert w.bits_per_weight == pytest.approx(w.nbytes * 8 / t.numel())
    assert w.escape_rate == w.nnz / t.numel()
    with pytest.raises(W12FormatError, match="missing"):
        W12Weight.from_state_dict({}, "x", (4, 4))


def test_w12weight_validation_errors(rng):
    w = w12.pack(normal((130, 70), rng))
    with pytest.raises(W12FormatError, match="dtype"):
        W12Weight(w.records.to(torch.int16), *w.tensors()[1:], shape=w.shape)
    with pytest.raises(W12FormatError, match="needs"):
        W12Weight(*w.tensors(), shape=(131, 70))
    with pytest.raises(W12FormatError, match="esc_col"):
        W12Weight(*w.tensors()[:4], torch.zeros(w.nnz + 1, dtype=torch.int16), shape=w.shape)
    bad_ptr = w.esc_ptr.clone()
    bad_ptr[5] = bad_ptr[6] + 1
    with pytest.raises(W12FormatError, match="esc_ptr"):
        W12Weight(w.records, w.base, bad_ptr, w.esc_col, w.esc_val, shape=w.shape).check_escapes()
    bad_base = w.base.clone()
    bad_base[0] = 0
    with pytest.raises(W12FormatError, match="base"):
        W12Weight(w.records, bad_base, w.esc_ptr, w.esc_col, w.esc_val, shape=w.shape).check_escapes()


# -- public API errors ----------------------------------------------------------------------------
def test_pack_errors(rng):
    with pytest.raises(TypeError, match="bfloat16"):
        w12.pack(torch.zeros(4, 4))
    with pytest.raises(TypeError, match="torch.Tensor"):
        w12.pack([[1.0]])
    with pytest.raises(ValueError, match="rank"):
        w12.pack(torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="empty"):
        w12.pack(torch.zeros(0, 4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16"):
        cpu_encoder.encode(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="rank"):
        cpu_encoder.encode(torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="empty"):
        cpu_encoder.encode(torch.zeros(4, 0, dtype=torch.bfloat16))


def test_unpack_and_linear_errors(rng):
    w = w12.pack(normal((16, 32), rng))
    with pytest.raises(TypeError, match="W12Weight"):
        w12.unpack(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="features"):
        w12.linear(torch.zeros(2, 31, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="bias"):
        w12.linear(torch.zeros(2, 32, dtype=torch.bfloat16), w, torch.zeros(15, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D"):
        w12.linear(torch.zeros(2, 32, dtype=torch.bfloat16), w12.pack(normal((2, 16, 32), rng)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("xshape", [(1, 70), (5, 70), (2, 3, 70)])
def test_linear_matches_f_linear(rng, dtype, xshape):
    wt = normal((131, 70), rng)
    x = torch.randn(xshape, generator=rng).to(dtype)
    bias = torch.randn(131, generator=rng).to(dtype)
    w = w12.pack(wt)
    for b in (None, bias):
        got = w12.linear(x, w, b)
        want = f_linear(x, wt.to(dtype), b)
        assert got.dtype == want.dtype and torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))


# -- the fused encoder ---------------------------------------------------------------------------
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fused_encoder_threads_agree(rng, threads):
    t = normal((5, 300, 130), rng)
    t.view(-1)[::97] = 0.0
    ref = reference.encode(t)
    got = cpu_encoder.encode(t, threads=threads)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_fused_encoder_backend_choice(monkeypatch, rng):
    t = normal((20, 30), rng)
    monkeypatch.setenv("W12_CPU_ENCODER", "torch")
    assert cpu_encoder.backend() == "torch"
    ref = cpu_encoder.encode(t)
    monkeypatch.setenv("W12_CPU_ENCODER", "bogus")
    with pytest.raises(ValueError, match="W12_CPU_ENCODER"):
        cpu_encoder.backend()
    if cpu_encoder._load() is None:
        pytest.skip(f"no fused encoder here: {cpu_encoder._lib_error}")
    monkeypatch.setenv("W12_CPU_ENCODER", "c")
    assert cpu_encoder.backend() == "c"
    assert all(torch.equal(cpu_encoder.encode(t)[k], v) for k, v in ref.items())


def test_fused_decoder_reused_buffers_and_bad_escapes(rng):
    t = normal((2, 200, 130), rng)
    t.view(-1)[::53] = 0.0
    ref = reference.encode(t)
    buf = torch.full((cpu_encoder.records_nbytes(t.shape) + 100,), 0xA5, dtype=torch.uint8)  # dirty memory
    got = cpu_encoder.encode(t, out=buf)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    with pytest.raises(ValueError, match="at least"):
        cpu_encoder.encode(t, out=torch.empty(10, dtype=torch.uint8))
    w = W12Weight(**ref, shape=t.shape)
    assert torch.equal(bits(cpu_encoder.decode(w)), bits(t))
    if cpu_encoder.backend() == "c" and w.nnz:
        col = w.esc_col.clone()
        col[0] = 10**6
        with pytest.raises(W12FormatError, match="outside"):
            cpu_encoder.decode(W12Weight(w.records, w.base, w.esc_ptr, col, w.esc_val, shape=t.shape))
