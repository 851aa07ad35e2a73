"""A refusal ends `kedro run` with its message alone; other errors keep their traceback."""

from __future__ import annotations

import sys

import pytest

from meshtrain import refusals
from meshtrain.checkpoint.manifest import CheckpointError
from meshtrain.config import ConfigError, Refused
from meshtrain.launch.backends import BackendUnavailableError
from meshtrain.models.llama.pretrained import PretrainedError
from meshtrain.planner import LayoutError
from meshtrain.tracking.servers import TrackingConfigError


def test_every_deliberate_refusal_is_a_refused():
    for kind in (
        ConfigError,
        LayoutError,
        CheckpointError,
        PretrainedError,
        BackendUnavailableError,
        TrackingConfigError,
    ):
        assert issubclass(kind, Refused), kind


def test_the_refusal_behind_another_error_is_found():
    try:
        try:
            raise ConfigError("`training.x` is wrong")
        except ConfigError as inner:
            raise RuntimeError("Node plan_layout failed") from inner
    except RuntimeError as outer:
        assert isinstance(refusals.refusal_in(outer), ConfigError)
    assert refusals.refusal_in(RuntimeError("boom")) is None


@pytest.fixture
def installed(monkeypatch):
    """The wrapper around a recording hook, as Kedro's rich hook would be wrapped."""
    seen: list[type] = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, error, tb: seen.append(kind))
    monkeypatch.delenv(refusals.TRACEBACK_VARIABLE, raising=False)
    refusals.show_refusals_plainly()
    refusals.show_refusals_plainly()  # a second session in the process wraps nothing more
    return seen


def test_a_refusal_prints_its_message_alone(installed, capsys):
    sys.excepthook(
        ConfigError, ConfigError("`parallel.tensor_parallel_size` must be at least 1"), None
    )
    err = capsys.readouterr().err
    assert err.startswith("ConfigError: `parallel.tensor_parallel_size` must be at least 1\n")
    assert refusals.TRACEBACK_VARIABLE in err and len(err.splitlines()) == 3
    assert installed == []


def test_other_errors_and_the_variable_keep_the_traceback(installed, monkeypatch):
    sys.excepthook(RuntimeError, RuntimeError("boom"), None)
    monkeypatch.setenv(refusals.TRACEBACK_VARIABLE, "1")
    sys.excepthook(LayoutError, LayoutError([]), None)
    assert installed == [RuntimeError, LayoutError]
