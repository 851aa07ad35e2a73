"""Rank 0's per-step metrics, written from the worker straight into the Kedro session's run.

The process that owns the MLflow run (the Kedro session) passes a
`TrackingTarget` to the workers. This module is what every worker imports, so
it imports MLflow only when a logger is given a target: the other ranks (and
rank 0 outside a run) never pay MLflow's import, about 2.5 s of CPU a process,
which on a node of many ranks is start-up every rank waits through. A warm-rank
server imports it once for all of them (`import_client`), on a core the launcher's own
start leaves idle, so that rank 0 does not import it while its model builds beside the
other ranks (it was most of the wait for the first step at 4 ranks on 2 cores).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

# MLflow accepts at most 1000 metrics per batch.
_BATCH = 1000


@dataclass(frozen=True)
class TrackingTarget:
    tracking_uri: str
    run_id: str


def _client(tracking_uri: str) -> MlflowClient:
    from meshtrain.offline import disable_telemetry

    disable_telemetry()  # before mlflow is imported
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def import_client() -> None:
    """For a warm-rank server: MLflow's client and the stores a run's URI may name (a
    database's, a tracking server's REST one), which the client imports when made."""
    from meshtrain.offline import disable_telemetry

    disable_telemetry()  # before mlflow is imported
    import mlflow.store.tracking.rest_store  # noqa: F401
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
    import mlflow.tracking  # noqa: F401


class MetricsLogger:
    """Rank 0's buffered writer of per-step metrics into an existing MLflow run; does
    nothing without a target."""

    def __init__(self, target: TrackingTarget | None, flush_every_s: float = 5.0) -> None:
        self.target = target
        self.client = _client(target.tracking_uri) if target else None
        if self.client is not None:
            from mlflow.entities import Metric

            self._metric = Metric
        self.flush_every_s = flush_every_s
        self._pending: list[Any] = []
        self._last_flush = time.monotonic()

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.client is None:
            return
        now_ms = int(time.time() * 1000)
        self._pending.extend(self._metric(k, float(v), now_ms, step) for k, v in metrics.items())
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def log_artifact(self, path: str | Path) -> None:
        if self.client is not None:
            self.client.log_artifact(self.target.run_id, str(path))

    def flush(self) -> None:
        if self.client is None or not self._pending:
            return
        for start in range(0, len(self._pending), _BATCH):
            batch = self._pending[start : start + _BATCH]
            self.client.log_batch(self.target.run_id, metrics=batch)
        self._pending = []
        self._last_flush = time.monotonic()
