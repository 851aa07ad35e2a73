"""`kedro sweep`: layout shorthands, the fixed global batch, and one real sweep end to end.

The end-to-end sweep trains "dp2 tp3 pp2" with the small test run in a scratch
project: tp3 is refused by the planner (3 divides neither the heads nor the world
size), the other two train at the same global batch and must reach the same
weights. `tests/test_notebook.py` reads the same sweep's runs.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
from safetensors.torch import load_file

from meshtrain.config import ConfigError
from meshtrain.tracking.sweep import (
    ShorthandError,
    layout_error,
    parse_shorthand,
    parse_shorthands,
    plan_sweep,
    to_params_arg,
)
from meshtrain.tracking.sweep_table import comparison_table
from tests import warm_kedro
from tests.kedro_project import SMALL_RUN, mlflow_client, project_env

# ---------------------------------------------------------------- layout shorthands


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("dp2", {"data_parallel_size": 2, "tensor_parallel_size": 1, "pipeline_parallel_size": 1}),
        ("tp2", {"tensor_parallel_size": 2, "pipeline_parallel_size": 1}),
        ("pp2", {"tensor_parallel_size": 1, "pipeline_parallel_size": 2}),
        (
            "dp2xtp2",
            {"data_parallel_size": 2, "tensor_parallel_size": 2, "pipeline_parallel_size": 1},
        ),
        (
            "TP2xPP2-gpipe-mb8",
            {
                "tensor_parallel_size": 2,
                "pipeline_parallel_size": 2,
                "pipeline_schedule": "gpipe",
                "pipeline_parallel_num_microbatches": 8,
            },
        ),
        (
            "dp4-nozero1-nosp-ac",
            {
                "data_parallel_size": 4,
                "tensor_parallel_size": 1,
                "pipeline_parallel_size": 1,
                "zero_1": False,
                "sequence_parallel": False,
                "activation_checkpointing": "full",
            },
        ),
        (
            "pp2-i1f1b-v2",
            {
                "tensor_parallel_size": 1,
                "pipeline_parallel_size": 2,
                "pipeline_schedule": "interleaved_1f1b",
                "pipeline_parallel_virtual_stages": 2,
            },
        ),
        # Sharded data parallelism, as `zero1` / `nozero1` are read.
        (
            "dp4-tp1-pp1-sdp4",
            {
                "data_parallel_size": 4,
                "tensor_parallel_size": 1,
                "pipeline_parallel_size": 1,
                "sharded_data_parallel_degree": 4,
            },
        ),
        (
            "dp4xtp2-sdp2-sp",
            {
                "data_parallel_size": 4,
                "tensor_parallel_size": 2,
                "pipeline_parallel_size": 1,
                "sharded_data_parallel_degree": 2,
                "sequence_parallel": True,
            },
        ),
        (
            "dp4-nosdp",
            {
                "data_parallel_size": 4,
                "tensor_parallel_size": 1,
                "pipeline_parallel_size": 1,
                "sharded_data_parallel_degree": 1,
            },
        ),
        # Context parallelism: cpN, as in the layout's name.
        (
            "dp2-cp2",
            {
                "data_parallel_size": 2,
                "tensor_parallel_size": 1,
                "pipeline_parallel_size": 1,
                "context_parallel_size": 2,
            },
        ),
        (
            "cp4",
            {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "context_parallel_size": 4},
        ),
        (
            "dp1-tp2-pp1-cp4-sp",
            {
                "data_parallel_size": 1,
                "tensor_parallel_size": 2,
                "pipeline_parallel_size": 1,
                "context_parallel_size": 4,
                "sequence_parallel": True,
            },
        ),
        # A run name reads back as the layout it names.
        (
            "dp1-tp2-pp2-sp-1f1b-mb4",
            {
                "data_parallel_size": 1,
                "tensor_parallel_size": 2,
                "pipeline_parallel_size": 2,
                "sequence_parallel": True,
                "pipeline_schedule": "1f1b",
                "pipeline_parallel_num_microbatches": 4,
            },
        ),
    ],
)
def test_layout_strings_name_the_parallel_parameters(text: str, expected: dict):
    spec = parse_shorthand(text)
    expected = {"context_parallel_size": 1, **expected}  # cp not named: off, as tp and pp
    assert spec.params == {f"parallel.{k}": v for k, v in expected.items()}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("dq2", ["token 'dq2' is not understood", "dpN, tpN, ppN", "Examples: dp2"]),
        ("dp", ["token 'dp' is not understood", "it needs a number, e.g. dp2"]),
        ("dp0", ["token 'dp0' asks for dp=0", "sizes start at 1"]),
        ("dp2xdp4", ["tokens 'dp2' and 'dp4' both set parallel.data_parallel_size"]),
        ("sp-nosp", ["tokens 'sp' and 'nosp' both set parallel.sequence_parallel"]),
        ("dp2--tp2", ["empty token"]),
        ("tp2x", ["empty token"]),
        ("sdp", ["token 'sdp' is not understood", "it needs a number, e.g. sdp2", "sdpN"]),
        ("dp4-sdp0", ["token 'sdp0' asks for sdp=0"]),
        ("sdp2-nosdp", ["tokens 'sdp2' and 'nosdp' both set"]),
        ("dp4-zero1-sdp4", ["tokens 'zero1' and 'sdp4'", "includes ZeRO-1", "drop 'zero1'"]),
        ("cp", ["token 'cp' is not understood", "it needs a number, e.g. cp2", "cpN"]),
        ("cp0", ["token 'cp0' asks for cp=0", "sizes start at 1"]),
        ("cp2-cp4", ["tokens 'cp2' and 'cp4' both set parallel.context_parallel_size"]),
    ],
)
def test_bad_layout_strings_say_which_token_why_and_what_works(text: str, says: list[str]):
    with pytest.raises(ShorthandError) as error:
        parse_shorthand(text)
    assert f"layout {text!r}" in str(error.value)
    for part in says:
        assert part in str(error.value)


def test_layout_lists_split_on_spaces_or_commas_and_refuse_repeats():
    assert [s.text for s in parse_shorthands(" dp2  tp2,pp2\n")] == ["dp2", "tp2", "pp2"]
    with pytest.raises(ShorthandError, match="'tp2' and 'tp2xpp1' are the same layout"):
        parse_shorthands("tp2 tp2xpp1")
    with pytest.raises(ShorthandError, match="--layouts is empty"):
        parse_shorthands("  ")


# ---------------------------------------------------------------- one global batch

PARAMS = {
    "training": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1},
    "launch": {"nproc_per_node": 2, "nnodes": 1},
    "parallel": {},
}


def test_every_layout_gets_the_same_global_batch_and_explicit_dp_fixes_the_world():
    batch, entries = plan_sweep(parse_shorthands("dp2 tp2 pp2 dp4 dp2xtp2"), PARAMS)
    assert batch == 4 * 4  # per-device batch x the largest dp
    overrides = {e.layout: e.overrides for e in entries}
    assert all(e.error is None for e in entries)
    assert {o["training.global_batch_size"] for o in overrides.values()} == {16}
    assert overrides["dp4"]["launch.nproc_per_node"] == 4
    assert overrides["dp2xtp2"]["launch.nproc_per_node"] == 4
    assert overrides["dp2"]["launch.nproc_per_node"] == 2
    assert "launch.nproc_per_node" not in overrides["tp2"]  # dp=auto: the configured world


def test_the_global_batch_comes_from_the_option_or_the_parameters():
    configured = {**PARAMS, "training": {**PARAMS["training"], "global_batch_size": 24}}
    assert plan_sweep(parse_shorthands("dp2"), configured)[0] == 24
    assert plan_sweep(parse_shorthands("dp2"), PARAMS, global_batch_size=12)[0] == 12
    assert plan_sweep(parse_shorthands("dp2"), configured, global_batch_size=24)[0] == 24
    with pytest.raises(ValueError, match="--global-batch-size=12 and training.global_batch_size"):
        plan_sweep(parse_shorthands("dp2"), configured, global_batch_size=12)


def test_context_parallel_ranks_count_in_the_world_and_leave_dp_the_rest():
    batch, (dp2_cp2, cp2) = plan_sweep(parse_shorthands("dp2-cp2 cp2"), PARAMS)
    assert dp2_cp2.overrides["launch.nproc_per_node"] == 4  # dp x cp
    assert dp2_cp2.overrides["parallel.context_parallel_size"] == 2
    assert "launch.nproc_per_node" not in cp2.overrides  # dp auto: 2 ranks / cp2 = dp1
    assert batch == 4 * 2  # per-device 4 x the largest dp: dp2-cp2's 2, not its 4 ranks
    two_nodes = {**PARAMS, "launch": {"nproc_per_node": 2, "nnodes": 2}}
    _, (odd,) = plan_sweep(parse_shorthands("dp3-cp1"), two_nodes, global_batch_size=12)
    assert "(dp x tp x pp x cp)" in odd.error


def test_a_layout_the_world_cannot_hold_is_left_for_the_planner_to_refuse():
    batch, (tp3, dp2) = plan_sweep(parse_shorthands("tp3 dp2"), PARAMS)
    assert batch == 8  # tp3 has no dp in a world of 2; dp2's decides
    assert tp3.error is None
    assert "training.global_batch_size" not in tp3.overrides
    assert dp2.overrides["training.global_batch_size"] == 8


def test_layouts_that_nodes_cannot_share_and_parameter_typos_are_refused():
    two_nodes = {**PARAMS, "launch": {"nproc_per_node": 2, "nnodes": 2}}
    _, (dp3,) = plan_sweep(parse_shorthands("dp3"), two_nodes, global_batch_size=12)
    assert "needs 3 processes" in dp3.error and "launch.nnodes=2" in dp3.error
    with pytest.raises(ConfigError, match="per_device_train_batch"):
        plan_sweep(parse_shorthands("dp2"), {"training": {"per_device_batch": 4}})


def test_overrides_are_written_in_kedro_params_form():
    assert (
        to_params_arg({"parallel.zero_1": False, "launch.nproc_per_node": 4})
        == "parallel.zero_1=false,launch.nproc_per_node=4"
    )
    with pytest.raises(ValueError, match="cannot contain a comma"):
        to_params_arg({"model.x": "[1,2]"})


def test_the_planners_refusal_is_found_in_wrapped_output():
    # As Kedro's rich traceback prints it into a pipe: wrapped at 80 columns.
    output = (
        "│ ❱ 474 │   │   raise LayoutError(refusals)          │\n"
        "╰──────────────────────────────────────────────────────╯\n"
        "LayoutError: meshtrain refused the layout before starting any worker:\n"
        "  - parallel.tensor_parallel_size=3: it must divide num_attention_heads=4; it \n"
        "must divide the world size 2. Values that work here: 1, 2.\n"
        "  - data.block_size=128: sequence parallelism splits each block over \n"
        "tensor_parallel_size=3 ranks.\n"
        "\n"
        "== tp2: kedro run ...\n"
    )
    assert layout_error(output) == (
        "meshtrain refused the layout before starting any worker:\n"
        "  - parallel.tensor_parallel_size=3: it must divide num_attention_heads=4; it "
        "must divide the world size 2. Values that work here: 1, 2.\n"
        "  - data.block_size=128: sequence parallelism splits each block over "
        "tensor_parallel_size=3 ranks."
    )
    assert layout_error("RuntimeError: boom") is None


# ---------------------------------------------------------------- a real sweep

# tp2 runs through kedro in the team stack (tests/servers.py) and on two nodes.
LAYOUTS = "dp2 tp3 pp2"
# adam_epsilon=1e-5: see tests/test_pipeline_e2e.py (last-bit noise near zero gradients).
# The model is not logged: the sweep compares layouts (tests/test_pipeline_e2e.py logs one).
SWEEP_PARAMS = SMALL_RUN + ",training.adam_epsilon=1e-5,evaluation.log_model=false"
EXPECTED = {
    # layout: (dp, tp, pp, run name); global batch 4 x the largest dp (2) = 8 in each
    "dp2": ("2", "1", "1", "dp2-tp1-pp1"),
    "pp2": ("1", "1", "2", "dp1-tp1-pp2-1f1b-mb4"),
}


@dataclass(frozen=True)
class Sweep:
    project: Path
    result: subprocess.CompletedProcess
    sweep_id: str

    @property
    def output(self) -> str:
        return self.result.stdout + self.result.stderr


_SHARED: dict[str, Sweep] = {}


def shared_sweep(tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    """Run the sweep once per test session, for this module and tests/test_notebook.py."""
    if "sweep" not in _SHARED:
        from tests.kedro_project import make_project

        project = make_project(tmp_path_factory.mktemp("sweep_project"))
        # A git repository, so that every run can carry its commit.
        for command in (
            ["git", "init", "-q"],
            ["git", "add", "conf", "pyproject.toml"],
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c"],
        ):
            subprocess.run(command, cwd=project, check=True, capture_output=True)
        result = warm_kedro.run(
            ["sweep", "--layouts", LAYOUTS, "--params", SWEEP_PARAMS],
            project,
            project_env(),
            timeout=900,
        )
        found = re.search(r"^sweep (sweep-\S+): 3 layouts, global batch 8$", result.stdout, re.M)
        assert found, result.stdout[-3000:] + result.stderr[-3000:]
        _SHARED["sweep"] = Sweep(project, result, found.group(1))
    return _SHARED["sweep"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Sweep:
    return shared_sweep(tmp_path_factory)


def _runs(sweep: Sweep) -> dict[str, object]:
    client = mlflow_client(sweep.project)
    experiment = client.get_experiment_by_name("meshtrain")
    runs = client.search_runs(
        [experiment.experiment_id], f"tags.`meshtrain.sweep` = '{sweep.sweep_id}'"
    )
    return {r.data.tags.get("meshtrain.sweep.layout", "<data>"): r for r in runs}


@pytest.mark.slow
def test_sweep_trains_every_layout_and_reports_the_refused_one(sweep: Sweep):
    output = sweep.output
    assert sweep.result.returncode == 1, output[-5000:]
    # Data processing once; each layout from plan_layout on, tp3 in the middle not
    # stopping the two after it.
    assert output.count("== data_processing") == 1
    assert [line.split(":")[0] for line in re.findall(r"^== (\S+: kedro run)", output, re.M)] == [
        "dp2",
        "tp3",
        "pp2",
    ]
    summary = output[output.index(f"== sweep {sweep.sweep_id}") :]
    table, refused = summary.split("\ntp3: refused\n")
    for layout, (*_, name) in EXPECTED.items():
        assert re.search(rf"^\s*{layout}\s+finished\s+{name}\s", table, re.M), table
    for column in ("final loss", "val perplexity", "tokens/s", "MFU", "peak RSS rank 0 (MiB)"):
        assert column in table
    assert "parallel.tensor_parallel_size=3: it must divide num_attention_heads=4" in refused
    assert "Values that work here: 1, 2." in refused
    assert "1 of 3 layouts did not finish: tp3" in refused


@pytest.mark.slow
def test_each_sweep_run_holds_its_layout_tags_metrics_and_pictures(sweep: Sweep):
    runs = _runs(sweep)
    assert sorted(runs) == ["<data>", "dp2", "pp2", "tp3"]
    data = runs["<data>"]
    assert data.data.tags["meshtrain.sweep.stage"] == "data_processing"
    assert data.data.tags["kedro.pipeline"] == "data_processing"
    client = mlflow_client(sweep.project)
    for layout, (dp, tp, pp, name) in EXPECTED.items():
        run = runs[layout]
        params, tags, metrics = run.data.params, run.data.tags, run.data.metrics
        assert run.info.status == "FINISHED", layout
        assert run.info.run_name == name == tags["meshtrain.layout"]
        assert (
            params["parallel.data_parallel_size"],
            params["parallel.tensor_parallel_size"],
            params["parallel.pipeline_parallel_size"],
        ) == (dp, tp, pp), layout
        assert params["global_batch_size"] == params["training.global_batch_size"] == "8"
        # The planner's split of it, as logged: per-device batch x accumulation x dp.
        per_device = int(params["training.per_device_train_batch_size"])
        assert per_device * int(params["training.gradient_accumulation_steps"]) * int(dp) == 8
        # The loss chunk as resolved (`auto` at these sizes: the whole microbatch).
        assert int(params["training.loss_chunk_tokens"]) > 0
        assert "parallel.loss_chunk_tokens" not in params
        assert tags["meshtrain.sweep.status"] == "finished"
        assert tags["kedro.env"] == "local"
        assert len(tags["mlflow.source.git.commit"]) == 40
        assert len(client.get_metric_history(run.info.run_id, "loss")) == 8
        for key in ("tokens_per_s", "memory/peak_rss_mb", "val_loss", "eval/val_perplexity"):
            assert key in metrics, (layout, key)
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"plan.json", "loss_curve.png", "memory_breakdown.png"} <= artifacts
        assert ("pipeline_timeline.png" in artifacts) == (pp != "1"), layout
    refused = runs["tp3"]
    assert refused.info.status == "FAILED"
    assert refused.info.run_name == "tp3 (refused)"
    assert refused.data.tags["meshtrain.sweep.status"] == "refused"
    assert "parallel.tensor_parallel_size=3" in refused.data.tags["meshtrain.sweep.error"]


@pytest.mark.slow
def test_sweep_layouts_reach_the_same_weights(sweep: Sweep):
    folder = sweep.project / "data/06_models/sweeps" / sweep.sweep_id
    assert sorted(p.name for p in folder.iterdir()) == ["dp2", "pp2"]
    expected = load_file(folder / "dp2" / "model.safetensors")
    for layout in ("pp2",):
        got = load_file(folder / layout / "model.safetensors")
        assert got.keys() == expected.keys()
        for key, want in expected.items():
            assert got[key].shape == want.shape
            assert (got[key] - want).norm() / want.norm() <= 1e-5, (layout, key)


@pytest.mark.slow
def test_sweep_refuses_a_bad_layout_string_before_running_anything(tmp_path: Path):
    from tests.kedro_project import make_project

    project = make_project(tmp_path / "project")
    result = warm_kedro.run(["sweep", "--layouts", "dp2 tq2"], project, project_env(), 300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "token 'tq2' is not understood" in result.stderr
    assert not (project / "mlflow.db").exists()
    assert not any((project / "data/02_intermediate").iterdir())


def test_printed_tracking_uris_hide_passwords():
    from meshtrain.cli_sweep import redact

    assert redact("http://me:s3cret@mlflow.example:5000") == "http://me:***@mlflow.example:5000"
    assert redact("sqlite:////project/mlflow.db") == "sqlite:////project/mlflow.db"


def test_params_that_a_layout_also_sets_are_refused():
    import click

    from meshtrain.cli_sweep import _refuse_conflicts

    specs = parse_shorthands("dp2 tp2-nosp")
    _refuse_conflicts(specs, {"parallel": {"zero_1": False}, "training": {"max_steps": 8}})
    with pytest.raises(click.BadParameter, match="sets parallel.sequence_parallel, which layout"):
        _refuse_conflicts(specs, {"parallel": {"sequence_parallel": True}})


def test_the_comparison_table_puts_predictions_beside_measurements():
    mib = 2**20
    runs = pd.DataFrame(
        {
            "status": ["FINISHED", "FAILED"],
            "tags.meshtrain.sweep.layout": ["dp2", "tp3"],
            "tags.meshtrain.sweep.status": ["finished", "refused"],
            "tags.mlflow.runName": ["dp2-tp1-pp1", "tp3 (refused)"],
            "metrics.loss": [6.2, None],
            "metrics.memory/peak_rss_mb": [600.0, None],
            "metrics.eval/val_perplexity": [None, None],  # not logged: column left out
            "params.estimate.memory_per_rank_bytes.parameters": [str(4 * mib), None],
            "params.estimate.memory_per_rank_bytes.gradients": [str(4 * mib), None],
            "params.estimate.memory_per_rank_bytes.optimizer_states": [str(2 * mib), None],
            "params.estimate.memory_per_rank_bytes.total": [str(30 * mib), None],
        }
    )
    table = comparison_table(runs)
    assert list(table.columns) == [
        "layout",
        "status",
        "run name",
        "final loss",
        "peak RSS rank 0 (MiB)",
        "predicted peak (MiB)",
        "predicted model states (MiB)",
    ]
    assert table.loc[0, "predicted peak (MiB)"] == 30
    assert table.loc[0, "predicted model states (MiB)"] == 10
    assert table["status"].tolist() == ["finished", "refused"]
    # The worker's own prediction, when logged, wins over the plan's param.
    runs["metrics.memory/predicted_peak_mb"] = [28.0, None]
    assert comparison_table(runs).loc[0, "predicted peak (MiB)"] == 28


def test_expert_parallel_size_is_a_size_token_taken_from_dp():
    """`epN` sets parallel.expert_parallel_size; ep takes its ranks from dp, so `dp4-ep2`
    runs on 4 processes, not 8, and ep not named keeps the configured value."""
    spec = parse_shorthand("dp4-ep2")
    assert spec.params["parallel.expert_parallel_size"] == 2
    assert "parallel.expert_parallel_size" not in parse_shorthand("dp4").params
    assert spec.model_ranks == 1
    _, (entry,) = plan_sweep([spec], PARAMS)
    assert entry.overrides["launch.nproc_per_node"] == 4
    for text, says in (("ep", "it needs a number, e.g. ep2"), ("ep2-ep4", "both set")):
        with pytest.raises(ShorthandError, match=says):
            parse_shorthand(text)
    with pytest.raises(ShorthandError, match="epN"):
        parse_shorthand("dq2")
