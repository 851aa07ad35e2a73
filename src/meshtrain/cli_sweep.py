"""The work of `kedro sweep` (`meshtrain.cli`): the data processed once, each layout
trained by its own `kedro run`, the outcomes recorded in MLflow and compared.

Imported when the command runs: it loads mlflow and pandas.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import click
from kedro.framework.session import KedroSession
from kedro.framework.startup import ProjectMetadata
from mlflow.tracking import MlflowClient

from meshtrain.config import ConfigError
from meshtrain.pipelines.config_loader import mlflow_settings as project_mlflow_settings
from meshtrain.pipelines.config_loader import project_tracking_server
from meshtrain.tracking import sweep as sweeps
from meshtrain.tracking.pipeline_run import use_tracking_server
from meshtrain.tracking.servers import redact
from meshtrain.tracking.sweep_table import comparison_table, format_table, sweep_runs

# Lines of a failed run's output kept for the summary when it is not a planner refusal.
_TAIL_LINES = 400


@dataclass
class Outcome:
    """How one child `kedro run` ended."""

    layout: str
    status: str  # finished | refused | failed
    message: str = ""
    run_id: str | None = None


def run_sweep(
    metadata: ProjectMetadata,
    layouts: str,
    params: tuple[str, dict[str, Any]],
    env: str | None,
    global_batch_size: int | None,
) -> None:
    """`kedro sweep`'s options -> the layouts run, recorded and compared (exits non-zero
    when one did not finish)."""
    raw_params, user_params = params
    project_path = Path(metadata.project_path)
    try:
        specs = sweeps.parse_shorthands(layouts)
    except sweeps.ShorthandError as error:
        raise click.BadParameter(str(error), param_hint="--layouts") from None
    _refuse_conflicts(specs, user_params)
    project = _load_project(project_path, env, user_params)
    try:
        batch, entries = sweeps.plan_sweep(specs, project.params, global_batch_size)
    except (ConfigError, ValueError) as error:
        raise click.UsageError(str(error)) from None

    sweep_id = sweeps.new_sweep_id()
    if project.server:
        use_tracking_server(project.server)
    click.secho(f"sweep {sweep_id}: {len(entries)} layouts, global batch {batch}", bold=True)
    for entry in entries:
        click.echo(f"  {entry.layout:<16} {entry.error or entry.params_arg()}")

    base = [sys.executable, "-m", "kedro", "run", *(["--env", env] if env else [])]
    _process_data_once(base, raw_params, project_path, sweep_id)
    outcomes = [_train_layout(entry, base, raw_params, project, sweep_id) for entry in entries]
    _report(sweep_id, outcomes, project.tracking_uri, project.experiment, project.tracked)
    if any(o.status != "finished" for o in outcomes):
        sys.exit(1)


@dataclass
class _Project:
    """What the sweep needs of the Kedro project: its parameters and MLflow store."""

    path: Path
    params: dict[str, Any]
    mlflow: dict[str, Any]
    server: Any  # TrackingServer, or None with MLflow disabled

    @property
    def tracked(self) -> bool:
        return bool(self.mlflow["enabled"])

    @property
    def tracking_uri(self) -> str:
        return self.server.uri if self.server else ""

    @property
    def experiment(self) -> str:
        return self.mlflow["experiment_name"]


def _load_project(project_path: Path, env: str | None, user_params: dict[str, Any]) -> _Project:
    with KedroSession.create(
        project_path=project_path, env=env, runtime_params=user_params, save_on_close=False
    ) as session:
        context = session.load_context()
        settings = project_mlflow_settings(context.config_loader, env)
        # The same store the hook of each layout's `kedro run` writes to (credentials too).
        server = (
            project_tracking_server(context.config_loader, env, project_path, settings)
            if settings["enabled"]
            else None
        )
        return _Project(project_path, context.params, settings, server)


def _process_data_once(base: list[str], raw_params: str, project_path: Path, sweep_id: str):
    """The data_processing pipeline, once for every layout; exits the sweep if it fails."""
    click.secho("\n== data_processing (once for every layout)", bold=True)
    data = _run_child(
        [*base, "--pipeline", "data_processing", *(["--params", raw_params] if raw_params else [])],
        project_path,
        {sweeps.SWEEP_TAG: sweep_id, sweeps.SWEEP_STAGE_TAG: "data_processing"},
    )
    if data.returncode != 0:
        click.secho(
            f"\nsweep {sweep_id}: data_processing failed (exit {data.returncode}); no layout "
            "was trained.",
            fg="red",
            err=True,
        )
        sys.exit(1)


def _train_layout(
    entry: sweeps.SweepEntry, base: list[str], raw_params: str, project: _Project, sweep_id: str
) -> Outcome:
    """`kedro run --from-nodes plan_layout` for one layout, its model in its own folder."""
    if entry.error:
        click.secho(f"\n== {entry.layout}: not run: {entry.error}", fg="red", bold=True)
        return Outcome(entry.layout, "refused", entry.error)
    models_root = (
        PurePosixPath(project.params["consolidation"]["output_dir"]).parent / "sweeps" / sweep_id
    )
    overrides = entry.params_arg(
        {"consolidation.output_dir": str(models_root / _folder_name(entry.layout))}
    )
    run_params = f"{raw_params},{overrides}" if raw_params else overrides
    click.secho(f"\n== {entry.layout}: kedro run --params {overrides}", bold=True)
    result = _run_child(
        [*base, "--from-nodes", "plan_layout", "--params", run_params],
        project.path,
        {sweeps.SWEEP_TAG: sweep_id, sweeps.SWEEP_LAYOUT_TAG: entry.layout},
    )
    outcome = _outcome(entry.layout, result)
    if project.tracked:
        _record(
            MlflowClient(tracking_uri=project.tracking_uri), project.experiment, sweep_id, outcome
        )
    return outcome


def _refuse_conflicts(specs: list[sweeps.LayoutShorthand], user_params: dict[str, Any]) -> None:
    """A `parallel.*` value in --params that a layout also names would be silently
    overridden for that layout; refuse it and say where it belongs."""
    for spec in specs:
        for name in spec.params:
            group, key = name.split(".", 1)
            if name.startswith("parallel.") and key in (user_params.get(group) or {}):
                raise click.BadParameter(
                    f"it sets {name}, which layout {spec.text!r} sets too; name it in each "
                    "layout (--layouts) or leave it out of the layouts",
                    param_hint="--params",
                )


def _folder_name(layout: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in layout)


def _run_child(command: list[str], cwd: Path, tags: dict[str, str]) -> subprocess.CompletedProcess:
    """Run one `kedro run`, echoing its output as it comes and keeping the tail.

    The tags reach the MLflow run that the project's hook opens through MLflow's own
    run-context variable, so even a run the planner refuses carries them.
    """
    env = dict(os.environ)
    env["MLFLOW_RUN_CONTEXT"] = json.dumps(tags)
    # The child writes into a pipe; let it wrap at this terminal's width, not 80 columns.
    env.setdefault("COLUMNS", str(shutil.get_terminal_size().columns))
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    with subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    ) as process:
        for line in process.stdout:
            sys.stdout.write(line)
            tail.append(line)
        process.wait()
    sys.stdout.flush()
    return subprocess.CompletedProcess(command, process.returncode, "".join(tail), "")


def _outcome(layout: str, result: subprocess.CompletedProcess) -> Outcome:
    if result.returncode == 0:
        return Outcome(layout, "finished")
    refusal = sweeps.layout_error(result.stdout)
    if refusal:
        return Outcome(layout, "refused", refusal)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    errors = [line for line in lines if not line[0].isspace() and "Error" in line.split(":")[0]]
    message = errors[-1] if errors else "\n".join(lines[-5:])
    return Outcome(layout, "failed", f"exit {result.returncode}: {message}")


def _record(client: MlflowClient, experiment: str, sweep_id: str, outcome: Outcome) -> None:
    """Mark the layout's MLflow run with how it ended (a refused run keeps the reason)."""
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return
    runs = client.search_runs(
        [found.experiment_id],
        f"tags.`{sweeps.SWEEP_TAG}` = '{sweep_id}' and "
        f"tags.`{sweeps.SWEEP_LAYOUT_TAG}` = '{outcome.layout}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if not runs:
        if outcome.status == "refused":  # before its MLflow run opened: the sweep's own
            _record_refused(client, found.experiment_id, sweep_id, outcome)
        return
    run_id = runs[0].info.run_id
    outcome.run_id = run_id
    client.set_tag(run_id, sweeps.SWEEP_STATUS_TAG, outcome.status)
    if outcome.message:
        client.set_tag(run_id, sweeps.SWEEP_ERROR_TAG, outcome.message[:5000])
    if outcome.status != "finished" and runs[0].info.run_name in (None, "", "__default__"):
        client.set_tag(run_id, "mlflow.runName", f"{outcome.layout} ({outcome.status})")


def _record_refused(
    client: MlflowClient, experiment_id: str, sweep_id: str, outcome: Outcome
) -> None:
    """A layout refused before its `kedro run` opened a run (its parameters are checked
    first) still has its row in the sweep's runs: FAILED, with the refusal."""
    run = client.create_run(
        experiment_id,
        run_name=f"{outcome.layout} ({outcome.status})",
        tags={
            sweeps.SWEEP_TAG: sweep_id,
            sweeps.SWEEP_LAYOUT_TAG: outcome.layout,
            sweeps.SWEEP_STATUS_TAG: outcome.status,
            sweeps.SWEEP_ERROR_TAG: (outcome.message or "")[:5000],
        },
    )
    client.set_terminated(run.info.run_id, "FAILED")
    outcome.run_id = run.info.run_id


def _report(
    sweep_id: str, outcomes: list[Outcome], tracking_uri: str, experiment: str, tracked: bool
) -> None:
    click.secho(f"\n== sweep {sweep_id}", bold=True)
    if tracked:
        runs = sweep_runs(tracking_uri, experiment, sweep_id)
        status = f"tags.{sweeps.SWEEP_STATUS_TAG}"
        finished = runs[runs[status] == "finished"] if status in runs else runs.iloc[:0]
        if len(finished):
            click.echo(format_table(comparison_table(finished)))
        elif any(o.status == "finished" for o in outcomes):
            click.secho(
                f"No run of this sweep is in {redact(tracking_uri)}, yet layouts finished: "
                "the runs went to another store. When mlflow.yml takes the server from "
                "credentials, export MLFLOW_TRACKING_URI for the sweep.",
                fg="red",
                err=True,
            )
        click.echo(
            f"\nMLflow: {redact(tracking_uri)}, experiment {experiment!r}, tag {sweeps.SWEEP_TAG}"
        )
    else:
        click.echo("MLflow is disabled in mlflow.yml: no comparison table.")
    for outcome in outcomes:
        if outcome.status != "finished":
            click.secho(f"\n{outcome.layout}: {outcome.status}", fg="red", bold=True)
            click.echo(outcome.message)
    bad = [o.layout for o in outcomes if o.status != "finished"]
    if bad:
        click.secho(
            f"\n{len(bad)} of {len(outcomes)} layouts did not finish: {', '.join(bad)}",
            fg="red",
            bold=True,
        )
    else:
        click.secho(f"\nall {len(outcomes)} layouts finished", fg="green")
