"""`consolidation.*` checked before a run starts: a value consolidation would refuse after
hours of training (a dtype, a shard size, a checkpoint that is not there) is refused
before the first node instead."""

from __future__ import annotations

from pathlib import Path

from meshtrain.checkpoint.consolidate.driver import check_dtype, parse_size
from meshtrain.checkpoint.manifest import CheckpointError, resolve_checkpoint
from meshtrain.checkpoint.remote import is_url
from meshtrain.config import ConfigError, ConsolidationConfig


def check_consolidation(cfg: ConsolidationConfig, *, lora: bool) -> None:
    """Refuse the `consolidation.*` values the consolidation node would refuse; `lora`:
    the run trains adapters (`model.lora` is set)."""
    try:
        check_dtype(cfg.dtype)
    except ValueError:
        raise ConfigError(
            f"`consolidation.dtype` is {cfg.dtype!r}; use float32 (fp32), bfloat16 (bf16), "
            "float16 (fp16), or null for the dtype the checkpoint holds."
        ) from None
    try:
        parse_size(cfg.max_shard_size)
    except ValueError as error:
        raise ConfigError(f"`consolidation.max_shard_size`: {error}.") from None
    if cfg.merge_lora and is_url(cfg.merged_output_dir):
        raise ConfigError(
            f"`consolidation.merged_output_dir` is {cfg.merged_output_dir!r}: the merged model "
            "is written to a local folder only; upload it from there, or keep "
            "consolidation.output_dir (the adapters) on object storage."
        )
    for name in ("output_dir", "merged_output_dir"):
        if is_url(getattr(cfg, name)):
            continue  # object storage: written once the model is whole (`remote_io`)
        folder = Path(getattr(cfg, name))
        if folder.exists() and not folder.is_dir():
            raise ConfigError(
                f"`consolidation.{name}` is {str(folder)!r}, which is a file: name a folder "
                "(it is replaced by the model once written in full)."
            )
    if cfg.checkpoint is not None and not is_url(cfg.checkpoint):
        if not Path(cfg.checkpoint).is_dir():
            raise ConfigError(
                f"`consolidation.checkpoint` is {cfg.checkpoint!r}, which is not a folder: "
                "give a checkpoint-<step> folder or a run folder (its latest), or null for "
                "this run's final checkpoint."
            )
        try:
            resolve_checkpoint(Path(cfg.checkpoint))
        except CheckpointError as error:
            raise ConfigError(f"`consolidation.checkpoint`: {error}.") from None
    if cfg.merge_lora and not lora and cfg.checkpoint is None:
        raise ConfigError(
            "`consolidation.merge_lora` is true but `model.lora` is null: a full model has "
            "no adapters to merge. Set model.lora, or consolidation.merge_lora=false."
        )
