"""The checkpoint jobs behind ``w12 convert/verify/info/restore`` (library functions).

``convert`` streams a checkpoint tensor by tensor through three stages that overlap: a reader
thread fetches the next weight to convert while the main thread encodes the current one and a
writer thread writes the previous one's records (reads and writes release the GIL; the encoder's
torch ops use the intra-op threads). At most one tensor waits in each stage, so peak memory is a
small multiple of the largest tensor, never the model. Everything is written into a temporary
folder beside the destination and renamed at the end, so a failed or interrupted job never leaves
a destination that looks complete.
"""

from __future__ import annotations

import json
import os
import queue
import re
import resource
import shutil
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import cpu_encoder
from .checkpoint import (
    CONFIG_NAME,
    FLOAT_DTYPES,
    INDEX_NAME,
    CheckpointError,
    Folder,
    Planned,
    ShardWriter,
    W12Checkpoint,
    is_linear_weight,
    open_folder,
    quantization_config,
    read_json,
    w12_metadata,
    w12_names,
    w12_plan,
)
from .format import FORMAT_VERSION

CASTS = {"bf16": torch.bfloat16}


def _env_flag(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    return default if v is None else v.strip().lower() not in ("0", "false", "no", "")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


# ------------------------------------------------------------------------------------------------
# Atomic output folders
# ------------------------------------------------------------------------------------------------
@contextmanager
def _staged_output(dst: Path, force: bool):
    """Yields a temporary folder beside ``dst``; on success it replaces ``dst``, on failure it goes."""
    if dst.exists() and not force:
        raise CheckpointError(f"{dst}: already exists; pass --force (force=True) to overwrite it")
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"{dst}: exists and is not a folder")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.w12-partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if dst.exists():
            old = dst.parent / f".{dst.name}.w12-old-{uuid.uuid4().hex[:8]}"
            os.replace(dst, old)
            os.replace(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_not_inside(src: Path, dst: Path) -> None:
    s, d = src.resolve(), dst.resolve()
    if d == s or s in d.parents or (s.is_dir() and d in s.parents):
        raise CheckpointError(f"{dst}: the destination must not be the source folder or inside it ({src})")


def _copy_side_files(folder: Folder, out: Path) -> int:
    n = 0
    for rel in folder.other_files():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(folder.root / rel, out / rel)
        n += 1
    return n


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")


# ------------------------------------------------------------------------------------------------
# Convert
# ------------------------------------------------------------------------------------------------
@dataclass
class ConvertSummary:
    src: str
    dst: str
    tensors_converted: int = 0
    tensors_copied: int = 0
    weights_converted: int = 0
    weights_total: int = 0
    source_bytes: int = 0  # tensor bytes of the source
    converted_source_bytes: int = 0  # of which in the converted tensors
    w12_bytes: int = 0  # the five tensors of every converted weight
    output_bytes: int = 0  # all shard files written
    output_tensor_bytes: int = 0  # tensor data in them (the index's total_size)
    escapes: int = 0
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    cast: str | None = None
    per_tensor: list = field(default_factory=list)  # (name, shape, bits/weight, escapes)

    @property
    def bits_per_weight(self) -> float:
        return self.w12_bytes * 8 / max(self.weights_converted, 1)

    @property
    def escape_rate(self) -> float:
        return self.escapes / max(self.weights_converted, 1)

    @property
    def weights_per_s(self) -> float:
        return self.weights_total / max(self.seconds, 1e-9)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(bits_per_weight=self.bits_per_weight, escape_rate=self.escape_rate, weights_per_s=self.weights_per_s)
        return d

    def table(self) -> str:
        rows = [
            ("converted tensors", f"{self.tensors_converted}", f"{self.weights_converted / 1e6:,.2f} M weights"),
            (
                "copied tensors",
                f"{self.tensors_copied}",
                f"{(self.weights_total - self.weights_converted) / 1e6:,.2f} M",
            ),
            ("converted: BF16 -> W12", _fmt_bytes(self.converted_source_bytes), _fmt_bytes(self.w12_bytes)),
            ("bits/weight", f"{self.bits_per_weight:.4f}", f"escapes {self.escapes} ({self.escape_rate:.2e})"),
            ("all tensors: source -> W12", _fmt_bytes(self.source_bytes), _fmt_bytes(self.output_bytes)),
            ("time", f"{self.seconds:.1f} s", f"{self.weights_per_s / 1e6:,.1f} M weights/s"),
            ("peak RSS", _fmt_bytes(self.peak_rss_bytes), ""),
        ]
        if self.cast:
            rows.append(("cast", self.cast, "lossy: compared with the source after the cast"))
        w = max(len(r[0]) for r in rows)
        return "\n".join(f"  {a:<{w}}  {b:>14}  {c}" for a, b, c in rows)


@dataclass
class _Task:
    shard: str
    name: str
    convert: bool
    numel: int


def select(folder: Folder, include=None, exclude=None, embeddings: bool = False) -> dict[str, bool]:
    """``{name: convert?}`` for every tensor, by the rule documented in ``w12 convert --help``."""
    inc = [_compile(r, "--include") for r in include or []]
    exc = [_compile(r, "--exclude") for r in exclude or []]
    out = {}
    for name in folder.tensor_names():
        t = folder.info(name)
        if inc:
            chosen = len(t.shape) >= 2 and t.numel > 0 and any(r.search(name) for r in inc)
        else:
            chosen = is_linear_weight(name, t.dtype, t.shape, embeddings)
        out[name] = chosen and not any(r.search(name) for r in exc)
    return out


def _compile(pattern: str, what: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise CheckpointError(f"{what} {pattern!r}: not a valid regular expression ({e})") from None


def _check_plan(folder: Folder, chosen: dict[str, bool], cast: str | None) -> None:
    bad = [n for n, c in chosen.items() if c and folder.info(n).dtype != "BF16"]
    for name in bad:
        dtype = folder.info(name).dtype
        where = f"{folder.file_of(name).path}: tensor {name!r}"
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{where} has dtype {dtype}; W12 converts floating weights only (exclude it)")
        if cast is None:
            more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
            raise CheckpointError(
                f"{where}{more} has dtype {dtype}; W12 stores BF16 weights only. Pass --cast bf16 to cast them "
                "first: casting is lossy, so the result will be bit-identical to the BF16 cast, not to this source"
            )
    names = set(folder.where)
    seen: dict[str, str] = {}
    for name, c in chosen.items():
        if not c:
            continue
        for tname in w12_names(name):
            other = seen.get(tname) or (tname if tname in names else None)
            if other:
                raise CheckpointError(
                    f"{folder.file_of(name).path}: tensor {name!r} would be stored as {tname!r}, "
                    f"which clashes with {other!r}"
                )
            seen[tname] = name


def encode_tensor(t: torch.Tensor, out: torch.Tensor | None = None) -> dict:
    """The five W12 tensors of a BF16 CPU tensor: the fused encoder, identical to the reference;
    ``out`` is a reusable buffer for the records."""
    return cpu_encoder.encode(t, out=out)


class _BufferPool:
    """Two reusable record buffers, handed from the encoder to the writer and back.

    Fresh allocations cost a page fault every 4 KB (as much kernel time as encoding itself); two
    buffers keep one tensor encoding while the previous one is written, and bound the memory.
    """

    def __init__(self, n: int = 2):
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(n):
            self.free.put(torch.empty(0, dtype=torch.uint8))

    def get(self, nbytes: int) -> torch.Tensor:
        buf = self.free.get()
        return buf if buf.numel() >= nbytes else torch.empty(nbytes, dtype=torch.uint8)

    def put(self, buf: torch.Tensor) -> None:
        self.free.put(buf)


def convert(
    src,
    dst,
    include=None,
    exclude=None,
    embeddings: bool = False,
    cast: str | None = None,
    force: bool = False,
    progress: bool = True,
    fsync: bool | None = None,
) -> ConvertSummary:
    """Converts a BF16 safetensors checkpoint (HF folder or one file) into a W12 folder at ``dst``.

    ``include``/``exclude``: lists of regexes (``re.search`` on tensor names) choosing the tensors
    to convert; ``embeddings`` also converts embedding tables; ``cast="bf16"`` casts FP32/FP16
    weights chosen for conversion (lossy). ``fsync`` (default: env ``W12_FSYNC``, on) flushes each
    shard to disk before the final rename. Raises ``CheckpointError`` naming the file and tensor.
    """
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    if cast is not None and cast not in CASTS:
        raise CheckpointError(f"--cast {cast!r}: the only cast is 'bf16'")
    fsync = _env_flag("W12_FSYNC", True) if fsync is None else fsync
    _check_not_inside(src, dst)
    folder = open_folder(src)
    try:
        return _convert(folder, src, dst, include, exclude, embeddings, cast, force, progress, fsync, t0)
    finally:
        folder.close()


def _convert(folder, src, dst, include, exclude, embeddings, cast, force, progress, fsync, t0) -> ConvertSummary:
    for f in folder.files.values():
        if f.metadata.get("format") == "w12":
            raise CheckpointError(f"{f.path}: already a W12 checkpoint")
    config = None
    if folder.config_path is not None:
        config = read_json(folder.config_path, "config")
        qc = config.get("quantization_config")
        if qc is not None:
            method = qc.get("quant_method") if isinstance(qc, dict) else qc
            raise CheckpointError(f"{folder.config_path}: the model is already quantized (quant_method {method!r})")
    chosen = select(folder, include, exclude, embeddings)
    _check_plan(folder, chosen, cast)
    if dst.exists() and not force:
        raise CheckpointError(f"{dst}: already exists; pass --force (force=True) to overwrite it")

    summary = ConvertSummary(str(src), str(dst), cast=cast)
    tasks = []
    for shard, f in folder.files.items():
        for t in sorted(f.tensors.values(), key=lambda t: t.start):
            tasks.append(_Task(shard, t.name, chosen[t.name], t.numel))
            summary.weights_total += t.numel
            summary.source_bytes += t.nbytes
    with _staged_output(dst, force) as tmp:
        weight_map = _convert_shards(folder, tasks, tmp, cast, summary, progress, fsync)
        if folder.index is not None:
            index = dict(folder.index)
            index["metadata"] = {**(index.get("metadata") or {}), "total_size": summary.output_tensor_bytes}
            index["weight_map"] = weight_map
            _write_json(tmp / INDEX_NAME, index)
        if config is not None:
            config["quantization_config"] = quantization_config(
                embeddings=embeddings, **({"cast": cast} if cast else {})
            )
            _write_json(tmp / CONFIG_NAME, config)
        _copy_side_files(folder, tmp)
    summary.seconds = time.perf_counter() - t0
    summary.peak_rss_bytes = peak_rss_bytes()
    return summary


def _convert_shards(folder: Folder, tasks, out: Path, cast, summary: ConvertSummary, progress: bool, fsync: bool):
    weight_map: dict[str, str] = {}
    converting = {t.name for t in tasks if t.convert}
    writers: dict[str, ShardWriter] = {}
    for shard, f in folder.files.items():
        plan, entries = [], {}
        for t in sorted(f.tensors.values(), key=lambda t: t.start):
            if t.name in converting:
                plan += w12_plan(t.name, t.shape)
                entries[t.name] = {"shape": list(t.shape), "layout": 0}
                if t.dtype != "BF16":
                    entries[t.name]["source_dtype"] = t.dtype
            else:
                plan.append(Planned(t.name, t.dtype, t.shape))
        for p in plan:
            weight_map[p.name] = shard
        (out / shard).parent.mkdir(parents=True, exist_ok=True)
        writers[shard] = ShardWriter(out / shard, plan, w12_metadata(entries, f.metadata))

    pool = _BufferPool(2)
    reader = ThreadPoolExecutor(1, thread_name_prefix="w12-read")
    writer = ThreadPoolExecutor(1, thread_name_prefix="w12-write")
    pending: deque[Future] = deque()
    bar = tqdm(
        total=summary.weights_total, unit="w", unit_scale=True, desc="convert", disable=not progress, smoothing=0.1
    )
    t_start = time.perf_counter()
    conv = [t for t in tasks if t.convert]
    nxt = {id(a): b for a, b in zip(conv, conv[1:])}
    fut = reader.submit(folder.map, conv[0].name) if conv else None
    try:
        last_shard = None
        for i, task in enumerate(tasks):
            if last_shard is not None and task.shard != last_shard:
                pending.append(writer.submit(_close_writer, writers[last_shard], fsync, summary))
            last_shard = task.shard
            w = writers[task.shard]
            if task.convert:
                t = fut.result()
                follow = nxt.get(id(task))
                fut = reader.submit(folder.map, follow.name) if follow is not None else None
                if cast is not None and t.dtype != torch.bfloat16:
                    t = t.to(CASTS[cast])
                buf = pool.get(cpu_encoder.records_nbytes(t.shape))
                try:
                    parts = encode_tensor(t, out=buf)
                except BaseException:
                    pool.put(buf)
                    raise
                del t
                tensors = dict(zip(w12_names(task.name), parts.values()))
                nbytes = sum(p.numel() * p.element_size() for p in tensors.values())
                nnz = int(parts["esc_col"].numel())
                summary.tensors_converted += 1
                summary.weights_converted += task.numel
                summary.converted_source_bytes += folder.info(task.name).nbytes
                summary.w12_bytes += nbytes
                summary.escapes += nnz
                summary.output_tensor_bytes += nbytes
                summary.per_tensor.append((task.name, list(folder.info(task.name).shape), nbytes * 8 / task.numel, nnz))
                pending.append(writer.submit(_write_parts, w, tensors, pool, buf))
            else:
                summary.tensors_copied += 1
                summary.output_tensor_bytes += folder.info(task.name).nbytes
                pending.append(writer.submit(_copy, w, task.name, folder.file_of(task.name)))
            # Bound the queue: two tensors in flight keeps the writer busy without holding more.
            while len(pending) > 2:
                pending.popleft().result()
            bar.update(task.numel)
            el = time.perf_counter() - t_start
            bar.set_postfix_str(f"{i + 1}/{len(tasks)} tensors, {(i + 1) / max(el, 1e-9):.1f} tensors/s", refresh=False)
        if last_shard is not None:
            pending.append(writer.submit(_close_writer, writers[last_shard], fsync, summary))
        while pending:
            pending.popleft().result()
    except BaseException:
        for p in pending:
            p.cancel()
        writer.shutdown(wait=True)
        for w in writers.values():
            w.abort()
        raise
    finally:
        bar.close()
        reader.shutdown(wait=True, cancel_futures=True)
        writer.shutdown(wait=True)
    return weight_map


def _write_parts(w: ShardWriter, tensors: dict, pool: _BufferPool, buf: torch.Tensor) -> None:
    try:
        for name, t in tensors.items():
            try:
                w.add(name, t)
            except OSError as e:  # disk full and the like: say which file
                raise OSError(e.errno, f"writing {name} to {w.path}: {e.strerror or e}") from e
    finally:
        tensors.clear()
        pool.put(buf)  # always, so the encoder never waits for a buffer that will not come back


def _copy(w: ShardWriter, name: str, src) -> None:
    try:
        w.copy_from(name, src)
    except CheckpointError:
        raise
    except OSError as e:
        raise OSError(e.errno, f"copying {name} to {w.path}: {e.strerror or e}") from e


def _close_writer(w: ShardWriter, fsync: bool, summary: ConvertSummary) -> None:
    try:
        summary.output_bytes += w.close(fsync=fsync)
    except OSError as e:
        raise OSError(e.errno, f"finishing {w.path}: {e.strerror or e}") from e


# ------------------------------------------------------------------------------------------------
# Verify
# ------------------------------------------------------------------------------------------------
@dataclass
class VerifyResult:
    ok: bool
    tensors_checked: int = 0
    weights_checked: int = 0
    seconds: float = 0.0
    mismatch: dict | None = None  # the first failure: tensor, file and (for values) index/row/column/bits
    message: str = ""


def _first_mismatch(expected: torch.Tensor, got: torch.Tensor) -> dict:
    a, b = expected.reshape(-1), got.reshape(-1)
    i = int((a != b).nonzero()[0, 0])
    idx = list(torch.unravel_index(torch.tensor(i), tuple(expected.shape)))
    out = {
        "index": [int(v) for v in idx],
        "expected_bits": f"0x{int(a[i]) & 0xFFFF:04x}",
        "got_bits": f"0x{int(b[i]) & 0xFFFF:04x}",
    }
    if expected.dim() >= 2:
        out.update(row=int(idx[-2]), column=int(idx[-1]))
    return out


def verify(src, dst, progress: bool = True) -> VerifyResult:
    """Decodes every W12 tensor of ``dst`` and compares its bits with ``src``; compares copied
    tensors byte for byte; checks that both hold the same tensor names. Stops at the first failure.

    Weights converted with ``--cast bf16`` are compared with the source after the same cast.
    Corrupt inputs raise ``CheckpointError``; a readable but different ``dst`` returns ``ok=False``.
    """
    t0 = time.perf_counter()
    source = open_folder(src)
    ck = W12Checkpoint(dst)
    res = VerifyResult(ok=True)
    src_names, dst_names = source.tensor_names(), ck.names()
    missing = [n for n in src_names if n not in set(dst_names)]
    extra = [n for n in dst_names if n not in set(src_names)]
    if missing or extra:
        name = (missing or extra)[0]
        res.ok = False
        res.mismatch = {"tensor": name, "problem": "missing from DST" if missing else "not in SRC"}
        res.message = (
            f"tensor {name!r} is "
            + ("in SRC but missing from DST" if missing else "in DST but not in SRC")
            + f" ({len(missing)} missing, {len(extra)} extra)"
        )
        source.close()
        ck.close()
        return res
    total = sum(source.info(n).numel for n in src_names)
    bar = tqdm(total=total, unit="w", unit_scale=True, desc="verify", disable=not progress)
    try:
        for name in src_names:
            info = source.info(name)
            if name in ck.entries:
                entry = ck.entries[name]
                where = f"{ck.folder.files[entry.shard].path}: {name}"
                if tuple(entry.shape) != info.shape:
                    res.ok, res.mismatch = False, {"tensor": name, "problem": "shape"}
                    res.message = f"{where}: shape {list(entry.shape)} but SRC has {list(info.shape)}"
                    break
                expected = source.read(name)
                if info.dtype != "BF16":
                    if entry.source_dtype != info.dtype:
                        res.ok, res.mismatch = False, {"tensor": name, "problem": "dtype"}
                        res.message = f"{where}: SRC tensor is {info.dtype} but DST does not record a cast from it"
                        break
                    expected = expected.to(torch.bfloat16)
                w = ck.load(name, check_escapes=True)
                got = cpu_encoder.decode(w)
                if not torch.equal(expected.view(torch.int16), got.view(torch.int16)):
                    res.ok = False
                    res.mismatch = {"tensor": name, "file": str(ck.folder.files[entry.shard].path)}
                    res.mismatch.update(_first_mismatch(expected.view(torch.int16), got.view(torch.int16)))
                    m = res.mismatch
                    pos = f"row {m['row']}, column {m['column']}" if "row" in m else f"index {m['index']}"
                    if len(m["index"]) > 2:
                        pos = f"matrix {m['index'][:-2]}, " + pos
                    res.message = f"{where}: {pos}: SRC bits {m['expected_bits']}, decoded {m['got_bits']}"
                    break
                del expected, got, w
            else:
                other = ck.folder.info(name)
                where = f"{ck.folder.file_of(name).path}: {name}"
                if (other.dtype, other.shape) != (info.dtype, info.shape):
                    res.ok, res.mismatch = False, {"tensor": name, "problem": "dtype/shape"}
                    res.message = (
                        f"{where}: {other.dtype} {list(other.shape)} but SRC has {info.dtype} {list(info.shape)}"
                    )
                    break
                a = source.read(name).reshape(-1).view(torch.uint8)
                b = ck.read_plain(name).reshape(-1).view(torch.uint8)
                if not torch.equal(a, b):
                    i = int((a != b).nonzero()[0, 0])
                    res.ok = False
                    res.mismatch = {"tensor": name, "file": str(ck.folder.file_of(name).path), "byte": i}
                    res.message = f"{where}: copied tensor differs from SRC at byte {i}"
                    break
            res.tensors_checked += 1
            res.weights_checked += info.numel
            bar.update(info.numel)
    finally:
        bar.close()
        source.close()
        ck.close()
    res.seconds = time.perf_counter() - t0
    if res.ok:
        res.message = f"OK: {res.tensors_checked} tensors, {res.weights_checked:,} weights bit-identical"
    return res


# ------------------------------------------------------------------------------------------------
# Info
# ------------------------------------------------------------------------------------------------
def info(path) -> dict:
    """Sizes of a W12 folder or file, from the headers alone (nothing is decoded).

    Returns ``{"tensors": [...], "totals": {...}}``: per converted tensor its shape, bytes,
    bits/weight, escapes and escape rate; totals over converted weights, plain tensors and files.
    """
    ck = W12Checkpoint(path)
    rows = []
    for name, e in ck.entries.items():
        f = ck.folder.files[e.shard]
        nbytes = sum(f.tensors[t].nbytes for t in w12_names(name))
        rows.append(
            {
                "name": name,
                "shape": list(e.shape),
                "shard": e.shard,
                "weights": e.numel,
                "bytes": nbytes,
                "bf16_bytes": e.numel * 2,
                "bits_per_weight": nbytes * 8 / e.numel,
                "escapes": e.nnz,
                "escape_rate": e.nnz / e.numel,
            }
        )
    weights = sum(r["weights"] for r in rows)
    w12_bytes = sum(r["bytes"] for r in rows)
    escapes = sum(r["escapes"] for r in rows)
    plain_bytes = sum(ck.folder.info(n).nbytes for n in ck.plain)
    files = sum(f.size for f in ck.folder.files.values())
    ck.close()
    totals = {
        "converted_tensors": len(rows),
        "plain_tensors": len(ck.plain),
        "weights": weights,
        "bytes": w12_bytes,
        "bf16_bytes": weights * 2,
        "bits_per_weight": w12_bytes * 8 / weights if weights else None,
        "escapes": escapes,
        "escape_rate": escapes / weights if weights else None,
        "plain_bytes": plain_bytes,
        "file_bytes": files,
        "version": FORMAT_VERSION,
    }
    return {"path": str(path), "tensors": rows, "totals": totals}


def info_table(data: dict, per_tensor: bool = True) -> str:
    lines = []
    if per_tensor and data["tensors"]:
        w = max(len(r["name"]) for r in data["tensors"])
        lines.append(f"{'tensor':<{w}}  {'shape':>18}  {'bytes':>12}  {'bits/w':>8}  {'escapes':>8}  {'rate':>9}")
        for r in data["tensors"]:
            shape = "x".join(map(str, r["shape"]))
            lines.append(
                f"{r['name']:<{w}}  {shape:>18}  {r['bytes']:>12,}  {r['bits_per_weight']:>8.4f}  "
                f"{r['escapes']:>8}  {r['escape_rate']:>9.2e}"
            )
        lines.append("")
    t = data["totals"]
    lines.append(f"converted tensors  {t['converted_tensors']}   ({t['weights']:,} weights)")
    if t["weights"]:
        lines.append(
            f"W12 bytes          {t['bytes']:,}   (BF16 {t['bf16_bytes']:,}: {t['bytes'] / t['bf16_bytes']:.2%})"
        )
        lines.append(f"bits/weight        {t['bits_per_weight']:.4f}")
        lines.append(f"escapes            {t['escapes']:,}   (rate {t['escape_rate']:.2e})")
    lines.append(f"plain tensors      {t['plain_tensors']}   ({t['plain_bytes']:,} bytes)")
    lines.append(f"files              {t['file_bytes']:,} bytes")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Restore
# ------------------------------------------------------------------------------------------------
@dataclass
class RestoreSummary:
    src: str
    out: str
    tensors_decoded: int = 0
    tensors_copied: int = 0
    weights: int = 0
    output_bytes: int = 0
    seconds: float = 0.0


def restore(dst, out, force: bool = False, progress: bool = True) -> RestoreSummary:
    """Writes the plain BF16 checkpoint back from a W12 folder ``dst`` into ``out``.

    Decoded tensors are bit-identical to the source the folder was converted from (to its BF16
    cast, for ``--cast bf16`` conversions); copied tensors are copied byte for byte, shard names
    and side files kept, and ``quantization_config`` removed from config.json.
    """
    t0 = time.perf_counter()
    dst, out = Path(dst), Path(out)
    _check_not_inside(dst, out)
    ck = W12Checkpoint(dst)
    if out.exists() and not force:
        raise CheckpointError(f"{out}: already exists; pass --force (force=True) to overwrite it")
    res = RestoreSummary(str(dst), str(out))
    names = {f: [] for f in ck.folder.files}
    for name in ck.names():
        names[ck.entries[name].shard if name in ck.entries else ck.folder.where[name]].append(name)
    total = sum(e.numel for e in ck.entries.values()) + sum(ck.folder.info(n).numel for n in ck.plain)
    bar = tqdm(total=total, unit="w", unit_scale=True, desc="restore", disable=not progress)
    weight_map, tensor_total = {}, 0
    try:
        with _staged_output(out, force) as tmp:
            for shard, f in ck.folder.files.items():
                plan = []
                for name in names[shard]:
                    e = ck.entries.get(name)
                    if e is not None:
                        plan.append(Planned(name, "BF16", e.shape))
                    else:
                        plan.append(Planned(name, f.tensors[name].dtype, f.tensors[name].shape))
                    weight_map[name] = shard
                    tensor_total += ShardWriter._max_bytes(plan[-1])
                md = {k: v for k, v in f.metadata.items() if not k.startswith("w12_") and k != "format"}
                md["format"] = f.metadata.get("w12_source_format", "pt")
                (tmp / shard).parent.mkdir(parents=True, exist_ok=True)
                w = ShardWriter(tmp / shard, plan, md)
                try:
                    for name in names[shard]:
                        if name in ck.entries:
                            wt = ck.load(name, check_escapes=True)
                            w.add(name, cpu_encoder.decode(wt))
                            res.tensors_decoded += 1
                            n = wt.numel
                        else:
                            w.copy_from(name, f)
                            res.tensors_copied += 1
                            n = f.tensors[name].numel
                        res.weights += n
                        bar.update(n)
                    res.output_bytes += w.close(fsync=_env_flag("W12_FSYNC", True))
                except BaseException:
                    w.abort()
                    raise
            if ck.folder.index is not None:
                index = dict(ck.folder.index)
                index["weight_map"] = weight_map
                index["metadata"] = {**(index.get("metadata") or {}), "total_size": tensor_total}
                _write_json(tmp / INDEX_NAME, index)
            if ck.config is not None:
                config = {k: v for k, v in ck.config.items() if k != "quantization_config"}
                _write_json(tmp / CONFIG_NAME, config)
            _copy_side_files(ck.folder, tmp)
    finally:
        bar.close()
        ck.close()
    res.seconds = time.perf_counter() - t0
    return res


def compare_plain(a, b, progress: bool = False) -> VerifyResult:
    """Compares two plain checkpoints tensor by tensor, byte for byte (e.g. a source and its restore)."""
    t0 = time.perf_counter()
    fa, fb = open_folder(a), open_folder(b)
    res = VerifyResult(ok=True)
    try:
        na, nb = fa.tensor_names(), fb.tensor_names()
        if sorted(na) != sorted(nb):
            diff = sorted(set(na) ^ set(nb))
            res.ok, res.mismatch = False, {"tensor": diff[0], "problem": "names"}
            res.message = f"tensor {diff[0]!r} is in only one of {a} and {b} ({len(diff)} such tensors)"
            return res
        for name in tqdm(na, desc="compare", disable=not progress):
            ia, ib = fa.info(name), fb.info(name)
            if (ia.dtype, ia.shape) != (ib.dtype, ib.shape):
                res.ok, res.mismatch = False, {"tensor": name, "problem": "dtype/shape"}
                res.message = f"{name}: {ia.dtype} {list(ia.shape)} vs {ib.dtype} {list(ib.shape)}"
                return res
            x, y = fa.read(name).reshape(-1).view(torch.uint8), fb.read(name).reshape(-1).view(torch.uint8)
            if not torch.equal(x, y):
                i = int((x != y).nonzero()[0, 0])
                res.ok, res.mismatch = False, {"tensor": name, "byte": i}
                res.message = f"{fb.file_of(name).path}: {name}: differs from {fa.file_of(name).path} at byte {i}"
                return res
            res.tensors_checked += 1
            res.weights_checked += ia.numel
    finally:
        fa.close()
        fb.close()
    res.seconds = time.perf_counter() - t0
    res.message = f"OK: {res.tensors_checked} tensors, {res.weights_checked:,} weights bit-identical"
    return res
