"""Context parallelism: each sequence's tokens split over a group of ranks.

The block is cut into 2 x cp equal chunks and rank r of the cp group holds chunks r and
2cp-1-r, one from the front and its mirror from the back: under causal attention the
front chunks attend few keys and the back ones many, so every rank gets the same work
(Megatron's and torchtitan's load balancing). Everything outside attention is per token
and runs on the rank's own tokens; rotary positions are the tokens' original positions.

Attention needs every earlier key: each layer all-gathers K and V over the group (Llama
3's all-gather form; cheap under GQA, where K/V are a fraction of Q) into the original
order, and each of the rank's query chunks attends the keys up to its own end
(`distributed.gathered_attention`). The backward gathers them again and reduce-scatters
their gradient back to the ranks that own them.

The same code runs on gloo (CPU) and NCCL: plain collectives (docs/context_parallel.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshtrain.data.batch import TokenBatch, example_ids


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in its cp group: which chunks of every sequence it holds."""

    group: dist.ProcessGroup
    size: int
    rank: int

    @property
    def chunks(self) -> tuple[int, int]:
        """The global chunk indices this rank holds, in the order it holds them."""
        return self.rank, 2 * self.size - 1 - self.rank

    def local_indices(self, length: int, device: torch.device) -> torch.Tensor:
        """The positions in a block of `length` tokens of this rank's tokens."""
        chunk = length // (2 * self.size)
        return torch.cat(
            [torch.arange(i * chunk, (i + 1) * chunk, device=device) for i in self.chunks]
        )

    def shard(self, batch: TokenBatch) -> TokenBatch:
        """This rank's tokens of every row: ids, targets (computed on the whole row, so the
        token after a chunk's last is still its target), positions (when packed) and
        precomputed reference log-probabilities (DPO's)."""
        length = batch.input_ids.shape[1]
        if length % (2 * self.size):
            raise ValueError(f"a block of {length} tokens does not split into {2 * self.size}")
        mine = self.local_indices(length, batch.input_ids.device)
        positions = batch.position_ids
        reference = batch.reference_logps
        return TokenBatch(
            batch.input_ids[:, mine],
            batch.labels[:, mine],
            None if positions is None else positions[:, mine],
            batch.real_tokens,
            None if reference is None else reference[:, mine],
        )

    def attention_inputs(
        self, position_ids: torch.Tensor | None, local_length: int, device: torch.device
    ) -> tuple[torch.Tensor, ContextAttention]:
        """The rotary positions of this rank's tokens and what attention needs to see the
        whole sequence. `position_ids`: this rank's share of packed examples' positions
        (None: one sequence per row)."""
        if position_ids is None:
            positions = self.local_indices(local_length * self.size, device)[None]
            return positions, ContextAttention(self, local_length // 2)
        everyone = to_sequence_order(all_gather_rows(position_ids, self), self.size)
        examples = example_ids(everyone)
        return position_ids, ContextAttention(self, local_length // 2, examples)


@dataclass(frozen=True)
class KeyBlock:
    """Keys [start, stop) of the sequence that a query chunk attends in one kernel call:
    every one of them, the causal triangle of its own chunk, or those a mask allows."""

    start: int
    stop: int
    causal: bool = False
    mask: torch.Tensor | None = None


@dataclass
class ContextAttention:
    """One forward's view of the whole sequence for the attention of every layer (it
    travels as the layers' `attention_mask`): the chunk length, packed examples' ids in
    sequence order (None: one sequence per row), and their masks, built once per dtype."""

    context: ContextParallel
    chunk: int
    examples: torch.Tensor | None = None  # (batch, sequence)
    _masks: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def query_chunks(self) -> list[tuple[slice, int]]:
        """(this rank's query rows, the number of keys they may see) per chunk."""
        c = self.chunk
        return [(slice(k * c, (k + 1) * c), (i + 1) * c) for k, i in enumerate(self.context.chunks)]

    def key_blocks(self, part: int, dtype: torch.dtype, device: torch.device) -> list[KeyBlock]:
        """What query chunk `part` attends, block by block: one sequence per row, the
        earlier chunks whole and its own causally (no mask exists: the kernel skips the
        masked half); packed examples, one masked block."""
        own = self.context.chunks[part] * self.chunk
        if self.examples is not None:
            return [KeyBlock(0, own + self.chunk, mask=self.mask(part, dtype, device))]
        blocks = [KeyBlock(0, own)] if own else []
        return [*blocks, KeyBlock(own, own + self.chunk, causal=True)]

    def mask(self, part: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Packed examples' additive mask of query chunk `part` over keys [0, its end):
        causal, inside each example, (batch, 1, chunk, keys). In the queries' dtype and
        shared by every layer (sdpa keeps a mask it need not convert, not one per layer)."""
        key = (part, dtype)
        if key not in self._masks:
            self._masks[key] = self._build_mask(part, dtype, device)
        return self._masks[key]

    def _build_mask(self, part: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        c, start = self.chunk, self.context.chunks[part] * self.chunk
        keys = start + c
        causal = torch.ones(c, keys, dtype=torch.bool, device=device).tril(start)
        queries = self.examples[:, start:keys]
        allowed = causal & (queries[:, :, None] == self.examples[:, None, :keys])
        blocked = torch.zeros(allowed.shape, dtype=dtype, device=device)
        return blocked.masked_fill_(~allowed, float("-inf")).unsqueeze(1)


def all_gather_rows(local: torch.Tensor, context: ContextParallel) -> torch.Tensor:
    """Every cp rank's `local` (batch, tokens, ...), stacked: (cp, batch, tokens, ...)."""
    # Concatenated along the batch (gloo takes no stacked form), then viewed stacked.
    out = local.new_empty((context.size * local.shape[0], *local.shape[1:]))
    dist.all_gather_single(out, local.contiguous(), group=context.group)
    return out.view(context.size, *local.shape)


def to_sequence_order(gathered: torch.Tensor, cp: int) -> torch.Tensor:
    """(cp, batch, 2c, ...) as the ranks hold it -> (batch, 2cp x c, ...) in the sequence's
    order: the ranks' first chunks in rank order, then their second ones in reverse."""
    ranks, batch, tokens = gathered.shape[:3]
    chunks = gathered.reshape(ranks, batch, 2, tokens // 2, *gathered.shape[3:])
    ordered = torch.cat([chunks[:, :, 0], chunks[:, :, 1].flip(0)])  # (2cp, batch, c, ...)
    return ordered.transpose(0, 1).reshape(batch, cp * tokens, *gathered.shape[3:])


def to_rank_order(sequence: torch.Tensor, cp: int) -> torch.Tensor:
    """The inverse of `to_sequence_order`: (batch, 2cp x c, ...) -> (cp, batch, 2c, ...)."""
    batch, length = sequence.shape[:2]
    chunks = sequence.reshape(batch, 2 * cp, length // (2 * cp), *sequence.shape[2:])
    chunks = chunks.transpose(0, 1)  # (2cp, batch, c, ...)
    pairs = torch.stack([chunks[:cp], chunks[cp:].flip(0)], dim=2)  # (cp, batch, 2, c, ...)
    return pairs.reshape(cp, batch, length // cp, *sequence.shape[2:])


def gather_sequence(local: torch.Tensor, context: ContextParallel) -> torch.Tensor:
    """(batch, local tokens, ...) on each cp rank -> (batch, sequence, ...) in the sequence's
    order on all of them."""
    return to_sequence_order(all_gather_rows(local, context), context.size)


class GatherSequence(torch.autograd.Function):
    """`gather_sequence` under autograd: the backward is `reduce_scatter_sequence`."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, context: ContextParallel) -> torch.Tensor:  # noqa: ANN001
        ctx.context = context
        return gather_sequence(local, context)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN205 (autograd's signature)
        return reduce_scatter_sequence(grad, ctx.context), None


def reduce_scatter_sequence(grad: torch.Tensor, context: ContextParallel) -> torch.Tensor:
    """The inverse's gradient: (batch, sequence, ...) on each cp rank -> each of its tokens'
    sum over the ranks, on the rank that holds the token: (batch, local tokens, ...)."""
    pieces = to_rank_order(grad, context.size).contiguous()
    mine = grad.new_empty(pieces.shape[1:])
    dist.reduce_scatter_single(mine, pieces.flatten(0, 1), group=context.group)
    return mine
