"""Hugging Face Transformers integration: the ``w12`` quantization method.

After ``import w12``, ``AutoModelForCausalLM.from_pretrained(w12_folder, device_map=...)`` builds
``W12Linear`` modules on the meta device (shapes from the shards' ``w12_tensors`` metadata and
headers) and Transformers' own loader places the W12 tensors directly on their devices, so BF16
weights are never materialised. ``save_pretrained`` on a patched or loaded model writes the W12
container (format §6). ``from_pretrained(bf16_folder, quantization_config=W12Config())`` loads
BF16 and converts with ``w12.patch`` once loaded.

Import cost: ``import w12`` does not import Transformers. This module installs a meta-path hook
that registers the method right after ``transformers.quantizers.auto`` is imported (the module
that ``from_pretrained`` consults, and which is imported by ``transformers.modeling_utils``), or
at once if that module is already loaded. So users pay nothing unless they use Transformers,
and need no extra call when they do.
"""

from __future__ import annotations

import importlib.abc
import json
import logging
import sys
import threading

import torch

from .format import FORMAT_VERSION

# W12Config and W12HfQuantizer are module attributes too, built on first access (see __getattr__).
__all__ = ["attach_to_model", "detach_from_model", "register", "shard_metadata"]

logger = logging.getLogger("w12")

QUANT_METHOD = "w12"
_HOOK_TARGET = "transformers.quantizers.auto"
_LOCK = threading.RLock()
_CLASSES: dict = {}


# -- registration -----------------------------------------------------------------------------
def register() -> tuple[type, type]:
    """Registers ``W12Config`` and ``W12HfQuantizer`` with Transformers (idempotent); returns them."""
    with _LOCK:
        if not _CLASSES:
            classes = _build_classes()
            from transformers.quantizers import auto

            if QUANT_METHOD not in auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
                auto.register_quantization_config(QUANT_METHOD)(classes["W12Config"])
            if QUANT_METHOD not in auto.AUTO_QUANTIZER_MAPPING:
                auto.register_quantizer(QUANT_METHOD)(classes["W12HfQuantizer"])
            _CLASSES.update(classes)
        return _CLASSES["W12Config"], _CLASSES["W12HfQuantizer"]


