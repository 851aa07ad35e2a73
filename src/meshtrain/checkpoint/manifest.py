"""A checkpoint's JSON manifest (every tensor, every file's size and sha256) and its
completion marker; finding complete checkpoints. The folder's names are in `files`.

A checkpoint without `COMPLETE` is a half-written one and is never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

from meshtrain.checkpoint.files import CHECKPOINT_RE, MANIFEST, MARKER
from meshtrain.config import Refused

FORMAT = "meshtrain-checkpoint"
FORMAT_VERSION = 1


class CheckpointError(Refused, RuntimeError):
    """A checkpoint is incomplete, corrupted or not a meshtrain checkpoint."""


def write_json_atomic(path: Path, payload: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def describe_files(root: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under `root` except the manifest and marker."""
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel in (MANIFEST, MARKER) or rel.endswith(".tmp"):
            continue
        files[rel] = {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
    return files


def mark_complete(root: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest, then the marker: the marker's presence means all is on disk."""
    write_json_atomic(root / MANIFEST, manifest)
    tmp = root / (MARKER + ".tmp")
    tmp.write_text(f"{manifest['step']}\n")
    os.replace(tmp, root / MARKER)


def is_complete(root: Path) -> bool:
    return (root / MARKER).is_file() and (root / MANIFEST).is_file()


def read_manifest(root: Path, *, verify: bool = True) -> dict[str, Any]:
    """Load and check a checkpoint's manifest; with `verify`, sizes and hashes too."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a folder")
    if not is_complete(root):
        raise CheckpointError(
            f"{root} has no {MARKER} marker: it was not completely written; "
            "use an earlier checkpoint"
        )
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        message = f"{root / MANIFEST} is not valid JSON (cut short?): {error}"
        raise CheckpointError(message) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{root / MANIFEST} is not a {FORMAT} manifest")
    if manifest.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{root} was written by a newer meshtrain (format {manifest['version']})"
        )
    listed = manifest.get("files")
    if not isinstance(listed, dict) or not all(
        isinstance(meta, dict) and isinstance(meta.get("bytes"), int) for meta in listed.values()
    ):
        raise CheckpointError(f"{root / MANIFEST} has no valid `files` list (name: bytes, sha256)")
    resolved_root = root.resolve()
    for rel, meta in listed.items():
        # Checked before the file is opened or even stat'ed: "../x", "/etc/passwd" and
        # symlinks out of the folder are refused without touching what they name.
        path = (root / rel).resolve()
        if resolved_root not in path.parents:
            raise CheckpointError(f"manifest entry {rel!r} points outside {root}")
        if not path.is_file():
            raise CheckpointError(f"{root / rel} is listed in the manifest but missing")
        if path.stat().st_size != meta["bytes"]:
            raise CheckpointError(
                f"{root / rel} has {path.stat().st_size} bytes, the manifest says {meta['bytes']}"
            )
        if verify and sha256_of(path) != meta["sha256"]:
            raise CheckpointError(f"{root / rel} does not match its sha256 in the manifest")
    return manifest


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint in a run folder, oldest first."""
    found = []
    for child in Path(run_dir).iterdir() if Path(run_dir).is_dir() else []:
        match = CHECKPOINT_RE.match(child.name)
        if match and is_complete(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def resolve_checkpoint(path: Path) -> Path:
    """Accept a checkpoint folder, its `shards/` folder, or a run folder (its latest)."""
    path = Path(path)
    if path.name == "shards":
        path = path.parent
    if (path / MANIFEST).exists() or CHECKPOINT_RE.match(path.name):
        return path
    complete = list_checkpoints(path)
    if not complete:
        raise CheckpointError(f"no complete checkpoint-<step> folder in {path}")
    return complete[-1][1]


def find_resume_checkpoint(output_dir: Path, resume_from: str, run_name: str | None) -> Path:
    """Resolve `training.resume_from`: `latest`, or a checkpoint / run folder.

    `latest` is the newest complete checkpoint of run `run_name` if it is set,
    else of any run under `output_dir` (by when its marker was written).
    Half-written checkpoints are skipped with a warning.
    """
    if resume_from != "latest":
        path = Path(resume_from)
        if not path.exists():
            raise CheckpointError(f"training.resume_from: {path} does not exist")
        path = resolve_checkpoint(path)
        if not is_complete(path):
            raise CheckpointError(
                f"training.resume_from: {path} has no {MARKER} marker (it was not completely "
                "written); use an earlier checkpoint or `latest`"
            )
        return checked_for_resume(path)
    runs = [Path(output_dir) / run_name] if run_name else sorted(Path(output_dir).glob("*/"))
    complete, partial = [], []
    for run in runs:
        for child in run.glob("checkpoint-*") if run.is_dir() else []:
            (complete if is_complete(child) else partial).append(child)
    if not complete:
        raise CheckpointError(
            f"training.resume_from=latest: no complete checkpoint under "
            f"{Path(output_dir) / (run_name or '*')}"
        )
    newest = max(complete, key=lambda c: (c / MARKER).stat().st_mtime)
    for child in partial:
        warnings.warn(
            f"skipping {child}: no {MARKER} marker (a checkpoint interrupted while saving)",
            stacklevel=2,
        )
    return checked_for_resume(newest)


def checked_for_resume(path: Path) -> Path:
    """Before any worker starts: the manifest, its paths and every file's size (the workers
    check the sha256 when they restore; hashing here too would read the checkpoint twice)."""
    try:
        read_manifest(path, verify=False)
    except CheckpointError as error:
        raise CheckpointError(f"training.resume_from: {error}") from None
    return path
