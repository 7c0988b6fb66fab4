"""Verification: one target forward over root + tree nodes, greedy acceptance, cache commit.

The three pieces are separate functions with plain tensors between them so that later mechanisms can
swap one without the others (a certified LM head replaces `ArgmaxHead`, a read-only Q pass skips
`commit`, a batched step passes B > 1 trees).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from .cache import KVCache
from .tree import TreeBatch


def host_to_device(values: list[int], device) -> torch.Tensor:
    """Small host list -> device LongTensor without blocking the host (pinned, non-blocking on CUDA):
    a pageable copy would wait for the queued GPU work, an extra sync in the hot loop."""
    t = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _cache_kwarg(module) -> str:
    """transformers 5.24 renamed `past_key_values` to `cache` (the old name warns); 5.17 only has the old one."""
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _decoder_and_head(model):
    """The base decoder (returns hidden states) and the output projection of a HF causal LM."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    if dec is None:
        dec = getattr(model, "model", None)
    head = model.get_output_embeddings()
    if dec is None or head is None:
        raise TypeError(f"{type(model).__name__}: expected a causal LM with get_decoder() and get_output_embeddings()")
    return dec, head


def _num_layers(model) -> int:
    cfg = model.config
    n = getattr(cfg, "num_hidden_layers", None)
    if n is None and hasattr(cfg, "get_text_config"):
        n = getattr(cfg.get_text_config(), "num_hidden_layers", None)
    if n is None:
        raise TypeError(f"{type(model).__name__}: config has no num_hidden_layers")
    types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in types):
        raise NotImplementedError(
            f"{type(model).__name__}: layer types {sorted(set(types))} — only full-attention layers can be compacted "
            "by KV gather so far (sliding-window and recurrent layers need the replay commit of the hybrid-target issue)"
        )
    return int(n)


def head_weight(lm_head: torch.nn.Module) -> torch.Tensor:
    """The output projection's dense weight `[V, H]` (decoded for a W12-patched head)."""
    w = getattr(lm_head, "weight", None)
    if isinstance(w, torch.Tensor):
        return w
    if hasattr(lm_head, "dequantized_weight"):
        return lm_head.dequantized_weight()
    raise TypeError(f"{type(lm_head).__name__}: cannot get a dense weight from this LM head")


