"""Draft lattices (what drafters propose) and tree builders (which nodes get verified).

Plain data flows between the pieces:

* a drafter answers a `DraftRequest` with a lattice for one request: a `NodeLattice` (candidates with
  parent indices and parent-conditioned edge log-probs, as a sequential drafter produces them) or a
  `PositionLattice` (top-k candidates per position, as a parallel block drafter produces them, with
  optional parent-conditioned scores between adjacent positions);
* a tree builder turns one lattice per request into a `TreeBatch`: `[B, N]` token ids, parent indices
  (-1 = the root, i.e. the last committed token), depths, path scores and a validity mask, padded to
  the tree's node budget `N` so that the verify forward has one shape per tree size.

Nodes are kept in topological order (a parent's index is smaller than its child's).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

DEFAULT_DRAFT_DEPTH = 8  # drafting depth when a tree does not cap it (the published block size)
DEFAULT_BRANCH = 8  # nodes expanded per level / children per node for best-first drafting


@dataclass(frozen=True)
class DraftRequest:
    """What a tree asks of a drafter: `depth` positions, `beam` nodes expanded per level with `topk`
    children each (parent-conditioned drafting), or `topk` candidates per position (`kind="positions"`)."""

    depth: int
    beam: int
    topk: int
    kind: str = "nodes"

    def __post_init__(self):
        if self.depth < 1 or self.beam < 1 or self.topk < 1:
            raise ValueError(f"DraftRequest: depth, beam and topk must be >= 1, got {self}")
        if self.kind not in ("nodes", "positions"):
            raise ValueError(f"DraftRequest.kind must be 'nodes' or 'positions', got {self.kind!r}")


@dataclass
class NodeLattice:
    """Candidates of one request; `parents[i] < i`, -1 = root; `logp` is log p(token | path to parent)."""

    tokens: torch.Tensor  # [M] long
    parents: torch.Tensor  # [M] long
    logp: torch.Tensor  # [M] float
    scores: torch.Tensor  # [M] float, path log-prob = sum of logp from the root
    depths: torch.Tensor  # [M] long, 1 for children of the root

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def empty(device=None) -> NodeLattice:
        z = torch.zeros(0, dtype=torch.long, device=device)
        f = torch.zeros(0, dtype=torch.float32, device=device)
        return NodeLattice(z, z.clone(), f, f.clone(), z.clone())

    @staticmethod
    def from_lists(tokens, parents, logp, device=None) -> NodeLattice:
        """Build from host lists (parents must precede children); scores and depths are derived."""
        scores, depths = [], []
        for i, (p, lp) in enumerate(zip(parents, logp)):
            if p >= i or p < -1:
                raise ValueError(f"NodeLattice.from_lists: parents[{i}]={p} must be -1 or an earlier index")
            scores.append(lp + (scores[p] if p >= 0 else 0.0))
            depths.append(1 + (depths[p] if p >= 0 else 0))
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        as_f32 = lambda x: torch.tensor(x, dtype=torch.float32, device=device)  # noqa: E731
        return NodeLattice(as_long(tokens), as_long(parents), as_f32(logp), as_f32(scores), as_long(depths))


@dataclass
class PositionLattice:
    """Per-position candidates of one request (a parallel drafter's block).

    `cond_logp[p, i, j]` (optional) = log p(tokens[p, j] | tokens[p-1, i]): parent-conditioned scores
    (a Markov head); `cond_logp[0]` is unused (position 0 is conditioned on the root only)."""

    tokens: torch.Tensor  # [P, K] long
    logp: torch.Tensor  # [P, K] float, independent per-position log-probs
    cond_logp: torch.Tensor | None = None  # [P, K, K] float

    def __post_init__(self):
        if self.tokens.dim() != 2 or self.tokens.shape != self.logp.shape:
            raise ValueError(
                f"PositionLattice: tokens {tuple(self.tokens.shape)} and logp {tuple(self.logp.shape)} must both be [P, K]"
            )
        p, k = self.tokens.shape
        if self.cond_logp is not None and tuple(self.cond_logp.shape) != (p, k, k):
            raise ValueError(f"PositionLattice: cond_logp must be [{p}, {k}, {k}], got {tuple(self.cond_logp.shape)}")


@dataclass
class TreeBatch:
    """Trees of B requests padded to N nodes; padding nodes hang off the root and are never accepted."""

    tokens: torch.Tensor  # [B, N] long
    parents: torch.Tensor  # [B, N] long, -1 = root
    depths: torch.Tensor  # [B, N] long, >= 1
    scores: torch.Tensor  # [B, N] float, path log-prob under the drafter
    valid: torch.Tensor  # [B, N] bool
    n_valid_hint: int | None = None  # max valid nodes over the batch, when known on the host without a sync

    @property
    def batch(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def nodes(self) -> int:
        return int(self.tokens.shape[1])

    def trimmed(self, n: int) -> TreeBatch:
        """The first `n` nodes (valid only when every valid node has index < n, e.g. `n_valid_hint`)."""
        sl = slice(0, n)
        return TreeBatch(
            self.tokens[:, sl], self.parents[:, sl], self.depths[:, sl], self.scores[:, sl], self.valid[:, sl], n
        )

    def rows_ancestors(self) -> torch.Tensor:
        """Bool `[B, N+1, N+1]`: row r sees row c iff c is r or an ancestor of r (row 0 = root, row i+1 = node i).

        Pointer doubling: a fixed number of gathers per tree size, no host sync."""
        b, n = self.tokens.shape
        dev = self.tokens.device
        par = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=dev), self.parents + 1], dim=1)  # [B, N+1]
        eye = torch.eye(n + 1, dtype=torch.bool, device=dev).expand(b, n + 1, n + 1)
        anc = eye | torch.nn.functional.one_hot(par, n + 1).bool()
        jump = par
        for _ in range(max(1, math.ceil(math.log2(n + 1)))):
            anc = anc | torch.gather(anc, 1, jump.unsqueeze(-1).expand(b, n + 1, n + 1))
            jump = torch.gather(jump, 1, jump)
        return anc

    def row_positions(self, offset: torch.Tensor | int) -> torch.Tensor:
        """Position ids `[B, N+1]` of the verify rows: the root sits at `offset`, a node at offset + depth."""
        b = self.tokens.shape[0]
        zero = torch.zeros(b, 1, dtype=torch.long, device=self.tokens.device)
        return torch.cat([zero, self.depths], dim=1) + offset

    def validate(self) -> None:
        """Host-side structural checks (syncs; for tests and debugging, not the hot loop)."""
        n = self.nodes
        idx = torch.arange(n, device=self.parents.device)
        if bool((self.parents >= idx).any()) or bool((self.parents < -1).any()):
            raise ValueError("TreeBatch: every parent index must be -1 or smaller than the node's own index")
        pd = torch.where(self.parents >= 0, torch.gather(self.depths, 1, self.parents.clamp(min=0)), 0)
        if bool(((self.depths != pd + 1) & self.valid).any()):
            raise ValueError("TreeBatch: a valid node's depth must be its parent's depth + 1")
        pv = torch.where(self.parents >= 0, torch.gather(self.valid, 1, self.parents.clamp(min=0)), True)
        if bool((self.valid & ~pv).any()):
            raise ValueError("TreeBatch: not prefix-closed (a valid node has an invalid parent)")


def _pad_stack(rows: list[tuple], n: int, device) -> TreeBatch:
    """Stack per-request (tokens, parents, depths, scores) tensors, padding each to n nodes."""
    out = {k: [] for k in ("tokens", "parents", "depths", "scores", "valid")}
    for row in rows:
        tok, par, dep, sc = row[:4]
        m = int(tok.shape[0])
        pad = n - m
        ok = row[4] if len(row) > 4 else torch.ones(m, dtype=torch.bool, device=device)
        out["tokens"].append(torch.cat([tok, torch.zeros(pad, dtype=torch.long, device=device)]))
        out["parents"].append(torch.cat([par, torch.full((pad,), -1, dtype=torch.long, device=device)]))
        out["depths"].append(torch.cat([dep, torch.ones(pad, dtype=torch.long, device=device)]))
        out["scores"].append(torch.cat([sc.float(), torch.full((pad,), -math.inf, device=device)]))
        out["valid"].append(torch.cat([ok, torch.zeros(pad, dtype=torch.bool, device=device)]))
    return TreeBatch(**{k: torch.stack(v) for k, v in out.items()})


def _select_prefix_closed(lat: NodeLattice, n: int):
    """Top-n nodes by path score, prefix-closed, renumbered in topological order (device ops only).

    A child's score never exceeds its parent's (log-probs are <= 0) and children come after parents in
    the lattice, so a *stable* descending sort always ranks a parent before its children: any top-n
    prefix of that order is prefix-closed, ties included. Drafters honour the request's depth, so
    every lattice node is within the tree's depth cap."""
    k = min(n, lat.size)
    order = torch.sort(lat.scores, descending=True, stable=True).indices[:k]
    keep = torch.sort(order).values  # back to lattice order, which is topological
    remap = torch.full((lat.size + 1,), -1, dtype=torch.long, device=lat.tokens.device)
    remap[keep + 1] = torch.arange(k, device=lat.tokens.device)
    parents = remap[lat.parents[keep] + 1]
    return lat.tokens[keep], parents, lat.depths[keep], lat.scores[keep]


class TreeShape:
    """Base of the tree builders: `draft_request()` says what to ask the drafter for, `build()` selects."""

    nodes: int

    def draft_request(self) -> DraftRequest:
        raise NotImplementedError(f"{type(self).__name__} must define draft_request()")

    def build(self, lattices: list) -> TreeBatch:
        raise NotImplementedError(f"{type(self).__name__} must define build()")


class ChainTree(TreeShape):
    """Stock speculative decoding: the drafter's top-1 token per position, `length` positions."""

    def __init__(self, length: int):
        if int(length) < 1:
            raise ValueError(f"ChainTree(length={length}): length must be >= 1")
        self.length = self.nodes = int(length)

    def __repr__(self):
        return f"ChainTree({self.length})"

    def draft_request(self) -> DraftRequest:
        return DraftRequest(depth=self.length, beam=1, topk=1, kind="nodes")

    def build(self, lattices: list) -> TreeBatch:
        rows, hint = [], 0
        for lat in lattices:
            if isinstance(lat, PositionLattice):
                p = min(self.length, lat.tokens.shape[0])
                tok = lat.tokens[:p, 0]
                dev = tok.device
                par = torch.arange(p, device=dev) - 1
                rows.append((tok, par, torch.arange(1, p + 1, device=dev), torch.cumsum(lat.logp[:p, 0].float(), 0)))
                hint = max(hint, p)
            else:
                rows.append(self._greedy_path(lat))
                hint = max(hint, min(self.length, lat.size))
        dev = lattices[0].tokens.device
        tb = _pad_stack(rows, self.length, dev)
        tb.n_valid_hint = hint
        return tb

    def _greedy_path(self, lat: NodeLattice):
        """Follow the best child of each node from the root (device ops; invalid tail = no child)."""
        dev = lat.tokens.device
        L = self.length
        if lat.size == 0:
            z = torch.zeros(0, dtype=torch.long, device=dev)
            return z, z.clone(), z.clone(), torch.zeros(0, device=dev), torch.zeros(0, dtype=torch.bool, device=dev)
        cur = torch.tensor(-1, device=dev)
        alive = torch.tensor(True, device=dev)
        picks, oks = [], []
        for _ in range(min(L, lat.size)):
            cand = torch.where(lat.parents == cur, lat.logp.float(), torch.full_like(lat.logp.float(), -math.inf))
            best = torch.argmax(cand)
            alive = alive & torch.isfinite(cand[best])
            picks.append(best)
            oks.append(alive)
            cur = best
        idx = torch.stack(picks)
        ok = torch.stack(oks)
        # Nodes past the end of the path become padding: they must not appear valid.
        k = idx.shape[0]
        tok = torch.where(ok, lat.tokens[idx], 0)
        par = torch.arange(k, device=dev) - 1
        dep = torch.where(ok, torch.arange(1, k + 1, device=dev), 1)
        return tok, torch.where(ok, par, -1), dep, _mask_scores(lat.scores[idx], ok), ok


def _mask_scores(scores, ok):
    return torch.where(ok, scores.float(), torch.full_like(scores.float(), -math.inf))


class BestFirstTree(TreeShape):
    """The `nodes` highest path scores (prefix-closed, best-first), parent-conditioned where the drafter
    gives parent-conditioned scores; depth capped at `max_depth` (None: the default drafting depth)."""

    def __init__(self, nodes: int, max_depth: int | None = None, beam: int | None = None, topk: int | None = None):
        if int(nodes) < 1:
            raise ValueError(f"BestFirstTree(nodes={nodes}): nodes must be >= 1")
        if max_depth is not None and int(max_depth) < 1:
            raise ValueError(f"BestFirstTree(max_depth={max_depth}): must be >= 1 or None")
        self.nodes = int(nodes)
        self.max_depth = None if max_depth is None else int(max_depth)
        self.depth = min(self.nodes, self.max_depth or DEFAULT_DRAFT_DEPTH)
        self.beam = int(beam or min(self.nodes, DEFAULT_BRANCH))
        self.topk = int(topk or min(self.nodes, DEFAULT_BRANCH))

    def __repr__(self):
        return f"{type(self).__name__}({self.nodes}, max_depth={self.max_depth})"

    def draft_request(self) -> DraftRequest:
        return DraftRequest(depth=self.depth, beam=self.beam, topk=self.topk, kind="nodes")

    def build(self, lattices: list) -> TreeBatch:
        rows, hint = [], 0
        for lat in lattices:
            if isinstance(lat, PositionLattice):
                rows.append(_heap_over_positions(lat, self.nodes, self.depth, use_cond=True))
            else:
                rows.append(_select_prefix_closed(lat, self.nodes))
            hint = max(hint, int(rows[-1][0].shape[0]))
        tb = _pad_stack(rows, self.nodes, lattices[0].tokens.device)
        tb.n_valid_hint = hint
        return tb


class IndependentTree(BestFirstTree):
    """DDTree-style: best-first over *independent* per-position log-probs (the path score of a node is
    the sum of its tokens' per-position scores, whatever its parent). Needs a drafter that can give
    per-position candidates (`ModelDrafter` does, from its greedy chain; block drafters do)."""

    def draft_request(self) -> DraftRequest:
        return DraftRequest(depth=self.depth, beam=1, topk=self.topk, kind="positions")

    def build(self, lattices: list) -> TreeBatch:
        rows = []
        for lat in lattices:
            if not isinstance(lat, PositionLattice):
                raise TypeError(
                    f"IndependentTree needs per-position candidates (PositionLattice) from the drafter, got {type(lat).__name__}"
                )
            rows.append(_heap_over_positions(lat, self.nodes, self.depth, use_cond=False))
        tb = _pad_stack(rows, self.nodes, lattices[0].tokens.device)
        tb.n_valid_hint = max(int(r[0].shape[0]) for r in rows)
        return tb


DDTree = IndependentTree


def _heap_over_positions(lat: PositionLattice, n: int, max_depth: int, use_cond: bool):
    """Best-first heap over a position lattice (host work over a small [P, K] block).

    Each popped node is final (scores only decrease along a path), so the result is the exact top-n
    prefix-closed set. With `use_cond` and parent-conditioned scores available, an edge is scored by
    log p(child | parent); otherwise by the child's independent per-position log-prob."""
    dev = lat.tokens.device
    P, K = lat.tokens.shape
    P = min(P, max_depth)
    toks = lat.tokens.tolist()
    logp = lat.logp.float().tolist()
    cond = lat.cond_logp.float().tolist() if (use_cond and lat.cond_logp is not None) else None
    heap = [(-logp[0][j], 0, j, -1, 0) for j in range(K)]  # (-score, depth-1, cand, parent node, tiebreak)
    heapq.heapify(heap)
    out_tok, out_par, out_dep, out_sc = [], [], [], []
    cand_of_node = []
    counter = 0
    while heap and len(out_tok) < n:
        neg, p, j, parent, _ = heapq.heappop(heap)
        node = len(out_tok)
        out_tok.append(toks[p][j])
        out_par.append(parent)
        out_dep.append(p + 1)
        out_sc.append(-neg)
        cand_of_node.append(j)
        if p + 1 < P:
            for j2 in range(K):
                edge = cond[p + 1][j][j2] if cond is not None else logp[p + 1][j2]
                counter += 1
                heapq.heappush(heap, (neg - edge, p + 1, j2, node, counter))
    return (
        torch.tensor(out_tok, dtype=torch.long, device=dev),
        torch.tensor(out_par, dtype=torch.long, device=dev),
        torch.tensor(out_dep, dtype=torch.long, device=dev),
        torch.tensor(out_sc, dtype=torch.float32, device=dev),
    )
