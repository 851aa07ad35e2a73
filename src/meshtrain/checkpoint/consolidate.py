"""Merge a sharded checkpoint into a plain Hugging Face model folder, one tensor at a time.

The output loads with `AutoModelForCausalLM.from_pretrained` and no meshtrain
import: `config.json`, the weights, and the tokenizer files. The weights are
`model.safetensors`, or, past `max_shard_size`, `model-0000i-of-0000N.safetensors`
files with a `model.safetensors.index.json` that maps each tensor to its file.

Consolidation only moves bytes, so it needs neither torch nor safetensors: the
shard files' safetensors headers (an 8-byte little-endian length, then JSON
giving each tensor's dtype, shape and `data_offsets` into the data section that
follows) say where every piece lies, and every shape and dtype is in the
manifest, so each output file's header is written before any tensor data is
read. Then, tensor by tensor:

* a tensor whose output bytes are contiguous byte ranges of the shards (a
  replicated tensor: rank 0's piece; a tensor split along dim 0: the pieces one
  after another; replicated KV heads: the first copy of each run of heads) is
  copied file to file by the kernel (`os.copy_file_range`, else `os.sendfile`,
  else reads and writes through one buffer), never entering this process;
* a tensor split along a later dim (row-parallel: dim 1) interleaves its
  pieces row by row, as raw bytes (so any dtype, bf16 included): blocks of at most
  `CHUNK_BYTES` of output are assembled in a reused buffer, each piece's rows read
  straight into their places with one `preadv`, then written (pieces with rows
  narrower than `SCATTER_MIN_BYTES` are read whole and interleaved with numpy).

Memory stays near two blocks of `CHUNK_BYTES`, whatever the model's size. With
`verify`, the sha256 of every checkpoint file is computed on background threads
while the bytes are copied; the output is put in place only if all match.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshtrain.checkpoint.files import shard_dir_name
from meshtrain.checkpoint.manifest import (
    CheckpointError,
    read_manifest,
    resolve_checkpoint,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

SAFE_WEIGHTS = "model.safetensors"
SAFE_WEIGHTS_INDEX = "model.safetensors.index.json"
CHUNK_BYTES = 2**20  # the largest block of output rows interleaved at once (fits in L2)
COPY_BYTES = 64 * 2**20  # the most bytes one kernel copy call moves (between progress updates)
HASH_BYTES = 2**20  # the read size of the sha256 check
MAX_OPEN_SHARDS = 64  # shard files kept open at once (least recently used closed first)
SCATTER_MIN_BYTES = 256  # narrower piece rows are interleaved with numpy, not read in place
_MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit

# dtype name (the manifest's `dtype`, torch's name) -> (safetensors code, bytes per element)
_DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint64": ("U64", 8),
    "uint32": ("U32", 4),
    "uint16": ("U16", 2),
    "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
}
_ALIASES = {
    "double": "float64",
    "float": "float32",
    "half": "float16",
    "long": "int64",
    "int": "int32",
    "short": "int16",
}
# dtype name -> safetensors dtype code (the `dtype` field of a file header).
SAFETENSORS_DTYPES: dict[str, str] = {name: code for name, (code, _) in _DTYPES.items()}
_CODE_NAMES = {code: name for name, (code, _) in _DTYPES.items()}
_CODE_SIZES = {code: size for code, size in _DTYPES.values()}

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or a string like "5GB", "500MB", "1.5GB", "2GiB", "1000".

    Units are case-insensitive; KB/MB/GB/TB are decimal (1GB = 10**9 bytes, as in
    Hugging Face's `max_shard_size`), KiB/MiB/GiB/TiB binary. Raises ValueError."""
    if isinstance(size, bool) or not isinstance(size, int | str):
        raise ValueError(f"a size is an int or a string like '5GB', not {size!r}")
    if isinstance(size, int):
        number = size
    else:
        match = _SIZE_RE.fullmatch(size)
        unit = match.group(2).lower() if match else None
        if unit not in _SIZE_UNITS:
            raise ValueError(
                f"cannot read {size!r} as a size: use bytes or a number with a unit "
                "(KB, MB, GB, TB or KiB, MiB, GiB, TiB), like '5GB'"
            )
        try:
            number = int(Decimal(match.group(1)) * _SIZE_UNITS[unit])
        except InvalidOperation as error:  # pragma: no cover - the regex admits only numbers
            raise ValueError(f"cannot read {size!r} as a size") from error
    if number < 1:
        raise ValueError(f"a size must be at least 1 byte, not {size!r}")
    return number


