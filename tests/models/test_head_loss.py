"""The chunked linear cross-entropy in one process: the same losses, gradients and weights
as the loss over the whole logits for 12 AdamW steps (with half the tokens ignored too),
bf16 near it, evaluation without gradients, a frozen head, and the planner's choices."""

from __future__ import annotations

import copy

import pytest
import torch

from meshtrain.data.batch import IGNORE_INDEX
from meshtrain.models import build_model, build_model_config
from meshtrain.models.head_loss import (
    linear_cross_entropy_sum,
    score_in_chunks,
    token_loss_sum,
)
from meshtrain.models.llama.stage import WholeModel
from meshtrain.planner.loss_memory import auto_loss_chunk_tokens
from tests.conftest import TINY_MODEL, TINY_VOCAB

STEPS = 12
CHUNK = 48  # 4 x 32 tokens a batch: three chunks, the last one short


def _batches(ignore_half: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(STEPS):
        # Learnable (arithmetic sequences), as the layouts' equivalence tests train on:
        # random tokens leave the loss flat and let rounding grow over the steps.
        start = torch.randint(0, TINY_VOCAB, (4, 1), generator=generator)
        stride = torch.randint(1, 4, (4, 1), generator=generator)
        ids = (start + stride * torch.arange(33)) % TINY_VOCAB
        labels = ids[:, 1:].clone()
        if ignore_half:
            labels[torch.rand(labels.shape, generator=generator) < 0.5] = IGNORE_INDEX
        batches.append((ids[:, :-1], labels))
    return batches


def _train(chunk: int, ignore_half: bool, tied: bool = False):
    """12 steps of AdamW on the summed loss over the trained tokens; the losses, the weights
    after, and each step's largest relative difference of a gradient from the whole
    logits' gradient at the same weights."""
    fields = {**TINY_MODEL, "tie_word_embeddings": tied}
    model = build_model(build_model_config("llama", fields, vocab_size=TINY_VOCAB), seed=5)
    score_in_chunks(model.lm_head, chunk)
    scored = WholeModel(model)

    def whole(ids, labels):  # the same decoder, the head's logits whole
        return token_loss_sum(model.lm_head(model.model(input_ids=ids).last_hidden_state), labels)

    # AdamW at a modest rate: at the equivalence tests' 1e-2 a 64-wide toy model turns
    # last-bit gradient differences (5e-7 here) into 1e-5 weight differences in 12 steps.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5, weight_decay=0.1)
    losses, grad_differences = [], []
    for ids, labels in _batches(ignore_half):
        tokens = (labels != IGNORE_INDEX).sum()
        (whole(ids, labels) / tokens).backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.zero_grad()
        loss = scored(ids, labels) / tokens
        loss.backward()
        grad_differences.append(
            max(
                float((p.grad - want[n]).norm() / want[n].norm())
                for n, p in model.named_parameters()
            )
        )
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, dict(model.named_parameters()), grad_differences


@pytest.mark.parametrize(("ignore_half", "tied"), [(False, False), (True, False), (True, True)])
def test_chunked_loss_trains_as_the_whole_logits_do(ignore_half: bool, tied: bool):
    chunked = _train(CHUNK, ignore_half, tied)
    whole = _train(0, ignore_half, tied)
    for step, (got, want) in enumerate(zip(chunked[0], whole[0], strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want}"
    for name, weight in whole[1].items():
        rel = (chunked[1][name] - weight).norm() / weight.norm()
        assert rel <= 1e-5, f"{name}: {rel:.2e}"
    assert max(chunked[2]) <= 1e-5, chunked[2]
    assert max(whole[2]) == 0  # the same loss twice: the check itself compares like with like


def _head_case(dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 40, 32, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(100, 32, generator=generator) / 8).to(dtype).requires_grad_()
    labels = torch.randint(0, 100, (3, 40), generator=generator)
    labels[0, :25] = IGNORE_INDEX
    return hidden, weight, labels


def _loss_and_grads(loss_fn, hidden, weight, labels, autocast: bool = False):
    hidden.grad = weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = loss_fn(hidden, weight, labels)
    loss.backward(torch.tensor(0.25))
    return loss.detach(), hidden.grad, weight.grad


def _whole(hidden, weight, labels):
    return token_loss_sum(hidden @ weight.T, labels)


def _chunked(hidden, weight, labels):
    return linear_cross_entropy_sum(hidden, weight, labels, 16)


@pytest.mark.parametrize(
    ("autocast", "dtype"), [(True, torch.float32), (False, torch.bfloat16)], ids=["bf16", "master"]
)
def test_bf16_keeps_fp32_log_sum_exp_and_stays_near_the_whole_logits(autocast, dtype):
    """Under autocast (bf16 logits of fp32 weights) and with bf16 weights, the chunked loss
    is the whole-logits loss to bf16's rounding, its gradients in the weights' dtypes."""
    case = _head_case(dtype)
    want = _loss_and_grads(_whole, *case, autocast=autocast)
    got = _loss_and_grads(_chunked, *case, autocast=autocast)
    assert got[0].dtype == torch.float32
    assert abs(got[0] - want[0]) <= 2e-3 * abs(want[0])
    for got_grad, want_grad in zip(got[1:], want[1:], strict=True):
        assert got_grad.dtype == want_grad.dtype == dtype
        assert (got_grad.float() - want_grad.float()).norm() <= 2e-2 * want_grad.float().norm()


def test_evaluation_and_a_frozen_head_make_no_gradient_they_do_not_need():
    hidden, weight, labels = _head_case()
    with torch.no_grad():
        assert torch.allclose(_chunked(hidden, weight, labels), _whole(hidden, weight, labels))
    weight.requires_grad_(False)
    _, hidden_grad, weight_grad = _loss_and_grads(_chunked, hidden, weight, labels)
    assert weight_grad is None
    _, want, _ = _loss_and_grads(_whole, hidden, weight, labels)
    assert torch.allclose(hidden_grad, want, rtol=1e-5, atol=1e-7)
    assert hidden_grad[0, :24].abs().max() == 0  # ignored positions: no gradient


def test_a_fully_ignored_batch_scores_zero():
    hidden, weight, labels = _head_case()
    labels = torch.full_like(labels, IGNORE_INDEX)
    loss, hidden_grad, weight_grad = _loss_and_grads(_chunked, hidden, weight, labels)
    assert loss == 0 and hidden_grad.abs().max() == 0 and weight_grad.abs().max() == 0


def test_the_whole_model_with_a_copy_of_the_head_loses_nothing():
    """WholeModel keeps the Hugging Face names: a checkpoint of it is the model's."""
    model = build_model(build_model_config("llama", TINY_MODEL, vocab_size=TINY_VOCAB), seed=5)
    names = [n for n, _ in model.named_parameters()]
    copied = copy.deepcopy(model)
    score_in_chunks(copied.lm_head, CHUNK)
    assert [n for n, _ in WholeModel(copied).named_parameters()] == names
    assert isinstance(copied.lm_head, torch.nn.Linear)


def test_auto_chunk_keeps_the_fp32_logits_near_256_mib_and_at_least_1024_tokens():
    assert auto_loss_chunk_tokens(128_256, 1, 16_384) == 512 * 2  # 1,024 floor
    assert auto_loss_chunk_tokens(32_000, 1, 16_384) == 2048
    assert auto_loss_chunk_tokens(32_000, 8, 16_384) == 16_384  # one chunk
    assert auto_loss_chunk_tokens(4096, 1, 1024) == 1024  # the whole microbatch
