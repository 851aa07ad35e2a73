"""KV-head replication for tensor parallelism: the one place that repeats heads and undoes it.

With fewer KV heads than tensor-parallel ranks, every KV head of k_proj/v_proj
is repeated `copies` times along dim 0 before the column split, so each rank
holds whole heads (optimum-neuron's `kv_size_multiplier`). Training, resume,
checkpoint manifests and consolidation all need the same arithmetic, in both
directions. Works on any array with `reshape` and `expand` (torch tensors) and
imports nothing, so the torch-free consolidation can use the row arithmetic.
"""

from __future__ import annotations

from typing import Any


def kv_replication_factor(num_key_value_heads: int, tensor_parallel_size: int) -> int:
    """How many copies of each KV head tp ranks need so every rank holds whole heads.

    1 when the KV heads divide evenly over the ranks; tp / kv when there are
    fewer KV heads than ranks. Raises ValueError when neither divides the other.
    """
    if num_key_value_heads % tensor_parallel_size == 0:
        return 1
    if tensor_parallel_size % num_key_value_heads == 0:
        return tensor_parallel_size // num_key_value_heads
    raise ValueError(
        f"num_key_value_heads={num_key_value_heads} and tensor_parallel_size="
        f"{tensor_parallel_size}: one must divide the other"
    )


def repeat_kv_heads(tensor: Any, copies: int, head_dim: int) -> Any:
    """Each head's `head_dim` rows (dim 0) `copies` times in a row: `[h0 h0 h1 h1 ...]`."""
    if copies == 1:
        return tensor
    heads, rest = tensor.shape[0] // head_dim, tuple(tensor.shape[1:])
    repeated = tensor.reshape(heads, 1, head_dim, *rest).expand(heads, copies, head_dim, *rest)
    return repeated.reshape(heads * copies * head_dim, *rest)


def drop_kv_copies(tensor: Any, copies: int, head_dim: int) -> Any:
    """The inverse of `repeat_kv_heads`: the first copy of each head."""
    if copies == 1:
        return tensor
    heads, rest = tensor.shape[0] // (copies * head_dim), tuple(tensor.shape[1:])
    first = tensor.reshape(heads, copies, head_dim, *rest)[:, 0]
    return first.reshape(heads * head_dim, *rest)


def first_copy_rows(rows: int, copies: int, head_dim: int) -> list[tuple[int, int]]:
    """Row ranges `[start, end)` of a replicated tensor that `drop_kv_copies` keeps."""
    if copies == 1:
        return [(0, rows)]
    if rows % (copies * head_dim):
        raise ValueError(
            f"{rows} rows are not whole heads of {head_dim} rows repeated {copies} times"
        )
    step = copies * head_dim
    return [(start, start + head_dim) for start in range(0, rows, step)]
