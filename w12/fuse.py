"""Sibling projections that read the same input, run as one GEMM: q/k/v and gate/up.

A decode step of a Transformers Llama runs q_proj, k_proj, v_proj and gate_proj, up_proj as five
GEMMs on two inputs. Every W12 GEMM launch costs several microseconds of fixed time, which is
most of the time of the small k/v projections ([1024, 4096] in Llama-3.1-8B); one GEMM over the
concatenated weight [q; k; v] (and [gate; up]) saves three launches per layer.

``fuse_projections(model)`` finds such groups (siblings under one parent, named as in
``DEFAULT_GROUPS``) and concatenates their weights once. Each member then holds *views* into the
fused tensors (no second copy), keeps its class's state_dict keys, and stays a normal module for
``state_dict`` / ``save_pretrained`` / ``w12.unpatch``. The group itself is a plain object, not a
submodule, so it adds nothing to the state_dict.

Forward: the first member called with an input ``x`` runs the fused GEMM and caches its output;
the others called with the same tensor object get their column slice of it (a view). Once every
member has been served, the cache is dropped, so no activation outlives the forward (compiled
graphs and CUDA-graph pools would otherwise hold it). A member called with another input
recomputes with that input, so results are right for any call pattern; a group whose members
keep being called with different inputs (cross-attention, k/v cached across steps) stops
fusing after a few such calls and every member runs its own GEMM.

Only CUDA inputs take the fused GEMM. On the CPU every member computes exactly what the unfused
module computes (patched CPU models stay bit-identical to BF16); ``W12_FUSE_FORCE=1`` (read at
import) or ``w12.fuse._FORCE = True`` sends CPU inputs through the fused GEMM too, for tests.

Fusion is for inference: fused BF16 weights have ``requires_grad=False`` (``unfuse_projections``
restores the flag). Moving or reloading members (``.to()``, ``.cuda()``, ``.half()``,
``load_state_dict``) turns the group off while members differ from the fused tensors; once every
member has moved it fuses again, or dissolves where the conditions no longer hold (``.float()`` of
BF16 members). ``unfuse_projections`` gives every member its own tensors back.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Iterable

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from .format import TILE_N
from .nn import W12Linear, _kernel_layout, _nonaliased_empty

__all__ = ["DEFAULT_GROUPS", "fuse_projections", "fused_groups", "unfuse_projections"]

logger = logging.getLogger("w12")

# The order Transformers' forwards call them in; the fused weight keeps this order except that a
# W12 member whose rows do not fill whole 128-row tiles goes last.
DEFAULT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

_FORCE = os.environ.get("W12_FUSE_FORCE", "0") == "1"

# Inputs abandoned before every member was served, in a row, before a group stops fusing. One is
# an exception in the middle of a forward; three is a call pattern that fusion cannot serve.
_MAX_MISSES = 3


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` when it is the whole of its storage, else a copy (a view would drag the fused
    storage along, and safetensors refuses tensors that share one)."""
    if t.device.type == "meta":
        return t
    if t.numel() == 0:  # an empty view still names the fused storage; a plain empty one names none
        return _nonaliased_empty(t)
    if t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone()


def _fingerprint(m: nn.Module) -> tuple:
    """What identifies the tensors a member holds; a different fingerprint means they were replaced."""
    out = []
    for t in (*m._parameters.values(), *m._buffers.values()):
        if t is not None:
            out.append((t.device, t.dtype, tuple(t.shape), t.data_ptr()))
    return tuple(out)


