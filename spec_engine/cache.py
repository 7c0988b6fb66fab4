"""KV cache with preallocated buffers that can be compacted to an accepted tree path.

Transformers' own cache classes change between releases (5.17 on the GPU machine, 5.24 here: crop
semantics, static-layer bookkeeping). The models only call `cache.update(k, v, layer_idx, ...)` when
given an explicit 4-D mask and position ids, so this class overrides exactly that and keeps its own
length: writes go to rows `[length, length + n)` of per-layer buffers, and `length` only moves when
the engine says so (`advance`, `compact`, `crop`). A forward that is not followed by `advance` is
therefore read-only with respect to the committed cache.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class KVCache(DynamicCache):
    """Per-layer `[B, H, capacity, D]` key/value buffers; rows `< length` are committed."""

    def __init__(self, num_layers: int, capacity: int = 256):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"KVCache: num_layers must be >= 1, got {num_layers}")
        self.num_layers = int(num_layers)
        self.capacity = max(16, int(capacity))
        self.length = 0
        self._k: list[torch.Tensor | None] = [None] * self.num_layers
        self._v: list[torch.Tensor | None] = [None] * self.num_layers
        # Static mode (CUDA graphs): fixed buffers, rows written at the device indices `write_index`,
        # attention over the whole buffer (the caller masks the columns that are not in use).
        self.write_index: torch.Tensor | None = None

    def allocate_static(self, batch: int, kv_heads: int, head_dim: int, dtype, device) -> None:
        """Preallocate every layer's buffers and switch to static mode (shapes never change again)."""
        shape = (batch, kv_heads, self.capacity, head_dim)
        self._k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
        self._v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
        self.write_index = torch.zeros(1, dtype=torch.long, device=device)

    # --- the part transformers calls -------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"KVCache.update: layer_idx {layer_idx} outside [0, {self.num_layers})")
        if self.write_index is not None:
            k, v = self._k[layer_idx], self._v[layer_idx]
            k.index_copy_(2, self.write_index, key_states.to(k.dtype))
            v.index_copy_(2, self.write_index, value_states.to(v.dtype))
            return k, v
        n = key_states.shape[-2]
        end = self.length + n
        k, v = self._k[layer_idx], self._v[layer_idx]
        if k is None or end > k.shape[-2]:
            k, v = self._grow(layer_idx, key_states, value_states, end)
        k[:, :, self.length : end] = key_states
        v[:, :, self.length : end] = value_states
        return k[:, :, :end], v[:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    # --- the part the engine calls -----------------------------------------------------------------
    def advance(self, n: int) -> None:
        """Commit the `n` rows written by the last forward."""
        self.length += int(n)

    def crop(self, length: int) -> None:  # absolute length, unlike transformers' negative-count crop
        if not 0 <= length <= self.length:
            raise ValueError(f"KVCache.crop: length {length} outside [0, {self.length}]")
        self.length = int(length)

    def compact(self, base: int, rows: torch.Tensor) -> None:
        """Keep rows `base + rows[i]` (ascending, >= i) at `base + i`, then commit `base + len(rows)`.

        Used after tree verify: `base` is the committed length before verify, `rows` the verify rows of
        the root and of the accepted nodes in path order."""
        m = int(rows.shape[0])
        for i in range(self.num_layers):
            if self._k[i] is None:
                continue
            src = rows.to(self._k[i].device) + base
            # index_select copies first, so an overlapping destination is safe.
            self._k[i][:, :, base : base + m] = self._k[i].index_select(2, src)
            self._v[i][:, :, base : base + m] = self._v[i].index_select(2, src)
        self.length = base + m

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed (keys, values) of layer i, `[B, H, length, D]` views."""
        if self._k[i] is None:
            raise ValueError(f"KVCache.layer({i}): nothing has been written to this layer yet")
        return self._k[i][:, :, : self.length], self._v[i][:, :, : self.length]

    def _grow(self, i, key_states, value_states, need):
        cap = max(self.capacity, need)
        while cap < need:
            cap *= 2
        if self._k[i] is not None and cap < 2 * self._k[i].shape[-2]:
            cap = 2 * self._k[i].shape[-2]
        b, h, _, dk = key_states.shape
        dv = value_states.shape[-1]
        k = key_states.new_zeros(b, h, cap, dk)
        v = value_states.new_zeros(b, h, cap, dv)
        if self._k[i] is not None:
            k[:, :, : self.length] = self._k[i][:, :, : self.length]
            v[:, :, : self.length] = self._v[i][:, :, : self.length]
        self._k[i], self._v[i] = k, v
        self.capacity = max(self.capacity, cap)
        return k, v
