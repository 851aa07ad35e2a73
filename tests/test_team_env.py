"""`kedro run --env team` logs into a shared MLflow tracking server whose backend store is
PostgreSQL and which lets in only its users (MLflow's basic-auth app), with the server's
address and the user's credentials taken from credentials, never from git.

The servers are real (PostgreSQL from Debian's package, `mlflow server --app-name
basic-auth` on it, both on 127.0.0.1); see tests/servers.py. The admin (created by the
server from environment variables) adds a team member; the member's two runs go there:
the dp=2 default through conf/local/credentials.yml, the tp=2 run through MLFLOW_TRACKING_*.
A wrong password and no credentials at all are refused and write nothing; no password
appears in any output, param, tag, plan.json or file.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from base64 import b64encode
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException

from meshtrain.tracking.servers import TrackingConfigError, TrackingServer, choose_tracking_server
from tests import servers


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
    assert params["parallel.zero_1"] == "False"
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 8
    # System metrics are on by default (conf/base/mlflow.yml), sampled while the run is open.
    for key in ("system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"):
        assert key in run.data.metrics, key
    # Artifacts go through the server into its own store, not into the project.
    assert "plan.json" in [a.path for a in client.list_artifacts(run.info.run_id)]
    assert list(team.server.artifacts.rglob(f"{run.info.run_id}/artifacts/plan.json"))
    assert not (team.project / "mlflow.db").exists()
    assert not (team.project / "mlruns").exists()
    # The data it trained on, with digests, as the run's dataset inputs on the server.
    inputs = {i.tags[0].value: i.dataset for i in run.inputs.dataset_inputs}
    assert sorted(inputs) == ["training", "validation"]
    assert all(len(d.digest) == 16 for d in inputs.values())


@pytest.mark.slow
def test_team_run_registers_its_model_in_the_postgres_backed_registry(team):
    """conf/team/mlflow.yml names the registered model: the dp=2 run's consolidated model,
    logged to the run through the server, is a version of it, tagged with the layout."""
    assert team.dp2.returncode == 0, servers.output(team.dp2)
    client, run = _run(team, servers.DP2_LAYOUT)
    assert run.data.tags["meshtrain.pipelines"] == servers.DP2_PIPELINES
    (output,) = run.outputs.model_outputs
    model = client.get_logged_model(output.model_id)
    assert model.source_run_id == run.info.run_id
    assert model.tags["meshtrain.layout"] == servers.DP2_LAYOUT
    assert "eval/val_perplexity" in {m.key for m in model.metrics}
    (version,) = client.search_model_versions(f"name = '{servers.REGISTERED_MODEL}'")
    assert version.run_id == run.info.run_id and version.version == "1"
    assert version.tags["meshtrain.layout"] == servers.DP2_LAYOUT
    assert client.get_registered_model(servers.REGISTERED_MODEL).latest_versions
    # The registry is PostgreSQL's tables; the weights are files in the server's store.
    connection = team.postgres.connect()
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT model_versions.name, model_versions.run_id, model_version_tags.value"
                " FROM model_versions JOIN model_version_tags USING (name, version)"
                " WHERE model_version_tags.key = 'meshtrain.layout'"
            )
            rows = cursor.fetchall()
    finally:
        connection.close()
    assert rows == [(servers.REGISTERED_MODEL, run.info.run_id, servers.DP2_LAYOUT)]
    (weights,) = team.server.artifacts.rglob(f"{output.model_id}/**/model.safetensors")
    assert weights.stat().st_size > 1_000_000  # ~1M fp32 parameters


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


def _http_status(uri: str, authorization: str | None) -> int:
    request = urllib.request.Request(f"{uri}/api/2.0/mlflow/experiments/search?max_results=10")
    if authorization:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.mark.slow
def test_the_server_refuses_clients_without_the_right_credentials_and_they_write_nothing(team):
    assert team.dp2.returncode == 0, servers.output(team.dp2)
    assert team.tp2.returncode == 0, servers.output(team.tp2)
    # What the admin saw before the two refused runs: the member's two runs, nothing else.
    experiments, runs = team.seen_before_refused
    assert experiments == ["Default", "meshtrain"] and len(runs) == 2
    for how, result in team.refused.items():
        output = result.stdout + result.stderr
        assert result.returncode != 0, (how, servers.output(result))
        assert "TrackingConfigError" in output, (how, servers.output(result))
        assert "(HTTP 401, not authenticated); nothing was logged" in output, how
        assert "Traceback" not in output, how
    wrong, anonymous = team.refused["wrong_password"], team.refused["anonymous"]
    assert f"refused user '{team.member.username}'" in wrong.stdout + wrong.stderr
    assert "credentials entry 'mlflow'" in wrong.stdout + wrong.stderr
    assert "refused a client without credentials" in anonymous.stdout + anonymous.stderr
    # Nothing reached the server, and the hook stopped them before the planning node.
    assert team.seen_after_refused == team.seen_before_refused
    assert sorted(team.plan_before_refused) == sorted(team.refused)
    for how, plan in team.plan_before_refused.items():
        assert plan and team.plan_after_refused[how] == plan, how
    # MLflow's own client, and bare HTTP, fare no better; /health alone is open.
    intruders = [None, servers.User(team.member.username, team.wrong_password)]
    for user in intruders:
        with pytest.raises(MlflowException) as error:
            team.client(user).create_experiment("intruder")
        assert error.value.error_code == "UNAUTHENTICATED"
    wrong_header = "Basic " + b64encode(f"admin:{team.wrong_password}".encode()).decode()
    assert _http_status(team.server.uri, None) == 401
    assert _http_status(team.server.uri, wrong_header) == 401
    assert "intruder" not in servers.seen_by(team.client())[0]
    with urllib.request.urlopen(f"{team.server.uri}/health", timeout=10) as response:
        assert response.status == 200


def _text_files(root: Path):
    for path in root.rglob("*"):
        if path.is_file():
            yield path, path.read_bytes()


@pytest.mark.slow
def test_no_password_appears_in_outputs_params_tags_plan_or_files(team, tmp_path):
    assert team.dp2.returncode == 0 and team.tp2.returncode == 0
    secrets = {
        "member": team.member.password,
        "admin": team.server.admin.password,
        "wrong": team.wrong_password,
        "database": team.postgres.password,
    }
    results = {"dp2": team.dp2, "tp2": team.tp2, **team.refused}
    results["no_credentials"] = team.no_credentials
    client = team.client()
    for layout in (servers.DP2_LAYOUT, servers.TP2_LAYOUT):
        _, run = _run(team, layout)
        local = tmp_path / layout
        local.mkdir()
        plan = Path(client.download_artifacts(run.info.run_id, "plan.json", str(local)))
        json.loads(plan.read_text())  # the real plan.json came back
        texts = {
            "params": json.dumps(run.data.params),
            "tags": json.dumps(run.data.tags),
            "plan.json": plan.read_text(),
        }
        for what, text in texts.items():
            for whose, secret in secrets.items():
                assert secret not in text, f"{whose}'s password in {layout}'s {what}"
    for how, result in results.items():
        for whose, secret in secrets.items():
            assert secret not in result.stdout + result.stderr, f"{whose}'s password, {how}"
    # Everything the projects and the runs wrote (data, plan.json, checkpoints and their
    # per-rank logs, conf/local), the server's artifacts (the model too) and its log.
    files = [
        *(found for project in team.projects for found in _text_files(project)),
        *_text_files(team.server.artifacts),
        (team.server.log, team.server.log.read_bytes()),
    ]
    assert len(files) > 20
    for path, content in files:
        for whose, secret in secrets.items():
            assert secret.encode() not in content, f"{whose}'s password in {path}"


@pytest.mark.slow
def test_team_env_without_credentials_stops_before_any_node(team):
    """Run beside the refused ones in tests/servers.py (a project of its own, nothing in
    conf/local, no MLFLOW_TRACKING_URI), to share their Kedro start-up time."""
    result, project = team.no_credentials, team.bare_project
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "TrackingConfigError" in output
    assert "credentials entry 'mlflow'" in output
    assert "conf/local/credentials.yml" in output
    assert "MLFLOW_TRACKING_URI" in output
    assert not [p for p in (project / "data").rglob("*") if p.is_file()]
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
