"""Drafters behind one small protocol.

    reset(prompt_ids)      a new request; `prompt_ids` is 1-D
    propose(request)       -> NodeLattice | PositionLattice for the committed context
    commit(tokens)         tokens the engine has just committed (accepted drafts + bonus)

`ModelDrafter` (a small causal LM, EAGLE-2-style level-by-level expansion with a tree-masked KV cache),
`NgramDrafter` (prompt/history lookup) and `BlockDrafterAdapter` (any parallel block drafter: one
forward -> top-k candidates per position, optional parent-conditioned scores) implement it;
`MarkovBlockDrafter` is a small block drafter used as a test double.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch

from .tree import DraftRequest, NodeLattice, PositionLattice
from .verify import CausalLM, host_to_device


@runtime_checkable
class Drafter(Protocol):
    def reset(self, prompt_ids: torch.Tensor) -> None: ...

    def propose(self, request: DraftRequest) -> NodeLattice | PositionLattice: ...

    def commit(self, tokens: list[int]) -> None: ...


class ModelDrafter:
    """A small causal LM sharing the target's tokenizer.

    Its KV cache holds the committed context; each `propose` first feeds the tokens committed since
    the last call, then expands the `beam` best nodes of each level (by path log-prob) into their
    `topk` children, each row attending the context and its own ancestors (tree mask), and finally
    drops the draft rows from the cache. Everything stays on the device: no host sync while drafting.

    `static` (default: on CUDA) keeps the cache in fixed buffers and runs each forward through a
    `StaticRunner`, CUDA-graphed per row count: a drafting level is a handful of rows, so an eager
    forward is almost all launch and Python overhead (measured on the H200: ~25 ms per level for a
    0.5B drafter, against ~1 ms replayed). The static cache doubles (graphs re-captured) when a
    request outgrows it. Both modes draft the same tokens."""

    def __init__(self, model, capacity: int = 512, static: bool | None = None, use_graphs: bool | None = None):
        self.lm = CausalLM(model)
        self.capacity = capacity
        self.cache = None
        self.tokens: list[int] = []
        self.static = (self.lm.device.type == "cuda") if static is None else bool(static)
        self.use_graphs = use_graphs
        self.runner = None

    def _new_runner(self, capacity: int):
        from .graphs import StaticRunner

        head = self.lm.lm_head
        return StaticRunner(
            self.lm,
            capacity,
            use_graphs=self.use_graphs,
            project=lambda h: torch.log_softmax(head(h).float(), dim=-1),
        )

    def _ensure_capacity(self, need: int) -> None:
        """Static mode: grow (double) the runner when `need` rows would not fit, keeping the context."""
        if not self.static or need <= self.runner.capacity:
            return
        cap = self.runner.capacity
        while cap < need:
            cap *= 2
        old, keep = self.runner, self.cache.length
        self.runner = self._new_runner(cap)
        for i in range(old.cache.num_layers):
            self.runner.cache._k[i][:, :, :keep] = old.cache._k[i][:, :, :keep]
            self.runner.cache._v[i][:, :, :keep] = old.cache._v[i][:, :, :keep]
        self.runner.cache.length = keep
        self.cache = self.runner.cache

    def reset(self, prompt_ids: torch.Tensor) -> None:
        ids = prompt_ids.reshape(-1).tolist()
        if not ids:
            raise ValueError("ModelDrafter.reset: empty prompt")
        self.tokens = list(ids)
        need = max(self.capacity, len(ids) + 64)
        if not self.static:
            self.cache = self.lm.new_cache(need)
            return
        if self.runner is None or self.runner.capacity < need:
            self.runner = self._new_runner(max(need, 2 * self.capacity))
        self.runner.cache.length = 0
        self.cache = self.runner.cache

    def commit(self, tokens: list[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def _feed_pending(self) -> torch.Tensor:
        """Feed committed tokens not yet in the cache; returns log-probs after the last one `[V]`."""
        if self.cache is None:
            raise RuntimeError("ModelDrafter.propose called before reset()")
        pending = self.tokens[self.cache.length :]
        if not pending:
            # Everything is cached (a propose without a commit in between): re-feed the last token.
            self.cache.crop(self.cache.length - 1)
            pending = self.tokens[-1:]
        ids = host_to_device(pending, self.lm.device).view(1, -1)
        if self.static:
            self._ensure_capacity(self.cache.length + len(pending) + 1)
            # Short feeds (the tokens of the last step) replay a graph; the prompt runs eagerly.
            return self.runner.prefill(ids, graph=len(pending) <= 16)[0, -1]
        h = self.lm.prefill(self.cache, ids)
        return torch.log_softmax(self.lm.lm_head(h[0, -1:]).float(), dim=-1)[0]

    def _rows(self, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Log-probs `[R, V]` of draft rows `ids [R]` written after `cache.length` (not committed),
        each seeing the columns of `allowed [R, cache.length + R]`."""
        base = self.cache.length
        if self.static:
            self._ensure_capacity(base + ids.numel())
            return self.runner.forward(ids.view(-1), pos.view(-1), allowed, base)[0]
        h = self.lm.hidden(ids.view(1, -1), pos.view(1, -1), allowed.unsqueeze(0), self.cache)
        return torch.log_softmax(self.lm.lm_head(h[0]).float(), dim=-1)

    @torch.no_grad()
    def propose(self, request: DraftRequest) -> NodeLattice | PositionLattice:
        root_logp = self._feed_pending()
        base = self.cache.length
        try:
            if request.kind == "positions":
                return self._chain_positions(root_logp, request)
            return self._expand_levels(root_logp, request)
        finally:
            self.cache.crop(base)  # draft rows are scratch; the committed context stays

    def _expand_levels(self, root_logp: torch.Tensor, req: DraftRequest) -> NodeLattice:
        dev = root_logp.device
        k = min(req.topk, root_logp.shape[-1])
        lp, tok = torch.topk(root_logp, k)
        toks, pars, lps, scores, depths = [tok], [torch.full((k,), -1, device=dev)], [lp], [lp], [torch.ones_like(tok)]
        level_start, level_size, total = 0, k, k
        base = self.cache.length  # context rows; draft rows follow
        fed_rows = torch.full((1 + req.beam * req.depth * k,), -1, dtype=torch.long, device=dev)  # cand -> fed row
        fed_anc = torch.zeros(0, 0, dtype=torch.bool, device=dev)  # [F, F] ancestors-or-self among fed rows
        for d in range(1, req.depth):
            all_scores = torch.cat(scores)
            beam = min(req.beam, level_size)
            front = torch.topk(all_scores[level_start : level_start + level_size], beam).indices + level_start
            all_tok, all_par = torch.cat(toks), torch.cat(pars)
            if fed_rows.shape[0] < total + 1:
                fed_rows = torch.cat([fed_rows, torch.full((total + 1,), -1, dtype=torch.long, device=dev)])
            f0 = fed_anc.shape[0]
            par_row = fed_rows[all_par[front] + 1]  # -1 for children of the root
            par_anc = torch.where(
                (par_row >= 0).unsqueeze(1),
                fed_anc[par_row.clamp(min=0)] if f0 else torch.zeros(beam, 0, dtype=torch.bool, device=dev),
                torch.zeros(beam, f0, dtype=torch.bool, device=dev),
            )
            new_anc = torch.cat([par_anc, torch.eye(beam, dtype=torch.bool, device=dev)], dim=1)  # [beam, f0+beam]
            fed_anc = torch.cat([torch.cat([fed_anc, torch.zeros(f0, beam, dtype=torch.bool, device=dev)], 1), new_anc])
            fed_rows[front + 1] = torch.arange(f0, f0 + beam, device=dev)
            allowed = torch.cat([torch.ones(beam, base, dtype=torch.bool, device=dev), new_anc], dim=1)
            pos = torch.full((beam,), base - 1 + d, dtype=torch.long, device=dev)
            # Rows of earlier levels are already in the cache after `base`; write this level after them.
            self.cache.length = base + f0
            child_lp = self._rows(all_tok[front], pos, allowed)
            self.cache.length = base + f0 + beam
            kk = min(req.topk, child_lp.shape[-1])
            clp, ctok = torch.topk(child_lp, kk)  # [beam, kk]
            parent_score = all_scores[front].unsqueeze(1)
            toks.append(ctok.reshape(-1))
            pars.append(front.repeat_interleave(kk))
            lps.append(clp.reshape(-1))
            scores.append((parent_score + clp).reshape(-1))
            depths.append(torch.full((beam * kk,), d + 1, dtype=torch.long, device=dev))
            level_start, level_size = total, beam * kk
            total += beam * kk
        self.cache.length = base
        return NodeLattice(
            torch.cat(toks), torch.cat(pars).long(), torch.cat(lps), torch.cat(scores), torch.cat(depths)
        )

    def _chain_positions(self, root_logp: torch.Tensor, req: DraftRequest) -> PositionLattice:
        """Greedy chain; per position the top-k of the drafter given the greedy prefix (independent scores)."""
        k = min(req.topk, root_logp.shape[-1])
        lp, tok = torch.topk(root_logp, k)
        all_tok, all_lp = [tok], [lp]
        for _ in range(1, req.depth):
            base = self.cache.length
            one = torch.ones(1, base + 1, dtype=torch.bool, device=root_logp.device)
            step = self._rows(all_tok[-1][:1], torch.full((1,), base, dtype=torch.long, device=one.device), one)[0]
            self.cache.advance(1)
            lp, tok = torch.topk(step, k)
            all_tok.append(tok)
            all_lp.append(lp)
        return PositionLattice(torch.stack(all_tok), torch.stack(all_lp))


