"""w12.patch(model, lm_head="certified"): the certified head rides beside an unchanged model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import w12


class TinyLM(nn.Module):
    def __init__(self, vocab, hidden, rng):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, dtype=torch.bfloat16)
        self.proj = nn.Linear(hidden, hidden, bias=False, dtype=torch.bfloat16)
        self.lm_head = nn.Linear(hidden, vocab, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_((torch.randn(p.shape, generator=rng) * 0.05).to(torch.bfloat16))

    def get_output_embeddings(self):
        return self.lm_head

    def get_input_embeddings(self):
        return self.embed

    def forward(self, hidden):
        return self.lm_head(self.proj(hidden))


@pytest.mark.parametrize("vocab,hidden", [(300, 64), (1001, 130)])
def test_certified_head_argmax_and_model_unchanged(vocab, hidden, rng):
    model = TinyLM(vocab, hidden, rng)
    keys_before = set(model.state_dict())
    x = torch.randn(17, hidden, generator=rng).to(torch.bfloat16)
    w12.patch(model, lm_head="certified", keep_if_larger=True)
    # the head stays the ordinary BF16 module (logits for sampling), the rest is W12
    assert isinstance(model.lm_head, nn.Linear) and isinstance(model.proj, w12.W12Linear)
    assert "w12_certified_head" not in dict(model.named_modules())
    assert {k for k in model.state_dict() if k.startswith("lm_head")} == {"lm_head.weight"}
    assert "proj.weight" in keys_before and "proj.w12_records" in model.state_dict()
    h = model.proj(x)
    ids = w12.certified_argmax(model, h)
    exact = (h.double() @ model.lm_head.weight.double().t()).topk(2, dim=-1).values
    clear = (exact[:, 0] - exact[:, 1]) > 1e-3  # away from near-ties FP64 decides
    ref = (h.double() @ model.lm_head.weight.double().t()).argmax(-1)
    assert clear.any()
    assert torch.equal(ids[clear], ref[clear])


def test_certified_argmax_errors(rng):
    model = TinyLM(100, 64, rng)
    with pytest.raises(ValueError, match="certified head"):
        w12.certified_argmax(model, torch.zeros(1, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="lm_head"):
        w12.patch(model, lm_head="int8")


def test_spec_engine_verifies_with_the_certified_head(rng):
    transformers = pytest.importorskip("transformers")
    from spec_engine import BestFirstTree, NgramDrafter, SpecEngine

    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # BF16-representable head values: the certified head stores BF16 exactly
        model.lm_head.weight.copy_(model.lm_head.weight.bfloat16().float())
    prompt = torch.randint(0, 256, (1, 12), generator=rng)
    prompt = torch.cat([prompt, prompt], dim=1)  # repeats give the n-gram drafter something to propose
    ref = model.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, prompt.shape[1] :]
    # FP32 model: attach the head as w12.patch(lm_head="certified") does for BF16 ones
    head = w12.CertifiedHead(model.lm_head.weight.detach().bfloat16())
    object.__setattr__(model, "w12_certified_head", head)
    calls = []
    orig = head.argmax
    head.argmax = lambda h, **kw: calls.append(h.shape) or orig(h, **kw)
    engine = SpecEngine(model, NgramDrafter(), tree=BestFirstTree(8))
    out = engine.generate(prompt, max_new_tokens=12)
    assert calls, "the engine did not verify through the certified head"
    assert torch.equal(out.tokens, ref)
