"""warmup_cosine: linear warmup to the peak, then cosine decay to the floor, never below it."""

from __future__ import annotations

import math

import pytest

from meshtrain.components.lr_schedule import warmup_cosine

WARMUP = 10
MAX_STEPS = 100
MIN_RATIO = 0.1


def _lr(step: int, **overrides: float) -> float:
    kwargs = {"warmup_steps": WARMUP, "max_steps": MAX_STEPS, "min_ratio": MIN_RATIO}
    return warmup_cosine(step, **{**kwargs, **overrides})


def test_warmup_is_linear_and_reaches_the_peak() -> None:
    values = [_lr(s) for s in range(WARMUP)]
    assert values == pytest.approx([(s + 1) / WARMUP for s in range(WARMUP)])
    assert values[0] > 0.0
    assert values[-1] == pytest.approx(1.0)
    steps = [b - a for a, b in zip(values, values[1:], strict=False)]
    assert steps == pytest.approx([1 / WARMUP] * (WARMUP - 1))


def test_decay_starts_at_the_peak() -> None:
    assert _lr(WARMUP) == pytest.approx(1.0)


def test_decay_is_monotone_and_ends_at_the_floor() -> None:
    values = [_lr(s) for s in range(WARMUP, MAX_STEPS + 1)]
    assert all(b < a for a, b in zip(values, values[1:], strict=False))
    assert values[-1] == pytest.approx(MIN_RATIO)


def test_halfway_through_the_decay_is_the_midpoint() -> None:
    middle = WARMUP + (MAX_STEPS - WARMUP) // 2
    assert _lr(middle) == pytest.approx(MIN_RATIO + (1 - MIN_RATIO) / 2)


def test_cosine_shape() -> None:
    step = WARMUP + 30
    progress = 30 / (MAX_STEPS - WARMUP)
    expected = MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))
    assert _lr(step) == pytest.approx(expected)


@pytest.mark.parametrize("min_ratio", [0.0, 0.1, 0.5, 1.0])
def test_after_warmup_never_below_the_floor_nor_above_the_peak(min_ratio: float) -> None:
    values = [_lr(s, min_ratio=min_ratio) for s in range(3 * MAX_STEPS)]
    assert all(0.0 <= v <= 1.0 + 1e-12 for v in values)
    assert all(min_ratio - 1e-12 <= v for v in values[WARMUP:])
    # Past max_steps the multiplier stays on the floor.
    assert all(v == pytest.approx(min_ratio) for v in values[MAX_STEPS:])


def test_no_warmup_starts_at_the_peak() -> None:
    assert _lr(0, warmup_steps=0) == pytest.approx(1.0)
    assert _lr(MAX_STEPS, warmup_steps=0) == pytest.approx(MIN_RATIO)


def test_warmup_as_long_as_the_run_does_not_divide_by_zero() -> None:
    assert _lr(MAX_STEPS - 1, warmup_steps=MAX_STEPS) == pytest.approx(1.0)
    assert _lr(MAX_STEPS, warmup_steps=MAX_STEPS) == pytest.approx(1.0)
    assert _lr(MAX_STEPS + 1, warmup_steps=MAX_STEPS) == pytest.approx(MIN_RATIO)
