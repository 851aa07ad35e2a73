"""Consolidation from and to object storage: the checkpoint downloaded, the model written
on this machine and then uploaded (`checkpoint.remote`).

The consolidation itself reads and writes local files (it memory-maps the checkpoint's
tensors and writes the model with positional writes, which object storage has not). The
downloaded checkpoint lives in a temporary folder deleted afterwards; the model's local
copy is kept under `data/06_models/remote/<scheme>/<bucket>/<key>` so that the evaluation
and MLflow can load it without downloading it again.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshtrain.checkpoint import remote

# The local copies of models consolidated to object storage.
REMOTE_MODELS = Path("data/06_models/remote")


def consolidate_anywhere(
    checkpoint: str | Path,
    output_dir: str | Path,
    write: Callable[[str | Path, str | Path], dict[str, Any]],
    *,
    parameter: str = "consolidation.checkpoint",
) -> dict[str, Any]:
    """`write(checkpoint, output_dir)` on local folders, whichever of the two is a URL; its
    summary, with `uploaded_to` (the output's URL) and `checkpoint` (the URL it was read
    from) where they are remote."""
    with tempfile.TemporaryDirectory(prefix="meshtrain-consolidate-") as scratch:
        source = checkpoint
        if remote.is_url(checkpoint):
            source_url = remote.find_checkpoint(str(checkpoint), parameter)
            source = remote.download_folder(source_url, Path(scratch) / remote.name(source_url))
        target = output_dir
        if remote.is_url(output_dir):
            target = remote.local_folder(str(output_dir), REMOTE_MODELS)
        summary = write(source, target)
        if remote.is_url(output_dir):
            remote.replace_folder(Path(target), str(output_dir))
            summary["uploaded_to"] = str(output_dir)
        if remote.is_url(checkpoint):
            summary["checkpoint"] = source_url
    return summary
