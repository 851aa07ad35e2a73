"""The whole checkpoint: check the output folder, plan, write the weights and the model
files into `<output_dir>.partial`, and swap that into place only once all is written
(and, with `verify`, every checkpoint file matched its sha256)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from meshtrain.checkpoint import files
from meshtrain.checkpoint.consolidate.convert import FLOATING
from meshtrain.checkpoint.consolidate.plan import (
    TensorPlan,
    file_names,
    plan_tensors,
    split_into_files,
)
from meshtrain.checkpoint.consolidate.progress import Bar, NoBar, Progress
from meshtrain.checkpoint.consolidate.rebuild import TensorWriter
from meshtrain.checkpoint.consolidate.verify import Verifier
from meshtrain.checkpoint.manifest import CheckpointError, read_manifest, resolve_checkpoint
from meshtrain.checkpoint.safetensors_format import SafetensorsWriter
from meshtrain.config import ConsolidationConfig

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


DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


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


def _copy_model_files(root: Path, dest: Path, dtype: str | None, listed: Iterable[str]) -> None:
    """The config, generation config and tokenizer files a Hugging Face folder needs; the
    config says the weights' dtype when `dtype` cast them. Only tokenizer files the manifest
    lists are copied (read_manifest checked they lie in the folder and the verifier hashes
    them): anything else found there, a symlink out of the folder say, is left behind."""
    if dtype is None:
        shutil.copy2(root / files.MODEL_CONFIG, dest / files.MODEL_CONFIG)
    else:
        config = json.loads((root / files.MODEL_CONFIG).read_text())
        config["dtype"] = dtype
        config.pop("torch_dtype", None)  # transformers < 4.56 spelled it so
        (dest / files.MODEL_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if (root / files.GENERATION_CONFIG).is_file():
        shutil.copy2(root / files.GENERATION_CONFIG, dest / files.GENERATION_CONFIG)
    for rel in sorted(listed):
        inside = rel.removeprefix(files.TOKENIZER + "/")
        if inside != rel:
            (dest / inside).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, dest / inside)


def _write_weights(
    partial: Path, plans: list[TensorPlan], limit: int, bar: Bar, verifier: Verifier | None
) -> list[str]:
    """Write the weight files (and the index, past one file) into `partial`."""
    groups = split_into_files(plans, limit)
    names = file_names(len(groups))
    tensors = TensorWriter()
    done = 0
    try:
        for file_name, group in zip(names, groups, strict=True):
            by_name = {plan.spec.name: plan for plan in group}
            with SafetensorsWriter(
                partial / file_name, [p.written for p in group], metadata={"format": "pt"}
            ) as writer:
                for name in writer.names:
                    tensors.write(by_name[name], writer.fileno(), writer.data_offset(name), bar)
                    writer.mark_written(name)
                    done += 1
                    bar.set_postfix_str(f"{done}/{len(plans)} tensors, {file_name}")
                    if verifier is not None and (failure := verifier.failure(wait=False)):
                        raise failure
    finally:
        tensors.close()
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(plan.written.nbytes for plan in plans)},
            "weight_map": {
                plan.spec.name: file_name
                for file_name, group in zip(names, groups, strict=True)
                for plan in group
            },
        }
        (partial / files.HF_WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names


def swap_into_place(partial: Path, output_dir: Path) -> None:
    """Replace `output_dir` with `partial`; an old output stays whole, moved aside, until
    the new one is in place."""
    if output_dir.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.old-", dir=output_dir.parent))
        os.replace(output_dir, aside / output_dir.name)
        os.replace(partial, output_dir)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(partial, output_dir)


def consolidate_checkpoint(
    checkpoint: str | Path,
    output_dir: str | Path,
    *,
    verify: bool = True,
    max_shard_size: int | str = ConsolidationConfig.max_shard_size,
    progress: bool = True,
    dtype: str | None = None,
) -> dict[str, Any]:
    """Write the full model of `checkpoint` to `output_dir`, streaming; returns a summary.

    `checkpoint` is a checkpoint folder, its `shards/` folder or a run folder (its
    latest complete checkpoint). `verify` checks every file's sha256 (while the
    weights are written; the output is kept only if all match; sizes are always
    checked first). Weight files hold at most `max_shard_size` bytes of tensor data
    (an int, or "5GB", "500MB", "2GiB"; a tensor larger than that gets a file of its
    own). `progress` shows a bar on stderr. The folder is written as
    `<output_dir>.partial` and swapped into place at the end, replacing an old one.
    `dtype` ("float32", "bfloat16", "float16"): write the floating-point tensors in it
    (default: as stored; a bf16_master run stores its fp32 master weights).
    The summary names the weight `files` and their `total_size` (bytes of tensor data).
    Raises CheckpointError (checkpoint problems) or ValueError (`max_shard_size`, `dtype`)."""
    limit = parse_size(max_shard_size)
    dtype = check_dtype(dtype)
    root = resolve_checkpoint(Path(checkpoint))
    manifest = read_manifest(root, verify=False)  # sizes; the hashes are checked below
    output_dir = Path(output_dir)
    _check_output_dir(root, manifest, output_dir)
    verifier = Verifier(root, manifest["files"]) if verify else None
    partial = output_dir.with_name(output_dir.name + ".partial")
    try:
        plans = plan_tensors(root, manifest, dtype)
        total_size = sum(plan.written.nbytes for plan in plans)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            desc = f"consolidating step {manifest['step']}"
            read_size = sum(plan.spec.nbytes for plan in plans)
            with Progress(read_size, desc) if progress else NoBar() as bar:
                names = _write_weights(partial, plans, limit, bar, verifier)
            _copy_model_files(root, partial, dtype, manifest["files"])
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

    swap_into_place(partial, output_dir)
    return {
        "checkpoint": str(root),
        "step": manifest["step"],
        "output_dir": str(output_dir),
        "num_tensors": len(plans),
        "num_parameters": sum(math.prod(plan.spec.shape) for plan in plans),
        "layout": manifest["layout"],
        "files": names,
        "total_size": total_size,
        "dtype": sorted({plan.written.dtype_name for plan in plans}),
    }


def check_dtype(dtype: str | None) -> str | None:
    """The canonical name of a `--dtype` (fp32 / bf16 / fp16 spelled any usual way)."""
    if dtype is None:
        return None
    name = DTYPE_ALIASES.get(str(dtype).lower().removeprefix("torch."), str(dtype))
    if name not in FLOATING:
        raise ValueError(
            f"cannot write the model as {dtype!r}: use float32 (fp32), bfloat16 (bf16) or "
            "float16 (fp16)"
        )
    return name
