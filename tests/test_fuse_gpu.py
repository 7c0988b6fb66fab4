"""Fused projections on a CUDA GPU (run on the device machine: ``pytest -m gpu tests/test_fuse_gpu.py -s``).

The fused GEMM covers more rows than each member's, so its kernel choice and K-split may differ
and its bits need not equal the unfused GEMMs': logits are compared with a tolerance, and greedy
tokens token by token with the margin rule of ``test_hf_gpu.py`` at a divergence.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _hf_gpu_models import MAX_MARGIN, NEW_TOKENS, divergence_margin, greedy, prompts, small_llama  # noqa: E402

import w12  # noqa: E402
from w12 import cuda_ops, fuse  # noqa: E402
from w12.fuse import fused_groups  # noqa: E402
from w12.nn import W12Linear  # noqa: E402

pytestmark = pytest.mark.gpu

MAX_REL_DIFF = 1e-2
GROUPS = 4 * 2  # q/k/v and gate/up of 4 layers


def rel_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item() / b.float().abs().max().item()


def idle(model) -> bool:
    return all(g._cache is None and g._mask == 0 for g in fused_groups(model))


@pytest.fixture(scope="module")
def models():
    if not cuda_ops.available():
        pytest.fail("w12 CUDA kernels are not built: the GPU tests would only exercise the reference path")
    ref = small_llama()
    unfused = w12.patch(copy.deepcopy(ref), fuse=False)
    fused = w12.patch(copy.deepcopy(ref))
    assert fused.w12_report.fused_groups == GROUPS and fused_groups(unfused) == []
    return ref, unfused, fused


def test_fused_gemm_runs_on_cuda(models, monkeypatch):
    _, _, fused = models
    calls = []
    real = fuse._Group._linear
    monkeypatch.setattr(fuse._Group, "_linear", lambda self, x: calls.append(self.n) or real(self, x))
    with torch.no_grad():
        fused(prompts()[0])
    assert sorted(calls) == [2048] * 4 + [5632] * 4  # [q; k; v] = 1024 + 512 + 512, [gate; up] = 2 x 2816
    assert idle(fused)
    layouts = {g.layout for g in fused_groups(fused)}
    assert layouts == {cuda_ops.preferred_layout("cuda")}


@pytest.mark.parametrize("m", [1, 8, 64, 130])
def test_fused_slices_close_to_member_gemms(models, m):
    _, _, fused = models
    attn, mlp = fused.model.layers[1].self_attn, fused.model.layers[1].mlp
    x = (torch.randn(m, 1024, device="cuda") * 0.5).to(torch.bfloat16)
    for mods in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
        g = mods[0]._w12_group
        y = g._linear(x)
        for mod in mods:
            _, n0, n1 = mod._w12_slot
            own = W12Linear.forward(mod, x)  # the member's own GEMM on its views into the fused storage
            assert rel_diff(y[:, n0:n1], own) < MAX_REL_DIFF, (m, g.label, n0)


def test_fused_logits_close_to_unfused(models):
    _, unfused, fused = models
    with torch.no_grad():
        for prompt in prompts():
            a, b = fused(prompt).logits, unfused(prompt).logits
            assert rel_diff(a, b) < MAX_REL_DIFF, prompt.shape
    assert idle(fused)


def test_fused_greedy_matches_unfused(models):
    _, unfused, fused = models
    report = []
    for prompt in prompts():
        a, b = greedy(unfused, prompt), greedy(fused, prompt)
        i, margin = divergence_margin(unfused, prompt, a, b)
        report.append((prompt.shape[1], i, margin))
        assert margin < MAX_MARGIN, f"prompt of {prompt.shape[1]}: divergence at {i}, margin {margin:.3f} nat"
    print("\n(prompt length, first divergence fused vs unfused W12, margin nat):", report)


def test_compile_reduce_overhead_static_cache_fused(models):
    _, _, fused = models
    cc = transformers.CompileConfig(mode="reduce-overhead", fullgraph=True)
    prompt = prompts()[1]
    kw = dict(cache_implementation="static", compile_config=cc)
    first = greedy(fused, prompt, **kw)
    again = greedy(fused, prompt, **kw)  # replays the captured graphs
    assert first.shape == (NEW_TOKENS,) and torch.equal(first, again)
    assert idle(fused)
    eager = greedy(fused, prompt, cache_implementation="static", disable_compile=True)
    i, margin = divergence_margin(fused, prompt, eager, first)
    print(f"\ncompiled vs eager fused W12: first divergence {i}, margin {margin:.3f} nat")
    assert margin < MAX_MARGIN


def test_bf16_fused_close_to_bf16(models):
    ref, _, _ = models
    fused16 = copy.deepcopy(ref)
    assert w12.fuse_projections(fused16) == GROUPS
    with torch.no_grad():
        for prompt in prompts():
            assert rel_diff(fused16(prompt).logits, ref(prompt).logits) < MAX_REL_DIFF
    prompt = prompts()[2]
    a, b = greedy(ref, prompt), greedy(fused16, prompt)
    i, margin = divergence_margin(ref, prompt, a, b)
    assert margin < MAX_MARGIN, (i, margin)


def test_cpu_patch_then_cuda_fuses_again(models):
    ref, _, fused = models
    model = w12.patch(copy.deepcopy(ref).cpu())  # CPU and GPU packing give the same bytes
    assert model.w12_report.fused_groups == GROUPS
    model.cuda()  # every member moves (and permutes its records): each group fuses again on the GPU
    groups = fused_groups(model)
    assert len(groups) == GROUPS and all(g.active and g.tensors["records"].is_cuda for g in groups)
    assert {g.layout for g in groups} == {cuda_ops.preferred_layout("cuda")}
    ids = prompts()[2]
    with torch.no_grad():
        a, b = model(ids).logits, fused(ids).logits
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "same records, same kernels: same bits"


def test_cross_input_on_cuda(models):
    fused = copy.deepcopy(models[2])
    attn = fused.model.layers[0].self_attn
    g = attn.q_proj._w12_group
    x1 = torch.randn(1, 3, 1024, device="cuda").to(torch.bfloat16)
    x2 = torch.randn(1, 9, 1024, device="cuda").to(torch.bfloat16)
    q = attn.q_proj(x1)
    k, v = attn.k_proj(x2), attn.v_proj(x2)
    for y, x, mod in ((q, x1, attn.q_proj), (k, x2, attn.k_proj), (v, x2, attn.v_proj)):
        _, n0, n1 = mod._w12_slot
        assert torch.equal(y, g._linear(x)[..., n0:n1])


def test_save_and_load_on_gpu_fused(models, tmp_path):
    _, _, fused = models
    fused.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cuda")
    assert len(fused_groups(loaded)) == GROUPS
    ids = prompts()[2]
    with torch.no_grad():
        a, b = fused(ids).logits, loaded(ids).logits
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_unpatch_fused_on_gpu_restores_bf16(models):
    ref, _, fused = models
    restored = w12.unpatch(copy.deepcopy(fused))
    assert fused_groups(restored) == []
    for (name, p), (_, q) in zip(ref.named_parameters(), restored.named_parameters()):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16)), name
