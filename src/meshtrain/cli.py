"""meshtrain's own `kedro` commands (Kedro loads `<package>.cli:cli` in a project).

    kedro sweep --layouts "dp2 tp2 pp2" [--params "k=v,..."] [--env ENV]
        [--global-batch-size N]

Only new commands live here; `kedro run` and the rest stay Kedro's own.
"""

from __future__ import annotations

from typing import Any

import click
from kedro.framework.cli.utils import CONTEXT_SETTINGS, _split_params, env_option
from kedro.framework.startup import ProjectMetadata

from meshtrain.tracking import sweep as sweeps


@click.group(context_settings=CONTEXT_SETTINGS, name="meshtrain")
def cli() -> None:
    """meshtrain's project commands."""


def _params_option(ctx: click.Context, param: click.Parameter, value: str | None):
    """Keep the `--params` text as given (the child runs get it verbatim) and its parsed form."""
    return value or "", _split_params(ctx, param, value or "")


@cli.command(context_settings={"max_content_width": 100})
@click.option(
    "--layouts",
    "-l",
    required=True,
    help='layouts to train, separated by spaces or commas, e.g. "dp2 tp2 pp2 dp2xtp2"; '
    + sweeps.GRAMMAR
    + ".",
)
@click.option(
    "--params",
    default="",
    callback=_params_option,
    help="overrides for every layout, in `kedro run --params` form: "
    '"training.max_steps=50,training.learning_rate=1e-3"',
)
@env_option
@click.option(
    "--global-batch-size",
    type=click.IntRange(min=1),
    default=None,
    help="samples per optimizer step, the same in every layout: passed to each as "
    "training.global_batch_size, which the planner splits into that layout's per-device "
    "batch and accumulation steps. Default: training.global_batch_size when set, else "
    "per_device_train_batch_size x gradient_accumulation_steps x the largest dp among "
    "the layouts.",
)
@click.pass_obj
def sweep(
    metadata: ProjectMetadata,
    layouts: str,
    params: tuple[str, dict[str, Any]],
    env: str | None,
    global_batch_size: int | None,
) -> None:
    """Train the same data and model under several layouts and compare them.

    Runs the data_processing pipeline once, then, for each layout, `kedro run
    --from-nodes plan_layout` in its own process: one MLflow run per layout in the
    project's experiment, all tagged meshtrain.sweep=<sweep id>, each consolidated
    model in its own folder. Prints a comparison table at the end. A layout the
    planner refuses is reported and the others still run; the exit status is then
    non-zero.
    """
    # (imported here: the sweep's work loads mlflow and pandas, which every other
    # `kedro` command, this project's `kedro run` included, would otherwise wait for)
    from meshtrain.cli_sweep import run_sweep  # noqa: PLC0415

    run_sweep(metadata, layouts, params, env, global_batch_size)
