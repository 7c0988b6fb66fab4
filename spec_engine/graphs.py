"""Static-shape forwards for CUDA graphs: one captured forward per row count.

The KV cache is preallocated (`KVCache.allocate_static`), every verify attends the whole buffer with
the unused columns masked, and the rows are written at device indices, so the forward for R rows has
the same shapes at every step and can be captured once and replayed. The inputs (ids, positions,
mask, write indices) are static buffers refilled before each replay, on the device, without a sync.
Off CUDA (or with `use_graphs=False`) the same static path runs eagerly, which is how it is tested
on the CPU.

`StaticRunner` is the machinery (any row count, any mask, any projection of the hidden states);
`StaticVerifier` projects to the target's argmax for tree verify; `ModelDrafter` uses a runner that
projects to log-probs for its level-by-level drafting.
"""

from __future__ import annotations

import torch

from .cache import KVCache
from .tree import TreeBatch
from .verify import CausalLM, VerifyOutput


def _kv_shape(model) -> tuple[int, int]:
    cfg = model.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return int(kv), int(head_dim)


class StaticRunner:
    """Forwards over a static KV cache, CUDA-graphed per row count when possible.

    `project(hidden [1, R, H])` runs inside the graph on the decoder's output (argmax ids for a
    verifier, log-probs for a drafter)."""

    def __init__(self, target: CausalLM, capacity: int, use_graphs: bool | None = None, project=None):
        self.lm = target
        self.project = project if project is not None else target.head
        self.capacity = int(capacity)
        self.cache = KVCache(target.num_layers, self.capacity)
        kv, hd = _kv_shape(target.model)
        self.cache.allocate_static(1, kv, hd, target.dtype, target.device)
        self.use_graphs = (target.device.type == "cuda") if use_graphs is None else bool(use_graphs)
        self._slots: dict[int, dict] = {}  # rows -> static buffers (+ graph)
        self.graph_errors: dict[int, str] = {}
        self._min = torch.finfo(target.dtype).min
        self._cols = torch.arange(self.capacity, device=target.device)

    def _run(self, slot) -> torch.Tensor:
        self.cache.write_index = slot["widx"]
        out = self.lm.decoder(
            input_ids=slot["ids"],
            position_ids=slot["pos"],
            attention_mask=slot["mask"],
            use_cache=True,
            **{self.lm._cache_kw: self.cache},
        )
        return self.project(out.last_hidden_state)

    def _slot(self, rows: int) -> dict:
        """The static buffers (and, once captured, the graph) for `rows` rows, kept per row count."""
        if rows not in self._slots:
            self._slots[rows] = {**self._eager_slot(rows, self.lm.device), "graph": None}
        return self._slots[rows]

    def _fill(self, slot, ids, pos, allowed_tail, base):
        """allowed_tail [rows, rows]: which of the rows being written each row may see."""
        rows = ids.shape[-1]
        allowed = (self._cols < base).unsqueeze(0).expand(rows, self.capacity).clone()
        if base + rows <= self.capacity:
            allowed[:, base : base + rows] = allowed_tail
        self._fill_mask(slot, ids, pos, allowed, base)

    def _fill_mask(self, slot, ids, pos, allowed, base):
        """allowed [rows, <= capacity]: every column each row may see (the rest are masked)."""
        rows = ids.shape[-1]
        if base + rows > self.capacity:
            raise ValueError(f"{type(self).__name__}: {base} + {rows} rows exceed the cache capacity {self.capacity}")
        slot["ids"].copy_(ids.view(1, rows))
        slot["pos"].copy_(pos.view(1, rows))
        slot["widx"].copy_(torch.arange(base, base + rows, device=ids.device))
        m = slot["mask"][0, 0]
        m.fill_(self._min)
        m[:, : allowed.shape[-1]].masked_fill_(allowed, 0.0)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor, base: int, graph: bool = True):
        """Rows `ids [R]` at positions `pos [R]` written at `base ..`, seeing the columns in
        `allowed [R, <= capacity]`; returns the projection `[1, R, ...]` (the cache length is the
        caller's to move). `graph=False` runs eagerly (e.g. for one-off row counts)."""
        rows = ids.numel()
        slot = self._slot(rows) if graph else self._eager_slot(rows, ids.device)
        self._fill_mask(slot, ids, pos, allowed, base)
        return self._forward(rows) if graph else self._run(slot)

    def _eager_slot(self, rows: int, dev) -> dict:
        return {
            "ids": torch.zeros(1, rows, dtype=torch.long, device=dev),
            "pos": torch.zeros(1, rows, dtype=torch.long, device=dev),
            "mask": torch.full((1, 1, rows, self.capacity), self._min, dtype=self.lm.dtype, device=dev),
            "widx": torch.zeros(rows, dtype=torch.long, device=dev),
        }

    def _forward(self, rows: int) -> torch.Tensor:
        slot = self._slot(rows)
        if not self.use_graphs or rows in self.graph_errors:
            return self._run(slot)
        if slot["graph"] is None:
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        self._run(slot)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    slot["out"] = self._run(slot)
                slot["graph"] = graph
            except Exception as exc:  # fall back to eager for this shape, and say why
                self.graph_errors[rows] = f"{type(exc).__name__}: {exc}"
                return self._run(slot)
        slot["graph"].replay()
        return slot["out"].clone()

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, graph: bool = False) -> torch.Tensor:
        """Causal forward of `ids` (1-D) after the committed rows, committed; returns the projection
        of its rows. Eager by default (prompts vary in length); `graph=True` for short feeds."""
        ids = ids.view(-1).to(self.lm.device)
        t = ids.numel()
        base = self.cache.length
        slot = self._slot(t) if graph else self._eager_slot(t, ids.device)
        tri = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
        self._fill(slot, ids, torch.arange(base, base + t, device=ids.device), tri, base)
        out = self._forward(t) if graph else self._run(slot)
        self.cache.length = base + t
        return out


class StaticVerifier(StaticRunner):
    """Prefill and tree verify over a static KV cache (projection: the target's argmax head)."""

    def __init__(self, target: CausalLM, capacity: int, use_graphs: bool | None = None):
        super().__init__(target, capacity, use_graphs)

    @torch.no_grad()
    def verify(self, root: torch.Tensor, tree: TreeBatch) -> VerifyOutput:
        """Same contract as `verify.verify` (rows written after `cache.length`, not committed)."""
        if tree.batch != 1:
            raise ValueError(f"StaticVerifier: one request per verify for now, got {tree.batch}")
        base = self.cache.length
        rows = tree.nodes + 1
        slot = self._slot(rows)
        ids = torch.cat([root.view(1), tree.tokens[0]])
        self._fill(slot, ids, tree.row_positions(base)[0], tree.rows_ancestors()[0], base)
        return VerifyOutput(argmax=self._forward(rows).view(1, rows), base=base)
