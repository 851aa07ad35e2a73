"""The LM head and its loss: summed next-token cross-entropy, whole or chunk by chunk.

A microbatch's logits are `tokens x vocabulary`: at Llama 3's 128,256 tokens and
8,192 tokens per microbatch, 4 GiB in fp32 before the loss keeps its own copies.
`linear_cross_entropy_sum` never builds them: it runs the head's matmul, the
log-sum-exp and the gradients of the logits one chunk of tokens at a time, and
keeps only the gradients of the hidden states and of the head's weight (which the
backward would produce anyway), so the loss's working set is one chunk's.

The gradients are computed in the forward (Liger Kernel's and Cut Cross-Entropy's
choice): recomputing the chunk's logits in the backward would add a third head
matmul, and at large vocabularies the head is most of the model's FLOPs.

Under tensor parallelism the head's weight is vocabulary-sharded (Megatron's
vocabulary-parallel loss): each rank scores its rows of the vocabulary, and the
maximum, the sum of exponentials and the target's logit are combined over the tp
group per chunk; the hidden states' gradient is a partial sum over the tp ranks,
which DTensor reduces on its way back (reduce-scattered under sequence parallelism).

Precision follows the unchunked loss: the logits in the compute dtype (bf16 under
autocast or bf16 parameters), the log-sum-exp and the logits' gradient in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor, Partial, Replicate

from meshtrain.data.batch import IGNORE_INDEX
from meshtrain.distributed.tensor_parallel import vocabulary_start


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over the trained positions of the batch, in fp32.

    A sum, not a mean: the run divides by the trained tokens of the whole global batch, so
    microbatches, accumulation steps and ranks with unequal numbers of trained tokens
    weigh each token equally (a mean of per-microbatch means would not). The labels come
    shifted, so vocabulary-sharded DTensor logits go through unchanged.
    """
    return F.cross_entropy(
        logits.flatten(0, 1).float(),
        labels.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


class ScoringHead:
    """An LM head (a Linear, its class kept below this one) whose forward, given labels,
    returns their summed loss chunk by chunk instead of logits (`score_in_chunks`).

    Scoring inside the head's own forward keeps every module hook that guards its weight
    in force: ZeRO-1's wait for the weight's gathered update, tensor parallelism's input
    layout (`distributed.tensor_parallel.VocabParallelLossHead`). A head with LoRA
    adapters (`models.lora.LoraLayer`) scores their low-rank term in the same chunks."""

    loss_chunk_tokens: int
    # Whether the backward runs through the loss twice: the input gradient, then the
    # weights' (a zero-bubble pipeline schedule's split backward).
    backward_twice: bool = False

    def forward(
        self, hidden: torch.Tensor, labels: torch.Tensor | None = None, per_token: bool = False
    ) -> torch.Tensor:
        """`per_token`: each label's log-probability (`models.token_logps`) instead of the
        summed loss."""
        if labels is None:
            return super().forward(hidden)  # type: ignore[misc]
        adapter = None
        if hasattr(self, "lora_A") and not getattr(self, "adapters_off", False):
            adapter = LowRank(
                self.lora_A.weight, self.lora_B.weight, self.scaling, self.lora_dropout
            )
        if per_token:
            from meshtrain.models.token_logps import linear_token_logps  # noqa: PLC0415

            return linear_token_logps(
                hidden, self.weight, labels, self.loss_chunk_tokens, adapter=adapter
            )
        return linear_cross_entropy_sum(
            hidden,
            self.weight,
            labels,
            self.loss_chunk_tokens,
            adapter=adapter,
            backward_twice=self.backward_twice,
        )


@dataclass
class LowRank:
    """A LoRA adapter on the head: logits gain `(dropout(h) @ a.T) * scaling @ b.T`."""

    a: torch.Tensor  # r x hidden
    b: torch.Tensor  # vocabulary rows x r
    scaling: float
    dropout: nn.Module


def score_in_chunks(lm_head: nn.Linear, chunk_tokens: int, backward_twice: bool = False) -> None:
    """Make `lm_head` a `ScoringHead` of `chunk_tokens` tokens a chunk, in place (its
    parameters and their names unchanged); 0 leaves it a plain head. `backward_twice`:
    a split backward runs through its loss for the input gradient, then the weights'."""
    if chunk_tokens <= 0:
        return
    base = type(lm_head)
    lm_head.__class__ = type(f"Scoring{base.__name__}", (ScoringHead, base), {})
    lm_head.loss_chunk_tokens = chunk_tokens
    lm_head.backward_twice = backward_twice


def head_loss(
    hidden: torch.Tensor, lm_head: nn.Linear, labels: torch.Tensor, per_token: bool = False
) -> torch.Tensor:
    """Summed loss of the final hidden states (batch, sequence, hidden) through `lm_head`:
    chunk by chunk by a `ScoringHead`, else through the whole logits (which under tensor
    parallelism needs `loss_parallel` around it: they are vocabulary-sharded DTensors).
    `per_token`: each label's log-probability instead (a `ScoringHead` only)."""
    if per_token:
        return lm_head(hidden, labels=labels, per_token=True)
    if isinstance(lm_head, ScoringHead):
        return lm_head(hidden, labels=labels)
    loss = token_loss_sum(lm_head(hidden), labels)
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    *,
    adapter: LowRank | None = None,
    backward_twice: bool = False,
) -> torch.Tensor:
    """`token_loss_sum(hidden @ weight.T, labels)` without the logits of more than
    `chunk_tokens` tokens at once; ignored positions cost nothing. With `adapter`, the
    logits are those of the LoRA head. `backward_twice`: the gradients are kept for a
    second run of the backward (else they are scaled in place and freed).

    `weight` is the head's (vocabulary, hidden) weight, a plain tensor or a DTensor
    sharded on the vocabulary over the tp mesh; `hidden` is then a DTensor on that mesh
    (`VocabParallelLossHead` makes the head's input one), the adapter's B is sharded
    like `weight` and its A replicated."""
    fixed, terms = head_terms(hidden, weight, adapter)
    return _ChunkedLinearCrossEntropy.apply(
        labels.flatten(), chunk_tokens, backward_twice, *fixed, *terms
    )