def dtype_name(dtype: Any) -> str:
    """The canonical name ("float32", "bfloat16") of a torch dtype, a dtype name or a
    safetensors code ("F32"); raises ValueError for one safetensors cannot store."""
    name = str(dtype).removeprefix("torch.")
    name = _ALIASES.get(name, _CODE_NAMES.get(name, name))
    if name not in _DTYPES:
        raise ValueError(f"safetensors has no code for dtype {dtype}")
    return name


# --- low-level file io ------------------------------------------------------------------------


def _write_all(fd: int, data: Any, offset: int) -> None:
    """Write all of `data` (a bytes-like object) at `offset` of `fd`."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _pread_some(fd: int, view: memoryview, offset: int) -> int:
    """Read up to len(view) bytes at `offset` of `fd` into `view`; returns how many."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)  # pragma: no cover - platforms without preadv
    view[: len(data)] = data  # pragma: no cover
    return len(data)  # pragma: no cover


def _read_into(fd: int, buffer: Any, offset: int, path: Path) -> None:
    """Fill `buffer` (a writable bytes-like object) from `offset` of `fd`."""
    view = memoryview(buffer).cast("B")
    while view:
        got = _pread_some(fd, view, offset)
        if got == 0:
            raise CheckpointError(f"{path} ended before the data its header lists")
        view = view[got:]
        offset += got


def _iov_max() -> int:
    """How many segments one `preadv` call takes."""
    try:
        value = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - POSIX has it
        value = -1
    return min(value, 1024) if value > 0 else 16


_IOV_MAX = _iov_max()


# errno values meaning "this way of copying does not work here", not "the copy failed".
_UNSUPPORTED = {
    errno.EXDEV,
    errno.ENOSYS,
    errno.EOPNOTSUPP,
    getattr(errno, "ENOTSUP", errno.EOPNOTSUPP),
    errno.EINVAL,
    errno.ENOTSOCK,
}


class _ByteCopier:
    """Copies byte ranges between files: `os.copy_file_range` (in the kernel, no copy
    through this process), else `os.sendfile`, else reads and writes through one
    buffer. A way that fails as unsupported is not tried again by this copier."""

    def __init__(self) -> None:
        kernel = [way for way in ("copy_file_range", "sendfile") if hasattr(os, way)]
        self.ways = [*kernel, "read_write"]  # the first is the one in use
        self._buffer: bytearray | None = None

    def copy(self, src: int, src_offset: int, dst: int, dst_offset: int, count: int, bar) -> None:
        while count > 0:
            step = min(count, COPY_BYTES)
            done = self._copy_some(src, src_offset, dst, dst_offset, step)
            if done == 0:
                # Some file systems answer 0 to copy_file_range/sendfile instead of an error.
                if len(self.ways) == 1:
                    raise CheckpointError("a shard file ended before the data its header lists")
                self.ways.pop(0)
                continue
            src_offset += done
            dst_offset += done
            count -= done
            bar.update(done)

    def _copy_some(self, src: int, src_offset: int, dst: int, dst_offset: int, count: int) -> int:
        while True:
            way = self.ways[0]
            try:
                if way == "copy_file_range":
                    return os.copy_file_range(src, dst, count, src_offset, dst_offset)
                if way == "sendfile":
                    os.lseek(dst, dst_offset, os.SEEK_SET)
                    return os.sendfile(dst, src, src_offset, count)
            except OSError as error:
                if error.errno not in _UNSUPPORTED:
                    raise
                self.ways.pop(0)
                continue
            if self._buffer is None:
                self._buffer = bytearray(max(1, min(COPY_BYTES, CHUNK_BYTES)))
            view = memoryview(self._buffer)[:count]
            got = _pread_some(src, view, src_offset)
            _write_all(dst, view[:got], dst_offset)
            return got


class _ShardFiles:
    """Read-only descriptors of the shard files, opened on first use; past
    `MAX_OPEN_SHARDS` open, the least recently used are closed (never one of the
    files asked for at the same time)."""

    def __init__(self) -> None:
        self._open: OrderedDict[Path, int] = OrderedDict()

    def fds(self, paths: Sequence[Path]) -> list[int]:
        """A descriptor of each of `paths`, all open together."""
        fds = []
        for path in paths:
            fd = self._open.get(path)
            if fd is not None:
                self._open.move_to_end(path)
            else:
                for old in [p for p in self._open if p not in paths]:  # oldest first
                    if len(self._open) < MAX_OPEN_SHARDS:
                        break
                    os.close(self._open.pop(old))
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
                if hasattr(os, "posix_fadvise"):
                    with contextlib.suppress(OSError):  # advice only
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                self._open[path] = fd
            fds.append(fd)
        return fds

    def close(self) -> None:
        while self._open:
            os.close(self._open.popitem()[1])


