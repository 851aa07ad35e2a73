"""Each trained token's log-probability under the LM head, chunk by chunk: what a
preference loss sums per sequence (`models/preference_loss.py`).

The language-model loss computes its gradients in the forward (`models.head_loss`): its
own gradient is 1 for every token. A preference loss is a nonlinear function of each
sequence's summed log-probability, so a token's gradient is known only once the whole
pair is scored. This head therefore returns the log-probabilities and keeps what their
backward needs: the head's inputs, and each token's log-sum-exp (one float). The backward
makes each chunk's logits again (one more head matmul than the forward-gradient loss) and
never holds more than one chunk's. Under tensor parallelism the weight is sharded on the
vocabulary as for the loss: the maximum, the sum of exponentials and the target's logit
are combined over the tp group in the forward; the backward needs no collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtrain.models.head_loss import LowRank, head_terms, trained_rows


def linear_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    *,
    adapter: LowRank | None = None,
) -> torch.Tensor:
    """The (batch, sequence) fp32 log-probability of each position's label under
    `hidden @ weight.T` (plus a LoRA adapter's term), 0 where the label is ignored; no
    more than `chunk_tokens` tokens' logits at once. Weight and adapter as
    `head_loss.linear_cross_entropy_sum` takes them."""
    fixed, terms = head_terms(hidden, weight, adapter)
    logps = _ChunkedTokenLogProbs.apply(labels.flatten(), chunk_tokens, *fixed, *terms)
    return logps.view(hidden.shape[:2])


_FIXED_INPUTS = 5  # _ChunkedTokenLogProbs's arguments before its terms


class _ChunkedTokenLogProbs(torch.autograd.Function):
    """Forward: log p(label) of every trained token under the logits `sum_i x_i @ w_i.T`.
    Backward: the chunk's logits again, their gradient `g * (onehot - softmax)`, and from
    it every x_i's and w_i's."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        labels: torch.Tensor,
        chunk_tokens: int,
        compute: torch.dtype,
        vocab_start: int,
        group: dist.ProcessGroup | None,
        *terms: torch.Tensor,
    ) -> torch.Tensor:
        trained = trained_rows(labels)
        targets = labels.index_select(0, trained)
        logps = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
        lse = torch.empty(len(targets), dtype=torch.float32, device=labels.device)
        ws = [w.to(compute) for w in terms[1::2]]
        with torch.autocast(labels.device.type, enabled=False):
            for start in range(0, len(targets), chunk_tokens):
                rows = trained[start : start + chunk_tokens]
                xs = [x.index_select(0, rows).to(compute) for x in terms[::2]]
                lse[start : start + len(rows)], target = _chunk_scores(
                    _logits(xs, ws), targets[start : start + len(rows)], vocab_start, group
                )
                logps[rows] = target - lse[start : start + len(rows)]
        ctx.save_for_backward(labels, trained, lse, *terms)
        ctx.settings = (chunk_tokens, compute, vocab_start)
        return logps

    @staticmethod
    def backward(ctx, grad_logps: torch.Tensor):  # noqa: ANN205 (autograd's signature)
        labels, trained, lse, *terms = ctx.saved_tensors
        chunk_tokens, compute, vocab_start = ctx.settings
        needs = ctx.needs_input_grad[_FIXED_INPUTS:]
        inputs, weights = terms[::2], terms[1::2]
        ws = [w.to(compute) for w in weights]
        grad_in = [torch.zeros_like(x) if needs[2 * i] else None for i, x in enumerate(inputs)]
        grad_w = [
            torch.zeros_like(w, dtype=torch.float32) if needs[2 * i + 1] else None
            for i, w in enumerate(weights)
        ]
        targets = labels.index_select(0, trained)
        g = grad_logps.index_select(0, trained).float()
        with torch.autocast(labels.device.type, enabled=False):
            for start in range(0, len(targets), chunk_tokens):
                rows = trained[start : start + chunk_tokens]
                part = slice(start, start + len(rows))
                xs = [x.index_select(0, rows).to(compute) for x in inputs]
                grad_logits = _chunk_gradient(
                    _logits(xs, ws), targets[part], lse[part], g[part], vocab_start
                ).to(compute)
                for i, (x, w) in enumerate(zip(xs, ws, strict=True)):
                    if grad_in[i] is not None:
                        grad_in[i].index_add_(0, rows, (grad_logits @ w).to(grad_in[i].dtype))
                    if grad_w[i] is not None:
                        grad_w[i] += (grad_logits.T @ x).float()
        grads = []
        for i, w in enumerate(weights):
            grads += [grad_in[i], None if grad_w[i] is None else grad_w[i].to(w.dtype)]
        return (None,) * _FIXED_INPUTS + tuple(grads)


def _logits(xs: list[torch.Tensor], ws: list[torch.Tensor]) -> torch.Tensor:
    logits = xs[0] @ ws[0].T
    for x, w in zip(xs[1:], ws[1:], strict=True):
        logits.addmm_(x, w.T)
    return logits


def _chunk_scores(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp, target logit) of each row, in fp32, over the whole vocabulary. The
    fp32 logits are overwritten (one chunk's logits alive at a time)."""
    z = logits.float()
    local = targets - vocab_start
    mine = (local >= 0) & (local < z.shape[1])
    target = z.gather(1, local.clamp(0, z.shape[1] - 1).unsqueeze(1)).squeeze(1)
    target = target.masked_fill(~mine, 0.0)
    top = z.max(dim=1).values
    if group is not None:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    sums = z.sub_(top.unsqueeze(1)).exp_().sum(dim=1)
    if group is not None:
        dist.all_reduce(sums, group=group)
        dist.all_reduce(target, group=group)
    return top + sums.log(), target


def _chunk_gradient(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, start: int
) -> torch.Tensor:
    """d(sum g * log p(target)) / d logits = g * (onehot - softmax), in fp32, over this
    rank's vocabulary rows (from `start`)."""
    z = logits.float().sub_(lse.unsqueeze(1)).exp_().mul_(-g.unsqueeze(1))
    local = targets - start
    mine = (local >= 0) & (local < z.shape[1])
    z.scatter_add_(
        1, local.clamp(0, z.shape[1] - 1).unsqueeze(1), (g * mine.to(g.dtype)).unsqueeze(1)
    )
    return z
