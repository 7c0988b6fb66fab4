"""SpecEngine: greedy speculative decoding with chain or tree drafts, lossless by construction.

One step = draft (drafter -> lattice) -> tree (builder -> TreeBatch) -> verify (one target forward)
-> accept (longest matching path + bonus; the step's only host sync) -> commit (KV compaction and
drafter update). The committed tokens are exactly the target's greedy continuation: every emitted
token is the target's argmax given the committed prefix.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .drafters import Drafter
from .graphs import StaticVerifier
from .tree import ChainTree, TreeShape
from .verify import CausalLM, accept, commit, host_to_device, verify


@dataclass
class StepStats:
    accepted: int  # draft tokens accepted (the bonus token not counted)
    new_tokens: int  # tokens committed by the step (accepted + bonus, cut at a stop token / the budget)
    nodes: int  # valid tree nodes verified
    rows: int  # rows in the verify forward (root + nodes incl. padding)
    t_draft: float  # seconds: drafter + tree building
    t_verify: float
    t_accept: float
    t_commit: float


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # [new] long, the generated ids
    steps: list[StepStats] = field(default_factory=list)
    cache: object = None  # the target KVCache (committed rows = prompt + tokens[:-1])
    prefill_s: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify step."""
        return sum(s.new_tokens for s in self.steps) / max(1, len(self.steps))


def _profile_default() -> bool:
    return os.environ.get("W12_SPEC_PROFILE", "0") not in ("", "0", "false", "False")


