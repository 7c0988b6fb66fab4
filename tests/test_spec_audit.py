"""Token-forcing audit: lossless outputs pass, biased outputs are caught, margins are right."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spec_engine import BestFirstTree, ModelDrafter, SpecEngine
from spec_engine.audit import ForcedSequence, ForcingStats, Scorer, audit, verdict


@pytest.fixture(scope="module")
def model():
    cfg = LlamaConfig(
        vocab_size=80,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.3,
    )
    torch.manual_seed(3)
    m = LlamaForCausalLM(cfg).eval()
    m.generation_config.eos_token_id = None
    return m


def _ar(model, prompt, n):
    out = model.generate(
        prompt.view(1, -1),
        attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, prompt.numel() :]


def _prompts(k=4):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 80, (n,), generator=g) for n in [2, 7, 15, 4][:k]]


def test_engine_output_passes_and_biased_output_is_caught(model):
    prompts = _prompts()
    base = [_ar(model, p, 24) for p in prompts]
    eng = [SpecEngine(model, ModelDrafter(model), tree=BestFirstTree(8)).generate(p, 24).tokens for p in prompts]
    v = audit(model, prompts, eng, base)
    assert v.lossless, v.reasons
    assert v.system["mismatches"] == 0 == v.baseline["mismatches"]
    # A biased system: replace every 5th token by the scorer's second choice.
    scorer = Scorer(model)
    biased = []
    for p, out in zip(prompts, base):
        out = out.clone()
        for i in range(2, out.numel(), 5):
            seq = torch.cat([p, out[:i]]).view(1, -1)
            with torch.no_grad():
                out[i] = model(seq).logits[0, -1].float().topk(2).indices[1]
        biased.append(out)
    v2 = audit(model, prompts, biased, base)
    assert not v2.lossless and v2.system["mismatches"] >= len(prompts) * 4
    forced = scorer.force(prompts[0], biased[0])
    assert forced.mismatch_positions[0] == 2 and forced.first_divergence_margin > 0


def test_margin_is_logprob_gap(model):
    p = _prompts(1)[0]
    out = _ar(model, p, 6).clone()
    with torch.no_grad():
        logits = model(torch.cat([p, out[:3]]).view(1, -1)).logits[0, -1].float()
    lp = torch.log_softmax(logits, -1)
    out[3] = int(lp.argsort(descending=True)[5])
    f = Scorer(model).force(p, out)
    assert 3 in f.mismatch_positions
    assert f.mismatch_margins[f.mismatch_positions.index(3)] == pytest.approx(float(lp.max() - lp[out[3]]), abs=1e-4)


def test_verdict_rules():
    base = ForcingStats([ForcedSequence(1000, [1, 2], [0.2, 0.1], 0.0)])  # first 0.2 -> delta 0.25 -> large 0.5
    same = ForcingStats([ForcedSequence(1000, [3, 4], [0.05, 0.3], 0.0)])
    assert verdict(same, base).lossless
    many = ForcingStats([ForcedSequence(1000, list(range(9)), [0.01] * 9, 0.0)])  # +0.7 points
    assert not verdict(many, base).lossless
    large = ForcingStats([ForcedSequence(1000, [5], [0.6], 0.0)])
    v = verdict(large, base)
    assert not v.lossless and v.delta == 0.25 and "margin" in v.reasons[0]
    with pytest.raises(ValueError, match="prompts"):
        Scorer.force_all(None, [torch.tensor([1])], [])
