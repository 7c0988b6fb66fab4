"""Checkpoint container I/O: safetensors shards read and written one tensor at a time.

The W12 container (``shared/W12_FORMAT.md`` §6) is a normal Hugging Face model folder whose
shards hold ``STEM.w12_*`` tensors in place of each converted weight. This module reads and
writes such folders (and plain BF16 ones) without ever holding a whole shard in memory:

* ``SafetensorsFile`` parses and *validates* a shard header itself, so a truncated or corrupt file
  is reported with the file and tensor names before anything is read, and reads one tensor with
  ``preadv`` into a fresh buffer (no mmap: the process's RSS stays honest and buffers own their
  memory).
* ``ShardWriter`` streams tensors into a file whose header is only known at the end (the escape
  lists' lengths are known only after encoding): it reserves room for the largest header the
  planned tensors could need and writes the real one, space-padded, when the shard is closed.
* ``W12Checkpoint`` opens a converted folder, checks its version and that every tensor agrees with
  the ``w12_tensors`` metadata, and loads ``W12Weight``\\ s lazily; ``load_w12_weights`` and
  ``save_w12`` are the small API the Hugging Face integration builds on.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .format import FORMAT_VERSION, RECORD_BYTES, TENSOR_SUFFIXES, TILE_K, TILE_N, ceil_div
from .weight import W12FormatError, W12Weight

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
W12_VERSION = str(FORMAT_VERSION)
# safetensors' own parser refuses larger headers; a larger one here means a corrupt length field.
MAX_HEADER_BYTES = 100_000_000
COPY_CHUNK = 64 << 20
# copy_file_range refusals that mean "copy through user space instead"
_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF, errno.EPERM}

# safetensors dtype name -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BOOL": (torch.bool, 1),
    "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "I16": (torch.int16, 2),
    "U16": (torch.uint16, 2),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I32": (torch.int32, 4),
    "U32": (torch.uint32, 4),
    "F32": (torch.float32, 4),
    "I64": (torch.int64, 8),
    "U64": (torch.uint64, 8),
    "F64": (torch.float64, 8),
}
TORCH_TO_ST = {v[0]: k for k, v in DTYPES.items()}
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
W12_DTYPES = {"w12_records": "U8", "w12_base": "U8", "w12_esc_ptr": "I32", "w12_esc_col": "I32", "w12_esc_val": "I16"}

# Embedding tables are gathered, not multiplied, so by default they are copied (``--embeddings``
# converts them). A name is an embedding if it contains "embed" (embed_tokens, word_embeddings,
# position_embeddings, token_type_embeddings, tok_embeddings, embed_in, embed_positions, ...) or
# is GPT-2's ``wte``/``wpe`` or T5's ``shared``. A tied ``lm_head.weight`` stored as a real tensor
# is a linear weight and is converted.
EMBEDDING_RE = re.compile(r"embed|(^|\.)(wte|wpe|shared)\.weight$")


class CheckpointError(W12FormatError):
    """A checkpoint file or folder is missing, corrupt or inconsistent; the message names it."""


def stem_of(name: str) -> str:
    """``NAME`` without a trailing ``.weight``: the prefix of its ``STEM.w12_*`` tensors (§6)."""
    return name[: -len(".weight")] if name.endswith(".weight") else name


def w12_names(name: str) -> list[str]:
    stem = stem_of(name)
    return [f"{stem}.{s}" for s in TENSOR_SUFFIXES]


def is_embedding(name: str) -> bool:
    return EMBEDDING_RE.search(name) is not None


def is_linear_weight(name: str, dtype: str, shape, embeddings: bool = False) -> bool:
    """The default conversion rule: a floating tensor of rank >= 2 named ``*.weight`` that is not
    an embedding table (unless ``embeddings``)."""
    return (
        dtype in FLOAT_DTYPES
        and len(shape) >= 2
        and math.prod(shape) > 0
        and name.endswith(".weight")
        and (embeddings or not is_embedding(name))
    )


def w12_tensor_shapes(shape, nnz: int) -> dict[str, tuple]:
    """Container shapes of the five tensors of a weight of ``shape`` with ``nnz`` escapes."""
    *batch, n, k = shape
    rows = math.prod(batch) * n
    return {
        "w12_records": (*batch, ceil_div(n, TILE_N), ceil_div(k, TILE_K), RECORD_BYTES),
        "w12_base": (rows,),
        "w12_esc_ptr": (rows + 1,),
        "w12_esc_col": (nnz,),
        "w12_esc_val": (nnz,),
    }


# ------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple
    start: int  # absolute file offsets
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _preadv_exact(fd: int, buf: memoryview, offset: int, path: Path, name: str) -> None:
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got <= 0:
            raise CheckpointError(f"{path}: tensor {name!r}: unexpected end of file at byte {offset + done}")
        done += got


class SafetensorsFile:
    """One safetensors file: a validated header and tensor reads by name."""

    def __init__(self, path):
        self._fd: int | None = None
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: no such file") from None
        self.size = size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{self.path}: truncated ({size} bytes): too short for a safetensors header")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(
                    f"{self.path}: corrupt or truncated: the header claims {n} bytes but the file has {size}"
                )
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not valid JSON: {e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (__metadata__ must map strings to strings)")
        self.metadata: dict[str, str] = meta
        self.data_start = 8 + n
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            self.tensors[name] = self._parse_entry(name, entry)
        self._check_layout()

    def _parse_entry(self, name: str, entry) -> TensorInfo:
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: corrupt header entry {entry!r}")
        dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPES:
            raise CheckpointError(f"{where}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise CheckpointError(f"{where}: corrupt shape {shape!r}")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) for o in offs)
            or not 0 <= offs[0] <= offs[1]
        ):
            raise CheckpointError(f"{where}: corrupt data_offsets {offs!r}")
        need = math.prod(shape) * DTYPES[dtype][1]
        if offs[1] - offs[0] != need:
            raise CheckpointError(
                f"{where}: shape {shape} of {dtype} needs {need} bytes but its data_offsets span {offs[1] - offs[0]}"
            )
        return TensorInfo(name, dtype, tuple(shape), self.data_start + offs[0], self.data_start + offs[1])

    def _check_layout(self) -> None:
        pos = self.data_start
        for t in sorted(self.tensors.values(), key=lambda t: (t.start, t.end)):
            if t.end > self.size:
                raise CheckpointError(
                    f"{self.path}: truncated: tensor {t.name!r} needs bytes up to {t.end} but the file has {self.size}"
                )
            if t.start != pos:
                raise CheckpointError(
                    f"{self.path}: corrupt header: tensor {t.name!r} overlaps another or leaves a gap"
                )
            pos = t.end
        if pos != self.size:
            raise CheckpointError(f"{self.path}: corrupt: {self.size - pos} bytes after the last tensor's data")

    # -- reads ------------------------------------------------------------------------------
    def _fileno(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        self.close()

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {name!r}") from None

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as a fresh CPU tensor of its own dtype and shape."""
        t = self.info(name)
        buf = torch.empty(t.nbytes, dtype=torch.uint8)
        if t.nbytes:
            _preadv_exact(self._fileno(), memoryview(buf.numpy()), t.start, self.path, name)
        return buf.view(DTYPES[t.dtype][0]).view(t.shape)

    def map(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as a read-only view of the file's pages (no copy, no anonymous memory).

        The pages are populated when mapped, so a reader thread that calls this prefetches the
        tensor for the thread that uses it. Falls back to ``read`` where a view is impossible.
        Never write into the result.
        """
        t = self.info(name)
        dtype, size = DTYPES[t.dtype]
        start = t.start - t.start % mmap.ALLOCATIONGRANULARITY
        if t.nbytes == 0 or (t.start - start) % size:
            return self.read(name)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        try:
            mm = mmap.mmap(self._fileno(), t.end - start, flags=flags, prot=mmap.PROT_READ, offset=start)
        except (OSError, ValueError):
            return self.read(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "buffer is not writable": the view is only ever read
            x = torch.frombuffer(mm, dtype=torch.uint8, count=t.nbytes, offset=t.start - start)
        return x.view(dtype).view(t.shape)

    def copy_to(self, name: str, out) -> None:
        """Appends the raw bytes of ``name`` to the binary file ``out``: in the kernel where the
        file system allows (``copy_file_range``), else in bounded chunks through user space."""
        t = self.info(name)
        out.flush()
        pos, done = out.tell(), 0
        try:
            while done < t.nbytes:
                n = os.copy_file_range(self._fileno(), out.fileno(), t.nbytes - done, t.start + done, pos + done)
                if n <= 0:
                    raise CheckpointError(f"{self.path}: tensor {name!r}: unexpected end of file")
                done += n
        except (OSError, AttributeError) as e:
            if isinstance(e, OSError) and e.errno not in _NO_COPY_RANGE:
                raise
        out.seek(pos + done)
        if done == t.nbytes:
            return
        chunk = torch.empty(min(COPY_CHUNK, t.nbytes - done), dtype=torch.uint8)
        view = memoryview(chunk.numpy())
        for off in range(t.start + done, t.end, COPY_CHUNK):
            m = min(COPY_CHUNK, t.end - off)
            _preadv_exact(self._fileno(), view[:m], off, self.path, name)
            out.write(view[:m])


def read_json(path: Path, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: corrupt {what} (not valid JSON: {e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: corrupt {what} (not a JSON object)")
    return data


@dataclass
class Folder:
    """The safetensors shards of a model folder (or one file) and where each tensor lives."""

    root: Path
    files: dict[str, SafetensorsFile]  # shard name (relative to root) -> file, in shard order
    where: dict[str, str]  # tensor name -> shard name
    index: dict | None  # the parsed index json, when the folder has one
    single_file: bool = False
    ignored: list[str] = field(default_factory=list)  # *.safetensors the index does not list

    @property
    def config_path(self) -> Path | None:
        p = self.root / CONFIG_NAME
        return p if not self.single_file and p.is_file() else None

    def info(self, name: str) -> TensorInfo:
        return self.files[self.where[name]].info(name)

    def file_of(self, name: str) -> SafetensorsFile:
        return self.files[self.where[name]]

    def read(self, name: str) -> torch.Tensor:
        return self.file_of(name).read(name)

    def map(self, name: str) -> torch.Tensor:
        return self.file_of(name).map(name)

    def tensor_names(self) -> list[str]:
        """Every tensor, shard by shard, in file order (sequential reads)."""
        out = []
        for f in self.files.values():
            out.extend(t.name for t in sorted(f.tensors.values(), key=lambda t: t.start))
        return out

    def other_files(self) -> list[Path]:
        """Files to copy unchanged: everything but the shards, the index, config.json and dot-folders."""
        if self.single_file:
            return []
        skip = set(self.files) | {INDEX_NAME, CONFIG_NAME} | set(self.ignored)
        out = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for fn in sorted(filenames):
                rel = (Path(dirpath) / fn).relative_to(self.root)
                if rel.as_posix() not in skip:
                    out.append(rel)
        return out

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def open_folder(path) -> Folder:
    """Opens a model folder (sharded with an index, or one ``*.safetensors``) or a single file.

    Every shard header is validated and the index is checked against the shards both ways, so a
    missing shard, a missing or extra index entry, or a truncated file is reported here, by name.
    """
    path = Path(path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path}: not a .safetensors file")
        f = SafetensorsFile(path)
        return Folder(path.parent, {path.name: f}, dict.fromkeys(f.tensors, path.name), None, single_file=True)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or folder")
    index_path = path / INDEX_NAME
    present = sorted(p.relative_to(path).as_posix() for p in path.glob("*.safetensors"))
    if not index_path.is_file():
        if not present:
            bins = sorted(p.name for p in path.glob("*.bin"))
            hint = f" (found {', '.join(bins)}: convert them to safetensors first)" if bins else ""
            raise CheckpointError(f"{path}: no *.safetensors files{hint}")
        if len(present) > 1:
            raise CheckpointError(f"{path}: {len(present)} *.safetensors files but no {INDEX_NAME} to say how they fit")
        f = SafetensorsFile(path / present[0])
        return Folder(path, {present[0]: f}, dict.fromkeys(f.tensors, present[0]), None)
    index = read_json(index_path, "index")
    wmap = index.get("weight_map")
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise CheckpointError(f"{index_path}: corrupt index (no weight_map of tensor name -> shard file)")
    files: dict[str, SafetensorsFile] = {}
    for shard in sorted(set(wmap.values())):
        if not (path / shard).is_file():
            first = next(n for n, s in wmap.items() if s == shard)
            raise CheckpointError(f"{index_path}: lists tensor {first!r} in {shard}, but {path / shard} is missing")
        files[shard] = SafetensorsFile(path / shard)
    for name, shard in wmap.items():
        if name not in files[shard].tensors:
            raise CheckpointError(f"{index_path}: lists tensor {name!r} in {shard}, but that file has no such tensor")
    for shard, f in files.items():
        for name in f.tensors:
            if wmap.get(name) != shard:
                raise CheckpointError(
                    f"{f.path}: holds tensor {name!r}, which {INDEX_NAME} "
                    + ("does not list" if name not in wmap else f"places in {wmap[name]}")
                )
    ignored = [p for p in present if p not in files]
    return Folder(path, files, dict(wmap), index, ignored=ignored)


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------
def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a CPU tensor's data (copies only if it is not contiguous)."""
    t = t.detach().cpu().contiguous().reshape(-1)
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    return memoryview(t.numpy())


@dataclass
class Planned:
    name: str
    dtype: str
    shape: tuple | None  # None: a 1-D tensor whose length is only known when it is written
    max_numel: int = 0  # the bound on that length


class ShardWriter:
    """Writes one safetensors file tensor by tensor, in any order, with bounded memory.

    The data section is streamed; the header (whose offsets and escape counts are known only at
    the end) goes into room reserved for the largest header the plan could need, padded with
    spaces as the safetensors spec allows. Every tensor starts at a multiple of its element size
    (safetensors' loaders view the bytes in place): tensors whose byte size is a multiple of 8 are
    written as they come, the rest are held (in practice small: biases, escape lists) and written
    at ``close`` in decreasing element size.
    """

    def __init__(self, path, plan: list[Planned], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.plan = {p.name: p for p in plan}
        if len(self.plan) != len(plan):
            raise ValueError(f"{self.path}: duplicate tensor names in the shard plan")
        self.metadata = dict(metadata or {})
        worst_total = sum(self._max_bytes(p) for p in plan)
        worst = self._header(
            {p.name: (p.dtype, list(p.shape) if p.shape is not None else [p.max_numel]) for p in plan},
            dict.fromkeys(self.plan, (worst_total, worst_total)),
        )
        self.reserved = ceil_div(len(worst), 8) * 8
        self.pos = 0  # offset inside the data section
        self.offsets: dict[str, tuple[int, int]] = {}
        self.shapes: dict[str, list] = {}
        self.held: list[tuple[str, memoryview]] = []
        self.f = open(self.path, "wb")  # noqa: SIM115 - closed in close()/abort()
        self.f.seek(8 + self.reserved)

    @staticmethod
    def _max_bytes(p: Planned) -> int:
        return (math.prod(p.shape) if p.shape is not None else p.max_numel) * DTYPES[p.dtype][1]

    def _header(self, shapes: dict, offsets: dict) -> bytes:
        h: dict = {"__metadata__": self.metadata} if self.metadata else {}
        for name in self.plan:
            dtype, shape = shapes[name]
            h[name] = {"dtype": dtype, "shape": shape, "data_offsets": list(offsets[name])}
        return json.dumps(h, separators=(",", ":")).encode()

    def add(self, name: str, t: torch.Tensor) -> None:
        p = self.plan.get(name)
        if p is None or name in self.shapes:
            raise ValueError(f"{self.path}: tensor {name!r} is " + ("not planned" if p is None else "written twice"))
        dtype = TORCH_TO_ST.get(t.dtype)
        shape = list(t.shape)
        ok = dtype == p.dtype and (
            shape == list(p.shape) if p.shape is not None else len(shape) == 1 and shape[0] <= p.max_numel
        )
        if not ok:
            raise ValueError(f"{self.path}: tensor {name!r} is {dtype} {shape}, planned {p.dtype} {p.shape}")
        self.shapes[name] = shape
        data = tensor_bytes(t)
        if len(data) % 8:
            self.held.append((name, data))
        else:
            self._put(name, data)

    def copy_from(self, name: str, src: SafetensorsFile, src_name: str | None = None) -> None:
        """Adds a tensor by copying its bytes from ``src`` (streamed when alignment allows)."""
        info = src.info(src_name or name)
        p = self.plan.get(name)
        if p is None or name in self.shapes or (p.dtype, p.shape) != (info.dtype, info.shape):
            raise ValueError(f"{self.path}: tensor {name!r} does not match the shard plan")
        self.shapes[name] = list(info.shape)
        if info.nbytes % 8:
            self.held.append((name, tensor_bytes(src.read(info.name))))
        else:
            src.copy_to(info.name, self.f)
            self.offsets[name] = (self.pos, self.pos + info.nbytes)
            self.pos += info.nbytes

    def _put(self, name: str, data: memoryview) -> None:
        self.f.write(data)
        self.offsets[name] = (self.pos, self.pos + len(data))
        self.pos += len(data)

    def close(self, fsync: bool = False) -> int:
        """Writes the held tensors and the header; returns the file size."""
        for name, data in sorted(self.held, key=lambda x: -DTYPES[self.plan[x[0]].dtype][1]):
            self._put(name, data)
        self.held.clear()
        missing = [n for n in self.plan if n not in self.offsets]
        if missing:
            raise ValueError(f"{self.path}: planned tensors never written: {missing[:5]}")
        header = self._header({n: (self.plan[n].dtype, self.shapes[n]) for n in self.plan}, self.offsets)
        if len(header) > self.reserved:  # cannot happen: every number is bounded by the plan
            raise AssertionError(f"{self.path}: header of {len(header)} bytes exceeds the {self.reserved} reserved")
        self.f.seek(0)
        self.f.write(self.reserved.to_bytes(8, "little"))
        self.f.write(header + b" " * (self.reserved - len(header)))
        self.f.flush()
        if fsync:
            os.fsync(self.f.fileno())
        self.f.close()
        return 8 + self.reserved + self.pos

    def abort(self) -> None:
        self.f.close()


def w12_plan(name: str, shape) -> list[Planned]:
    """The shard plan entries of a weight ``name`` of ``shape`` converted to W12."""
    numel = math.prod(shape)
    shapes = w12_tensor_shapes(shape, 0)
    out = []
    for suffix, tname in zip(TENSOR_SUFFIXES, w12_names(name)):
        var = suffix in ("w12_esc_col", "w12_esc_val")
        out.append(Planned(tname, W12_DTYPES[suffix], None if var else shapes[suffix], numel if var else 0))
    return out


def w12_metadata(entries: dict[str, dict], base: dict[str, str] | None = None) -> dict[str, str]:
    """Shard metadata (§6): ``base`` (the source's, its ``format`` kept as ``w12_source_format``)
    plus ``format: w12``, ``w12_version`` and the ``w12_tensors`` map."""
    md = dict(base or {})
    if "format" in md and md["format"] != "w12":
        md["w12_source_format"] = md["format"]
    md.update(format="w12", w12_version=W12_VERSION, w12_tensors=json.dumps(entries, separators=(",", ":")))
    return md


def quantization_config(**extra) -> dict:
    """The ``quantization_config`` that marks a W12 folder's config.json."""
    return {"quant_method": "w12", "version": FORMAT_VERSION, "layout": 0, **extra}


# ------------------------------------------------------------------------------------------------
# W12 folders
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class W12Entry:
    name: str  # the original weight name (NAME)
    shape: tuple
    layout: int
    shard: str
    nnz: int
    source_dtype: str  # "BF16", or the dtype it was cast from with --cast bf16

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _parse_w12_map(f: SafetensorsFile, shard: str) -> dict[str, W12Entry]:
    md = f.metadata
    if md.get("format") != "w12":
        raise CheckpointError(f"{f.path}: not a W12 shard (its metadata has format={md.get('format')!r}, not 'w12')")
    version = md.get("w12_version")
    if version != W12_VERSION:
        raise CheckpointError(
            f"{f.path}: unknown W12 format version {version!r}: this w12 reads version {W12_VERSION} only"
        )
    try:
        tmap = json.loads(md.get("w12_tensors", ""))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f.path}: corrupt w12_tensors metadata (not valid JSON: {e})") from None
    if not isinstance(tmap, dict):
        raise CheckpointError(f"{f.path}: corrupt w12_tensors metadata (not a JSON object)")
    out = {}
    for name, e in tmap.items():
        shape = e.get("shape") if isinstance(e, dict) else None
        if not isinstance(shape, list) or len(shape) < 2 or not all(isinstance(s, int) and s > 0 for s in shape):
            raise CheckpointError(f"{f.path}: w12_tensors entry {name!r} has no valid shape (got {e!r})")
        layout = e.get("layout", 0)
        if layout != 0:
            raise CheckpointError(
                f"{f.path}: tensor {name!r} is stored in layout {layout!r}; on disk W12 v1 is layout 0"
            )
        names = w12_names(name)
        for tname in names:
            if tname not in f.tensors:
                raise CheckpointError(f"{f.path}: W12 tensor {name!r} lacks {tname!r}")
        nnz_shape = f.tensors[names[3]].shape
        nnz = nnz_shape[0] if len(nnz_shape) == 1 else -1
        want = w12_tensor_shapes(shape, max(nnz, 0))
        for suffix, tname in zip(TENSOR_SUFFIXES, names):
            t = f.tensors[tname]
            if t.dtype != W12_DTYPES[suffix] or t.shape != want[suffix] or nnz < 0:
                raise CheckpointError(
                    f"{f.path}: tensor {tname!r} is {t.dtype} {list(t.shape)}, but w12_tensors gives {name!r} shape "
                    f"{shape}, which needs {W12_DTYPES[suffix]} {list(want[suffix])}"
                )
        src_dtype = e.get("source_dtype", "BF16")
        out[name] = W12Entry(name, tuple(shape), 0, shard, nnz, src_dtype)
    return out


class W12Checkpoint:
    """A converted folder (or one converted ``.safetensors`` file), validated on open.

    Opening checks the version, that every ``w12_tensors`` entry has its five tensors with the
    dtypes and shapes its ``shape`` implies, and that no ``*.w12_*`` tensor is left unclaimed;
    tensors are read only when asked for.
    """

    def __init__(self, path):
        self.folder = open_folder(path)
        self.path = Path(path)
        self.config: dict | None = None
        if self.folder.config_path is not None:
            self.config = read_json(self.folder.config_path, "config")
            qc = self.config.get("quantization_config")
            if qc is not None:
                if not isinstance(qc, dict) or qc.get("quant_method") != "w12":
                    method = qc.get("quant_method") if isinstance(qc, dict) else qc
                    raise CheckpointError(f"{self.folder.config_path}: not a W12 folder (quant_method {method!r})")
                if qc.get("version") != FORMAT_VERSION:
                    raise CheckpointError(
                        f"{self.folder.config_path}: unknown W12 format version {qc.get('version')!r}: "
                        f"this w12 reads version {FORMAT_VERSION} only"
                    )
        self.entries: dict[str, W12Entry] = {}
        claimed: set[str] = set()
        for shard, f in self.folder.files.items():
            for name, entry in _parse_w12_map(f, shard).items():
                if name in self.entries:
                    raise CheckpointError(f"{f.path}: W12 tensor {name!r} is also in {self.entries[name].shard}")
                self.entries[name] = entry
                claimed.update(w12_names(name))
        self.plain: list[str] = []
        for name in self.folder.tensor_names():
            if name in claimed:
                continue
            if re.search(r"\.w12_[a-z_]+$", name):
                raise CheckpointError(
                    f"{self.folder.file_of(name).path}: tensor {name!r} belongs to no w12_tensors entry"
                )
            if name in self.entries:
                raise CheckpointError(f"{self.folder.file_of(name).path}: {name!r} is both a plain and a W12 tensor")
            self.plain.append(name)

    def names(self) -> list[str]:
        """Original tensor names (converted and plain), in file order."""
        by_records = {w12_names(e)[0]: e for e in self.entries}
        plain = set(self.plain)
        return [by_records.get(n, n) for n in self.folder.tensor_names() if n in plain or n in by_records]

    def load(self, name: str, device="cpu", check_escapes: bool = False) -> W12Weight:
        e = self.entries.get(name)
        if e is None:
            raise CheckpointError(f"{self.path}: no W12 tensor {name!r}")
        f = self.folder.files[e.shard]
        parts = [f.read(t) for t in w12_names(name)]
        where = f"{f.path}: {name}"
        try:
            w = W12Weight(*parts, shape=e.shape, layout=0)
            w.validate(where)
            if check_escapes:
                w.check_escapes(where)
        except W12FormatError as err:
            msg = str(err)
            raise CheckpointError(msg if msg.startswith(where) else f"{where}: {msg}") from None
        return w.to(device)

    def read_plain(self, name: str) -> torch.Tensor:
        return self.folder.read(name)

    def close(self) -> None:
        self.folder.close()


def is_w12_checkpoint(path) -> bool:
    """True if ``path`` holds W12 shards (cheap: reads the shard headers only)."""
    try:
        folder = open_folder(path)
    except CheckpointError:
        return False
    return any(f.metadata.get("format") == "w12" for f in folder.files.values())


def load_w12_weights(folder, device="cpu", check_escapes: bool = True) -> dict[str, W12Weight]:
    """Every converted weight of a W12 folder, as ``{NAME: W12Weight}`` (layout 0) on ``device``.

    ``NAME`` is the original name (``model.layers.0.mlp.down_proj.weight``). Raises
    ``CheckpointError`` naming the file and tensor on any inconsistency.
    """
    ck = W12Checkpoint(folder)
    try:
        return {name: ck.load(name, device, check_escapes) for name in ck.entries}
    finally:
        ck.close()


def load_w12_state_dict(folder, device="cpu") -> dict:
    """The whole folder: ``{NAME: W12Weight}`` for converted weights, plain tensors otherwise."""
    ck = W12Checkpoint(folder)
    try:
        return {
            name: ck.load(name, device, True) if name in ck.entries else ck.read_plain(name).to(device)
            for name in ck.names()
        }
    finally:
        ck.close()


def _shard_names(n: int) -> list[str]:
    return [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def save_w12(state_dict: dict, folder, max_shard_bytes: int = 5 << 30, metadata: dict | None = None) -> list[str]:
    """Writes a state dict mixing plain tensors and ``W12Weight``\\ s as W12 shards (§6).

    A ``W12Weight`` under key ``NAME`` is stored as ``STEM.w12_*`` (records in layout 0); tensors
    are stored as they are. Shards are cut at ``max_shard_bytes`` (one file: ``model.safetensors``;
    more: ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``). Each file is
    written under a temporary name and renamed, so a failed save leaves no complete-looking shard.
    ``config.json`` is the caller's (add ``quantization_config()`` to it). Returns the file names.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    groups: list[list[str]] = [[]]
    size = 0
    for name, v in state_dict.items():
        if not isinstance(v, (W12Weight, torch.Tensor)):
            raise TypeError(f"save_w12: {name!r} is a {type(v).__name__}, expected a torch.Tensor or W12Weight")
        if isinstance(v, W12Weight) and f"{stem_of(name)}.w12_records" in state_dict:
            raise ValueError(f"save_w12: {name!r} and its W12 tensors are both in the state dict")
        nbytes = v.nbytes if isinstance(v, W12Weight) else v.numel() * v.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    files = _shard_names(len(groups))
    weight_map, total = {}, 0
    for fname, names in zip(files, groups):
        plan, tensors, entries = [], {}, {}
        for name in names:
            v = state_dict[name]
            if isinstance(v, W12Weight):
                entries[name] = {"shape": list(v.shape), "layout": 0}
                for tname, t in v.cpu().state_dict(stem_of(name)).items():
                    tensors[tname] = t
            else:
                if v.dtype not in TORCH_TO_ST:
                    raise TypeError(f"save_w12: {name!r} has dtype {v.dtype}, which safetensors cannot store")
                tensors[name] = v.detach().cpu()
        for tname, t in tensors.items():
            plan.append(Planned(tname, TORCH_TO_ST[t.dtype], tuple(t.shape)))
            weight_map[tname] = fname
            total += t.numel() * t.element_size()
        tmp = folder / f".{fname}.w12-partial"
        writer = ShardWriter(tmp, plan, w12_metadata(entries, {"format": "pt", **(metadata or {})}))
        try:
            for tname, t in tensors.items():
                writer.add(tname, t)
            writer.close()
        except BaseException:
            writer.abort()
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, folder / fname)
    index = folder / INDEX_NAME
    if len(files) > 1:
        tmp = folder / f".{INDEX_NAME}.w12-partial"
        tmp.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        os.replace(tmp, index)
    elif index.exists():
        index.unlink()  # a stale index would send loaders to shards that no longer exist
    return files
