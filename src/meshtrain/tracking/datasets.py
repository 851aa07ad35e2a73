"""The packed training and validation splits as MLflow dataset inputs of the run.

MLflow's UI shows them in the runs list's Datasets column and in the compare view:
name, a digest of the blocks themselves (two runs on the same data show the same
digest, whatever the machine or the order of the cache files), where the text came
from (builtin, text files, or a hub name and config), rows and tokens. Nothing here
imports Kedro.
"""

from __future__ import annotations

import hashlib
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc

from meshtrain.offline import disable_telemetry

disable_telemetry()  # before mlflow is imported

import mlflow  # noqa: E402
from mlflow.data.code_dataset_source import CodeDatasetSource  # noqa: E402
from mlflow.data.dataset_source import DatasetSource  # noqa: E402
from mlflow.data.huggingface_dataset import HuggingFaceDataset  # noqa: E402
from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource  # noqa: E402

# The input context of each split, as MLflow's UI labels it.
CONTEXTS = {"train": "training", "validation": "validation"}


def blocks_digest(split: datasets.Dataset) -> tuple[str, int]:
    """A digest of the token ids (block by block) and their number, read chunk by chunk
    from the memory-mapped arrow data: the same blocks give the same digest."""
    if split._indices is not None:  # a select/shuffle view: hash what it shows
        split = split.flatten_indices()
    column = split.data.table.column("input_ids")
    digest = hashlib.sha256()
    tokens = 0
    for chunk in column.chunks:
        lengths = pc.list_value_length(chunk).to_numpy(zero_copy_only=False)
        values = np.asarray(chunk.flatten())
        digest.update(lengths.astype(np.int64).tobytes())
        digest.update(values.tobytes())
        tokens += int(values.size)
    return digest.hexdigest()[:16], tokens


def corpus_source(data: dict[str, Any]) -> tuple[str, DatasetSource]:
    """A short label and MLflow source for `data.*`: the hub dataset (name, config, split),
    the text files as `datasets` reads them, or meshtrain's builtin corpus."""
    source = data.get("source") or "builtin"
    if source == "hub":
        name = str(data.get("hub_dataset"))
        return name.rsplit("/", 1)[-1], HuggingFaceDatasetSource(
            path=name, config_name=data.get("hub_config"), split=data.get("hub_split", "train")
        )
    if source == "text_files":
        files = data.get("text_files") or []
        return "text_files", HuggingFaceDatasetSource(path="text", data_files=list(files))
    tags = {
        "corpus": "meshtrain builtin (Python help topics and stdlib docstrings)",
        "builtin_max_chars": str(data.get("builtin_max_chars")),
    }
    return "builtin", CodeDatasetSource(tags=tags)


class PackedBlocks(HuggingFaceDataset):
    """A packed split; its profile adds the token count to the rows."""

    def __init__(
        self, ds: datasets.Dataset, source: DatasetSource, name: str, digest: str, tokens: int
    ):
        super().__init__(ds=ds, source=source, name=name, digest=digest)
        self._tokens = tokens

    @property
    def profile(self) -> dict[str, Any]:
        return {"num_rows": self._ds.num_rows, "num_tokens": self._tokens}


def packed_split(split: datasets.Dataset, which: str, data: dict[str, Any]) -> PackedBlocks:
    label, source = corpus_source(data)
    digest, tokens = blocks_digest(split)
    block = data.get("block_size")
    name = f"{label}-{which}" + (f"-b{block}" if block else "")
    return PackedBlocks(split.select_columns(["input_ids"]), source, name, digest, tokens)


def log_packed_blocks(
    blocks: datasets.DatasetDict, data: dict[str, Any], splits: tuple[str, ...] = tuple(CONTEXTS)
) -> dict[str, PackedBlocks]:
    """Log `splits` of the packed blocks as inputs of the active run (no-op outside one).
    Returns them by split, for metrics that name the data they were measured on."""
    if mlflow.active_run() is None:
        return {}
    logged = {}
    for which in splits:
        dataset = packed_split(blocks[which], which, data)
        mlflow.log_input(dataset, context=CONTEXTS[which])
        logged[which] = dataset
    return logged