class _Group:
    """The fused tensors of one group of sibling projections and the cache of its forward."""

    def __init__(self, kind: str, members: list[nn.Module], label: str):
        self.kind = kind  # "w12" or "bf16"
        self.label = label
        # Weak references: members hold the group, and a cycle would keep GPU memory alive until
        # the garbage collector runs (w12.unpatch drops modules one at a time on purpose).
        self._members = [weakref.ref(m) for m in members]
        self._full = (1 << len(members)) - 1
        self._requires_grad = [{n: p.requires_grad for n, p in m._parameters.items() if p is not None} for m in members]
        self.tensors: dict | None = None
        self.active = False
        self.disabled: str | None = None
        self._cache = None  # (x, fused output over x)
        self._mask = 0
        self._misses = 0
        self._changed: set[int] = set()
        self._fingerprints: list[tuple] = []
        cls = _FusedW12Linear if kind == "w12" else _FusedLinear
        for m in members:
            m.__class__ = cls
            m.__dict__["_w12_group"] = self
        self._fuse(members)

    # -- storage --------------------------------------------------------------------------
    def members(self) -> list[nn.Module]:
        return [m for m in (r() for r in self._members) if m is not None]

    def _fuse(self, members: list[nn.Module]) -> None:
        """Concatenates the members' tensors and makes every member hold views into them."""
        k = members[0].in_features
        bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
        if self.kind == "w12":
            nnz = [m.w12_esc_col.numel() for m in members]
            offsets = [sum(nnz[:i]) for i in range(len(members) + 1)]
            # Each member's esc_ptr starts at 0 (format), so shifting it by the escapes before it
            # gives the fused rows' pointers; the last entry closes the list without a host sync.
            ptr = [m.w12_esc_ptr[:-1] + offsets[i] for i, m in enumerate(members)]
            ptr.append(members[-1].w12_esc_ptr[-1:] + offsets[-2])
            t = dict(
                records=torch.cat([m.w12_records for m in members]),
                base=torch.cat([m.w12_base for m in members]),
                esc_ptr=torch.cat(ptr),
                esc_col=torch.cat([m.w12_esc_col for m in members]),
                esc_val=torch.cat([m.w12_esc_val for m in members]),
                bias=bias,
            )
            self.layout = members[0].layout
        else:
            t = dict(weight=torch.cat([m.weight.detach() for m in members]), bias=bias)
        n0 = r0 = 0
        for i, m in enumerate(members):
            n1 = n0 + m.out_features
            if self.kind == "w12":
                r1 = r0 + m.w12_records.shape[0]
                e0, e1 = offsets[i], offsets[i + 1]
                m._buffers["w12_records"] = t["records"][r0:r1]
                m._buffers["w12_base"] = t["base"][n0:n1]
                m._buffers["w12_esc_col"] = t["esc_col"][e0:e1]
                m._buffers["w12_esc_val"] = t["esc_val"][e0:e1]
                r0 = r1
            else:
                m.weight = nn.Parameter(t["weight"][n0:n1], requires_grad=False)
            if bias is not None:
                m.bias = nn.Parameter(bias[n0:n1], requires_grad=False)
            m.__dict__["_w12_slot"] = (i, n0, n1)
            n0 = n1
        self.n, self.k = n0, k
        self.tensors = t
        self._fingerprints = [_fingerprint(m) for m in members]
        self._changed.clear()
        self._misses = 0
        self.disabled = None
        self.active = True

    def _release(self) -> None:
        self.tensors = None
        self.active = False
        self._cache = None
        self._mask = 0

    def dissolve(self) -> None:
        """Gives every member its own tensors and its plain class back."""
        self._release()
        for m, grads in zip([r() for r in self._members], self._requires_grad):
            if m is None:
                continue
            for name, buf in m._buffers.items():
                if buf is not None:
                    m._buffers[name] = _owned(buf)
            for name, p in m._parameters.items():
                if p is not None:
                    m._parameters[name] = nn.Parameter(_owned(p.detach()), requires_grad=grads.get(name, False))
            m.__class__ = W12Linear if self.kind == "w12" else nn.Linear
            m.__dict__.pop("_w12_group", None)
            m.__dict__.pop("_w12_slot", None)
        self._members = []

    def member_changed(self, m: nn.Module) -> None:
        """Called after a member may have replaced its tensors (moved, cast, reloaded)."""
        i = m.__dict__["_w12_slot"][0]
        if i not in self._changed and _fingerprint(m) == self._fingerprints[i]:
            return
        self._release()  # until every member has moved, members run unfused
        self._changed.add(i)
        if len(self._changed) < len(self._members):
            return
        members = self.members()
        reason = None if len(members) == len(self._members) else "a member was deleted"
        reason = reason or _problem(members, self.kind)
        if reason is not None:
            logger.info("w12: %s is no longer fused (%s)", self.label, reason)
            self.dissolve()
        else:
            self._fuse(members)

    # -- forward --------------------------------------------------------------------------
    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        t = self.tensors
        if self.kind == "w12":
            return torch.ops.w12.linear(
                x.contiguous(),
                t["records"],
                t["base"],
                t["esc_ptr"],
                t["esc_col"],
                t["esc_val"],
                self.n,
                self.k,
                self.layout,
                t["bias"],
            )
        return F.linear(x, t["weight"], t["bias"])

    def serve(self, x: torch.Tensor, i: int, n0: int, n1: int) -> torch.Tensor | None:
        """Member ``i``'s output columns ``[n0, n1)`` of the fused GEMM over ``x``; None when the
        group has just stopped fusing (the member then runs its own GEMM).

        The cache is keyed by the identity of ``x`` (held while cached, so it cannot be another
        tensor at a reused address). Input and output live in one tuple read once into a local, so
        a thread that replaces the cache between the check and the slice cannot hand this call
        another input's output; the mask only decides when to drop the cache. Dynamo traces this
        as it is (``is`` between traced tensors and attribute stores on a plain object are
        supported, replayed as side effects after the graph); since every full serve leaves
        ``_cache`` None and ``_mask``/``_misses`` 0, each compiled call starts from the same
        guarded state and nothing recompiles. The fused tensors
        are reached through a member module, so Dynamo makes them static inputs as it does module
        buffers (CUDA-graph trees do not copy them in; tests/test_fuse.py checks both).
        """
        cache = self._cache
        if cache is None or cache[0] is not x:
            if self._mask:  # the previous input was not served to every member
                self._misses += 1
                if self._misses >= _MAX_MISSES:
                    self._release()
                    self.disabled = "members are called with different inputs"
                    return None
            cache = (x, self._linear(x))
            self._cache = cache
            self._mask = 0
        self._mask |= 1 << i
        if self._mask == self._full:
            self._cache = None
            self._mask = 0
            self._misses = 0
        return cache[1][..., n0:n1]

    # -- copy / pickle --------------------------------------------------------------------
    def __getstate__(self):
        # Weak references cannot be pickled, and ``copy.deepcopy`` would keep them pointing at
        # the original model's members; strong ones go through the copy's memo.
        state = dict(self.__dict__)
        state["_members"] = [r() for r in self._members]
        state["_cache"] = None
        state["_mask"] = 0
        return state

    def __setstate__(self, state):
        state["_members"] = [weakref.ref(m) for m in state["_members"] if m is not None]
        self.__dict__.update(state)

    def __repr__(self) -> str:
        state = "active" if self.active else f"inactive ({self.disabled or 'members moved'})"
        return f"<w12 fused {self.kind} group {self.label}: N={getattr(self, 'n', '?')}, {state}>"


