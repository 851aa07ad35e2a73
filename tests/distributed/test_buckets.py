"""How the flat gradient buffer is cut into buckets and in which order they start.

The collectives themselves are checked against one process in
test_data_parallel / test_tensor_parallel / test_pipeline_parallel; these are
the rules every rank must apply identically, without a process group.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshtrain.distributed.data_parallel import GradientReducer, cut_buckets
from meshtrain.distributed.flat_buffer import FlatParameters


def _flat(sizes: list[tuple[str, tuple[int, ...]]], num_shards: int) -> FlatParameters:
    return FlatParameters(
        [(name, nn.Parameter(torch.zeros(shape))) for name, shape in sizes], num_shards=num_shards
    )


MODEL = [
    ("embed", (10, 4)),  # 40
    ("layer0.norm", (4,)),
    ("layer0.q", (4, 4)),  # 16
    ("layer0.down", (6, 4)),  # 24
    ("layer1.norm", (4,)),
    ("layer1.q", (4, 4)),
    ("layer1.down", (6, 4)),
    ("final_norm", (4,)),
    ("head", (10, 4)),
]


def _check_cover(flat: FlatParameters, buckets) -> None:
    assert buckets[0].start == 0 and buckets[-1].end == flat.padded_numel
    for before, after in zip(buckets, buckets[1:], strict=False):
        assert before.end == after.start


def test_buckets_cover_the_buffer_and_stop_at_parameter_boundaries() -> None:
    flat = _flat(MODEL, num_shards=1)
    buckets = cut_buckets(flat, bucket_numel=30, owned_ranges=None)
    _check_cover(flat, buckets)
    ends = {s.offset + s.numel for s in flat.slots}
    for bucket in buckets:
        assert bucket.end in ends and bucket.owner is None and not bucket.deferred
        # A bucket closes at the first parameter boundary past the size.
        last = flat.slots[bucket.slots[-1]]
        assert bucket.end - bucket.start - last.numel < 30
    assert len(cut_buckets(flat, bucket_numel=10**9, owned_ranges=None)) == 1


def test_zero_1_buckets_never_straddle_two_owners() -> None:
    flat = _flat(MODEL, num_shards=3)
    per_rank = flat.padded_numel // 3
    owned = [(r * per_rank, (r + 1) * per_rank) for r in range(3)]
    buckets = cut_buckets(flat, bucket_numel=10**9, owned_ranges=owned)
    _check_cover(flat, buckets)
    # One bucket per owner when the size allows, even where a parameter is cut in two.
    assert [(b.start, b.end, b.owner) for b in buckets] == [
        (lo, hi, r) for r, (lo, hi) in enumerate(owned)
    ]
    small = cut_buckets(flat, bucket_numel=20, owned_ranges=owned)
    _check_cover(flat, small)
    for bucket in small:
        lo, hi = owned[bucket.owner]
        assert lo <= bucket.start < bucket.end <= hi


def test_deferred_parameters_get_buckets_of_their_own_started_last() -> None:
    flat = _flat(MODEL, num_shards=1)
    deferred = {"layer0.norm", "layer1.norm"}
    buckets = cut_buckets(flat, bucket_numel=10**9, owned_ranges=None, deferred_names=deferred)
    _check_cover(flat, buckets)
    for bucket in buckets:
        names = {flat.slots[i].name for i in bucket.slots}
        assert bucket.deferred == bool(names & deferred)
        assert not bucket.deferred or names <= deferred
    reducer = GradientReducer(
        flat, None, owned_ranges=None, bucket_bytes=10**9, overlap=True, deferred_names=deferred
    )
    order = [reducer.buckets[b].deferred for b in reducer.launch_order]
    assert order == sorted(order) and order[-1]


def test_buckets_start_in_the_order_the_backward_finishes_them() -> None:
    """The head's gradient comes first, the embedding's last; every rank derives the same
    order from the model, whatever order the buffer keeps the parameters in."""
    flat = _flat(MODEL, num_shards=1)
    reducer = GradientReducer(flat, None, owned_ranges=None, bucket_bytes=4 * 20, overlap=True)
    first_names = [
        min((flat.slots[i] for i in reducer.buckets[b].slots), key=lambda s: s.position).name
        for b in reducer.launch_order
    ]
    positions = [dict((n, i) for i, (n, _) in enumerate(MODEL))[name] for name in first_names]
    assert positions == sorted(positions, reverse=True)
    assert "embed" in {flat.slots[i].name for i in reducer.buckets[reducer.launch_order[-1]].slots}


def test_one_process_needs_no_hooks_and_no_communication() -> None:
    flat = _flat(MODEL, num_shards=1)
    reducer = GradientReducer(flat, None, owned_ranges=None, bucket_bytes=64, overlap=True)
    assert not reducer.overlap and not reducer._hooks
    flat.grads.fill_(3.0)
    reducer.expect(1)
    reducer.finish(flat.grads)
    assert torch.equal(flat.grads, torch.full_like(flat.grads, 3.0))


@pytest.mark.parametrize("bucket_mb", [0, -1])
def test_a_bucket_size_that_cannot_work_is_refused(bucket_mb: float) -> None:
    from meshtrain.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match="training.grad_bucket_mb"):
        RunConfig.from_params(training={"grad_bucket_mb": bucket_mb})
