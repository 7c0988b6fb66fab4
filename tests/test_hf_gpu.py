"""W12 in Transformers on a CUDA GPU (run on the device machine: ``pytest -m gpu tests/test_hf_gpu.py -s``).

On the GPU the W12 GEMM is not bit-identical to cuBLAS (a different summation order), so greedy
decoding is compared token by token, and where a near-tie flips a token the log-prob margin of
the BF16 model at the first divergence is reported and must stay below 0.25 nat.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _hf_gpu_models import MAX_MARGIN, NEW_TOKENS, divergence_margin, greedy, prompts, small_llama  # noqa: E402

import w12  # noqa: E402
from w12 import cuda_ops  # noqa: E402
from w12.nn import W12Linear  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models():
    ref = small_llama()
    patched = w12.patch(copy.deepcopy(ref))
    assert len(patched.w12_report.converted) == 4 * 7 + 1
    return ref, patched


def test_kernels_in_use(models):
    _, patched = models
    if not cuda_ops.available():
        pytest.fail("w12 CUDA kernels are not built: the GPU tests would only exercise the reference path")
    layouts = {m.layout for m in patched.modules() if isinstance(m, W12Linear)}
    assert layouts == {cuda_ops.preferred_layout("cuda")}


def test_greedy_generate_matches_bf16(models):
    ref, patched = models
    report = []
    for prompt in prompts():
        a, b = greedy(ref, prompt), greedy(patched, prompt)
        i, margin = divergence_margin(ref, prompt, a, b)
        report.append((prompt.shape[1], i, margin))
        assert margin < MAX_MARGIN, (
            f"prompt of {prompt.shape[1]} tokens: divergence at {i} with margin {margin:.3f} nat"
        )
    print("\n(prompt length, first divergence, BF16 margin nat):", report)


def test_compile_reduce_overhead_static_cache(models):
    _, patched = models
    cc = transformers.CompileConfig(mode="reduce-overhead", fullgraph=True)
    prompt = prompts()[1]
    kw = dict(cache_implementation="static", compile_config=cc)
    first = greedy(patched, prompt, **kw)
    again = greedy(patched, prompt, **kw)  # replays the captured graphs
    assert first.shape == (NEW_TOKENS,) and torch.equal(first, again)
    eager = greedy(patched, prompt, cache_implementation="static", disable_compile=True)
    i, margin = divergence_margin(patched, prompt, eager, first)
    print(f"\ncompiled vs eager W12: first divergence {i}, margin {margin:.3f} nat")
    assert margin < MAX_MARGIN


def test_save_and_load_on_gpu(models, tmp_path):
    _, patched = models
    patched.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cuda")
    mods = [m for m in loaded.modules() if isinstance(m, W12Linear)]
    assert len(mods) == len(patched.w12_report.converted)
    assert all(m.w12_records.is_cuda for m in mods)
    ids = prompts()[2]
    with torch.no_grad():
        a, b = patched(ids).logits, loaded(ids).logits
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "same records, same kernels: same bits"


def test_gpu_state_dict_is_layout0_and_matches_cpu_pack():
    torch.manual_seed(3)
    lin = torch.nn.Linear(640, 384, dtype=torch.bfloat16)
    cpu = W12Linear.from_linear(lin)
    gpu = W12Linear.from_linear(copy.deepcopy(lin).cuda())
    for key, t in cpu.state_dict().items():
        assert torch.equal(gpu.state_dict()[key].cpu(), t), key
    back = gpu.to_linear()
    assert torch.equal(back.weight.cpu().view(torch.int16), lin.weight.view(torch.int16))
    moved = cpu.cuda()
    assert moved.layout == gpu.layout
    assert torch.equal(moved.w12_records, gpu.w12_records)


def test_unpatch_on_gpu_restores_bf16(models):
    ref, patched = models
    restored = w12.unpatch(copy.deepcopy(patched))
    for (name, p), (_, q) in zip(ref.named_parameters(), restored.named_parameters()):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16)), name