class SpecEngine:
    """`SpecEngine(target, drafter, tree=ChainTree(4))`.

    target: a HF causal LM (any family whose layers are full attention; W12-patched or not).
    drafter: anything with the `Drafter` protocol (`ModelDrafter`, `NgramDrafter`, `BlockDrafterAdapter`).
    tree: `ChainTree(length)`, `BestFirstTree(nodes, max_depth)` or `IndependentTree(nodes, max_depth)`.
    head: optional verify head `hidden [B, R, H] -> argmax ids [B, R]` (default: the model's LM head).
    fixed_shapes: verify every step with the tree's full node budget (padding included), so each tree
        size has one shape (CUDA-graph friendly); default on CUDA, off on CPU (where padding costs).
    profile: synchronize the device around each phase so the step times are exact (`W12_SPEC_PROFILE=1`).
    static: verify over a preallocated static KV cache with one CUDA graph per tree size (`StaticVerifier`;
        implies fixed_shapes; on the CPU the same static path runs eagerly).
    """

    def __init__(
        self,
        target,
        drafter: Drafter,
        tree: TreeShape | None = None,
        head=None,
        fixed_shapes: bool | None = None,
        profile: bool | None = None,
        static: bool = False,
        capacity: int = 2048,
    ):
        if not isinstance(drafter, Drafter):
            raise TypeError(f"SpecEngine: drafter {type(drafter).__name__} lacks reset/propose/commit")
        self.target = target if isinstance(target, CausalLM) else CausalLM(target, head=head)
        self.drafter = drafter
        self.tree = tree if tree is not None else ChainTree(4)
        if not isinstance(self.tree, TreeShape):
            raise TypeError(
                f"SpecEngine: tree must be ChainTree/BestFirstTree/IndependentTree, got {type(tree).__name__}"
            )
        self.fixed_shapes = (self.target.device.type == "cuda") if fixed_shapes is None else bool(fixed_shapes)
        self.profile = _profile_default() if profile is None else bool(profile)
        self.static = bool(static)
        self.fixed_shapes = self.fixed_shapes or self.static
        self.capacity = int(capacity)
        self._static: StaticVerifier | None = None

    def _static_verifier(self, need: int) -> StaticVerifier:
        # Kept across calls: its CUDA graphs are captured once per tree size.
        if self._static is None or self._static.capacity < need:
            self._static = StaticVerifier(self.target, max(need, self.capacity))
        self._static.cache.length = 0
        return self._static

    def _now(self) -> float:
        if self.profile and self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)
        return time.perf_counter()

    @staticmethod
    def _check_args(input_ids, max_new_tokens, stop_token_ids):
        if not isinstance(input_ids, torch.Tensor):
            input_ids = torch.as_tensor(input_ids, dtype=torch.long)
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(f"input_ids: one request only for now, got batch {input_ids.shape[0]}")
            input_ids = input_ids[0]
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty 1-D or [1, T] tensor, got shape {tuple(input_ids.shape)}")
        if int(max_new_tokens) < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        stops = set()
        if stop_token_ids is not None:
            stops = {int(stop_token_ids)} if isinstance(stop_token_ids, int) else {int(t) for t in stop_token_ids}
        return input_ids.long(), int(max_new_tokens), stops

    def stream(self, input_ids, max_new_tokens: int, stop_token_ids=None) -> Iterator[list[int]]:
        """Yield the tokens committed by each step (lists of ids), ending at a stop token or the budget."""
        ids, budget, stops = self._check_args(input_ids, max_new_tokens, stop_token_ids)
        yield from self._steps(ids, budget, stops, GenerationResult(tokens=torch.zeros(0, dtype=torch.long)))

    def generate(self, input_ids, max_new_tokens: int, stop_token_ids=None) -> GenerationResult:
        """Run to a stop token or `max_new_tokens`; the result has `.tokens`, `.steps`, `.cache`, `.tau`."""
        ids, budget, stops = self._check_args(input_ids, max_new_tokens, stop_token_ids)
        res = GenerationResult(tokens=torch.zeros(0, dtype=torch.long))
        toks: list[int] = []
        for chunk in self._steps(ids, budget, stops, res):
            toks.extend(chunk)
        res.tokens = torch.tensor(toks, dtype=torch.long)
        return res

    @torch.no_grad()
    def _steps(self, ids: torch.Tensor, budget: int, stops: set, res: GenerationResult) -> Iterator[list[int]]:
        dev = self.target.device
        ids = ids.to(dev)
        need = ids.numel() + budget + self.tree.nodes + 16
        sv = self._static_verifier(need) if self.static else None
        cache = sv.cache if sv is not None else self.target.new_cache(need)
        res.cache = cache
        if budget == 0:
            return
        t0 = self._now()
        if ids.numel() > 1:
            if sv is not None:
                sv.prefill(ids[:-1])
            else:
                self.target.prefill(cache, ids[:-1].view(1, -1))
        res.prefill_s = self._now() - t0
        self.drafter.reset(ids)
        root = ids[-1:].clone()
        produced = 0
        while produced < budget:
            t0 = self._now()
            lattice = self.drafter.propose(self.tree.draft_request())
            tree = self.tree.build([lattice])
            if not self.fixed_shapes and tree.n_valid_hint is not None and tree.n_valid_hint < tree.nodes:
                tree = tree.trimmed(tree.n_valid_hint)
            t1 = self._now()
            out = sv.verify(root, tree) if sv is not None else verify(self.target, cache, root, tree)
            t2 = self._now()
            acc = accept(tree, out)[0]  # the step's one host sync
            t3 = self._now()
            new = acc.tokens[: budget - produced]
            for i, tok in enumerate(new):
                if tok in stops:
                    new = new[: i + 1]
                    break
            # Cache keeps every committed token but the last: the root and the first len(new)-1 path nodes.
            commit(cache, out.base, acc.rows[: len(new)])
            self.drafter.commit(new)
            root = host_to_device(new[-1:], dev)
            t4 = self._now()
            produced += len(new)
            nodes = int(tree.n_valid_hint) if tree.n_valid_hint is not None else tree.nodes
            res.steps.append(
                StepStats(len(acc.tokens) - 1, len(new), nodes, tree.nodes + 1, t1 - t0, t2 - t1, t3 - t2, t4 - t3)
            )
            yield new
            if new[-1] in stops:
                return
