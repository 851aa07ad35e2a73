"""Tensor parallelism (tp) and sequence parallelism over its ranks: the degrees the
model's heads allow, their checks and refusals, and sequence parallelism's resolution.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from meshtrain.config import AUTO, ParallelConfig
from meshtrain.planner.types import Refusal, divisors, format_values


def tensor_parallel_degrees(world: int, model_config: PretrainedConfig) -> list[int]:
    """tp degrees the model and this engine accept: they divide the world and the attention
    heads, and the KV heads divide tp or tp divides them (then KV heads are replicated)."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    return [
        d for d in divisors(world) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)
    ]


def check_tensor_parallel(tp: int, world: int, model_config: PretrainedConfig) -> list[Refusal]:
    tp_ok = tensor_parallel_degrees(world, model_config)
    if tp in tp_ok:
        return []
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    why = []
    if heads % tp:
        why.append(f"it must divide num_attention_heads={heads}")
    if kv_heads % tp and tp % kv_heads:
        why.append(
            f"it must divide num_key_value_heads={kv_heads} or be a multiple of it "
            "(then each KV head is replicated)"
        )
    if world % tp:
        why.append(f"it must divide the world size {world}")
    return [
        Refusal(
            "parallel.tensor_parallel_size",
            tp,
            "; ".join(why) or "this degree is not supported",
            f"Values that work here: {format_values(tp_ok)}.",
        )
    ]


def resolve_sequence_parallel(
    par: ParallelConfig, tp: int, block_size: int, cp: int = 1
) -> tuple[bool, list[Refusal]]:
    """On with tensor parallelism at `auto`; a rank's share of each block (block / cp
    tokens) must split over the tp ranks."""
    refusals: list[Refusal] = []
    if par.sequence_parallel == AUTO:
        sequence_parallel = tp > 1
    else:
        sequence_parallel = par.sequence_parallel
        if sequence_parallel and tp == 1:
            chosen = (
                " (the only size auto can choose here)" if par.tensor_parallel_size == AUTO else ""
            )
            refusals.append(
                Refusal(
                    "parallel.sequence_parallel",
                    True,
                    f"it needs parallel.tensor_parallel_size > 1, and that is 1{chosen}: "
                    "sequence parallelism shards activations over the tensor-parallel ranks",
                    "Use sequence_parallel=auto (on whenever tp > 1) or false, or "
                    "parallel.tensor_parallel_size=2 or more.",
                )
            )
    step = tp * cp  # under cp each rank's block / cp tokens are split over tp
    if sequence_parallel and block_size % step and (cp == 1 or block_size % (2 * cp) == 0):
        over = f" x context_parallel_size={cp}" if cp > 1 else ""
        refusals.append(
            Refusal(
                "data.block_size",
                block_size,
                f"sequence parallelism splits each block over tensor_parallel_size={tp}{over} "
                "ranks",
                f"Use a block size divisible by {step} (e.g. "
                f"{block_size - block_size % step or step}), "
                "or parallel.sequence_parallel=false.",
            )
        )
    return sequence_parallel, refusals
