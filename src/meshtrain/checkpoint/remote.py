"""Checkpoints and models on object storage: any fsspec URL (`s3://`, `gs://`, ...).

A checkpoint bound for a bucket is written as a local one would be, into a staging
folder in host memory, and each rank then streams its own files up (a multipart upload:
no second copy on local disk), hashing them on the way for the manifest. A bucket has no
folders and no rename, but a single object appears whole or not at all: `manifest.json`
and then `COMPLETE` are written last, so a checkpoint without its marker is never used,
as on a local disk.

Reading goes the other way: what a run resumes from or starts from (`model.init_from`),
and what consolidation reads, is downloaded once per node into a local folder, and the
rest of meshtrain reads local files. Credentials and endpoints come from the
filesystem's usual environment and config files (for S3: `AWS_ACCESS_KEY_ID`,
`AWS_ENDPOINT_URL`, `~/.aws/config`), never from meshtrain's parameters.

fsspec (and s3fs, gcsfs) are imported only when a URL is used.
"""

from __future__ import annotations

import functools
import hashlib
import json
import posixpath
import re
import shutil
from pathlib import Path
from typing import Any

from meshtrain.checkpoint.files import CHECKPOINT_RE, MANIFEST, MARKER
from meshtrain.checkpoint.manifest import CheckpointError

_URL_RE = re.compile(r"^([a-z][a-z0-9+.-]*)://", re.IGNORECASE)
# Each part of a streamed upload: S3's multipart minimum is 5 MiB.
CHUNK_BYTES = 8 << 20
# The package each usual protocol needs, for the refusal when it is missing.
_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs"}
# The local folders of what lives on object storage, by scheme, bucket and key: a run's
# logs, staging and the checkpoint it resumes from; a consolidated model's copy.
LOCAL_COPIES = Path("data/06_models/remote")


def is_url(location: str | Path | None) -> bool:
    """A URL of a filesystem other than the local one (`file://` is local)."""
    if location is None or isinstance(location, Path):
        return False
    match = _URL_RE.match(str(location))
    return bool(match) and match.group(1).lower() not in ("file", "local")


def join(url: str, *parts: str) -> str:
    return posixpath.join(url.rstrip("/"), *parts)


