"""Every name in a checkpoint folder, in one place (saving, resuming, consolidation).

    checkpoint-<step>/
      shards/tp_rank_XX_pp_rank_YY/model.safetensors      local parameter shards
      shards/tp_rank_XX_pp_rank_YY/flat_layout.json       where each sits in the flat buffer
      optimizer/dp_rank_XX_tp_rank_YY_pp_rank_ZZ.safetensors   AdamW moments of a range
      optimizer/experts_tp_rank_YY_pp_rank_ZZ.safetensors      ... of the experts (after
                                                          the dense range; expert parallel)
      rng/rank_NNNNN.safetensors                          each rank's random state
      config.json, generation_config.json, tokenizer/     to rebuild a HF model
      trainer_state.json                                  step, layout, sample stream
      manifest.json                                       tensors and files (sha256)
      COMPLETE                                            written last, atomically

Imports nothing: `python -m meshtrain consolidate` runs without torch.
"""

from __future__ import annotations

import re
from pathlib import Path

MANIFEST = "manifest.json"
MARKER = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
MODEL_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER = "tokenizer"
SHARDS = "shards"
OPTIMIZER = "optimizer"
RNG = "rng"
SHARD_WEIGHTS = "model.safetensors"
# The flat-buffer index of one shard (name kept from format version 1).
FLAT_INDEX = "flat_layout.json"
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
# A Hugging Face model folder's weights (what consolidation writes, init_from reads):
# one file, or several listed in the index.
HF_WEIGHTS = "model.safetensors"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step}"


def shard_dir_name(tp_rank: int, pp_rank: int) -> str:
    return f"tp_rank_{tp_rank:02d}_pp_rank_{pp_rank:02d}"


def shard_dir(root: Path, tp_rank: int, pp_rank: int) -> Path:
    return root / SHARDS / shard_dir_name(tp_rank, pp_rank)


def shard_weights(root: Path, tp_rank: int, pp_rank: int) -> Path:
    return shard_dir(root, tp_rank, pp_rank) / SHARD_WEIGHTS


def flat_index(root: Path, tp_rank: int, pp_rank: int) -> Path:
    return shard_dir(root, tp_rank, pp_rank) / FLAT_INDEX


def optimizer_file_name(dp_rank: int, tp_rank: int, pp_rank: int) -> str:
    return f"dp_rank_{dp_rank:02d}_{shard_dir_name(tp_rank, pp_rank)}.safetensors"


def expert_optimizer_file_name(tp_rank: int, pp_rank: int) -> str:
    return f"experts_{shard_dir_name(tp_rank, pp_rank)}.safetensors"


def optimizer_files(root: Path, tp_rank: int, pp_rank: int) -> list[Path]:
    """The moment files of one (tp, pp) coordinate: one per dp rank that owned a range, and
    the experts' range under expert parallelism."""
    suffix = f"_{shard_dir_name(tp_rank, pp_rank)}.safetensors"
    return sorted((root / OPTIMIZER).glob(f"*{suffix}"))


def rng_file(root: Path, rank: int) -> Path:
    return root / RNG / f"rank_{rank:05d}.safetensors"
