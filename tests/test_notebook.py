"""`notebooks/compare_layouts.ipynb` runs top to bottom on a real sweep's MLflow runs.

It is executed with nbclient in an IPython kernel of this interpreter, from a
folder inside the scratch project, so it finds the project's `mlflow.db` itself
(no `MLFLOW_TRACKING_URI`) and the latest sweep (no `MESHTRAIN_SWEEP`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.kedro_project import REPO, mlflow_client
from tests.test_sweep import EXPECTED, Sweep, shared_sweep

NOTEBOOK = REPO / "notebooks" / "compare_layouts.ipynb"
KERNEL = "meshtrain-test"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Sweep:
    return shared_sweep(tmp_path_factory)


def _kernel_home(root: Path) -> Path:
    """A Jupyter data folder whose only kernel is this interpreter, so no kernel installed
    on the machine is picked instead."""
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "meshtrain test",
                "language": "python",
            }
        )
    )
    return root


def _texts(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(output.text)
        for kind in ("text/plain", "text/html"):
            parts.append(output.get("data", {}).get(kind, ""))
    return "\n".join(parts)


def test_notebook_is_committed_without_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


@pytest.mark.slow
@pytest.mark.long
def test_notebook_compares_the_layouts_of_the_latest_sweep(
    sweep: Sweep, tmp_path: Path, monkeypatch
):
    for name in ("MLFLOW_TRACKING_URI", "MESHTRAIN_SWEEP", "MESHTRAIN_EXPERIMENT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JUPYTER_PATH", str(_kernel_home(tmp_path / "jupyter")))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    workdir = sweep.project / "notebooks"
    workdir.mkdir(exist_ok=True)

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        notebook, kernel_name=KERNEL, timeout=300, resources={"metadata": {"path": str(workdir)}}
    ).execute()
    cells = [c for c in notebook.cells if c.cell_type == "code"]
    text = "\n".join(_texts(c) for c in cells)

    assert f"sqlite:///{sweep.project.resolve() / 'mlflow.db'}" in text
    assert f"sweep {sweep.sweep_id}: 2 of 3 layouts finished" in text
    # The table: each finished layout with its final loss as MLflow holds it.
    client = mlflow_client(sweep.project)
    experiment = client.get_experiment_by_name("meshtrain")
    table = _texts(cells[2])
    for layout, (*_, name) in EXPECTED.items():
        (run,) = client.search_runs(
            [experiment.experiment_id],
            f"tags.`meshtrain.sweep` = '{sweep.sweep_id}' and "
            f"tags.`meshtrain.sweep.layout` = '{layout}'",
        )
        assert name in table
        assert f"{run.data.metrics['loss']:.4f}" in table, layout
    for column in (
        "final loss",
        "tokens/s",
        "val perplexity",
        "peak RSS rank 0 (MiB)",
        "predicted peak (MiB)",
        "model states (MiB)",
        "predicted model states (MiB)",
    ):
        assert column in table
    assert "tp3" not in table
    # The refused layout, with the planner's reason.
    refused = _texts(cells[4])
    assert "tp3" in refused and "refused" in refused
    assert "parallel.tensor_parallel_size=3" in refused
    # The loss curves.
    assert any("image/png" in o.get("data", {}) for o in cells[-1].outputs)
