"""MLflow tracking helpers against a real sqlite store under pytest's tmp folder."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import mlflow
import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from meshtrain.tracking import mlflow_run as tracking
from meshtrain.tracking import plots
from meshtrain.tracking.rank_metrics import MetricsLogger, TrackingTarget


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


def test_runs_are_named_after_the_pipelines_they_ran_unless_they_train():
    registered = {
        "planning": {"plan_layout"},
        "training": {"train_model"},
        "evaluation": {"evaluate"},
    }
    name, tags = tracking.describe_run({"plan_layout"}, registered, trains=False)
    assert (name, tags) == (
        "planning",
        {"meshtrain.pipelines": "planning", "meshtrain.trains": "false"},
    )
    name, tags = tracking.describe_run({"plan_layout", "train_model"}, registered, trains=True)
    assert tags == {"meshtrain.pipelines": "planning,training", "meshtrain.trains": "true"}


def test_a_planning_run_keeps_its_name_and_the_experiment_is_for_training(store: str):
    experiment = mlflow.get_experiment_by_name("loss-curve")
    tracking.mark_model_training(experiment.experiment_id)
    tags = MlflowClient(tracking_uri=store).get_experiment(experiment.experiment_id).tags
    assert tags["mlflow.experimentKind"] == "custom_model_development"
    plan = {
        "layout": {"data_parallel_size": 2},
        "layout_name": "dp2-tp1-pp1",
        "world_size": 2,
        "global_batch_size": 8,
        "tokens_per_step": 1024,
        "num_parameters": 10,
        "backend": "gloo",
        "memory_estimate_per_rank": {"total": 1},
    }
    with mlflow.start_run(run_name="planning", tags={"meshtrain.trains": "false"}) as run:
        tracking.log_plan(plan, {})
    with mlflow.start_run(run_name="__default__", tags={"meshtrain.trains": "true"}) as trained:
        tracking.log_plan(plan, {})
    client = MlflowClient(tracking_uri=store)
    assert client.get_run(run.info.run_id).info.run_name == "planning"
    assert client.get_run(run.info.run_id).data.tags["meshtrain.layout"] == "dp2-tp1-pp1"
    assert client.get_run(trained.info.run_id).info.run_name == "dp2-tp1-pp1"


def test_a_refused_run_is_soft_deleted_but_a_sweeps_stays(store: str):
    from meshtrain.config import ConfigError

    client = MlflowClient(tracking_uri=store)
    mlflow.start_run()
    refused = mlflow.active_run().info.run_id
    tracking.discard_refused_run(ConfigError("`parallel.tensor_parallel_size` is 3"))
    run = client.get_run(refused)
    assert (run.info.lifecycle_stage, run.info.status) == ("deleted", "FAILED")
    assert run.data.tags["meshtrain.refused"] == "ConfigError"
    mlflow.start_run(tags={"meshtrain.sweep": "s1"})
    kept = mlflow.active_run().info.run_id
    tracking.discard_refused_run(ConfigError("no"))
    assert client.get_run(kept).info.lifecycle_stage == "active"


def test_samples_are_a_table_of_prompts_and_continuations(store: str, tmp_path: Path):
    samples = [{"prompt": "The", "continuation": " cat"}, {"prompt": "A", "continuation": " b"}]
    with mlflow.start_run() as run:
        tracking.log_samples(samples)
    client = MlflowClient(tracking_uri=store)
    path = client.download_artifacts(run.info.run_id, "samples.json", str(tmp_path))
    table = json.loads(Path(path).read_text())
    assert table["columns"] == ["prompt", "continuation"]
    assert table["data"] == [["The", " cat"], ["A", " b"]]


def test_packed_splits_are_dataset_inputs_with_stable_digests(store: str, tiny_blocks):
    import datasets

    from meshtrain.tracking.datasets import blocks_digest, log_packed_blocks

    data = {"source": "hub", "hub_dataset": "Salesforce/wikitext", "hub_config": "raw"}
    ids = []
    for _ in range(2):
        with mlflow.start_run() as run:
            log_packed_blocks(tiny_blocks, data | {"block_size": 32})
        ids.append(run.info.run_id)
    client = MlflowClient(tracking_uri=store)
    runs = [client.get_run(i).inputs.dataset_inputs for i in ids]
    first = {i.tags[0].value: i.dataset for i in runs[0]}
    assert sorted(first) == ["training", "validation"]
    assert first["training"].name == "wikitext-train-b32"
    assert '"config_name": "raw"' in first["training"].source
    profile = json.loads(first["training"].profile)
    assert profile == {"num_rows": 128, "num_tokens": 128 * 32}
    # Two runs on the same data: the same digests; other data: another.
    assert [i.dataset.digest for i in runs[0]] == [i.dataset.digest for i in runs[1]]
    train = tiny_blocks["train"]
    rebuilt = datasets.Dataset.from_dict({"input_ids": train["input_ids"]})
    assert blocks_digest(rebuilt) == blocks_digest(train)
    assert blocks_digest(train.select(range(127)))[0] != blocks_digest(train)[0]


def test_a_splits_schema_from_its_first_rows_is_mlflows_from_all(tiny_blocks, packed_blocks):
    """The schema logged with a split is inferred from a few rows, not every token: the
    same as MLflow's own inference over the whole split, pretraining and fine-tuning."""
    from mlflow.data.huggingface_dataset import HuggingFaceDataset

    from meshtrain.tracking.datasets import SCHEMA_ROWS, packed_split

    for blocks in (tiny_blocks, packed_blocks):
        split = packed_split(blocks["train"], "train", {"block_size": 32})
        assert split._ds.num_rows > SCHEMA_ROWS
        whole = HuggingFaceDataset(ds=split._ds, source=split.source, digest=split.digest)
        assert split.schema is not None and split.schema == whole.schema
