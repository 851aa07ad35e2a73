"""Merge a sharded checkpoint into a plain Hugging Face model folder, one tensor at a time.

The output loads with `AutoModelForCausalLM.from_pretrained` and no meshtrain
import: `config.json`, the weights, and the tokenizer files. The weights are
`model.safetensors`, or, past `max_shard_size`, `model-0000i-of-0000N.safetensors`
files with a `model.safetensors.index.json` that maps each tensor to its file.

Consolidation streams: every shape and dtype is in the manifest, so each output
file's header is written before any tensor data is read; then, tensor by
tensor, the shard files are opened memory-mapped, the full tensor is rebuilt
(tensor-parallel pieces concatenated along the manifest's `tp_dim`, replicated
KV heads kept once) in row blocks of at most `CHUNK_BYTES`, its bytes are
appended to the output file, and the shard files are closed again, which
releases their mapped pages. Peak memory stays near one full tensor (its mapped
pieces) plus one row block, whatever the model's size.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from meshtrain.checkpoint.manifest import (
    CheckpointError,
    read_manifest,
    resolve_checkpoint,
    shard_dir_name,
)

SAFE_WEIGHTS = "model.safetensors"
SAFE_WEIGHTS_INDEX = "model.safetensors.index.json"
CHUNK_BYTES = 16 * 2**20  # the largest row block assembled at once

# torch dtype -> safetensors dtype code (the `dtype` field of a file header).
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

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


# --- the safetensors writer -----------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's name, dtype and shape: all a safetensors header needs."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(size) for size in self.shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class SafetensorsWriter:
    """Write a .safetensors file whose tensors are all declared up front, data afterwards.

    Layout: an 8-byte little-endian header length N; N bytes of JSON (padded with
    spaces so the data starts 8-byte aligned) giving each tensor's dtype, shape
    and `data_offsets` relative to the data section; then the raw little-endian
    tensor bytes. Data is ordered by descending element size (stable, so specs
    of one dtype keep their order), which keeps every tensor aligned to its
    element size; `names` is that order. `write` takes a whole tensor, or its
    bytes in consecutive pieces (row blocks), and accepts the tensors in any
    order, though `names` order writes the file sequentially.

        with SafetensorsWriter(path, specs, metadata={"format": "pt"}) as writer:
            for name in writer.names:
                writer.write(name, tensors[name])
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
        ordered = sorted(specs, key=lambda spec: -spec.dtype.itemsize)
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        self._specs: dict[str, TensorSpec] = {}
        self._offsets: dict[str, int] = {}
        offset = 0
        for spec in ordered:
            if spec.name in self._specs or spec.name == "__metadata__":
                raise ValueError(f"tensor name {spec.name!r} is repeated or reserved")
            if spec.dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"safetensors has no code for dtype {spec.dtype}")
            self._specs[spec.name] = spec
            self._offsets[spec.name] = offset
            header[spec.name] = {
                "dtype": SAFETENSORS_DTYPES[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        self.data_size = offset
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self._data_start = 8 + len(encoded)
        self._written: set[str] = set()
        self._file = self.path.open("wb")
        self._file.write(struct.pack("<Q", len(encoded)))
        self._file.write(encoded)

    @property
    def names(self) -> list[str]:
        """The tensors in the order their data lies in the file."""
        return list(self._specs)

    def write(self, name: str, data: torch.Tensor | Iterable[torch.Tensor]) -> int:
        """Write tensor `name`: a tensor of its shape, or pieces whose bytes, in order,
        are the tensor's (row-major). Returns the bytes written."""
        spec = self._specs.get(name)
        if spec is None:
            raise KeyError(f"{name!r} is not one of the tensors declared for {self.path}")
        if name in self._written:
            raise ValueError(f"tensor {name!r} was already written to {self.path}")
        if isinstance(data, torch.Tensor):
            if tuple(data.shape) != spec.shape:
                raise ValueError(f"tensor {name!r} has shape {list(data.shape)}, not {spec.shape}")
            data = [data]
        self._file.seek(self._data_start + self._offsets[name])
        written = 0
        for piece in data:
            if piece.dtype != spec.dtype:
                raise ValueError(f"tensor {name!r} is {spec.dtype}, got a {piece.dtype} piece")
            size = piece.numel() * piece.element_size()
            if written + size > spec.nbytes:
                raise ValueError(f"tensor {name!r} got more than its {spec.nbytes} bytes")
            if size:
                flat = piece.detach().reshape(-1)
                if not flat.is_contiguous():  # pragma: no cover - reshape(-1) is contiguous
                    flat = flat.contiguous()
                self._file.write(memoryview(flat.view(torch.uint8).cpu().numpy()))
            written += size
        if written != spec.nbytes:
            raise ValueError(f"tensor {name!r} got {written} of its {spec.nbytes} bytes")
        self._written.add(name)
        return written

    def close(self) -> None:
        """Close the file; raises if a declared tensor was not written."""
        if self._file.closed:
            return
        self._file.close()
        missing = [name for name in self._specs if name not in self._written]
        if missing:
            raise ValueError(f"{self.path} is missing the data of {missing}")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()


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
class _TensorPlan:
    """How to rebuild one full tensor from its shard pieces."""

    spec: TensorSpec
    pp_rank: int
    tp_ranks: tuple[int, ...]  # the ranks holding a piece, concatenated in this order
    tp_dim: int | None
    kv_copies: int
    kv_head_dim: int | None


def _dtype_of(name: str, meta: Mapping[str, Any]) -> torch.dtype:
    dtype = getattr(torch, str(meta.get("dtype")), None)
    if not isinstance(dtype, torch.dtype) or dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"tensor {name} has dtype {meta.get('dtype')!r}, not one to save")
    return dtype


def _shard_path(root: Path, tp_rank: int, pp_rank: int) -> Path:
    return root / "shards" / shard_dir_name(tp_rank, pp_rank) / SAFE_WEIGHTS


def _plan_tensors(root: Path, manifest: Mapping[str, Any]) -> list[_TensorPlan]:
    """Check every tensor against the shard headers (no data is read), in manifest order."""
    tp = manifest["layout"]["tensor_parallel_size"]
    plans = []
    with ExitStack() as stack:
        headers: dict[tuple[int, int], tuple[Any, set[str]]] = {}

        def header(tp_rank: int, pp_rank: int):
            key = (tp_rank, pp_rank)
            if key not in headers:
                path = _shard_path(root, tp_rank, pp_rank)
                if not path.is_file():
                    raise CheckpointError(f"missing shard file {path}")
                handle = stack.enter_context(safe_open(str(path), framework="pt"))
                headers[key] = (handle, set(handle.keys()))
            return headers[key]

        for name, meta in manifest["tensors"].items():
            dtype = _dtype_of(name, meta)
            tp_dim = meta["tp_dim"]
            ranks = (0,) if tp_dim is None else tuple(range(tp))
            shapes = []
            for tp_rank in ranks:
                handle, keys = header(tp_rank, meta["pp_rank"])
                if name not in keys:
                    path = _shard_path(root, tp_rank, meta["pp_rank"])
                    raise CheckpointError(f"tensor {name} is missing from shard file {path}")
                piece = handle.get_slice(name)
                if piece.get_dtype() != SAFETENSORS_DTYPES[dtype]:
                    raise CheckpointError(
                        f"tensor {name} is stored as {piece.get_dtype()}, "
                        f"the manifest says {meta['dtype']}"
                    )
                shapes.append(list(piece.get_shape()))
            shape = _rebuilt_shape(name, shapes, tp_dim)
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
                    meta["pp_rank"],
                    ranks,
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


class _Scratch:
    """One buffer reused for every assembled row block of every tensor: blocks allocated
    and freed one by one would leave the C allocator holding on to freed memory."""

    def __init__(self) -> None:
        self._raw = torch.empty(0, dtype=torch.uint8)

    def get(self, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self._raw.numel():
            self._raw = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self._raw = torch.empty(nbytes, dtype=torch.uint8)
        return self._raw[:nbytes].view(dtype).view(shape)


def _row_blocks(
    plan: _TensorPlan, pieces: list[torch.Tensor], scratch: _Scratch
) -> Iterator[torch.Tensor]:
    """The full tensor's bytes as consecutive row blocks of at most about CHUNK_BYTES
    (a block assembled from pieces split along a later dim lives in `scratch`)."""
    if pieces[0].dim() == 0:
        yield pieces[0]
        return
    starts = [0]
    for piece in pieces:
        starts.append(starts[-1] + piece.shape[0])
    rows = starts[-1] if plan.tp_dim == 0 else pieces[0].shape[0]
    # Only dim 0 changes between the concatenation and the full tensor (KV copies).
    row_bytes = math.prod(plan.spec.shape[1:]) * plan.spec.dtype.itemsize
    step = max(1, CHUNK_BYTES // max(row_bytes, 1))
    if plan.tp_dim not in (None, 0):
        block_shape = list(pieces[0].shape)
        block_shape[0] = min(step, rows)
        block_shape[plan.tp_dim] = plan.spec.shape[plan.tp_dim]
        buffer = scratch.get(block_shape, plan.spec.dtype)
    for begin, end in _kept_rows(plan, rows):
        for low in range(begin, end, step):
            high = min(end, low + step)
            if plan.tp_dim is None:
                yield pieces[0][low:high]
            elif plan.tp_dim == 0:  # the pieces' rows follow one another: no copy needed
                for piece, start in zip(pieces, starts, strict=False):
                    lo, hi = max(low, start), min(high, start + piece.shape[0])
                    if lo < hi:
                        yield piece[lo - start : hi - start]
            else:
                block = buffer[: high - low]
                torch.cat([piece[low:high] for piece in pieces], dim=plan.tp_dim, out=block)
                yield block


def _write_tensor(
    writer: SafetensorsWriter, root: Path, plan: _TensorPlan, scratch: _Scratch, bar: tqdm
) -> None:
    """Open the tensor's shard files, stream it into `writer`, close them (unmapping them)."""
    with ExitStack() as stack:
        pieces = []
        for tp_rank in plan.tp_ranks:
            path = _shard_path(root, tp_rank, plan.pp_rank)
            handle = stack.enter_context(safe_open(str(path), framework="pt"))
            pieces.append(handle.get_tensor(plan.spec.name))

        def counted() -> Iterator[torch.Tensor]:
            for block in _row_blocks(plan, pieces, scratch):
                yield block
                bar.update(block.numel() * block.element_size())

        writer.write(plan.spec.name, counted())
        pieces.clear()


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
    latest complete checkpoint). `verify` checks every file's sha256 first (sizes
    are always checked). Weight files hold at most `max_shard_size` bytes of
    tensor data (an int, or "5GB", "500MB", "2GiB"; a tensor larger than that gets
    a file of its own). `progress` shows a bar on stderr. The folder is written as
    `<output_dir>.partial` and swapped into place at the end, replacing an old one.
    The summary names the weight `files` and their `total_size` (bytes of tensor data).
    Raises CheckpointError (checkpoint problems) or ValueError (`max_shard_size`)."""
    limit = parse_size(max_shard_size)
    root = resolve_checkpoint(Path(checkpoint))
    manifest = read_manifest(root, verify=verify)
    output_dir = Path(output_dir)
    _check_output_dir(root, manifest, output_dir)
    plans = _plan_tensors(root, manifest)
    groups = _split_into_files(plans, limit)
    names = _file_names(len(groups))
    total_size = sum(plan.spec.nbytes for plan in plans)

    partial = output_dir.with_name(output_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        with tqdm(
            total=total_size,
            unit="B",
            unit_scale=True,
            desc=f"consolidating step {manifest['step']}",
            file=sys.stderr,
            disable=not progress,
        ) as bar:
            done = 0
            scratch = _Scratch()
            for file_name, group in zip(names, groups, strict=True):
                by_name = {plan.spec.name: plan for plan in group}
                with SafetensorsWriter(
                    partial / file_name, [p.spec for p in group], metadata={"format": "pt"}
                ) as writer:
                    for name in writer.names:
                        _write_tensor(writer, root, by_name[name], scratch, bar)
                        done += 1
                        bar.set_postfix_str(f"{done}/{len(plans)} tensors, {file_name}")
        if len(groups) > 1:
            index = {
                "metadata": {"total_size": total_size},
                "weight_map": {
                    plan.spec.name: file_name
                    for file_name, group in zip(names, groups, strict=True)
                    for plan in group
                },
            }
            (partial / SAFE_WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        _copy_model_files(root, partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
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
