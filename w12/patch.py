"""``w12.patch`` / ``w12.unpatch``: swap a model's ``nn.Linear`` layers for ``W12Linear`` in place.

Layers are converted one at a time and the BF16 weight is dropped as soon as its W12 form
exists, so peak memory is the model plus one layer. Whatever is not converted is listed, with the
reason, in the returned model's ``w12_report`` (and logged on the ``w12`` logger).

Tied LM heads: a head whose weight *is* the input embedding stays BF16 by default, because the
embedding lookup needs the BF16 table anyway and a W12 copy would add 12 bits a weight of memory.
``lm_head=True`` converts it regardless (a separate W12 head beside the BF16 embedding: faster head
GEMM, more memory).
"""

from __future__ import annotations

import fnmatch
import logging
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear
from tqdm.auto import tqdm

from .format import RECORD_BYTES, TILE_K, TILE_N, ceil_div
from .fuse import fuse_projections, fused_groups, unfuse_projections
from .nn import W12Linear

__all__ = ["PatchReport", "patch", "unpatch"]

logger = logging.getLogger("w12")

Patterns = str | Iterable[str] | Callable[[str, nn.Module], bool] | None


@dataclass
class PatchReport:
    """What ``patch`` converted and what it skipped (and why)."""

    converted: list[dict] = field(default_factory=list)  # name, shape, bytes_bf16, bytes_w12, escapes
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (module name, reason)
    seconds: float = 0.0
    fused_groups: int = 0  # groups of sibling projections (q/k/v, gate/up) that run as one GEMM

    @property
    def bytes_bf16(self) -> int:
        return sum(c["bytes_bf16"] for c in self.converted)

    @property
    def bytes_w12(self) -> int:
        return sum(c["bytes_w12"] for c in self.converted)

    def summary(self) -> str:
        lines = [
            f"w12.patch: converted {len(self.converted)} linear layers "
            f"({self.bytes_bf16 / 2**20:.1f} MiB BF16 -> {self.bytes_w12 / 2**20:.1f} MiB W12"
            + (f", {self.bytes_w12 * 8 / (self.bytes_bf16 / 2):.3f} bits/weight" if self.bytes_bf16 else "")
            + f") in {self.seconds:.1f} s; skipped {len(self.skipped)}"
            + (f"; fused {self.fused_groups} projection groups into one GEMM each" if self.fused_groups else "")
        ]
        lines += [f"  skipped {name}: {reason}" for name, reason in self.skipped]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _matcher(patterns: Patterns, arg: str) -> Callable[[str, nn.Module], str | None] | None:
    """Returns f(name, module) -> the matching pattern (or a label), None when nothing matches."""
    if patterns is None:
        return None
    if callable(patterns):
        return lambda name, mod: f"{arg} callable" if patterns(name, mod) else None
    pats = [patterns] if isinstance(patterns, str) else list(patterns)
    for p in pats:
        if not isinstance(p, str):
            raise TypeError(f"w12.patch: {arg} must hold glob strings, got {type(p).__name__}")
    return lambda name, mod: next((p for p in pats if fnmatch.fnmatchcase(name, p)), None)


def _w12_nbytes_estimate(n: int, k: int) -> int:
    """Bytes of the W12 form without escapes (records with tile padding, base, esc_ptr)."""
    return ceil_div(n, TILE_N) * ceil_div(k, TILE_K) * RECORD_BYTES + n + 4 * (n + 1)


def _call_or_none(model, method: str):
    fn = getattr(model, method, None)
    if not callable(fn):
        return None
    try:
        return fn()
    except (NotImplementedError, AttributeError):
        return None


def _parents_of(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, str]]]:
    """id(module) -> every (parent, attribute, full name) that holds it (shared modules appear twice)."""
    out: dict[int, list] = {}
    for pname, parent in model.named_modules(remove_duplicate=False):
        for child_name, child in parent._modules.items():
            if child is not None:
                full = f"{pname}.{child_name}" if pname else child_name
                out.setdefault(id(child), []).append((parent, child_name, full))
    return out


