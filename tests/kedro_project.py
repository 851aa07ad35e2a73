"""A scratch copy of the Kedro project for end-to-end tests, and `kedro run` inside it.

Only `conf/`, `pyproject.toml` and `.telemetry` are copied, so a run writes its
data, checkpoints and MLflow store under pytest's tmp folder, never into the
repository; meshtrain itself is imported as installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEDRO = Path(sys.executable).with_name("kedro")

# A run small enough for tests: a slice of the built-in corpus, 8 steps.
SMALL_RUN = ",".join(
    [
        "data.builtin_max_chars=300000",
        "data.vocab_size=1024",
        "data.num_proc=1",
        "training.max_steps=8",
        "training.checkpoint_every=4",
        "training.eval_every=4",
        "training.eval_batches=2",
        "training.warmup_steps=2",
        "training.per_device_train_batch_size=4",
        "evaluation.max_batches=4",
        "evaluation.max_new_tokens=8",
    ]
)


def make_project(root: Path) -> Path:
    """Lay out a runnable project under `root` (conf/local left empty)."""
    shutil.copytree(REPO / "conf", root / "conf", ignore=shutil.ignore_patterns("local"))
    (root / "conf" / "local").mkdir()
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    shutil.copy(REPO / ".telemetry", root / ".telemetry")
    (root / "src").mkdir()  # kedro wants the folder
    for layer in ("01_raw", "02_intermediate", "05_model_input", "06_models", "08_reporting"):
        (root / "data" / layer).mkdir(parents=True)
    return root


def project_env(**extra: str) -> dict[str, str]:
    """The test's environment for a child `kedro run`: the project's own mlflow.yml decides
    the store (an inherited MLFLOW_TRACKING_URI would win), wide lines keep messages whole."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["COLUMNS"] = "400"
    env.update(extra)
    return env


def kedro_run(project: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`kedro run *args` in `project`, forked warm where it can be (tests/warm_kedro.py)."""
    from tests import warm_kedro

    return warm_kedro.run(["run", *args], project, project_env(), timeout)


def mlflow_client(project: Path):
    """A client on the scratch project's sqlite store."""
    import mlflow

    return mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