class NgramDrafter:
    """Prompt/history lookup: continuations of the latest occurrences of the current suffix n-gram.

    Up to `max_matches` continuations (most recent first, longest n-gram first) are merged into a trie;
    an edge's log-prob is the log of the fraction of continuations through the parent that take it."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_matches: int = 8):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"NgramDrafter: need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram, self.max_matches = max_ngram, min_ngram, max_matches
        self.tokens: list[int] = []
        self.device = None

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.tokens = prompt_ids.reshape(-1).tolist()
        self.device = prompt_ids.device

    def commit(self, tokens: list[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def continuations(self, depth: int) -> list[list[int]]:
        seq = self.tokens
        t = len(seq)
        found: list[list[int]] = []
        seen_starts: set[int] = set()
        for n in range(min(self.max_ngram, t - 1), self.min_ngram - 1, -1):
            suffix = seq[t - n :]
            for start in range(t - n - 1, -1, -1):  # latest first; the suffix itself is excluded
                if seq[start : start + n] == suffix and start + n not in seen_starts:
                    cont = seq[start + n : start + n + depth]
                    if cont:
                        seen_starts.add(start + n)
                        found.append(cont)
                        if len(found) >= self.max_matches:
                            return found
        return found

    def propose(self, request: DraftRequest) -> NodeLattice | PositionLattice:
        if request.kind == "positions":
            raise TypeError("NgramDrafter gives a candidate trie (NodeLattice), not per-position scores")
        conts = self.continuations(request.depth)
        children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        counts: list[int] = []
        toks, pars = [], []
        for cont in conts:
            parent = -1
            for tok in cont:
                key = (parent, tok)
                if key not in children:
                    children[key] = len(toks)
                    toks.append(tok)
                    pars.append(parent)
                    counts.append(0)
                parent = children[key]
                counts[parent] += 1
        total = len(conts)
        logp = [math.log(counts[i] / (counts[p] if p >= 0 else total)) for i, p in enumerate(pars)]
        return NodeLattice.from_lists(toks, pars, logp, device=self.device)


class BlockDrafter(Protocol):
    """A parallel drafter: one forward gives candidates for P positions after the context.

    `draft_block(context_ids, positions, topk)` returns a `PositionLattice` with tokens/logp `[P, K]`
    and, if the drafter has a Markov head, parent-conditioned scores `cond_logp [P, K, K]`."""

    def draft_block(self, context_ids: torch.Tensor, positions: int, topk: int) -> PositionLattice: ...


class BlockDrafterAdapter:
    """Puts a `BlockDrafter` behind the `Drafter` protocol (tracks the committed context for it)."""

    def __init__(self, block_drafter: BlockDrafter):
        self.block = block_drafter
        self.tokens: torch.Tensor | None = None

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.tokens = prompt_ids.reshape(-1).clone()

    def commit(self, tokens: list[int]) -> None:
        self.tokens = torch.cat([self.tokens, torch.tensor(tokens, dtype=torch.long, device=self.tokens.device)])

    def propose(self, request: DraftRequest) -> PositionLattice:
        if self.tokens is None:
            raise RuntimeError("BlockDrafterAdapter.propose called before reset()")
        return self.block.draft_block(self.tokens, request.depth, request.topk)


class MarkovBlockDrafter:
    """Block drafter test double: a bigram table `logits[prev, next]` (a Markov head).

    Per-position independent scores are the marginals of the chain started at the last context token;
    parent-conditioned scores are the bigram log-probs between adjacent candidates."""

    def __init__(self, bigram_logits: torch.Tensor):
        if bigram_logits.dim() != 2 or bigram_logits.shape[0] != bigram_logits.shape[1]:
            raise ValueError(f"MarkovBlockDrafter: bigram_logits must be [V, V], got {tuple(bigram_logits.shape)}")
        self.logp = torch.log_softmax(bigram_logits.float(), dim=-1)

    def draft_block(self, context_ids: torch.Tensor, positions: int, topk: int) -> PositionLattice:
        v = self.logp.shape[0]
        k = min(topk, v)
        dist = self.logp[int(context_ids[-1])].exp()
        toks, lps = [], []
        for _ in range(positions):
            lp, tok = torch.topk(dist.clamp_min(1e-30).log(), k)
            toks.append(tok)
            lps.append(lp)
            dist = dist @ self.logp.exp()
        tokens = torch.stack(toks)
        cond = torch.zeros(positions, k, k)
        for p in range(1, positions):
            cond[p] = self.logp[tokens[p - 1]][:, tokens[p]]
        dev = context_ids.device
        return PositionLattice(tokens.to(dev), torch.stack(lps).to(dev), cond.to(dev))
