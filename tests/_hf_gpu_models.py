"""The small Llama, prompts and greedy-decoding helpers shared by the Transformers GPU tests
(``test_hf_gpu.py``, ``test_fuse_gpu.py``). Import after ``pytest.importorskip("transformers")``."""

from __future__ import annotations

import torch
import transformers

MAX_MARGIN = 0.25  # nat: the largest BF16 log-prob margin allowed where greedy tokens diverge
PROMPT_LENS = (5, 17, 64, 130)
NEW_TOKENS = 24


def small_llama(seed=0):
    cfg = transformers.LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 4096, (1, n), generator=g).cuda() for n in PROMPT_LENS]


@torch.no_grad()
def greedy(model, prompt, **kw):
    out = model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, **kw)
    return out[0, prompt.shape[1] :]


@torch.no_grad()
def divergence_margin(ref_model, prompt, ref_tokens, tokens):
    """(index of the first differing token, ref log-prob of its choice minus that of the other), or (None, 0)."""
    diff = (ref_tokens != tokens).nonzero()
    if diff.numel() == 0:
        return None, 0.0
    i = int(diff[0, 0])
    prefix = torch.cat([prompt[0], ref_tokens[:i]])[None]
    logp = ref_model(prefix).logits[0, -1].float().log_softmax(-1)
    return i, float(logp[ref_tokens[i]] - logp[tokens[i]])
