"""The packed training and validation splits as MLflow dataset inputs of the run.

MLflow's UI shows them in the runs list's Datasets column and in the compare view:
name, a digest of the blocks themselves (two runs on the same data show the same
digest, whatever the machine or the order of the cache files), where the text came
from (builtin, text files, or a hub name and config), rows and tokens. Nothing here
imports Kedro.
"""

from __future__ import annotations

import hashlib
from functools import cached_property
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc
import torch

from meshtrain.config import LOSS_ON_BY_FORMAT
from meshtrain.data.batch import IGNORE_INDEX, next_token_labels
from meshtrain.data.blocks import PACKED_COLUMNS, is_packed
from meshtrain.offline import disable_telemetry

disable_telemetry()  # before mlflow is imported

import mlflow  # noqa: E402
from mlflow.data.code_dataset_source import CodeDatasetSource  # noqa: E402
from mlflow.data.dataset_source import DatasetSource  # noqa: E402
from mlflow.data.huggingface_dataset import HuggingFaceDataset  # noqa: E402
from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource  # noqa: E402
from mlflow.types import Schema  # noqa: E402

# The input context of each split, as MLflow's UI labels it.
CONTEXTS = {"train": "training", "validation": "validation"}
# The `datasets` builder that reads each kind of `data.data_files`.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


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
    the files as `datasets` reads them, the Kedro catalog's `raw_examples`, or one of
    meshtrain's builtin corpora."""
    source = data.get("source") or "builtin"
    if source == "hub":
        name = str(data.get("hub_dataset"))
        return name.rsplit("/", 1)[-1], HuggingFaceDatasetSource(
            path=name, config_name=data.get("hub_config"), split=data.get("hub_split", "train")
        )
    if source == "text_files":
        files = data.get("text_files") or []
        return "text_files", HuggingFaceDatasetSource(path="text", data_files=list(files))
    if source == "files":
        files = [str(f) for f in data.get("data_files") or []]
        return "files", HuggingFaceDatasetSource(path=file_builder(files), data_files=files)
    if source == "catalog":
        return "catalog", CodeDatasetSource(tags={"kedro_dataset": "raw_examples"})
    if source == "builtin_instructions":
        tags = {"corpus": "meshtrain builtin instructions (Python documentation Q&A)"}
        return "builtin_instructions", CodeDatasetSource(tags=tags)
    tags = {
        "corpus": "meshtrain builtin (Python help topics and stdlib docstrings)",
        "builtin_max_chars": str(data.get("builtin_max_chars")),
    }
    return "builtin", CodeDatasetSource(tags=tags)


def file_builder(files: list[str]) -> str:
    """The `datasets` builder of the files' kind (json for .json/.jsonl, parquet, csv)."""
    suffixes = {"." + f.rsplit(".", 1)[-1].lower() for f in files if "." in f}
    builders = {FILE_BUILDERS.get(suffix, suffix.lstrip(".")) for suffix in suffixes}
    return builders.pop() if len(builders) == 1 else "files"


def unpadded_tokens(positions: torch.Tensor, loss_mask: torch.Tensor) -> int:
    """Tokens before the blocks' padding tails, for blocks without `num_tokens`: a block's
    tail is its last run of positions when that run trains nothing."""
    length = positions.shape[1]
    index = torch.arange(length)
    last_start = torch.where(positions == 0, index, 0).amax(dim=1)
    trains_last = (loss_mask.bool() & (index >= last_start[:, None])).any(dim=1)
    return int(torch.where(trains_last, length, last_start).sum())


def token_counts(split: datasets.Dataset) -> tuple[int, int]:
    """Real (not padding) and trained tokens of fine-tuning blocks, read batch by batch."""
    has_count = "num_tokens" in split.column_names
    columns = ["input_ids", *PACKED_COLUMNS] + (["num_tokens"] if has_count else [])
    real = trained = 0
    for batch in split.select_columns(columns).with_format("torch").iter(batch_size=1024):
        positions, loss_mask = batch["position_ids"], batch["loss_mask"]
        labels = next_token_labels(batch["input_ids"], positions, loss_mask)
        trained += int((labels != IGNORE_INDEX).sum())
        real += (
            int(batch["num_tokens"].sum()) if has_count else unpadded_tokens(positions, loss_mask)
        )
    return real, trained


def fine_tuning_profile(split: datasets.Dataset, data: dict[str, Any], tokens: int) -> dict:
    """How fine-tuning blocks were made (`data.*`, `auto` resolved where the blocks or
    the format tell) and how full they are."""
    data_format = data.get("format") or "auto"
    loss_on = data.get("loss_on") or "auto"
    if loss_on == "auto":
        loss_on = LOSS_ON_BY_FORMAT.get(data_format, "auto")
    packing = data.get("packing") or "auto"
    real, trained = token_counts(split)
    return {
        "format": data_format,
        "columns": data.get("columns") or {},
        "loss_on": loss_on,
        # Positions restart per example: best-fit decreasing, whatever `auto` chose.
        "packing": "bfd" if packing == "auto" else packing,
        "packing_efficiency": round(real / tokens, 4) if tokens else None,
        "real_tokens": real,
        "trained_tokens": trained,
    }


# Rows MLflow's schema of a packed split is inferred from (`PackedBlocks.schema`).
SCHEMA_ROWS = 8


class PackedBlocks(HuggingFaceDataset):
    """A packed split; its profile adds the token counts (and how fine-tuning blocks
    were made) to the rows."""

    def __init__(
        self,
        ds: datasets.Dataset,
        source: DatasetSource,
        name: str,
        digest: str,
        profile: dict[str, Any],
    ):
        super().__init__(ds=ds, source=source, name=name, digest=digest)
        self._profile = profile

    @property
    def profile(self) -> dict[str, Any]:
        return {"num_rows": self._ds.num_rows, **self._profile}

    @cached_property
    def schema(self) -> Schema | None:
        """MLflow's schema, inferred from the first rows: a column's rows all have its Arrow
        type, and MLflow's own inference visits every token of up to 10,000 rows (5 s
        before training starts at the default size)."""
        head = self._ds.select(range(min(SCHEMA_ROWS, self._ds.num_rows)))
        return HuggingFaceDataset(ds=head, source=self.source, digest=self.digest).schema


def packed_split(split: datasets.Dataset, which: str, data: dict[str, Any]) -> PackedBlocks:
    label, source = corpus_source(data)
    digest, tokens = blocks_digest(split)
    block = f"-b{data['block_size']}" if data.get("block_size") else ""
    if not is_packed(split):
        name = f"{label}-{which}{block}"
        profile = {"num_tokens": tokens}
        return PackedBlocks(split.select_columns(["input_ids"]), source, name, digest, profile)
    profile = {"num_tokens": tokens, **fine_tuning_profile(split, data, tokens)}
    if isinstance(source, CodeDatasetSource):  # the source's tags say it too
        described = {k: str(profile[k]) for k in ("format", "columns", "loss_on", "packing")}
        source = CodeDatasetSource(tags=source.to_dict()["tags"] | described)
    name = f"{label}-{profile['format']}-{which}{block}"
    # MLflow's schema inference takes no int8 lists: the loss mask is in the profile.
    columns = ["input_ids", "position_ids"]
    return PackedBlocks(split.select_columns(columns), source, name, digest, profile)


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
