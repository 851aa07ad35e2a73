"""Consolidation from and to object storage: the checkpoint downloaded, the model written
on this machine and then uploaded (`checkpoint.remote`).

The consolidation itself reads and writes local files (it memory-maps the checkpoint's
tensors and writes the model with positional writes, which object storage has not). The
downloaded checkpoint lives in a temporary folder deleted afterwards. The pipeline keeps
the model's local copy under `data/06_models/remote/<scheme>/<bucket>/<key>`, so that
the evaluation and MLflow load it without downloading it again; the command does not.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshtrain.checkpoint import remote


def consolidate_anywhere(
    checkpoint: str | Path,
    output_dir: str | Path,
    write: Callable[[str | Path, str | Path], dict[str, Any]],
    *,
    parameter: str = "consolidation.checkpoint",
    keep_local: bool = True,
) -> dict[str, Any]:
    """`write(checkpoint, output_dir)` on local folders, whichever of the two is a URL; its
    summary, with `uploaded_to` (the output's URL) and `checkpoint` (the URL it was read
    from) where they are remote. `keep_local`: keep an uploaded model's local copy (its
    folder is the summary's `output_dir`; without, the URL is)."""
    with tempfile.TemporaryDirectory(prefix="meshtrain-consolidate-") as scratch:
        source = checkpoint
        if remote.is_url(checkpoint):
            source_url = remote.find_checkpoint(str(checkpoint), parameter)
            source = remote.download_folder(source_url, Path(scratch) / remote.name(source_url))
        target = output_dir
        if remote.is_url(output_dir):
            base = remote.LOCAL_COPIES if keep_local else Path(scratch) / "model"
            target = remote.local_folder(str(output_dir), base)
        summary = write(source, target)
        if remote.is_url(output_dir):
            remote.replace_folder(Path(target), str(output_dir))
            summary["uploaded_to"] = str(output_dir)
            if not keep_local:
                summary["output_dir"] = str(output_dir)
        if remote.is_url(checkpoint):
            summary["checkpoint"] = source_url
    return summary
