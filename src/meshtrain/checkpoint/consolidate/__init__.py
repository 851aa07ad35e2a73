"""Merge a sharded checkpoint into a plain Hugging Face model folder, one tensor at a time.

The output loads with `AutoModelForCausalLM.from_pretrained` and no meshtrain import:
`config.json`, the tokenizer files and `model.safetensors` (past `max_shard_size`,
`model-0000i-of-0000N.safetensors` and a `model.safetensors.index.json`). Only bytes
move, file to file, so neither torch nor safetensors is imported (`python -m meshtrain
consolidate` runs without them); a `dtype` cast goes through numpy, block by block.
"""

from meshtrain.checkpoint.consolidate.driver import check_dtype, consolidate_checkpoint, parse_size

__all__ = ["check_dtype", "consolidate_checkpoint", "parse_size"]
