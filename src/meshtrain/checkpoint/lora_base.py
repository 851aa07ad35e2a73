"""Which base model a LoRA checkpoint's adapters belong to.

A LoRA checkpoint holds only the adapters (and their moments): they mean something only
on the base they were trained on. So the checkpoint records that base's identity, and a
resume or a merge onto another base is refused naming what differs: the folder, its
config, or its weights (the sha256 of its weight index, or of its weight files where it
has no index). A randomly initialised base (a layout test) is its config and seed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from meshtrain.checkpoint import files
from meshtrain.checkpoint.manifest import CheckpointError, sha256_of

# The config fields that make a base what it is (not transformers' bookkeeping, which
# differs between a saved config.json and the one a run rebuilds from it).
_SHAPE_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
)


def _config_sha256(config: dict[str, Any]) -> str:
    shape = {key: config.get(key) for key in _SHAPE_FIELDS}
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()


def _weights_sha256(folder: Path) -> str:
    index = folder / files.HF_WEIGHTS_INDEX
    if index.is_file():
        return sha256_of(index)
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        digest.update(path.name.encode() + sha256_of(path).encode())
    return digest.hexdigest()


def base_identity(folder: str | None, config: dict[str, Any], seed: int) -> dict[str, Any]:
    """What identifies the base: its folder, config and weights (or, random, its seed)."""
    identity: dict[str, Any] = {"config_sha256": _config_sha256(config)}
    if folder is None:
        return identity | {"folder": None, "random_init_seed": seed}
    path = Path(folder).resolve()
    return identity | {"folder": str(path), "weights_sha256": _weights_sha256(path)}


def check_same_base(saved: dict[str, Any], current: dict[str, Any], action: str) -> None:
    """Refuse `action` (a resume, a merge) of adapters trained on `saved` onto `current`."""
    changed = [
        f"{key}: {saved.get(key)!r} -> {current.get(key)!r}"
        for key in ("folder", "config_sha256", "weights_sha256", "random_init_seed")
        if saved.get(key) != current.get(key)
    ]
    if changed:
        raise CheckpointError(
            f"cannot {action}: the LoRA adapters were trained on another base model ("
            + "; ".join(changed)
            + "). Use the base they were trained on (the checkpoint's trainer_state.json "
            "names it under lora.base)."
        )


def checkpoint_lora_state(root: Path) -> dict[str, Any] | None:
    """The `lora` record of a checkpoint's trainer state: settings and base (None: the
    checkpoint holds a full model)."""
    state = json.loads((root / files.TRAINER_STATE).read_text())
    return state.get("lora")