class _FusedMixin:
    """Forward through the group; keep the group consistent when the member's tensors change."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self._w12_group
        if g.active and (_FORCE or x.is_cuda):
            i, n0, n1 = self._w12_slot
            y = g.serve(x, i, n0, n1)
            if y is not None:
                return y
        return super().forward(x)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        group = self.__dict__.get("_w12_group")
        if group is not None:
            group.member_changed(self)
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        group = self.__dict__.get("_w12_group")
        if group is not None:
            group.member_changed(self)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if keep_vars:  # callers asked for the live tensors (to write into them): no copies
            return
        for name in (*self._parameters, *self._buffers):
            key = prefix + name
            if isinstance(destination.get(key), torch.Tensor):
                destination[key] = _owned(destination[key])

    def extra_repr(self) -> str:
        _, n0, n1 = self._w12_slot
        return f"{super().extra_repr()}, fused rows [{n0}:{n1}] of {self._w12_group.label}"


class _FusedW12Linear(_FusedMixin, W12Linear):
    pass


class _FusedLinear(_FusedMixin, nn.Linear):
    pass


def _is_fused(m) -> bool:
    return isinstance(m, _FusedMixin) and "_w12_group" in m.__dict__


def _order(members: list[nn.Module], kind: str) -> list[nn.Module]:
    """W12 row tiles concatenate only when every member but the last fills whole 128-row tiles."""
    if kind != "w12":
        return members
    return sorted(members, key=lambda m: m.out_features % TILE_N != 0)  # stable: call order otherwise


def _kind(members) -> str | None:
    if all(type(m) is W12Linear for m in members):
        return "w12"
    if all(type(m) is nn.Linear for m in members):
        return "bf16"
    return None


def _problem(members: list[nn.Module], kind: str) -> str | None:
    """Why these (ordered) members cannot share one GEMM, or None."""
    for m in members:
        if "forward" in m.__dict__:
            return "a member's forward is replaced on the instance (a hook wrapper such as accelerate's)"
        hook = getattr(m, "_hf_hook", None)
        if hook is not None and getattr(hook, "offload", False):
            return "weights offloaded by accelerate"
    if len({m.in_features for m in members}) != 1:
        return f"in_features differ: {[m.in_features for m in members]}"
    if len({m.bias is None for m in members}) != 1:
        return "some members have a bias and some do not"
    tensors = [m.w12_records if kind == "w12" else m.weight for m in members]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return f"members on several devices {sorted(map(str, devices))}"
    device = devices.pop()
    if device.type == "meta":
        return "weights on the meta device (not loaded)"
    if len({(m.bias.dtype, m.bias.device) for m in members if m.bias is not None}) > 1:
        return "biases differ in dtype or device"
    if kind == "bf16":
        if any(t.dtype != torch.bfloat16 for t in tensors):
            return f"weight dtypes {sorted({str(t.dtype) for t in tensors})}, not all bfloat16"
        return None
    if len({m.layout for m in members}) != 1:
        return f"record layouts differ: {[m.layout for m in members]}"
    if any(m.out_features % TILE_N for m in members[:-1]):
        return f"more than one member has out_features not a multiple of {TILE_N} ({[m.out_features for m in members]})"
    n = sum(m.out_features for m in members)
    want = _kernel_layout(device, n, members[0].in_features)
    if want != members[0].layout:
        return f"the kernels want layout {want} for the fused shape [{n}, {members[0].in_features}], members hold layout {members[0].layout}"
    return None


def _holders(model: nn.Module) -> dict[int, set]:
    """id(module) -> {(id(parent), attribute)}: more than one means it is shared."""
    out: dict[int, set] = {}
    for _, parent in model.named_modules(remove_duplicate=False):
        for attr, child in parent._modules.items():
            if child is not None:
                out.setdefault(id(child), set()).add((id(parent), attr))
    return out


def _tensor_holders(model: nn.Module) -> dict[int, set]:
    """id(parameter or buffer) -> {id(module)} of every module holding it (tied weights: several)."""
    out: dict[int, set] = {}
    for _, mod in model.named_modules(remove_duplicate=False):
        for t in (*mod._parameters.values(), *mod._buffers.values()):
            if t is not None:
                out.setdefault(id(t), set()).add(id(mod))
    return out


def _check_groups(groups) -> tuple[tuple[str, ...], ...]:
    if isinstance(groups, str) or not isinstance(groups, Iterable):
        raise TypeError("fuse_projections: groups must be a sequence of name tuples, e.g. (('q_proj', 'k_proj'),)")
    out = []
    for g in groups:
        names = (g,) if isinstance(g, str) else tuple(g)
        if len(names) < 2 or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            raise ValueError(f"fuse_projections: each group needs two or more distinct module names, got {g!r}")
        out.append(names)
    return tuple(out)


@torch.no_grad()
def fuse_projections(
    model: nn.Module, groups: Iterable[Iterable[str]] = DEFAULT_GROUPS, *, w12: bool = True, bf16: bool = True
) -> int:
    """Fuses sibling projections that read the same input into one GEMM per group; returns how
    many groups this call fused.

    A group is a set of child modules of one parent with the names of one entry of ``groups``,
    all present and all ``W12Linear`` (``w12=True``) or all BF16 ``nn.Linear`` (``bf16=True``),
    with one ``in_features``, one device, and biases on all or none. Groups that cannot be fused
    (a member shared with another parent or holding tied tensors, W12 members whose rows do not
    fill whole 128-row tiles, ...) are left alone and logged at debug level with the reason.
    Exact on the CPU; on CUDA the fused GEMM may sum in another order than the separate ones.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse_projections expects a torch.nn.Module, got {type(model).__name__}")
    groups = _check_groups(groups)
    holders, owners = _holders(model), _tensor_holders(model)
    fused = 0
    for pname, parent in list(model.named_modules()):
        for names in groups:
            mods = [parent._modules.get(n) for n in names]
            present = [m for m in mods if m is not None]
            if not present:
                continue
            label = f"{pname + '.' if pname else ''}({','.join(names)})"
            if any(_is_fused(m) for m in present):
                continue
            reason = None
            kind = _kind(present)
            if len(present) < len(mods):
                reason = f"{[n for n, m in zip(names, mods) if m is None]} missing"
            elif len({id(m) for m in mods}) != len(mods):
                reason = "one module under two names of the group"
            elif kind is None:
                reason = f"not all W12Linear or all nn.Linear: {[type(m).__name__ for m in mods]}"
            elif (kind == "w12" and not w12) or (kind == "bf16" and not bf16):
                continue
            elif any(len(holders.get(id(m), ())) > 1 for m in mods):
                reason = "a member is shared with another parent"
            elif any(
                len(owners.get(id(t), ())) > 1
                for m in mods
                for t in (*m._parameters.values(), *m._buffers.values())
                if t is not None
            ):
                reason = "a member's tensors are tied to another module"
            if reason is None:
                mods = _order(mods, kind)
                reason = _problem(mods, kind)
            if reason is not None:
                logger.debug("w12.fuse_projections: not fusing %s: %s", label, reason)
                continue
            _Group(kind, mods, label)
            fused += 1
    if fused:
        logger.info("w12.fuse_projections: fused %d groups of sibling projections", fused)
    return fused


def fused_groups(model: nn.Module) -> list[_Group]:
    """The fused groups whose members are in ``model`` (each once)."""
    seen: dict[int, _Group] = {}
    for m in model.modules():
        if _is_fused(m):
            seen.setdefault(id(m._w12_group), m._w12_group)
    return list(seen.values())


@torch.no_grad()
def unfuse_projections(model: nn.Module, *, w12: bool = True, bf16: bool = True) -> int:
    """Undoes ``fuse_projections``: every member gets its own tensors and its plain class back
    (``W12Linear`` / ``nn.Linear``, the original ``requires_grad``); returns how many groups."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"unfuse_projections expects a torch.nn.Module, got {type(model).__name__}")
    groups = [g for g in fused_groups(model) if (g.kind == "w12" and w12) or (g.kind == "bf16" and bf16)]
    for g in groups:
        g.dissolve()
    return len(groups)