# --- the safetensors format -------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's name, dtype (a torch dtype or its name: "float32") and shape: all a
    safetensors header needs."""

    name: str
    dtype: Any
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(size) for size in self.shape))

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype_name][1]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor lies in a .safetensors file: `start` is its first byte in the file."""

    code: str
    shape: tuple[int, ...]
    start: int
    nbytes: int


def read_safetensors_header(path: str | Path) -> dict[str, StoredTensor]:
    """Each tensor of a .safetensors file, from its header only (no data is read).

    Raises CheckpointError if the header is malformed or lists data past the file's end."""
    path = Path(path)
    with path.open("rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        head = handle.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is not a safetensors file: it has {size} bytes")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, _MAX_HEADER_BYTES):
            raise CheckpointError(
                f"{path} is not a safetensors file: a {length}-byte header in {size} bytes"
            )
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as error:
        message = f"{path} is not a safetensors file: its header is not JSON"
        raise CheckpointError(message) from error
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a safetensors file: its header is not an object")
    data_start = 8 + length
    data_size = size - data_start
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            code = entry["dtype"]
            shape = tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            valid = (
                code in _CODE_SIZES
                and all(type(n) is int and n >= 0 for n in (*shape, begin, end))
                and end - begin == math.prod(shape) * _CODE_SIZES[code]
                and 0 <= begin <= end <= data_size
            )
        except (KeyError, TypeError, ValueError):
            valid = False
        if not valid:
            raise CheckpointError(f"{path}: the header entry of tensor {name} is not valid")
        tensors[name] = StoredTensor(code, shape, data_start + begin, end - begin)
    return tensors


