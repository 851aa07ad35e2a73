"""GlobalBatchSampler: the sample order depends on (seed, global batch) only, never the layout."""

from __future__ import annotations

import itertools

import pytest

from meshtrain.data.sampler import GlobalBatchSampler

GLOBAL_BATCH = 16
NUM_SAMPLES = 40  # not a multiple of 16: steps 2 and 4 straddle an epoch boundary
STEPS = range(6)


def _splits() -> list[tuple[int, int]]:
    """Every (dp, micro-batch size) that cuts a global batch of 16."""
    splits = []
    for dp in (1, 2, 4, 8):
        per_rank = GLOBAL_BATCH // dp
        splits += [(dp, mb) for mb in range(1, per_rank + 1) if per_rank % mb == 0]
    return splits


@pytest.mark.parametrize(("dp", "micro_batch_size"), _splits())
def test_every_layout_sees_the_same_global_batch(dp: int, micro_batch_size: int) -> None:
    sampler = GlobalBatchSampler(NUM_SAMPLES, GLOBAL_BATCH, seed=7)
    reference = GlobalBatchSampler(NUM_SAMPLES, GLOBAL_BATCH, seed=7)
    for step in STEPS:
        gathered = []
        for rank in range(dp):
            microbatches = sampler.rank_microbatches(step, rank, dp, micro_batch_size)
            assert len(microbatches) == GLOBAL_BATCH // dp // micro_batch_size
            assert all(len(mb) == micro_batch_size for mb in microbatches)
            gathered += list(itertools.chain.from_iterable(microbatches))
        assert gathered == reference.global_indices(step), (dp, micro_batch_size, step)


def test_the_splits_cover_the_interesting_cases() -> None:
    splits = _splits()
    assert (1, 16) in splits and (8, 1) in splits and (2, 4) in splits
    assert len(splits) == 5 + 4 + 3 + 2


def test_global_indices_are_in_range_and_deterministic() -> None:
    a = GlobalBatchSampler(NUM_SAMPLES, GLOBAL_BATCH, seed=3)
    b = GlobalBatchSampler(NUM_SAMPLES, GLOBAL_BATCH, seed=3)
    for step in STEPS:
        indices = a.global_indices(step)
        assert len(indices) == GLOBAL_BATCH
        assert all(isinstance(i, int) and 0 <= i < NUM_SAMPLES for i in indices)
        assert indices == b.global_indices(step)
    # Asking again, out of order, gives the same answer (the epoch cache is only a cache).
    assert a.global_indices(0) == b.global_indices(0)
    assert a.global_indices(5) == b.global_indices(5)


def test_steps_are_consecutive_slices_of_the_epoch_stream() -> None:
    sampler = GlobalBatchSampler(NUM_SAMPLES, GLOBAL_BATCH, seed=0)
    stream = list(itertools.chain.from_iterable(sampler.global_indices(s) for s in range(5)))
    epochs = [stream[i : i + NUM_SAMPLES] for i in range(0, 80, NUM_SAMPLES)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(NUM_SAMPLES))
    # Step 2 straddles the boundary: its head ends epoch 0 and its tail starts epoch 1.
    step_2 = sampler.global_indices(2)
    assert step_2[:8] == epochs[0][32:]
    assert step_2[8:] == epochs[1][:8]


@pytest.mark.parametrize("num_samples", [16, 48, 160])
def test_each_epoch_is_a_permutation(num_samples: int) -> None:
    sampler = GlobalBatchSampler(num_samples, GLOBAL_BATCH, seed=11)
    steps_per_epoch = num_samples // GLOBAL_BATCH
    orders = []
    for epoch in range(3):
        seen = []
        for step in range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch):
            seen += sampler.global_indices(step)
        assert sorted(seen) == list(range(num_samples)), epoch
        orders.append(seen)
    # Epochs are reshuffled, not repeated.
    assert orders[0] != orders[1] and orders[1] != orders[2]


def test_different_seeds_give_different_orders() -> None:
    first = GlobalBatchSampler(160, GLOBAL_BATCH, seed=1)
    second = GlobalBatchSampler(160, GLOBAL_BATCH, seed=2)
    assert first.global_indices(0) != second.global_indices(0)
    assert [first.global_indices(s) for s in range(10)] != [
        second.global_indices(s) for s in range(10)
    ]


@pytest.mark.parametrize(
    ("dp", "micro_batch_size"),
    [(3, 1), (5, 1), (2, 3), (4, 8), (1, 32), (16, 2)],
)
def test_a_split_that_does_not_cut_the_batch_is_refused(dp: int, micro_batch_size: int) -> None:
    sampler = GlobalBatchSampler(NUM_SAMPLES, GLOBAL_BATCH, seed=0)
    with pytest.raises(ValueError, match=f"global batch 16 does not split into {dp} ranks"):
        sampler.rank_microbatches(0, 0, dp, micro_batch_size)


def test_an_empty_training_split_is_refused() -> None:
    with pytest.raises(ValueError, match="no blocks"):
        GlobalBatchSampler(0, GLOBAL_BATCH, seed=0)


def test_rank_slices_are_contiguous() -> None:
    sampler = GlobalBatchSampler(NUM_SAMPLES, GLOBAL_BATCH, seed=9)
    step = sampler.global_indices(3)
    assert sampler.rank_microbatches(3, 1, 2, 8) == [step[8:]]
    assert sampler.rank_microbatches(3, 3, 4, 2) == [step[12:14], step[14:16]]


@pytest.mark.parametrize(
    ("num_samples", "step", "expected"),
    [(40, 0, 0.0), (40, 1, 0.4), (40, 5, 2.0), (16, 3, 3.0), (64, 2, 0.5)],
)
def test_epoch_of(num_samples: int, step: int, expected: float) -> None:
    sampler = GlobalBatchSampler(num_samples, GLOBAL_BATCH, seed=0)
    assert sampler.epoch_of(step) == pytest.approx(expected)