class ArgmaxHead:
    """Default verify head: full-vocabulary logits, argmax per row (computed in `dtype`, FP32 by default).

    A certified INT8 head plugs in here: any callable `hidden [B, R, H] -> token ids [B, R]`."""

    def __init__(self, lm_head: torch.nn.Module, dtype: torch.dtype | None = None):
        self.lm_head = lm_head
        self.dtype = dtype

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.dtype is None:
            logits = self.lm_head(hidden)
        else:
            w = head_weight(self.lm_head).to(self.dtype)
            b = getattr(self.lm_head, "bias", None)
            logits = torch.nn.functional.linear(hidden.to(self.dtype), w, None if b is None else b.to(self.dtype))
        return logits.argmax(-1)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool `[B, Q, K]` -> float `[B, 1, Q, K]` (0 where allowed, dtype min elsewhere): the form both the
    eager and the SDPA attention of transformers add to the scores."""
    m = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    m.masked_fill_(~allowed, torch.finfo(dtype).min)
    return m.unsqueeze(1)


def causal_allowed(prefix: int, q: int, batch: int, device) -> torch.Tensor:
    """Bool `[B, q, prefix + q]`: every new row sees the whole prefix and the new rows up to itself."""
    tri = torch.ones(q, q, dtype=torch.bool, device=device).tril()
    full = torch.cat([torch.ones(q, prefix, dtype=torch.bool, device=device), tri], dim=1)
    return full.unsqueeze(0).expand(batch, q, prefix + q)


class CausalLM:
    """A HF causal LM driven with explicit positions, 4-D masks and a `KVCache` (target or drafter)."""

    def __init__(self, model, head=None):
        self.model = model
        self.decoder, self.lm_head = _decoder_and_head(model)
        self.num_layers = _num_layers(model)
        self._cache_kw = _cache_kwarg(self.decoder)
        if head is None:
            # A model patched with w12.patch(model, lm_head="certified") carries an exact INT8-screened
            # argmax head: verification needs only argmax ids, so it is the better default.
            certified = getattr(model, "w12_certified_head", None)
            head = certified.argmax if certified is not None else ArgmaxHead(self.lm_head)
        self.head = head

    @property
    def device(self):
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self):
        # Activation dtype (the embeddings'; the LM head may be W12-packed and have no dense weight).
        return self.model.get_input_embeddings().weight.dtype

    def new_cache(self, capacity: int = 256) -> KVCache:
        return KVCache(self.num_layers, capacity)

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, cache: KVCache):
        """Run the decoder over `ids [B, Q]`; `allowed [B, Q, cache.length + Q]`; writes Q rows after `length`
        (not committed: call `cache.advance`). Returns the final hidden states `[B, Q, H]`."""
        mask = additive_mask(allowed, self.dtype)
        out = self.decoder(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            use_cache=True,
            **{self._cache_kw: cache},
        )
        return out.last_hidden_state

    def prefill(self, cache: KVCache, ids: torch.Tensor) -> torch.Tensor:
        """Causal forward over `ids [B, T]` after the committed rows; commits them; returns hidden states."""
        b, t = ids.shape
        if t == 0:
            raise ValueError("CausalLM.prefill: no tokens to prefill")
        base = cache.length
        pos = (torch.arange(t, device=ids.device) + base).unsqueeze(0).expand(b, t)
        h = self.hidden(ids, pos, causal_allowed(base, t, b, ids.device), cache)
        cache.advance(t)
        return h


@dataclass
class VerifyOutput:
    argmax: torch.Tensor  # [B, N+1] target's next token after each row (row 0 = root)
    base: int  # committed cache length before the verify rows


def verify(target: CausalLM, cache: KVCache, root: torch.Tensor, tree: TreeBatch) -> VerifyOutput:
    """All tree nodes in one target forward (rows written after `cache.length`, not committed).

    `root [B]` is the last committed token, whose KV is not in the cache yet; it sits at position
    `cache.length`, a node at `cache.length + depth`; each row sees the committed prefix, the root,
    its ancestors and itself."""
    base = cache.length
    b, n = tree.tokens.shape
    ids = torch.cat([root.view(b, 1), tree.tokens], dim=1)
    pos = tree.row_positions(base)
    anc = tree.rows_ancestors()
    allowed = torch.cat([torch.ones(b, n + 1, base, dtype=torch.bool, device=ids.device), anc], dim=2)
    hidden = target.hidden(ids, pos, allowed, cache)
    return VerifyOutput(argmax=target.head(hidden), base=base)


@dataclass
class Acceptance:
    """Host-side result of one step for one request."""

    rows: list[int]  # verify rows of the root and the accepted nodes, in path order (rows[0] == 0)
    tokens: list[int]  # accepted draft tokens followed by the bonus token


def accept(tree: TreeBatch, out: VerifyOutput) -> list[Acceptance]:
    """Longest root path whose every token equals the target's argmax after its parent, plus the bonus.

    Computed on the device for all nodes at once; the only host transfer of the step is the packed
    result (one sync: the acceptance decision)."""
    b, n = tree.tokens.shape
    am = out.argmax
    after_parent = torch.gather(am, 1, tree.parents + 1)  # target's token after each node's parent
    match = (tree.tokens == after_parent) & tree.valid
    anc = tree.rows_ancestors()[:, 1:, 1:]  # node -> node ancestors incl. self
    ok = ~(anc & ~match.unsqueeze(1)).any(-1)  # every node on the path matches
    depth = torch.where(ok, tree.depths, torch.zeros_like(tree.depths))
    # Row 0 (the root, depth 0) competes too, so an empty or fully rejected tree selects the root.
    row_depth = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=am.device), depth], dim=1)
    best_depth, best_row = row_depth.max(dim=1)
    path = torch.gather(tree.rows_ancestors(), 1, best_row.view(b, 1, 1).expand(b, 1, n + 1)).squeeze(1)  # [B, N+1]
    all_depth = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=am.device), tree.depths], dim=1)
    key = torch.where(path, all_depth, torch.full_like(all_depth, n + 2))
    rows_sorted = torch.argsort(key, dim=1, stable=True)
    all_tokens = torch.cat([am[:, :1] * 0, tree.tokens], dim=1)
    toks_sorted = torch.gather(all_tokens, 1, rows_sorted)
    bonus = torch.gather(am, 1, best_row.view(b, 1))
    packed = torch.cat([best_depth.view(b, 1), bonus, rows_sorted, toks_sorted], dim=1).tolist()
    res = []
    for r in packed:
        d, bonus_tok = r[0], r[1]
        rows = r[2 : 2 + d + 1]
        toks = r[2 + n + 1 + 1 : 2 + n + 1 + 1 + d]
        res.append(Acceptance(rows=rows, tokens=toks + [bonus_tok]))
    return res


def commit(cache: KVCache, base: int, rows: list[int]) -> None:
    """Compact the cache to the committed prefix + the given verify rows (root first, path order)."""
    if not rows:
        cache.crop(base)
        return
    dev = next((k.device for k in cache._k if k is not None), torch.device("cpu"))
    cache.compact(base, host_to_device(rows, dev))
