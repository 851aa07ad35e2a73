"""`kedro run --env team` logs into a shared MLflow tracking server whose backend store is
PostgreSQL, with the server's address taken from credentials, never from git.

The servers are real (PostgreSQL from Debian's package, `mlflow server` on it, both on
127.0.0.1); see tests/servers.py. Two runs go there: the dp=2 default finds the server
through conf/local/credentials.yml, the tp=2 run through MLFLOW_TRACKING_URI.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshtrain.hooks import TrackingConfigError, TrackingServer, choose_tracking_server
from tests import servers
from tests.kedro_project import SMALL_RUN, make_project


@pytest.fixture(scope="session")
def team(tmp_path_factory) -> Iterator[servers.TeamTracking]:
    try:
        yield servers.team_tracking(tmp_path_factory)
    finally:
        servers.stop_team_tracking()


def _run(team: servers.TeamTracking, layout: str):
    client = team.client()
    experiment = client.get_experiment_by_name("meshtrain")
    (run,) = client.search_runs([experiment.experiment_id], f"tags.mlflow.runName = '{layout}'")
    return client, run


@pytest.mark.slow
def test_team_run_from_credentials_logs_into_the_postgres_backed_server(team):
    assert team.dp2.returncode == 0, servers.output(team.dp2)
    client, run = _run(team, servers.DP2_LAYOUT)
    assert run.info.status == "FINISHED"
    assert run.data.tags["kedro.env"] == "team"
    params = run.data.params
    assert params["parallel.data_parallel_size"] == "2"
    assert params["parallel.tensor_parallel_size"] == "1"
    assert params["parallel.pipeline_parallel_size"] == "1"
    assert params["parallel.zero_1"] == "True"
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 8
    # System metrics are on by default (conf/base/mlflow.yml), sampled while the run is open.
    for key in ("system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"):
        assert key in run.data.metrics, key
    # Artifacts go through the server into its own store, not into the project.
    assert "plan.json" in [a.path for a in client.list_artifacts(run.info.run_id)]
    assert list(team.server.artifacts.rglob(f"{run.info.run_id}/artifacts/plan.json"))
    assert not (team.project / "mlflow.db").exists()
    assert not (team.project / "mlruns").exists()


@pytest.mark.slow
def test_team_run_from_the_environment_variable_logs_into_the_same_server(team):
    assert team.tp2.returncode == 0, servers.output(team.tp2)
    client, run = _run(team, servers.TP2_LAYOUT)
    assert run.info.status == "FINISHED"
    assert run.data.params["parallel.tensor_parallel_size"] == "2"
    assert run.data.params["parallel.sequence_parallel"] == "True"
    assert "loss" in run.data.metrics


@pytest.mark.slow
def test_runs_are_rows_of_the_postgresql_backend_store(team):
    assert team.dp2.returncode == 0 and team.tp2.returncode == 0
    connection = team.postgres.connect()
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT runs.name, runs.status, params.value FROM runs JOIN params"
                " ON params.run_uuid = runs.run_uuid"
                " WHERE params.key = 'parallel.tensor_parallel_size' ORDER BY runs.name"
            )
            rows = cursor.fetchall()
    finally:
        connection.close()
    assert rows == [
        (servers.TP2_LAYOUT, "FINISHED", "2"),
        (servers.DP2_LAYOUT, "FINISHED", "1"),
    ]


@pytest.mark.slow
def test_team_env_without_credentials_stops_before_any_node(tmp_path):
    project = make_project(tmp_path / "project")
    result = servers.run_kedro(
        project, "--env", "team", "--pipeline", "planning", "--params", SMALL_RUN
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "TrackingConfigError" in output
    assert "credentials entry 'mlflow'" in output
    assert "conf/local/credentials.yml" in output
    assert "MLFLOW_TRACKING_URI" in output
    assert not (project / "data/05_model_input/plan.json").exists()
    assert not (project / "mlflow.db").exists()


TEAM = {"credentials": "mlflow", "tracking_uri": None}
LOOKED_IN = ["conf/base/credentials*.yml", "conf/team/credentials*.yml"]


def test_credentials_entry_from_host_port_and_basic_auth():
    entry = {"host": "mlflow.example.org", "port": 443, "scheme": "https"}
    entry |= {"username": "alice", "password": "s3cret"}
    server = choose_tracking_server(TEAM, {"mlflow": entry}, {}, LOOKED_IN)
    assert server == TrackingServer("https://mlflow.example.org:443", "alice", "s3cret")


def test_environment_variable_wins_over_credentials_and_yaml():
    environ = {"MLFLOW_TRACKING_URI": "http://127.0.0.1:1"}
    entry = {"mlflow": {"tracking_uri": "http://elsewhere:5000"}}
    assert choose_tracking_server(TEAM, entry, environ, LOOKED_IN).uri == "http://127.0.0.1:1"
    base = {"credentials": None, "tracking_uri": "sqlite:///mlflow.db"}
    assert choose_tracking_server(base, {}, environ, []).uri == "http://127.0.0.1:1"
    assert choose_tracking_server(base, {}, {}, []).uri == "sqlite:///mlflow.db"


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({"port": 5000}, "needs `tracking_uri`"),
        ({"tracking_uri": "http://h:1", "username": "alice"}, "only one of `username`"),
        ({"tracking_uri": "http://h:1", "pasword": "x"}, "unknown keys ['pasword']"),
        ("http://h:1", "must be a mapping"),
    ],
)
def test_incomplete_credentials_entry_is_refused_with_its_name(entry, says):
    with pytest.raises(TrackingConfigError, match="credentials entry 'mlflow'") as error:
        choose_tracking_server(TEAM, {"mlflow": entry}, {}, LOOKED_IN)
    assert says in str(error.value)
    assert "conf/team/credentials*.yml" in str(error.value)


def test_missing_system_package_skips_here_but_fails_in_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install chromium"):
        servers.require(False, "chromium")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true but chromium is not installed"):
        servers.require(False, "chromium")