def parent(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[0]


def name(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of `url` and the path in it; a missing protocol package is
    refused in one line naming what to install."""
    import fsspec  # noqa: PLC0415 (only a run on object storage needs it)

    protocol = _URL_RE.match(url).group(1).lower()
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as error:
        package = _PACKAGES.get(protocol, f"the fsspec filesystem for {protocol}://")
        raise CheckpointError(
            f"{url}: reading and writing {protocol}:// needs {package} ({error}); "
            f"pip install {package}"
        ) from None
    fs.invalidate_cache()  # other processes write there: list afresh
    return fs, path


def storage_errors(verb: str, url_at: int = 0):
    """Turn what the storage's client raises (botocore's errors are not `OSError`s) into one
    line naming the URL (the `url_at`-th argument) and the storage's reason."""

    def wrap(function):
        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return function(*args, **kwargs)
            except CheckpointError:
                raise
            except Exception as error:  # noqa: BLE001 (every client's errors differ)
                text = str(error).strip()
                reason = text.splitlines()[0] if text else type(error).__name__
                raise CheckpointError(f"cannot {verb} {args[url_at]}: {reason}") from error

        return run

    return wrap


@storage_errors("write", url_at=1)
def upload_file(local: Path, url: str) -> dict[str, Any]:
    """Stream one file up in parts; its size and sha256 (hashed on the way)."""
    fs, path = filesystem(url)
    digest, size = hashlib.sha256(), 0
    with local.open("rb") as source, fs.open(path, "wb", block_size=CHUNK_BYTES) as target:
        while block := source.read(CHUNK_BYTES):
            digest.update(block)
            target.write(block)
            size += len(block)
    return {"bytes": size, "sha256": digest.hexdigest()}


def upload_folder(local: Path, url: str) -> dict[str, dict[str, Any]]:
    """Every file under `local` to the same place under `url`; each one's description
    (size, sha256) by its path relative to `local`."""
    described = {}
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        relative = path.relative_to(local).as_posix()
        described[relative] = upload_file(path, join(url, relative))
    return described


@storage_errors("write")
def write_text(url: str, text: str) -> None:
    """One small object, whole or not at all (a single PUT)."""
    fs, path = filesystem(url)
    fs.pipe_file(path, text.encode())


def mark_complete(url: str, manifest: dict[str, Any]) -> None:
    """The manifest, then the marker (as `manifest.mark_complete` does on a disk)."""
    write_text(join(url, MANIFEST), json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    write_text(join(url, MARKER), f"{manifest['step']}\n")


@storage_errors("read")
def read_text(url: str) -> str:
    fs, path = filesystem(url)
    return fs.cat_file(path).decode()


@storage_errors("read")
def exists(url: str) -> bool:
    fs, path = filesystem(url)
    return fs.exists(path)


@storage_errors("delete")
def remove(url: str) -> None:
    """Delete everything under `url` (nothing there is no error)."""
    fs, path = filesystem(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


@storage_errors("list")
def children(url: str) -> list[str]:
    """The URLs one level under `url` (none if it does not exist)."""
    fs, path = filesystem(url)
    protocol = _URL_RE.match(url).group(0)
    try:
        listed = fs.ls(path, detail=False, refresh=True)
    except FileNotFoundError:
        return []
    return [protocol + entry.rstrip("/") for entry in listed if entry.rstrip("/") != path]


def checkpoints(run_url: str) -> tuple[list[tuple[int, str]], list[str]]:
    """The complete checkpoints of a run (step, URL), oldest first, and the incomplete ones
    (no marker: a save interrupted or still being written)."""
    complete, partial = [], []
    for child in children(run_url):
        match = CHECKPOINT_RE.match(name(child))
        if match:
            if exists(join(child, MARKER)) and exists(join(child, MANIFEST)):
                complete.append((int(match.group(1)), child))
            else:
                partial.append(child)
    return sorted(complete), partial


@storage_errors("download")
def download_folder(url: str, local: Path) -> Path:
    """Everything under `url` into `local` (replacing what was there); `local`."""
    fs, path = filesystem(url)
    if not fs.isdir(path):
        raise CheckpointError(f"{url} is not a folder (no object under it)")
    shutil.rmtree(local, ignore_errors=True)
    local.mkdir(parents=True)
    for entry in fs.find(path):
        target = local / _inside(url, posixpath.relpath(entry, path))
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(entry, str(target))
    return local


def _inside(url: str, relative: str) -> str:
    """An object's path under the folder being copied; a key that climbs out of it
    (`../`, which S3 allows in a key) is refused before anything is written there."""
    if relative.startswith("../") or relative == ".." or posixpath.isabs(relative):
        raise CheckpointError(f"{url} holds an object outside it ({relative!r}); not copied")
    return relative


def local_folder(url: str, base: Path) -> Path:
    """A stable local folder for `url` under `base` (bucket and key as folders)."""
    scheme, rest = url.split("://", 1)
    return base / scheme / Path(*[part for part in rest.split("/") if part not in ("", "..")])


def find_resume(output_dir: str, resume_from: str, run_name: str | None) -> str:
    """`training.resume_from` on object storage: `latest` (the newest complete checkpoint
    of run `run_name`, else of any run under `output_dir`), or a checkpoint's or a run's
    URL (`find_checkpoint`)."""
    if resume_from != "latest":
        return find_checkpoint(resume_from, "training.resume_from")
    runs = [join(output_dir, run_name)] if run_name else children(output_dir)
    newest = [_newest(run) for run in runs]
    found = [entry for entry in newest if entry is not None]
    if not found:
        raise CheckpointError(
            "training.resume_from=latest: no complete checkpoint under "
            f"{join(output_dir, run_name or '*')}"
        )
    return max(found)[1]


def find_checkpoint(url: str, parameter: str) -> str:
    """A complete checkpoint's URL, or a run's (its newest complete checkpoint); refused
    naming `parameter` otherwise."""
    url = url.rstrip("/")
    if CHECKPOINT_RE.match(name(url)):
        if not exists(join(url, MARKER)):
            raise CheckpointError(
                f"{parameter}: {url} has no {MARKER} marker (it was not completely written, "
                "or is not there); use an earlier checkpoint, or the run's URL for its newest"
            )
        return url
    newest = _newest(url)
    if newest is None:
        raise CheckpointError(f"{parameter}: no complete checkpoint-<step> under {url}")
    return newest[1]


def _newest(run_url: str) -> tuple[float, str] | None:
    """A run's newest complete checkpoint, with when its marker was written."""
    complete, _ = checkpoints(run_url)
    if not complete:
        return None
    url = complete[-1][1]
    fs, path = filesystem(url)
    return fs.modified(join(path, MARKER)).timestamp(), url


def replace_folder(local: Path, url: str) -> None:
    """`url` made a copy of `local`: every file uploaded, then what an older folder there
    held besides removed (a bucket has no rename, so readers may see a mix meanwhile)."""
    uploaded = upload_folder(local, url)
    fs, path = filesystem(url)
    for entry in fs.find(path):
        if posixpath.relpath(entry, path) not in uploaded:
            fs.rm_file(entry)


@storage_errors("download")
def mirror_folder(url: str, base: Path) -> Path:
    """A local copy of the folder at `url` under `base`, kept between runs: only what
    changed since the last copy (by the storage's own key of each object, an S3 ETag) is
    downloaded again. For what is read many times: a model to start from."""
    fs, path = filesystem(url)
    if not fs.isdir(path):
        raise CheckpointError(f"{url} is not a folder (no object under it)")
    local = local_folder(url, base)
    record = local / ".meshtrain-source.json"
    known = json.loads(record.read_text()) if record.is_file() else {}
    now = {}
    for entry in fs.find(path):
        relative = _inside(url, posixpath.relpath(entry, path))
        now[relative] = fs.ukey(entry)
        target = local / relative
        if known.get(relative) != now[relative] or not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(entry, str(target))
    for relative in set(known) - set(now):
        (local / relative).unlink(missing_ok=True)
    record.write_text(json.dumps(now, indent=1, sort_keys=True))
    return local