def head_terms(
    hidden: torch.Tensor, weight: torch.Tensor, adapter: LowRank | None
) -> tuple[tuple[torch.dtype, int, dist.ProcessGroup | None], list[torch.Tensor]]:
    """What a chunked head function takes after the labels and chunk size: (the compute
    dtype, this rank's first vocabulary row, the tp group or None), and the terms
    `x_1, w_1, ...` whose logits `sum_i x_i @ w_i.T` it scores (the head's, and a LoRA
    adapter's), each a local tensor."""
    group, vocab_start = None, 0
    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        group, vocab_start = mesh.get_group(), vocabulary_start(weight)
        # Gathered whole on every rank; its gradient, and that of what the adapter's A
        # sees, is each rank's vocabulary share (`partial_copy`).
        hidden = hidden.redistribute(mesh, [Replicate()])
    device = hidden.device.type
    compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    weight = local_shard(weight)
    terms = [partial_copy(hidden).flatten(0, 1), weight]
    if adapter is not None:
        a = partial_copy(adapter.a)
        adapter_in = partial_copy(adapter.dropout(hidden)).to(a.dtype)
        terms += [(F.linear(adapter_in, a) * adapter.scaling).flatten(0, 1), local_shard(adapter.b)]
    return (compute or weight.dtype, vocab_start, group), terms


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard (its gradient that shard's), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def partial_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's local copy whose gradient is a partial sum over the tp ranks
    (each scores its own vocabulary rows), else the tensor."""
    return tensor.to_local(grad_placements=[Partial()]) if isinstance(tensor, DTensor) else tensor


_FIXED_INPUTS = 6  # _ChunkedLinearCrossEntropy's arguments before its terms


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward: the summed loss of the logits `sum_i x_i @ w_i.T` (the head's term, and a
    LoRA adapter's), and the gradients of every x_i and w_i as if the loss's own
    gradient were 1. Backward: those, times the gradient that arrives; scaled in place
    and freed, unless the backward will run through it again (`backward_twice`: a split
    backward asks for the input's gradient, then for the weights')."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        labels: torch.Tensor,  # (tokens,), IGNORE_INDEX where not trained
        chunk_tokens: int,
        backward_twice: bool,
        compute: torch.dtype,
        vocab_start: int,
        group: dist.ProcessGroup | None,
        *terms: torch.Tensor,  # x_1 (tokens, width_1), w_1 (vocabulary rows, width_1), ...
    ) -> torch.Tensor:
        needs = ctx.needs_input_grad[_FIXED_INPUTS:]
        trained = trained_rows(labels)
        all_trained = trained.numel() == labels.numel()
        targets = labels if all_trained else labels.index_select(0, trained)
        inputs, weights = terms[::2], terms[1::2]
        rows = [x if all_trained else x.index_select(0, trained) for x in inputs]
        ws = [w.to(compute) for w in weights]
        grads = [
            _TermGradients(
                x if needs[2 * i] else None, w if needs[2 * i + 1] else None, len(targets)
            )
            for i, (x, w) in enumerate(zip(inputs, weights, strict=True))
        ]
        total = torch.zeros((), dtype=torch.float32, device=labels.device)
        with torch.autocast(labels.device.type, enabled=False):
            for start in range(0, len(targets), chunk_tokens):
                chunk = slice(start, start + chunk_tokens)
                xs = [x[chunk].to(compute) for x in rows]
                total += _score_chunk(xs, ws, targets[chunk], chunk, grads, vocab_start, group)
        ctx.backward_twice = backward_twice
        ctx.grads = [
            grad
            for term, x, w in zip(grads, inputs, weights, strict=True)
            for grad in (term.input_of(trained, all_trained, x.shape), term.weight_of(w.dtype))
        ]
        return total

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # noqa: ANN205 (autograd's signature)
        if ctx.backward_twice:
            grads = [None if g is None else g * grad_loss.to(g.dtype) for g in ctx.grads]
        else:
            grads = [None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in ctx.grads]
            ctx.grads = None
        return (None,) * _FIXED_INPUTS + tuple(grads)


def trained_rows(labels: torch.Tensor) -> torch.Tensor:
    """The indices of the trained tokens. Which they are is data, which fake tensors
    (`meshtrain.dryrun`) do not have: there every token counts as trained, the most
    memory the loss can take."""
    if is_fake(labels):
        return torch.arange(labels.numel(), device=labels.device)
    return (labels != IGNORE_INDEX).nonzero().squeeze(1)


def _score_chunk(
    xs: list[torch.Tensor],
    ws: list[torch.Tensor],
    targets: torch.Tensor,
    chunk: slice,
    grads: list[_TermGradients],
    vocab_start: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """One chunk's summed loss, its gradients added to `grads`. A function of its own so
    that nothing of one chunk is alive while the next one's logits are made."""
    logits = xs[0] @ ws[0].T
    for x, w in zip(xs[1:], ws[1:], strict=True):
        logits.addmm_(x, w.T)
    loss, grad_logits = _chunk_loss(logits, targets, vocab_start, group)
    grad_logits = grad_logits.to(xs[0].dtype)
    for term, x, w in zip(grads, xs, ws, strict=True):
        term.add(chunk, grad_logits, x, w)
    return loss


def _chunk_loss(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, its gradient with respect to the logits, fp32) of one chunk
    whose logits hold the vocabulary rows from `vocab_start` (the whole vocabulary
    without a tp `group`). The fp32 logits are overwritten by their gradient."""
    z = logits.float()  # the same tensor when the logits are fp32
    local = targets - vocab_start
    mine = (local >= 0) & (local < z.shape[1])
    local = local.clamp(0, z.shape[1] - 1).unsqueeze(1)
    target_logit = z.gather(1, local).squeeze(1).masked_fill_(~mine, 0.0)
    top = z.max(dim=1).values
    if group is not None:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    z.sub_(top.unsqueeze(1)).exp_()
    sums = z.sum(dim=1)
    if group is not None:
        dist.all_reduce(sums, group=group)
        dist.all_reduce(target_logit, group=group)
    loss = (top + sums.log() - target_logit).sum()
    z.div_(sums.unsqueeze(1))  # softmax
    z.scatter_add_(1, local, -mine.to(z.dtype).unsqueeze(1))  # minus the one-hot target
    return loss, z


class _TermGradients:
    """The gradients of one term's input (trained rows only) and weight, accumulated
    chunk by chunk (None for one that needs none)."""

    def __init__(self, x: torch.Tensor | None, weight: torch.Tensor | None, rows: int):
        self.input = None if x is None else x.new_empty((rows, x.shape[1]))
        # fp32 accumulation over the chunks, whatever the weight's dtype.
        self.weight = None if weight is None else torch.zeros_like(weight, dtype=torch.float32)

    def add(self, chunk: slice, grad_logits: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
        if self.input is not None:
            grad_input = self.input[chunk]
            if grad_input.dtype == grad_logits.dtype:
                torch.matmul(grad_logits, w, out=grad_input)
            else:
                grad_input.copy_(grad_logits @ w)
        if self.weight is not None:
            if grad_logits.dtype == torch.float32:
                self.weight.addmm_(grad_logits.T, x)
            else:
                self.weight += grad_logits.T @ x

    def input_of(
        self, trained: torch.Tensor, all_trained: bool, shape: torch.Size
    ) -> torch.Tensor | None:
        """The gradient over every position (zero where not trained)."""
        if self.input is None or all_trained:
            return self.input
        return self.input.new_zeros(shape).index_copy_(0, trained, self.input)

    def weight_of(self, dtype: torch.dtype) -> torch.Tensor | None:
        return None if self.weight is None else self.weight.to(dtype)
