"""The trainer's throughput figures: tokens over wall time, and the median step."""

from __future__ import annotations

import pytest

from meshtrain.components.metrics import Throughput


def test_throughput_is_tokens_over_time_and_the_median_ignores_one_slow_step() -> None:
    throughput = Throughput()
    assert throughput.tokens_per_s is None and throughput.median_step_s is None
    for seconds in (0.5, 0.5, 3.0, 0.5, 0.6):
        throughput.add(1000, seconds)
    assert throughput.tokens_per_s == pytest.approx(5000 / 5.1)
    assert throughput.median_step_s == 0.5
