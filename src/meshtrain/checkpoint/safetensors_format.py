"""The safetensors format, written and read without torch or the safetensors package.

A file is an 8-byte little-endian header length, that many bytes of JSON giving each
tensor's dtype, shape and `data_offsets` into the data section, then the raw bytes.
Knowing every shape and dtype up front (from the manifest), consolidation writes each
header before any tensor data and then fills the data section in place.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshtrain.checkpoint import files
from meshtrain.checkpoint.fileio import write_all
from meshtrain.checkpoint.manifest import CheckpointError

if TYPE_CHECKING:  # pragma: no cover
    import torch

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


def dtype_name(dtype: Any) -> str:
    """The canonical name ("float32", "bfloat16") of a torch dtype, a dtype name or a
    safetensors code ("F32"); raises ValueError for one safetensors cannot store."""
    name = str(dtype).removeprefix("torch.")
    name = _ALIASES.get(name, _CODE_NAMES.get(name, name))
    if name not in _DTYPES:
        raise ValueError(f"safetensors has no code for dtype {dtype}")
    return name


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


def _header_bytes(
    specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None
) -> tuple[bytes, list[TensorSpec], dict[str, int], int]:
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
            write_all(self._fd, header, 0)
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
                self._write_piece(piece, start + written)
            written += size
        if written != spec.nbytes:
            raise ValueError(f"tensor {name!r} got {written} of its {spec.nbytes} bytes")
        self._written.add(name)
        return written

    def _write_piece(self, piece: torch.Tensor, offset: int) -> None:
        """One tensor's bytes at `offset`, from host memory (`host_copy`: an accelerator's
        through a reused pinned buffer)."""
        from meshtrain.checkpoint.host_copy import host_bytes  # noqa: PLC0415 (torch)

        flat = piece.detach().reshape(-1).contiguous().view(sys.modules["torch"].uint8)
        for raw in host_bytes(flat):
            try:
                write_all(self._fd, raw, offset)
            except OSError as error:  # pwrite names no file: say which
                raise OSError(error.errno, error.strerror, str(self.path)) from error
            offset += raw.nbytes

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

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
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


def folder_weight_files(folder: str | Path) -> dict[str, Path] | None:
    """A Hugging Face folder's tensor name -> the safetensors file holding it (one file, or
    the index's map); None when it holds neither."""
    folder = Path(folder)
    index = folder / files.HF_WEIGHTS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / files.HF_WEIGHTS
    if single.is_file():
        return dict.fromkeys(read_safetensors_header(single), single)
    return None
