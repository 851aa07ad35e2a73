"""MLflow tracking helpers against a real sqlite store under pytest's tmp folder."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import mlflow
import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from meshtrain.tracking import mlflow_run as tracking
from meshtrain.tracking import plots
from meshtrain.tracking.mlflow_run import MetricsLogger, TrackingTarget


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One sqlite store for the module: creating one costs seconds (schema migrations)."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("loss-curve")
    yield uri
    if mlflow.active_run() is not None:
        mlflow.end_run()
    mlflow.set_tracking_uri(previous)


def test_loss_curve_is_drawn_from_the_runs_own_history(store: str, tmp_path: Path, monkeypatch):
    with mlflow.start_run() as run:
        mlflow.set_tag("meshtrain.layout", "dp2-tp1-pp1-zero1")
        target = TrackingTarget(store, run.info.run_id)
        # As rank 0 writes it: loss every step, val_loss at steps 0, 4 and 8.
        logger = MetricsLogger(target, flush_every_s=3600)
        for step in range(1, 9):
            logger.log({"loss": 7.0 - 0.1 * step, "tokens_per_s": 1000.0}, step=step)
        for step in (0, 4, 8):
            logger.log({"val_loss": 7.1 - 0.1 * step}, step=step)
        logger.flush()
        # A resumed run logs steps 5..8 again; the later values are the ones drawn.
        for step in range(5, 9):
            mlflow.log_metric("loss", 6.0 - 0.1 * step, step=step, timestamp=2**41 + step)

        drawn = {}
        real_loss_curve = plots.loss_curve

        def spy(history, path, title):
            drawn.update(history, title=title)
            return real_loss_curve(history, path, title)

        monkeypatch.setattr(plots, "loss_curve", spy)
        assert tracking.log_loss_curve() == "loss_curve.png"

    assert drawn["title"] == "dp2-tp1-pp1-zero1: loss per step"
    assert [step for step, _ in drawn["training loss"]] == list(range(1, 9))
    assert drawn["training loss"][4] == (5, pytest.approx(5.5))
    assert drawn["training loss"][3] == (4, pytest.approx(6.6))
    assert drawn["validation loss"] == [(0, 7.1), (4, pytest.approx(6.7)), (8, pytest.approx(6.3))]

    client = MlflowClient(tracking_uri=store)
    assert "loss_curve.png" in [a.path for a in client.list_artifacts(run.info.run_id)]
    local = client.download_artifacts(run.info.run_id, "loss_curve.png", str(tmp_path))
    picture = matplotlib.image.imread(local)
    assert picture.shape[0] > 200 and picture.shape[1] > 400
    # Not a blank canvas: the two curves put colour on it.
    assert np.unique(picture.reshape(-1, picture.shape[-1]), axis=0).shape[0] > 20


def test_loss_curve_needs_a_run_and_a_loss(store: str):
    assert tracking.log_loss_curve() is None  # no active run
    with mlflow.start_run() as run:
        mlflow.log_metric("tokens_per_s", 1.0, step=1)
        assert tracking.log_loss_curve() is None  # nothing to draw
    client = MlflowClient(tracking_uri=store)
    assert client.list_artifacts(run.info.run_id) == []


def test_loss_curve_plot_orders_steps_and_skips_empty_series(tmp_path: Path):
    path = plots.loss_curve(
        {"loss": [(3, 5.0), (1, 6.0), (2, 5.5)], "val_loss": []},
        tmp_path / "sub" / "curve.png",
        "title",
    )
    assert path.exists() and path.stat().st_size > 1000