def _header_bytes(specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None):
    """(the header's bytes, the specs in data order, their data offsets, the data size)."""
    ordered = sorted(specs, key=lambda spec: -spec.itemsize)
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offsets: dict[str, int] = {}
    offset = 0
    for spec in ordered:
        if spec.name in offsets or spec.name == "__metadata__":
            raise ValueError(f"tensor name {spec.name!r} is repeated or reserved")
        offsets[spec.name] = offset
        header[spec.name] = {
            "dtype": SAFETENSORS_DTYPES[spec.dtype_name],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded, ordered, offsets, offset


class SafetensorsWriter:
    """Write a .safetensors file whose tensors are all declared up front, data afterwards.

    Layout: an 8-byte little-endian header length N; N bytes of JSON (padded with
    spaces so the data starts 8-byte aligned) giving each tensor's dtype, shape
    and `data_offsets` relative to the data section; then the raw little-endian
    tensor bytes. Data is ordered by descending element size (stable, so specs
    of one dtype keep their order), which keeps every tensor aligned to its
    element size; `names` is that order. `write` takes a whole torch tensor, or
    its bytes in consecutive pieces (row blocks), and accepts the tensors in any
    order, though `names` order writes the file sequentially.

        with SafetensorsWriter(path, specs, metadata={"format": "pt"}) as writer:
            for name in writer.names:
                writer.write(name, tensors[name])

    To write a tensor's bytes some other way (another file's bytes, copied by the
    kernel), write them at `data_offset(name)` of `fileno()`, then `mark_written(name)`.
    """

    def __init__(
        self,
        path: str | Path,
        specs: Sequence[TensorSpec],
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        if sys.byteorder != "little":  # pragma: no cover - every supported platform is
            raise RuntimeError("writing safetensors needs a little-endian machine")
        self.path = Path(path)
        header, ordered, offsets, self.data_size = _header_bytes(specs, metadata)
        self._specs: dict[str, TensorSpec] = {spec.name: spec for spec in ordered}
        self._offsets = {name: len(header) + offset for name, offset in offsets.items()}
        self._written: set[str] = set()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0)
        self._fd = os.open(self.path, flags, 0o666)
        self._closed = False
        try:
            _write_all(self._fd, header, 0)
        except BaseException:
            self._close_fd()
            raise

    @property
    def names(self) -> list[str]:
        """The tensors in the order their data lies in the file."""
        return list(self._specs)

    def fileno(self) -> int:
        return self._fd

    def data_offset(self, name: str) -> int:
        """Where tensor `name`'s bytes start in the file; raises if it is not declared
        or was already written."""
        if name not in self._specs:
            raise KeyError(f"{name!r} is not one of the tensors declared for {self.path}")
        if name in self._written:
            raise ValueError(f"tensor {name!r} was already written to {self.path}")
        return self._offsets[name]

    def mark_written(self, name: str) -> None:
        """Record that tensor `name`'s bytes were written at `data_offset(name)`."""
        self.data_offset(name)
        self._written.add(name)

    def write(self, name: str, data: torch.Tensor | Iterable[torch.Tensor]) -> int:
        """Write tensor `name`: a tensor of its shape, or pieces whose bytes, in order,
        are the tensor's (row-major). Returns the bytes written."""
        start = self.data_offset(name)
        spec = self._specs[name]
        torch = sys.modules.get("torch")  # a caller holding tensors has imported it
        if torch is not None and isinstance(data, torch.Tensor):
            if tuple(data.shape) != spec.shape:
                raise ValueError(f"tensor {name!r} has shape {list(data.shape)}, not {spec.shape}")
            data = [data]
        written = 0
        for piece in data:
            if dtype_name(piece.dtype) != spec.dtype_name:
                raise ValueError(f"tensor {name!r} is {spec.dtype}, got a {piece.dtype} piece")
            size = piece.numel() * piece.element_size()
            if written + size > spec.nbytes:
                raise ValueError(f"tensor {name!r} got more than its {spec.nbytes} bytes")
            if size:
                flat = piece.detach().reshape(-1).contiguous()
                raw = flat.view(sys.modules["torch"].uint8).cpu().numpy()
                _write_all(self._fd, raw, start + written)
            written += size
        if written != spec.nbytes:
            raise ValueError(f"tensor {name!r} got {written} of its {spec.nbytes} bytes")
        self._written.add(name)
        return written

    def _close_fd(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._fd)

    def close(self) -> None:
        """Close the file; raises if a declared tensor was not written."""
        if self._closed:
            return
        self._close_fd()
        missing = [name for name in self._specs if name not in self._written]
        if missing:
            raise ValueError(f"{self.path} is missing the data of {missing}")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._close_fd()


def save_safetensors(
    tensors: Mapping[str, torch.Tensor],
    path: str | Path,
    *,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write `tensors` to one .safetensors file with `SafetensorsWriter`."""
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    with SafetensorsWriter(path, specs, metadata=metadata) as writer:
        for name in writer.names:
            writer.write(name, tensors[name])


# --- planning ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Piece:
    """One rank's piece of a tensor: its shard file and where its bytes start there."""

    path: Path
    start: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _TensorPlan:
    """How to rebuild one full tensor from its shard pieces."""

    spec: TensorSpec
    pieces: tuple[_Piece, ...]  # concatenated in this order along tp_dim
    tp_dim: int | None
    kv_copies: int
    kv_head_dim: int | None


def _dtype_of(name: str, meta: Mapping[str, Any]) -> str:
    try:
        return dtype_name(meta.get("dtype"))
    except ValueError:
        raise CheckpointError(
            f"tensor {name} has dtype {meta.get('dtype')!r}, not one to save"
        ) from None


def _shard_path(root: Path, tp_rank: int, pp_rank: int) -> Path:
    return root / "shards" / shard_dir_name(tp_rank, pp_rank) / SAFE_WEIGHTS


def _plan_tensors(root: Path, manifest: Mapping[str, Any]) -> list[_TensorPlan]:
    """Check every tensor against the shard headers (no data is read), in manifest order."""
    tp = manifest["layout"]["tensor_parallel_size"]
    headers: dict[tuple[int, int], tuple[Path, dict[str, StoredTensor]]] = {}

    def header(tp_rank: int, pp_rank: int) -> tuple[Path, dict[str, StoredTensor]]:
        key = (tp_rank, pp_rank)
        if key not in headers:
            path = _shard_path(root, tp_rank, pp_rank)
            if not path.is_file():
                raise CheckpointError(f"missing shard file {path}")
            headers[key] = (path, read_safetensors_header(path))
        return headers[key]

    plans = []
    for name, meta in manifest["tensors"].items():
        dtype = _dtype_of(name, meta)
        tp_dim = meta["tp_dim"]
        ranks = (0,) if tp_dim is None else tuple(range(tp))
        pieces = []
        for tp_rank in ranks:
            path, stored = header(tp_rank, meta["pp_rank"])
            if name not in stored:
                raise CheckpointError(f"tensor {name} is missing from shard file {path}")
            piece = stored[name]
            if piece.code != SAFETENSORS_DTYPES[dtype]:
                raise CheckpointError(
                    f"tensor {name} is stored as {piece.code}, the manifest says {meta['dtype']}"
                )
            pieces.append(_Piece(path, piece.start, piece.shape))
        shape = _rebuilt_shape(name, [list(p.shape) for p in pieces], tp_dim)
        copies = meta.get("kv_replication", 1)
        head_dim = meta.get("kv_head_dim")
        if copies > 1:
            if not shape or not head_dim or shape[0] % (copies * head_dim):
                raise CheckpointError(f"cannot undo KV replication of a {shape} tensor")
            shape[0] //= copies
        if shape != list(meta["shape"]):
            raise CheckpointError(
                f"tensor {name} rebuilt with shape {shape}, the manifest says {meta['shape']}"
            )
        plans.append(
            _TensorPlan(
                TensorSpec(name, dtype, tuple(shape)),
                tuple(pieces),
                tp_dim,
                copies,
                head_dim if copies > 1 else None,
            )
        )
    return plans


def _rebuilt_shape(name: str, shapes: list[list[int]], tp_dim: int | None) -> list[int]:
    if tp_dim is None:
        return list(shapes[0])
    first = shapes[0]
    if not 0 <= tp_dim < len(first) or any(
        len(s) != len(first) or s[:tp_dim] + s[tp_dim + 1 :] != first[:tp_dim] + first[tp_dim + 1 :]
        for s in shapes
    ):
        raise CheckpointError(
            f"tensor {name}: pieces of shapes {shapes} do not concatenate along dim {tp_dim}"
        )
    return first[:tp_dim] + [sum(s[tp_dim] for s in shapes)] + first[tp_dim + 1 :]


def _split_into_files(plans: list[_TensorPlan], limit: int) -> list[list[_TensorPlan]]:
    """Greedy in manifest order: a new file when the next tensor would pass `limit`."""
    files: list[list[_TensorPlan]] = [[]]
    size = 0
    for plan in plans:
        if files[-1] and size + plan.spec.nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(plan)
        size += plan.spec.nbytes
    return files


def _file_names(count: int) -> list[str]:
    if count == 1:
        return [SAFE_WEIGHTS]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


# --- rebuilding one tensor --------------------------------------------------------------------


def _kept_rows(plan: _TensorPlan, rows: int) -> list[tuple[int, int]]:
    """Dim-0 row ranges of the concatenated pieces that the full tensor keeps."""
    if plan.kv_copies == 1:
        return [(0, rows)]
    group = plan.kv_copies * plan.kv_head_dim
    return [(start, start + plan.kv_head_dim) for start in range(0, rows, group)]


def _byte_ranges(plan: _TensorPlan) -> list[tuple[_Piece, int, int]]:
    """The tensor's bytes as (piece, offset in the piece, length), in output order, for a
    tensor whose pieces' rows follow one another (replicated, or split along dim 0)."""
    pieces = plan.pieces
    if not pieces[0].shape:  # 0-d
        return [(pieces[0], 0, plan.spec.nbytes)]
    row_bytes = math.prod(pieces[0].shape[1:]) * plan.spec.itemsize
    starts = [0]
    for piece in pieces:
        starts.append(starts[-1] + piece.shape[0])
    ranges: list[tuple[_Piece, int, int]] = []
    for begin, end in _kept_rows(plan, starts[-1]):
        for piece, start in zip(pieces, starts, strict=False):
            low, high = max(begin, start), min(end, start + piece.shape[0])
            if low >= high:
                continue
            offset, length = (low - start) * row_bytes, (high - low) * row_bytes
            if not length:
                continue
            if ranges and ranges[-1][0] is piece and ranges[-1][1] + ranges[-1][2] == offset:
                ranges[-1] = (piece, ranges[-1][1], ranges[-1][2] + length)  # adjacent: merge
            else:
                ranges.append((piece, offset, length))
    return ranges


class _Scratch:
    """Two byte buffers reused for every interleaved block: the output block, and one
    piece's part of it (blocks allocated and freed one by one would leave the C
    allocator holding on to freed memory)."""

    def __init__(self) -> None:
        self._buffers = [bytearray(), bytearray()]

    def get(self, which: int, nbytes: int) -> memoryview:
        if nbytes > len(self._buffers[which]):
            self._buffers[which] = bytearray()  # free the old one first
            self._buffers[which] = bytearray(nbytes)
        return memoryview(self._buffers[which])[:nbytes]


def _preadv_all(fd: int, views: list[memoryview], offset: int, path: Path) -> None:
    """Fill `views`, in order, from consecutive bytes at `offset` of `fd`."""
    index = 0
    while index < len(views):
        got = os.preadv(fd, views[index : index + _IOV_MAX], offset)
        if got == 0:
            raise CheckpointError(f"{path} ended before the data its header lists")
        offset += got
        while got:  # skip the views filled; trim one filled in part (a short read)
            if got >= len(views[index]):
                got -= len(views[index])
                index += 1
            else:
                views[index] = views[index][got:]
                got = 0


def _interleave(
    plan: _TensorPlan, shards: _ShardFiles, scratch: _Scratch, fd: int, offset: int, bar
) -> None:
    """Write a tensor split along dim d >= 1 at `offset` of `fd`.

    As bytes, each piece is a matrix with one row per index of dims < d; an output
    row is the pieces' rows side by side. Blocks of output rows of at most about
    CHUNK_BYTES are assembled in `scratch` and written. Each piece's part of a block
    is read straight into place, one `preadv` segment per row; pieces whose rows are
    narrower than `SCATTER_MIN_BYTES` (too many segments) are read whole and
    interleaved with numpy instead."""
    dim = plan.tp_dim
    shape = plan.pieces[0].shape
    widths = [math.prod(piece.shape[dim:]) * plan.spec.itemsize for piece in plan.pieces]
    width = sum(widths)
    per_row = math.prod(shape[1:dim])  # matrix rows per dim-0 index
    if width == 0 or per_row == 0:
        return
    scatter = min(w for w in widths if w) >= SCATTER_MIN_BYTES and hasattr(os, "preadv")
    if not scatter:
        import numpy
    fds = shards.fds([piece.path for piece in plan.pieces])
    step = max(1, CHUNK_BYTES // width)
    for begin, end in _kept_rows(plan, shape[0]):
        for low in range(begin * per_row, end * per_row, step):
            count = min(step, end * per_row - low)
            block = scratch.get(0, count * width)
            matrix = None if scatter else numpy.frombuffer(block, numpy.uint8).reshape(count, -1)
            column = 0
            for piece, piece_fd, piece_width in zip(plan.pieces, fds, widths, strict=True):
                start = piece.start + low * piece_width
                if piece_width and scatter:
                    rows = range(column, count * width, width)
                    views = [block[row : row + piece_width] for row in rows]
                    _preadv_all(piece_fd, views, start, piece.path)
                elif piece_width:
                    part = scratch.get(1, count * piece_width)
                    _read_into(piece_fd, part, start, piece.path)
                    part_matrix = numpy.frombuffer(part, numpy.uint8).reshape(count, -1)
                    matrix[:, column : column + piece_width] = part_matrix
                column += piece_width
            _write_all(fd, block, offset)
            offset += count * width
            bar.update(count * width)


def _write_tensor(
    plan: _TensorPlan,
    shards: _ShardFiles,
    copier: _ByteCopier,
    scratch: _Scratch,
    fd: int,
    offset: int,
    bar,
) -> None:
    """Write the tensor's bytes at `offset` of `fd`."""
    if plan.tp_dim not in (None, 0):
        _interleave(plan, shards, scratch, fd, offset, bar)
        return
    for piece, start, length in _byte_ranges(plan):
        (source,) = shards.fds([piece.path])
        copier.copy(source, piece.start + start, fd, offset, length, bar)
        offset += length


# --- the sha256 check -------------------------------------------------------------------------


class _Verifier:
    """Checks every file of the checkpoint against its sha256 in the manifest, on
    background threads (hashing releases the GIL), largest files first."""

    def __init__(self, root: Path, files: Mapping[str, Mapping[str, Any]]) -> None:
        self._root = root
        self._order = list(files)
        self._files = files
        self._todo = sorted(files, key=lambda rel: -files[rel]["bytes"])
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._mismatched: list[str] = []
        self._errors: list[BaseException] = []
        self._failure: BaseException | None = None
        workers = min(len(self._todo), max(1, os.cpu_count() or 1), 8)
        self._threads = [
            threading.Thread(target=self._work, name=f"sha256-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        buffer = bytearray(HASH_BYTES)
        view = memoryview(buffer)
        while not self._stop.is_set():
            with self._lock:
                if not self._todo:
                    return
                rel = self._todo.pop(0)
            try:
                digest = hashlib.sha256()
                with (self._root / rel).open("rb", buffering=0) as handle:
                    while (got := handle.readinto(buffer)) and not self._stop.is_set():
                        digest.update(view[:got])
                if not self._stop.is_set() and digest.hexdigest() != self._files[rel]["sha256"]:
                    with self._lock:
                        self._mismatched.append(rel)
                    self._stop.set()
            except BaseException as error:  # reported by `failure`
                with self._lock:
                    self._errors.append(error)
                self._stop.set()

    def failure(self, *, wait: bool) -> BaseException | None:
        """The error to raise, if any so far (with `wait`: once every file is hashed): a
        CheckpointError for a mismatch (the first file in manifest order), or a read
        error. The same object every time."""
        if wait:
            for thread in self._threads:
                thread.join()
        with self._lock:
            if self._failure is None and self._mismatched:
                first = min(self._mismatched, key=self._order.index)
                self._failure = CheckpointError(
                    f"{self._root / first} does not match its sha256 in the manifest"
                )
            elif self._failure is None and self._errors:
                self._failure = self._errors[0]
            return self._failure

    def cancel(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


# --- the whole checkpoint ---------------------------------------------------------------------


def _check_output_dir(root: Path, manifest: Mapping[str, Any], output_dir: Path) -> None:
    """Refuse an output folder whose replacement would delete part of the checkpoint."""
    out = output_dir.resolve()
    checkpoint = root.resolve()
    listed = [(root / rel).resolve() for rel in manifest["files"]]
    if out == checkpoint or out in checkpoint.parents or any(out in p.parents for p in listed):
        raise CheckpointError(
            f"output folder {output_dir} would replace files of the checkpoint {root}"
        )
    if output_dir.exists() and not output_dir.is_dir():
        raise CheckpointError(f"output {output_dir} exists and is not a folder")


def _copy_model_files(root: Path, dest: Path) -> None:
    shutil.copy2(root / "config.json", dest / "config.json")
    if (root / "generation_config.json").is_file():
        shutil.copy2(root / "generation_config.json", dest / "generation_config.json")
    tokenizer = root / "tokenizer"
    if tokenizer.is_dir():
        for item in tokenizer.iterdir():
            if item.is_dir():
                shutil.copytree(item, dest / item.name)
            else:
                shutil.copy2(item, dest / item.name)


class _NoBar:
    """Stands in for tqdm when no progress is shown (and tqdm is not imported)."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _Progress:
    """A tqdm bar on stderr, created once tqdm is imported: the import (about 0.1 s, most
    of it `importlib.metadata` finding tqdm's version) runs on a thread while the first
    bytes are copied, and what is counted meanwhile shows as the bar's start."""

    def __init__(self, total: int, desc: str) -> None:
        self._options = {
            "total": total,
            "unit": "B",
            "unit_scale": True,
            "desc": desc,
            "file": sys.stderr,
        }
        self._bar: Any = None
        self._count = 0
        self._postfix: str | None = None
        self._loader = threading.Thread(target=self._load, name="import-tqdm", daemon=True)
        self._loader.start()

    @staticmethod
    def _load() -> None:
        with contextlib.suppress(ImportError):  # raised again, with its traceback, below
            import tqdm  # noqa: F401

    def _ready(self, *, wait: bool = False) -> bool:
        if self._bar is None and (wait or not self._loader.is_alive()):
            self._loader.join()
            from tqdm import tqdm

            self._bar = tqdm(initial=self._count, **self._options)
            if self._postfix is not None:
                self._bar.set_postfix_str(self._postfix, refresh=False)
        return self._bar is not None

    def update(self, n: int = 1) -> None:
        if self._ready():
            self._bar.update(n)
        else:
            self._count += n

    def set_postfix_str(self, text: str) -> None:
        self._postfix = text
        if self._ready():
            self._bar.set_postfix_str(text, refresh=False)

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self._ready(wait=True)
        self._bar.close()


def _write_weights(
    root: Path, partial: Path, plans: list[_TensorPlan], limit: int, bar, verifier
) -> list[str]:
    """Write the weight files (and the index, past one file) into `partial`."""
    groups = _split_into_files(plans, limit)
    names = _file_names(len(groups))
    shards = _ShardFiles()
    copier = _ByteCopier()
    scratch = _Scratch()
    done = 0
    try:
        for file_name, group in zip(names, groups, strict=True):
            by_name = {plan.spec.name: plan for plan in group}
            with SafetensorsWriter(
                partial / file_name, [p.spec for p in group], metadata={"format": "pt"}
            ) as writer:
                for name in writer.names:
                    offset = writer.data_offset(name)
                    _write_tensor(
                        by_name[name], shards, copier, scratch, writer.fileno(), offset, bar
                    )
                    writer.mark_written(name)
                    done += 1
                    bar.set_postfix_str(f"{done}/{len(plans)} tensors, {file_name}")
                    if verifier is not None and (failure := verifier.failure(wait=False)):
                        raise failure
    finally:
        shards.close()
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(plan.spec.nbytes for plan in plans)},
            "weight_map": {
                plan.spec.name: file_name
                for file_name, group in zip(names, groups, strict=True)
                for plan in group
            },
        }
        (partial / SAFE_WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names


def consolidate_checkpoint(
    checkpoint: str | Path,
    output_dir: str | Path,
    *,
    verify: bool = True,
    max_shard_size: int | str = "5GB",
    progress: bool = True,
) -> dict[str, Any]:
    """Write the full model of `checkpoint` to `output_dir`, streaming; returns a summary.

    `checkpoint` is a checkpoint folder, its `shards/` folder or a run folder (its
    latest complete checkpoint). `verify` checks every file's sha256 (while the
    weights are written; the output is kept only if all match; sizes are always
    checked first). Weight files hold at most `max_shard_size` bytes of tensor data
    (an int, or "5GB", "500MB", "2GiB"; a tensor larger than that gets a file of its
    own). `progress` shows a bar on stderr. The folder is written as
    `<output_dir>.partial` and swapped into place at the end, replacing an old one.
    The summary names the weight `files` and their `total_size` (bytes of tensor data).
    Raises CheckpointError (checkpoint problems) or ValueError (`max_shard_size`)."""
    limit = parse_size(max_shard_size)
    root = resolve_checkpoint(Path(checkpoint))
    manifest = read_manifest(root, verify=False)  # sizes; the hashes are checked below
    output_dir = Path(output_dir)
    _check_output_dir(root, manifest, output_dir)
    verifier = _Verifier(root, manifest["files"]) if verify else None
    partial = output_dir.with_name(output_dir.name + ".partial")
    try:
        plans = _plan_tensors(root, manifest)
        total_size = sum(plan.spec.nbytes for plan in plans)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            desc = f"consolidating step {manifest['step']}"
            with _Progress(total_size, desc) if progress else _NoBar() as bar:
                names = _write_weights(root, partial, plans, limit, bar, verifier)
            _copy_model_files(root, partial)
            if verifier is not None and (failure := verifier.failure(wait=True)):
                raise failure
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    except Exception as error:
        # A corrupted file may show first as a malformed header: name the real cause.
        if verifier is not None:
            failure = verifier.failure(wait=True)
            if isinstance(failure, CheckpointError) and failure is not error:
                raise failure from error
        raise
    except BaseException:  # KeyboardInterrupt: stop hashing now
        if verifier is not None:
            verifier.cancel()
        raise

    # Swap: an old output stays whole, moved aside, until the new one is in place.
    if output_dir.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.old-", dir=output_dir.parent))
        os.replace(output_dir, aside / output_dir.name)
        os.replace(partial, output_dir)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(partial, output_dir)
    return {
        "checkpoint": str(root),
        "step": manifest["step"],
        "output_dir": str(output_dir),
        "num_tensors": len(plans),
        "num_parameters": sum(math.prod(plan.spec.shape) for plan in plans),
        "layout": manifest["layout"],
        "files": names,
        "total_size": total_size,
    }


def drop_kv_copies(full: torch.Tensor, copies: int, head_dim: int, shape: list[int]):
    """Keep one of each run of `copies` identical KV heads along dim 0 (in memory)."""
    heads = full.shape[0] // (copies * head_dim)
    if heads * copies * head_dim != full.shape[0]:
        raise CheckpointError(f"cannot undo KV replication of a {list(full.shape)} tensor")
    return full.reshape(heads, copies, head_dim, *full.shape[1:])[:, 0].reshape(shape)
