"""GPU codec (w12.cuda_codec): encode, decode and layout permutation, bitwise against the CPU reference.

Every GPU result is compared byte for byte with ``w12.reference`` (the one definition of the
format), on random and adversarial weights. The error-path tests at the end need no GPU.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import w12
from w12 import cuda_codec, reference
from w12 import format as format_module
from w12.format import RECORD_BYTES, TILE_ELEMS, get_layout, register_layout, registered_layouts
from w12.format import convert_layout as cpu_convert_layout
from w12.weight import W12Weight

PARTS = ("records", "base", "esc_ptr", "esc_col", "esc_val")
TEST_LAYOUT_ID = 250  # a test-only random permutation; real layouts use small ids

gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def kernels():
    if not cuda_codec.available():
        pytest.fail("w12 CUDA codec kernels are not available (build w12/_kernels/libw12.so)")
    return True


# -- weights --------------------------------------------------------------------------------------


def realistic(shape, gen) -> torch.Tensor:
    """Gaussian rows with per-row scales over many binades (as in trained weights), plus exact zeros."""
    scale = torch.exp2(torch.randint(-20, 6, (*shape[:-1], 1), generator=gen).float())
    x = torch.randn(shape, generator=gen) * scale
    x[torch.rand(shape, generator=gen) < 1e-3] = 0.0
    return x.to(torch.bfloat16)


def random_bits(shape, gen) -> torch.Tensor:
    """Uniformly random bit patterns: every exponent, NaN payloads, infs, subnormals, mostly escapes."""
    return torch.randint(-32768, 32768, shape, generator=gen, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def all_patterns(rows: int, gen, shuffle: bool) -> torch.Tensor:
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    if shuffle:
        bits = bits[torch.randperm(bits.numel(), generator=gen)]
    return bits.view(rows, -1).view(torch.bfloat16)


SPECIALS = torch.tensor(
    [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFFF, 0x7F81, 0x0001, 0x807F, 0x0040, 0x7F7F, 0x0080],
    dtype=torch.int32,
).to(torch.int16)


def escapes_everywhere(gen) -> torch.Tensor:
    """Escapes (zeros, subnormals, inf, NaN) planted so that every (row, col) slot of a record holds
    one somewhere: K-tile j gets the slots with (r + c) % 3 == j % 3, for two row tiles and nine
    K tiles (wider than the decoder's 512-column thread groups)."""
    x = realistic((256, 576), gen).view(torch.int16).clone()
    r = torch.arange(256).unsqueeze(1) % 128
    c = torch.arange(576).unsqueeze(0)
    mask = (r + c % 64) % 3 == (c // 64) % 3
    x[mask] = SPECIALS[torch.randint(0, SPECIALS.numel(), (int(mask.sum()),), generator=gen)]
    return x.view(torch.bfloat16)


def escape_rows(gen) -> torch.Tensor:
    """Rows that are all (or almost all) escapes, between ordinary rows."""
    x = realistic((140, 200), gen).view(torch.int16).clone()
    x[3] = 0
    x[4] = torch.tensor(0x7FC3, dtype=torch.int16)  # NaN with a payload
    x[5, 0::2], x[5, 1::2] = 0x7F80, -128  # +inf / -inf (0xFF80)
    x[6] = torch.randint(1, 128, (200,), generator=gen).to(torch.int16)  # subnormals
    # exponents spread over 1..254: no 16-binade window holds more than a few of them
    e = torch.randint(1, 255, (200,), generator=gen).to(torch.int16)
    x[7] = (e << 7) | torch.randint(0, 128, (200,), generator=gen).to(torch.int16)
    x[139] = 0  # the last real row, followed by padding rows
    return x.view(torch.bfloat16)


# -- comparison helpers -----------------------------------------------------------------------------


def assert_equal_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.detach().cpu(), want.detach().cpu()
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype in (torch.bfloat16, torch.float16):
        got, want = got.view(torch.int16), want.view(torch.int16)
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        first = tuple(bad[0].tolist())
        raise AssertionError(
            f"{what}: {bad.shape[0]} of {got.numel()} entries differ; first at {first}: got {got[first].item()}, "
            f"want {want[first].item()}"
        )


def assert_same_encoding(w: W12Weight, ref: dict, what: str) -> None:
    for name in PARTS:
        assert_equal_bits(getattr(w, name), ref[name], f"{what}: {name}")


def poison_allocator(nbytes: int = 64 << 20) -> None:
    """Leaves 0xA5 garbage in the caching allocator's free blocks, so an output byte the kernel
    forgets to write differs from the reference instead of being a lucky zero."""
    junk = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device="cuda")
    del junk


SHAPES = [
    (1, 1),
    (1, 64),
    (128, 64),
    (129, 65),
    (127, 63),
    (3, 1000),
    (300, 1000),
    (257, 4104),  # K % 16 == 8: the decoder's last 16-column chunk is half outside
    (130, 4097),  # odd K: scalar paths
    (2, 130, 72),  # stacked experts
    (3, 5, 129, 200),  # two batch dims
]


# -- encode ---------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", ["realistic", "random_bits"])
def test_pack_matches_reference(kernels, rng, shape, kind):
    x = (realistic if kind == "realistic" else random_bits)(shape, rng)
    poison_allocator()
    w = cuda_codec.pack(x.cuda())
    assert w.device.type == "cuda" and w.layout == 0 and w.shape == shape
    assert_same_encoding(w, reference.encode(x), f"pack {kind} {shape}")


@gpu
@pytest.mark.parametrize("rows,shuffle", [(256, False), (256, True), (64, True), (1024, True)])
def test_pack_all_bit_patterns(kernels, rng, rows, shuffle):
    x = all_patterns(rows, rng, shuffle)
    poison_allocator()
    w = cuda_codec.pack(x.cuda())
    assert_same_encoding(w, reference.encode(x), f"all 65536 patterns as {rows} rows")
    assert_equal_bits(cuda_codec.unpack(*w.tensors(), w.N, w.K), x, "decode of all patterns")


@gpu
@pytest.mark.parametrize("make", [escapes_everywhere, escape_rows], ids=["every_tile_slot", "escape_rows"])
def test_pack_adversarial(kernels, rng, make):
    x = make(rng)
    poison_allocator()
    w = cuda_codec.pack(x.cuda())
    ref = reference.encode(x)
    assert int(ref["esc_ptr"][-1]) > 0
    assert_same_encoding(w, ref, make.__name__)
    assert_equal_bits(cuda_codec.unpack(*w.tensors(), w.N, w.K), x, f"{make.__name__} round trip")


@gpu
def test_pack_large_stack(kernels, rng):
    """Many blocks of both passes, with escapes scattered over a few thousand rows."""
    x = realistic((3, 1100, 3000), rng)
    w = cuda_codec.pack(x.cuda())
    assert_same_encoding(w, reference.encode(x), "stack [3, 1100, 3000]")


@gpu
def test_public_pack_and_unpack_use_the_gpu(kernels, rng):
    x = realistic((2, 200, 320), rng)
    w = w12.pack(x.cuda())
    assert w.device.type == "cuda"
    assert_same_encoding(w, reference.encode(x), "w12.pack on CUDA")
    assert_equal_bits(w12.unpack(w), x, "w12.unpack on CUDA")
    ref8 = reference.decode(*w.cpu().tensors(), w.N, w.K, 0, True)
    assert_equal_bits(w12.unpack_8bit(w), ref8.view(x.shape), "w12.unpack_8bit on CUDA")


@gpu
def test_pack_on_a_side_stream_and_unaligned_view(kernels, rng):
    x = realistic((300, 520), rng)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        w = cuda_codec.pack(x.cuda())
        y = cuda_codec.unpack(*w.tensors(), w.N, w.K)
    s.synchronize()
    assert_same_encoding(w, reference.encode(x), "pack on a side stream")
    assert_equal_bits(y, x, "unpack on a side stream")
    # a contiguous view starting 2 bytes into its storage: not 16-byte aligned, the scalar path
    flat = torch.cat([torch.zeros(1, dtype=torch.bfloat16), x.flatten()]).cuda()
    view = flat[1:].view(300, 520)
    assert view.data_ptr() % 16 != 0
    assert_same_encoding(cuda_codec.pack(view), reference.encode(x), "pack of an unaligned view")


# -- decode ---------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("eight_bit", [False, True], ids=["exact", "8bit"])
def test_unpack_matches_reference(kernels, rng, shape, eight_bit):
    x = random_bits(shape, rng) if len(shape) == 2 and shape[0] % 2 else realistic(shape, rng)
    ref = reference.encode(x)
    n, k = shape[-2], shape[-1]
    want = reference.decode(*(ref[p] for p in PARTS), n, k, 0, eight_bit)
    for variant in (-1, 0, 1):  # the library's default and each decode kernel variant
        poison_allocator()
        got = cuda_codec.unpack(*(ref[p].cuda() for p in PARTS), n, k, 0, eight_bit, _variant=variant)
        assert_equal_bits(got, want, f"unpack {shape} eight_bit={eight_bit} variant={variant}")
        if not eight_bit:
            assert_equal_bits(got, x, f"unpack {shape} is lossless")


@gpu
@pytest.mark.parametrize("make", [escapes_everywhere, escape_rows], ids=["every_tile_slot", "escape_rows"])
def test_unpack_8bit_adversarial(kernels, rng, make):
    x = make(rng)
    ref = reference.encode(x)
    want = reference.decode(*(ref[p] for p in PARTS), *x.shape, 0, True)
    for variant in (0, 1):
        got = cuda_codec.unpack(*(ref[p].cuda() for p in PARTS), *x.shape, 0, True, _variant=variant)
        assert_equal_bits(got, want, f"8-bit view of {make.__name__}, variant {variant}")


# -- layouts --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def layouts():
    """Every registered non-reference layout plus a test-only random permutation (removed afterwards,
    so other tests that walk the registry never see it)."""
    try:  # the GEMM kernels' layouts, when that module exists
        import w12.layouts  # noqa: F401
    except ImportError:
        pass
    perm = torch.randperm(TILE_ELEMS, generator=torch.Generator().manual_seed(250))
    register_layout(TEST_LAYOUT_ID, "test: random permutation", perm)
    yield sorted(i for i in registered_layouts() if i != 0)
    with format_module._LOCK:
        format_module._LAYOUTS.pop(TEST_LAYOUT_ID, None)


@gpu
@pytest.mark.parametrize("shape", [(1, 1, 12288), (2, 3, 12288), (700, 12288)], ids=["1rec", "6rec", "700rec"])
def test_convert_layout_matches_cpu_and_round_trips(kernels, layouts, shape):
    gen = torch.Generator().manual_seed(7)
    rec = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    for lay in layouts:
        poison_allocator()
        fwd = cuda_codec.convert_layout(rec.cuda(), 0, lay)
        assert_equal_bits(fwd, cpu_convert_layout(rec, 0, lay), f"layout 0 -> {lay} ({get_layout(lay).name})")
        back = cuda_codec.convert_layout(fwd, lay, 0)
        assert_equal_bits(back, rec, f"layout {lay} -> 0 round trip")
    for a in layouts:  # between two non-reference layouts directly (split or not on either side)
        mid = cuda_codec.convert_layout(rec.cuda(), 0, a)
        for b in layouts:
            if b != a:
                got = cuda_codec.convert_layout(mid, a, b)
                assert_equal_bits(got, cpu_convert_layout(rec, 0, b), f"layout {a} -> {b}")


@gpu
def test_unpack_from_other_layouts(kernels, layouts, rng):
    x = realistic((2, 150, 130), rng)
    w = cuda_codec.pack(x.cuda())
    for lay in layouts:
        moved = W12Weight(cuda_codec.convert_layout(w.records, 0, lay), *w.tensors()[1:], shape=w.shape, layout=lay)
        assert_equal_bits(w12.unpack(moved), x, f"unpack from layout {lay}")
        ref8 = reference.decode(*w.cpu().tensors(), w.N, w.K, 0, True)
        assert_equal_bits(w12.unpack_8bit(moved), ref8.view(x.shape), f"8-bit view from layout {lay}")


# The GEMM kernels' layouts (3: Hopper, 4: mma.sync; 1: the older one, through a permutation) decode
# without going back to layout 0 first (the prefill fallback of w12.linear).
DIRECT_LAYOUTS = [1, 3, 4]


@gpu
@pytest.mark.parametrize("lay", DIRECT_LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES + [(3, 200, 136)], ids=lambda s: "x".join(map(str, s)))
def test_unpack_gemm_layouts_direct(kernels, rng, shape, lay):
    # Vector stores where K % 8 == 0, per-element ones elsewhere, rows and columns past the tile.
    x = realistic(shape, rng)
    w = cuda_codec.pack(x.cuda())
    rec = cuda_codec.convert_layout(w.records, 0, lay)
    got = cuda_codec.unpack(rec, *w.tensors()[1:], w.N, w.K, lay)
    assert_equal_bits(got.view(x.shape), x, f"layout-{lay} decode of {shape}")


@gpu
@pytest.mark.parametrize("lay", DIRECT_LAYOUTS)
@pytest.mark.parametrize("make", [escapes_everywhere, escape_rows], ids=["every_tile_slot", "escape_rows"])
def test_unpack_gemm_layouts_adversarial(kernels, rng, make, lay):
    x = make(rng)
    w = cuda_codec.pack(x.cuda())
    rec = cuda_codec.convert_layout(w.records, 0, lay)
    got = cuda_codec.unpack(rec, *w.tensors()[1:], w.N, w.K, lay)
    assert_equal_bits(got.view(x.shape), x, f"layout-{lay} decode, {make.__name__}")
    pats = all_patterns(256, rng, True)
    wp = cuda_codec.pack(pats.cuda())
    got = cuda_codec.unpack(cuda_codec.convert_layout(wp.records, 0, lay), *wp.tensors()[1:], wp.N, wp.K, lay)
    assert_equal_bits(got, pats, f"layout-{lay} decode of all 65536 patterns")


# -- errors ---------------------------------------------------------------------------------------


@gpu
def test_gpu_bad_inputs(kernels, rng):
    x = realistic((256, 128), rng).cuda()
    with pytest.raises(ValueError, match="contiguous"):
        cuda_codec.pack(x.t())
    with pytest.raises(TypeError, match="bfloat16"):
        cuda_codec.pack(x.half())
    with pytest.raises(ValueError, match="rank"):
        cuda_codec.pack(x[0])
    w = cuda_codec.pack(x)
    with pytest.raises(ValueError, match=r"records have shape"):
        cuda_codec.unpack(*w.tensors(), 300, 128)
    with pytest.raises(ValueError, match="esc_col must be a CUDA tensor"):
        cuda_codec.unpack(w.records, w.base, w.esc_ptr, w.esc_col.cpu(), w.esc_val, 256, 128)
    with pytest.raises(TypeError, match="esc_val must be torch.int16"):
        cuda_codec.unpack(w.records, w.base, w.esc_ptr, w.esc_col, w.esc_col, 256, 128)
    with pytest.raises(ValueError, match="base"):
        cuda_codec.unpack(w.records, w.base[1:], w.esc_ptr, w.esc_col, w.esc_val, 256, 128)
    with pytest.raises(TypeError, match="uint8"):
        cuda_codec.convert_layout(w.records.view(torch.int8), 0, 0)
    with pytest.raises(ValueError, match="unknown W12 record layout"):
        cuda_codec.convert_layout(w.records, 0, 12345)


def test_cpu_tensors_are_refused_with_a_clear_message():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        cuda_codec.pack(x)
    with pytest.raises(TypeError, match="bfloat16"):
        cuda_codec.pack(x.float())
    rec = torch.zeros(1, 1, RECORD_BYTES, dtype=torch.uint8)
    with pytest.raises(ValueError, match="records must be a CUDA tensor"):
        cuda_codec.unpack(rec, rec[0, 0, :4], torch.zeros(5, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                          torch.zeros(0, dtype=torch.int16), 4, 64)  # fmt: skip
    with pytest.raises(ValueError, match="records must be a CUDA tensor"):
        cuda_codec.convert_layout(rec, 0, 0)


def test_unpack_op_has_a_cuda_kernel():
    # registered at import (w12.ops imports w12.cuda_codec), without loading the library
    assert torch._C._dispatch_has_kernel_for_dispatch_key("w12::unpack", "CUDA")


def test_import_does_not_initialise_cuda():
    code = "import torch, w12, w12.cuda_codec; assert not torch.cuda.is_initialized(); print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