def __getattr__(name):  # PEP 562: the classes exist only once Transformers is imported
    if name in ("W12Config", "W12HfQuantizer"):
        return register()[0 if name == "W12Config" else 1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _RegisterAfterExec(importlib.abc.Loader):
    """Wraps the real loader of ``transformers.quantizers.auto``; registers once it has run."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _uninstall_hook()
        try:
            register()
        except Exception as e:  # never break `import transformers` for users who do not load W12
            logger.warning("w12: could not register the 'w12' quantization method with Transformers: %s", e)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _HOOK_TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisterAfterExec(spec.loader)
                return spec
        return None


_HOOK = _Hook()


def _uninstall_hook() -> None:
    with _LOCK:
        if _HOOK in sys.meta_path:
            sys.meta_path.remove(_HOOK)


def _install_hook() -> None:
    with _LOCK:
        if _HOOK_TARGET in sys.modules:
            try:
                register()
            except Exception as e:  # `import w12` must work whatever Transformers is installed
                logger.warning("w12: could not register the 'w12' quantization method with Transformers: %s", e)
        elif _HOOK not in sys.meta_path:
            sys.meta_path.insert(0, _HOOK)


# -- checkpoint reading -----------------------------------------------------------------------
def _stem(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def read_checkpoint_index(files) -> tuple[dict, dict]:
    """(w12_tensors map NAME -> info, tensor shapes KEY -> tuple) over all shards' headers."""
    from safetensors import safe_open

    entries, shapes = {}, {}
    for f in files or []:
        if not str(f).endswith(".safetensors"):
            raise ValueError(f"W12 folders hold safetensors shards; cannot read {f}")
        with safe_open(str(f), framework="pt") as fh:
            meta = fh.metadata() or {}
            if meta.get("w12_tensors"):
                version = meta.get("w12_version")
                if version != str(FORMAT_VERSION):
                    raise ValueError(f"{f}: w12_version {version!r}, this w12 reads version {FORMAT_VERSION}")
                try:
                    entries.update(json.loads(meta["w12_tensors"]))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{f}: w12_tensors metadata is not valid JSON: {e}") from None
            for key in fh.keys():
                if ".w12_" in key:
                    shapes[key] = tuple(fh.get_slice(key).get_shape())
    return entries, shapes


def _model_conversions(model):
    """The model's checkpoint renamings and converters (Transformers 5.x), or empty lists."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        conv = get_model_conversion_mapping(model)
    except Exception as e:  # an older/newer Transformers without this API: names are used as they are
        logger.debug("w12: no weight conversion mapping (%s)", e)
        return [], []
    return [c for c in conv if isinstance(c, WeightRenaming)], [c for c in conv if isinstance(c, WeightConverter)]


def _resolve_module_name(model, name: str, names: dict, conversions, meta_state_dict) -> str | None:
    """The model's module for a checkpoint weight name: renamed as Transformers renames checkpoint
    keys (e.g. GPT-NeoX's ``embed_out`` is the model's ``lm_head``), with or without the base prefix."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    cands = []
    try:
        from transformers.core_model_loading import rename_source_key

        renamed, _ = rename_source_key(name, conversions[0], conversions[1], prefix or None, meta_state_dict)
        cands.append(_stem(renamed))
    except Exception as e:
        logger.debug("w12: could not rename %s (%s)", name, e)
    stem = _stem(name)
    cands += [stem, f"{prefix}.{stem}" if prefix else None, stem.removeprefix(f"{prefix}.") if prefix else None]
    return next((c for c in cands if c and c in names), None)


def _disk_name(model, stem: str) -> str:
    """The stem ``save_pretrained`` will write for a module (it reverts the model's renamings)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion

        out = revert_weight_conversion(model, {f"{stem}.w12_records": torch.empty(0)})
        (key,) = out.keys()
        return key.removesuffix(".w12_records")
    except Exception as e:
        logger.debug("w12: could not revert the name of %s (%s)", stem, e)
        return stem


def _replace_linears_on_meta(model, files) -> int:
    from torch import nn

    from .nn import W12Linear
    from .patch import _parents_of
    from .weight import W12FormatError

    entries, shapes = read_checkpoint_index(files)
    if not entries:
        raise W12FormatError(
            f"config.json says quant_method 'w12' but no shard among {[str(f) for f in files or []]} "
            "carries w12_tensors metadata (format §6)"
        )
    parents = _parents_of(model)
    names = dict(model.named_modules())
    conversions = _model_conversions(model)
    meta_state_dict = model.state_dict()
    for name, info in sorted(entries.items()):
        stem = _stem(name)
        shape = tuple(info.get("shape", ()))
        if int(info.get("layout", 0)) != 0:
            raise W12FormatError(f"{name}: layout {info.get('layout')} on disk; a v1 checkpoint is always layout 0")
        target = _resolve_module_name(model, name, names, conversions, meta_state_dict)
        module = model.get_submodule(target) if target is not None else None
        key = f"{stem}.w12_esc_col"
        if key not in shapes:
            raise W12FormatError(f"{name}: tensor {key} is listed in w12_tensors but is not in any shard")
        param = getattr(module, "weight", None) if name.endswith(".weight") else None
        if not isinstance(module, nn.Linear) and isinstance(param, nn.Parameter) and tuple(param.shape) == shape:
            _decode_on_load(model, target, module, shape, shapes[key][0])
            continue
        if not isinstance(module, nn.Linear):
            what = "no such module" if module is None else f"a {type(module).__name__} without a matching weight"
            raise W12FormatError(
                f"{name}: {what} in {type(model).__name__}; the Transformers loader reads W12 weights of modules "
                "(3-D expert stacks that Transformers merges from per-expert checkpoint tensors are not supported yet)"
            )
        if len(shape) != 2 or shape != (module.out_features, module.in_features):
            raise W12FormatError(
                f"{name}: checkpoint shape {list(shape)}, model expects [{module.out_features}, {module.in_features}]"
            )
        new = W12Linear(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            nnz=shapes[key][0],
            device="meta",
            dtype=module.bias.dtype if module.bias is not None else torch.bfloat16,
        )
        for parent, attr, _ in parents.get(id(module), []):
            parent._modules[attr] = new
    return len(entries)


def _decode_on_load(model, path: str, module, shape: tuple, nnz: int) -> None:
    """A W12 weight of a module that is not an ``nn.Linear`` (an embedding table, an MoE router):
    its five tensors load into buffers on the module and are decoded into its BF16 ``weight``
    once loaded (exact; that weight is used as a plain tensor by its module)."""
    import re

    from .format import RECORD_BYTES, TENSOR_SUFFIXES, TILE_K, TILE_N, ceil_div
    from .weight import _DTYPES

    *batch, n, k = shape
    rows = n
    for b in batch:
        rows *= b
    want = {
        "w12_records": (*batch, ceil_div(n, TILE_N), ceil_div(k, TILE_K), RECORD_BYTES),
        "w12_base": (rows,),
        "w12_esc_ptr": (rows + 1,),
        "w12_esc_col": (nnz,),
        "w12_esc_val": (nnz,),
    }
    for suffix in TENSOR_SUFFIXES:
        module.register_buffer(suffix, torch.empty(want[suffix], dtype=_DTYPES[suffix], device="meta"))
    pending = model.__dict__.setdefault("_w12_decode_on_load", [])
    pending.append((path, shape))
    # The BF16 weight is absent from the checkpoint on purpose: no "newly initialized" warning.
    names = {f"{path}.weight"}
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    names |= {a for a, b in tied.items() if b in names} | {b for a, b in tied.items() if a in names}
    ignore = set(model._keys_to_ignore_on_load_missing or [])
    model._keys_to_ignore_on_load_missing = ignore | {"^" + re.escape(n) + "$" for n in names}


def _finish_loaded(model) -> None:
    from .format import TENSOR_SUFFIXES
    from .nn import W12Linear
    from .weight import W12FormatError, W12Weight

    for path, shape in model.__dict__.pop("_w12_decode_on_load", []):
        module = model.get_submodule(path)
        parts = []
        for suffix in TENSOR_SUFFIXES:
            buf = module._buffers.pop(suffix)
            if buf.device.type == "meta" or not getattr(buf, "_is_hf_initialized", False):
                raise W12FormatError(f"{path}.{suffix} is missing from the checkpoint")
            parts.append(buf)
        w = W12Weight(*parts, shape=shape, layout=0)
        w.check_escapes(f"{path}.weight")
        from .codec import unpack

        with torch.no_grad():
            module.weight.data.copy_(unpack(w).to(module.weight.device))  # in place: keeps any tie

    for name, m in model.named_modules():
        if isinstance(m, W12Linear):
            for suffix in ("w12_records", "w12_base", "w12_esc_ptr", "w12_esc_col", "w12_esc_val"):
                buf = getattr(m, suffix)
                if buf.device.type == "meta" or not getattr(buf, "_is_hf_initialized", False):
                    raise W12FormatError(f"{name}.{suffix} is missing from the checkpoint")
            m.layout = 0  # as loaded from disk
            m.validate(name, deep=True)
            m._w12_prepare_for_device()
    # As w12.patch does by default: q/k/v and gate/up as one GEMM each (w12.unfuse_projections
    # undoes it). After accelerate's dispatch, which ran before this: hooked or offloaded members
    # are left unfused.
    from .fuse import fuse_projections

    fuse_projections(model, bf16=False)


class _PinnedFormat(dict):
    """Shard metadata that keeps ``"format": "w12"``.

    ``save_pretrained`` asks the quantizer for the metadata and then stamps ``"format": "pt"``
    over it; the W12 container (format §6) requires ``"w12"``. Loaders do not read the key.
    """

    def __setitem__(self, key, value):
        if key == "format" and value != QUANT_METHOD:
            return
        super().__setitem__(key, value)


def shard_metadata(model) -> dict:
    """The §6 shard metadata of a model holding ``W12Linear`` modules (names as in its state_dict)."""
    from .nn import W12Linear

    tensors = {
        f"{_disk_name(model, name)}.weight": {"shape": [m.out_features, m.in_features], "layout": 0}
        for name, m in model.named_modules()
        if isinstance(m, W12Linear)
    }
    return _PinnedFormat(format=QUANT_METHOD, w12_version=str(FORMAT_VERSION), w12_tensors=json.dumps(tensors))


def _rewrite_metadata(path, update) -> None:
    """Rewrites a safetensors shard's ``__metadata__`` with ``update(metadata) -> metadata``.

    The header is rewritten in place, padded with spaces to its old length (the format allows
    trailing header whitespace), so no tensor data moves; only a longer header forces a copy.
    """
    import os
    import struct

    with open(path, "r+b") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
        old_md = header.get("__metadata__", {}) or {}
        new_md = update(dict(old_md))
        if new_md == old_md:
            return
        header["__metadata__"] = new_md
        blob = json.dumps(header, separators=(",", ":")).encode()
        if len(blob) <= n:
            fh.seek(8)
            fh.write(blob + b" " * (n - len(blob)))
            return
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    tmp = f"{path}.w12tmp"
    save_file(tensors, tmp, metadata=new_md)
    del tensors
    os.replace(tmp, path)


def _regroup_split_weights(folder, shard_keys: dict, entries: dict) -> None:
    """Moves W12 tensors that Transformers' size-based sharding put apart back beside their
    ``w12_records``, so each shard holds whole weights (``w12 verify`` reads shards one by one)."""
    from pathlib import Path

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from .format import TENSOR_SUFFIXES

    where = {k: shard for shard, keys in shard_keys.items() for k in keys}
    moves: dict[str, str] = {}  # tensor -> destination shard
    for name in entries:
        stem = _stem(name)
        home = where.get(f"{stem}.w12_records")
        for suffix in TENSOR_SUFFIXES[1:]:
            key = f"{stem}.{suffix}"
            if home is not None and where.get(key) not in (None, home):
                moves[key] = home
    if not moves:
        return
    touched = sorted({where[k] for k in moves} | set(moves.values()))
    loaded = {shard: load_file(str(Path(folder) / shard)) for shard in touched}
    for key, dst in moves.items():
        loaded[dst][key] = loaded[where[key]].pop(key)
    for shard in touched:
        path = Path(folder) / shard
        with safe_open(str(path), framework="pt") as fh:
            md = fh.metadata() or {}
        tmp = path.with_name(path.name + ".w12tmp")
        save_file(loaded[shard], str(tmp), metadata=md)
        tmp.replace(path)
        shard_keys[shard] = set(loaded[shard])
    index_path = Path(folder) / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        index.setdefault("weight_map", {}).update(moves)
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def finalize_saved_folder(folder) -> None:
    """Makes a folder written by ``save_pretrained`` a W12 container to the letter of format §6:
    each shard carries ``format: w12`` and exactly its own ``w12_tensors`` entries, and holds all
    five tensors of each of them (Transformers writes one metadata dict to every shard, stamps
    ``format: pt`` and splits shards by size alone)."""
    from pathlib import Path

    from safetensors import safe_open

    shard_keys, entries = {}, {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            md = fh.metadata() or {}
            shard_keys[path.name] = set(fh.keys())
        if "w12_tensors" in md:
            entries.update(json.loads(md["w12_tensors"]))
    if not entries:
        return
    _regroup_split_weights(folder, shard_keys, entries)
    for shard, keys in shard_keys.items():
        own = {k: v for k, v in entries.items() if f"{_stem(k)}.w12_records" in keys}

        def update(m, own=own):
            m.update(format=QUANT_METHOD, w12_version=str(FORMAT_VERSION))
            m["w12_tensors"] = json.dumps(own)
            return m

        _rewrite_metadata(str(Path(folder) / shard), update)


def _save_pretrained_w12(self, save_directory, *args, **kwargs):
    """``save_pretrained`` of a W12 model: Transformers' own, then the per-shard §6 metadata."""
    out = type(self).save_pretrained(self, save_directory, *args, **kwargs)
    finalize_saved_folder(save_directory)
    return out


def attach_to_model(model) -> None:
    """Marks a patched Transformers model as W12-quantized so ``save_pretrained`` writes a W12 folder."""
    config_cls, quantizer_cls = register()
    current = getattr(model, "hf_quantizer", None)
    if current is not None and getattr(current.quantization_config, "quant_method", None) != QUANT_METHOD:
        method = getattr(current.quantization_config, "quant_method", "?")
        logger.warning(
            "w12: the model is already quantized with %s; save_pretrained will not write a W12 folder", method
        )
        return
    cfg = config_cls()
    model.hf_quantizer = quantizer_cls(cfg, pre_quantized=True)
    model.config.quantization_config = cfg
    model.is_quantized = True
    model.quantization_method = QUANT_METHOD
    _bind_save(model)


def _bind_save(model) -> None:
    # An instance attribute, so only W12 models get the post-save metadata fix-up.
    import types

    model.save_pretrained = types.MethodType(_save_pretrained_w12, model)


def detach_from_model(model) -> None:
    """Undoes ``attach_to_model`` (after ``w12.unpatch``)."""
    q = getattr(model, "hf_quantizer", None)
    if q is not None and getattr(q.quantization_config, "quant_method", None) == QUANT_METHOD:
        q.remove_quantization_config(model)
        model.config._is_quantized = False
    if getattr(model.__dict__.get("save_pretrained"), "__func__", None) is _save_pretrained_w12:
        del model.save_pretrained


# -- the classes (built once Transformers is imported) ----------------------------------------
def _build_classes() -> dict:
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    class W12Config(QuantizationConfigMixin):
        """``quantization_config`` of a W12 folder: ``{"quant_method": "w12", "version": 1}``."""

        def __init__(self, version: int = FORMAT_VERSION, quant_method: str = QUANT_METHOD, layout: int = 0, **extra):
            # ``extra``: what the converter records about the conversion (e.g. ``embeddings``, ``cast``);
            # kept so a re-saved config still says it.
            self.extra = dict(extra)
            if int(layout) != 0:
                raise ValueError(f"W12Config: a W12 v1 folder is always layout 0 on disk, got layout {layout!r}")
            if quant_method != QUANT_METHOD:
                raise ValueError(f"W12Config: quant_method must be 'w12', got {quant_method!r}")
            if int(version) != FORMAT_VERSION:
                raise ValueError(
                    f"W12 format version {version} in quantization_config; this w12 reads {FORMAT_VERSION}"
                )
            self.quant_method = QUANT_METHOD
            self.version = int(version)

        def to_dict(self) -> dict:
            return {"quant_method": QUANT_METHOD, "version": self.version, "layout": 0, **self.extra}

    class W12HfQuantizer(HfQuantizer):
        """Loads W12 folders into ``W12Linear`` modules; writes them from patched models."""

        requires_calibration = False

        def update_dtype(self, dtype):
            return torch.bfloat16 if dtype is None else dtype

        def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
            if not self.pre_quantized:
                return model
            n = _replace_linears_on_meta(model, checkpoint_files)
            logger.info("w12: %d linear layers will load as W12Linear", n)
            return model

        def _process_model_after_weight_loading(self, model, **kwargs):
            if self.pre_quantized:
                _finish_loaded(model)
                _bind_save(model)
            else:
                from .patch import patch

                patch(model)
            return model

        def get_state_dict_and_metadata(self, model):
            return None, shard_metadata(model)

        def is_serializable(self, *args, **kwargs):
            return True

        @property
        def is_trainable(self):
            return False

        @property
        def is_compileable(self):
            return True

    W12Config.__module__ = W12HfQuantizer.__module__ = __name__
    return {"W12Config": W12Config, "W12HfQuantizer": W12HfQuantizer}


_install_hook()