def _param_owners(model: nn.Module) -> dict[int, dict[int, str]]:
    """id(parameter) -> {id(module): name} of the modules that hold it (tied weights have several;
    one module reachable under two names counts once)."""
    out: dict[int, dict[int, str]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for p in mod._parameters.values():
            if p is not None:
                out.setdefault(id(p), {}).setdefault(id(mod), mname)
    return out


def _skip_reason(name, mod, include, exclude, is_head, head_tied, owners, lm_head, keep_if_larger) -> str | None:
    if isinstance(mod, NonDynamicallyQuantizableLinear):
        return "its owner (nn.MultiheadAttention) reads .weight directly instead of calling forward"
    if type(mod).forward is not nn.Linear.forward:
        return f"{type(mod).__name__} overrides nn.Linear.forward (its callers may not go through forward)"
    if include is not None and include(name, mod) is None:
        return "not matched by include"
    if exclude is not None:
        hit = exclude(name, mod)
        if hit is not None:
            return f"excluded by {hit!r}"
    w = mod.weight
    if is_head and lm_head is False:
        return "LM head (lm_head=False)"
    others = {n for i, n in owners.get(id(w), {}).items() if i != id(mod)}
    if others and not (is_head and lm_head):
        if is_head and head_tied:
            return "LM head tied to the input embedding (kept BF16; lm_head=True converts a separate W12 copy)"
        return f"weight shared with {sorted(others)}"
    if w.device.type == "meta":
        return "weight is on the meta device (not loaded)"
    hook = getattr(mod, "_hf_hook", None)
    if hook is not None and getattr(hook, "offload", False):
        return "weights offloaded by accelerate"
    if w.dtype != torch.bfloat16:
        return f"dtype {w.dtype} (W12 stores bfloat16 weights; cast the model to bfloat16 first)"
    n, k = w.shape
    bf16, est = n * k * 2, _w12_nbytes_estimate(n, k)
    if est >= bf16 and not keep_if_larger:
        return f"too small: padding to {TILE_N}x{TILE_K} tiles makes W12 {est} B vs {bf16} B BF16 (keep_if_larger=True converts it)"
    return None


@torch.no_grad()
def patch(
    model: nn.Module,
    include: Patterns = None,
    exclude: Patterns = None,
    lm_head: bool | str | None = None,
    keep_if_larger: bool = False,
    progress: bool | None = None,
    fuse: bool = True,
) -> nn.Module:
    """Replaces the model's BF16 ``nn.Linear`` layers by ``W12Linear`` in place and returns the model.

    include / exclude: glob patterns (``fnmatch``, on the module's full name, e.g.
        ``"*.mlp.*"``) or a callable ``(name, module) -> bool``. ``include=None`` means all.
    lm_head: ``None`` converts the output head unless it is tied to the input embedding;
        ``True`` converts it in any case; ``False`` never; ``"certified"`` keeps it BF16 and
        attaches a ``w12.CertifiedHead`` as ``model.w12_certified_head`` (exact greedy argmax from
        an INT8 screen; see ``w12.certified_argmax``), the ordinary head still giving logits.
    keep_if_larger: convert layers so small that tile padding makes W12 bigger than BF16.
    progress: tqdm bar (default: when there are more than 32 layers).
    fuse: afterwards, fuse sibling W12 projections that read the same input (q/k/v, gate/up)
        into one GEMM each (``w12.fuse_projections``; exact on the CPU, fewer launches on CUDA).
        ``w12.unfuse_projections(model)`` undoes it. BF16 layers are never fused here, and BF16
        groups fused earlier are unfused first so their layers can be converted.

    The report (``model.w12_report``, a ``PatchReport``) lists every converted layer and every
    skipped one with its reason. The weights are lossless: ``unpatch`` restores bit-identical
    ``nn.Linear`` layers. Linears already on a GPU are encoded there when the kernels exist.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"w12.patch expects a torch.nn.Module, got {type(model).__name__}")
    if lm_head not in (None, True, False, "certified"):
        raise ValueError(f"w12.patch: lm_head must be None, True, False or 'certified', got {lm_head!r}")
    certified = lm_head == "certified"
    if certified:
        lm_head = False  # the certified head rescores survivors with the exact BF16 weights
    inc, exc = _matcher(include, "include"), _matcher(exclude, "exclude")
    t0 = time.perf_counter()
    unfuse_projections(model, w12=False)  # a fused BF16 member is no plain nn.Linear: patch could not convert it
    head = _call_or_none(model, "get_output_embeddings")
    emb = _call_or_none(model, "get_input_embeddings")
    head_tied = (
        isinstance(head, nn.Module)
        and isinstance(emb, nn.Module)
        and getattr(head, "weight", None) is not None
        and head.weight is getattr(emb, "weight", None)
    )
    owners = _param_owners(model)
    parents = _parents_of(model)
    # Names only: holding the modules here would keep every BF16 weight alive until the end.
    names = [name for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    head_id = id(head) if head is not None else None
    report = PatchReport()
    if progress is None:
        progress = len(names) > 32
    for name in tqdm(names, desc="w12.patch", unit="layer", disable=not progress):
        mod = model.get_submodule(name)
        is_head = id(mod) == head_id
        reason = _skip_reason(name, mod, inc, exc, is_head, head_tied, owners, lm_head, keep_if_larger)
        if reason is not None:
            report.skipped.append((name, reason))
            continue
        n, k = mod.weight.shape
        new = W12Linear.from_linear(mod)
        if is_head and head_tied:
            _untie_config(model)
        for parent, attr, _ in parents.get(id(mod), []):
            parent._modules[attr] = new
        report.converted.append(
            dict(
                name=name,
                shape=[n, k],
                bytes_bf16=n * k * 2,
                bytes_w12=new.weight_w12().nbytes,
                escapes=new.w12_esc_col.numel(),
            )
        )
        del mod, new  # the BF16 weight goes now, not at the end of the loop
    report.skipped += _unconvertible_params(model)
    if fuse:
        fuse_projections(model, bf16=False)
    report.fused_groups = sum(g.kind == "w12" for g in fused_groups(model))
    report.seconds = time.perf_counter() - t0
    previous = getattr(model, "w12_report", None)
    if isinstance(previous, PatchReport):
        report.converted = previous.converted + report.converted
    model.w12_report = report
    if certified:
        _attach_certified_head(model, head)
    logger.info(report.summary())
    if report.converted:
        _attach_transformers(model)
    return model


def _attach_certified_head(model: nn.Module, head) -> None:
    from .head import CertifiedHead

    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(
            f"w12.patch(lm_head='certified'): the output head {type(head).__name__} has no dense [V, K] weight"
        )
    # A plain attribute, not a submodule: state_dict and save_pretrained stay those of the model.
    object.__setattr__(model, "w12_certified_head", CertifiedHead(weight.detach(), getattr(head, "bias", None)))


def certified_argmax(model: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Greedy next-token ids from final hidden states ``[..., K]`` through the model's certified head
    (``w12.patch(model, lm_head="certified")``): the exact argmax, without full-vocabulary logits."""
    head = getattr(model, "w12_certified_head", None)
    if head is None:
        raise ValueError(
            "certified_argmax: the model has no certified head; call w12.patch(model, lm_head='certified')"
        )
    return head.argmax(hidden_states)


@torch.no_grad()
def unpatch(model: nn.Module) -> nn.Module:
    """Replaces every ``W12Linear`` by an ``nn.Linear`` with the bit-identical BF16 weight; returns the model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"w12.unpatch expects a torch.nn.Module, got {type(model).__name__}")
    parents = _parents_of(model)
    names = [name for name, mod in model.named_modules() if isinstance(mod, W12Linear)]
    for name in names:
        mod = model.get_submodule(name)
        lin = mod.to_linear()
        for parent, attr, _ in parents.get(id(mod), []):
            parent._modules[attr] = lin
        del mod
    if hasattr(model, "w12_report"):
        del model.w12_report
    if "transformers" in sys.modules:
        from .hf import detach_from_model

        detach_from_model(model)
    return model


def _untie_config(model: nn.Module) -> None:
    """The head now has its own (W12) weight: a saved config must not ask loaders to tie it again."""
    config = getattr(model, "config", None)
    if config is None:
        return
    configs = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        configs.append(get_text())
    for c in configs:
        if getattr(c, "tie_word_embeddings", False):
            c.tie_word_embeddings = False
    logger.info("w12.patch: converted the tied LM head; config.tie_word_embeddings is now False")


def _unconvertible_params(model: nn.Module) -> list[tuple[str, str]]:
    """BF16 matrices held outside ``nn.Linear`` (expert stacks, routers), reported as not converted."""
    out = []
    for mname, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, W12Linear, nn.Embedding)):
            continue
        for pname, p in mod._parameters.items():
            if p is not None and p.dim() >= 2 and p.dtype == torch.bfloat16:
                kind = "stacked (expert) weight" if p.dim() >= 3 else "matrix"
                out.append(
                    (
                        f"{mname}.{pname}" if mname else pname,
                        f"{p.dim()}-D {kind} {list(p.shape)} of {type(mod).__name__}, not an nn.Linear: not converted",
                    )
                )
    return out


def _attach_transformers(model: nn.Module) -> None:
    """Makes ``save_pretrained`` of a patched Transformers model write a W12 folder."""
    if "transformers" not in sys.modules:
        return
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        from .hf import attach_to_model

        attach_to_model(model)
