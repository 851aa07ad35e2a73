"""Real servers for the tracking tests: PostgreSQL, an MLflow tracking server on it, and a
scratch project with two short `kedro run --env team` runs logged there.

Everything listens on 127.0.0.1 only, on free ports, with its files in a temporary folder.
Starting these costs about a minute and a half (mostly the two training runs), so the
stack is started once per pytest session and shared by tests/test_team_env.py and
tests/test_mlflow_ui.py; it is stopped at the end of the session, failed or not.

On a developer machine without PostgreSQL or Chromium the tests that need them are
skipped with the reason; with CI=true they fail instead, since CI installs both.
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from meshtrain.offline import TELEMETRY_OPT_OUT
from tests.kedro_project import KEDRO, SMALL_RUN, make_project, project_env

MLFLOW = Path(sys.executable).with_name("mlflow")
CHROMIUM = "/usr/bin/chromium"
# As in the environment notes: no sandbox as root, no GPU, and nothing that
# reaches beyond loopback (the network is closed; Chromium would keep retrying).
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


def require(found: bool, what: str) -> None:
    """Skip (developer machine) or fail (CI=true) when a system package is missing."""
    if found:
        return
    message = f"{what} is not installed (.ci/run installs it: apt-get install {what})"
    if in_ci():
        pytest.fail(f"CI=true but {message}", pytrace=False)
    pytest.skip(message)


def postgres_bin(name: str) -> str | None:
    """Debian keeps initdb/postgres out of PATH, under /usr/lib/postgresql/<version>/bin."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop(process: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
    """Signal the process group (servers fork workers), then kill what is left."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def _wait_until(ready, process: subprocess.Popen, log: Path, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"{what} exited with {process.returncode}:\n{log.read_text()[-4000:]}"
            )
        if ready():
            return
        time.sleep(0.3)
    raise RuntimeError(f"{what} not ready after {timeout:.0f} s:\n{log.read_text()[-4000:]}")


@dataclass
class Postgres:
    """A throw-away PostgreSQL cluster on 127.0.0.1 with password (scram) login."""

    port: int
    user: str
    password: str
    database: str = "mlflow"

    @property
    def uri(self) -> str:
        """SQLAlchemy URI; `+psycopg2` because SQLAlchemy 2.1 takes plain `postgresql://`
        to mean psycopg 3, and the test extra installs psycopg2-binary."""
        return (
            f"postgresql+psycopg2://{self.user}:{self.password}"
            f"@127.0.0.1:{self.port}/{self.database}"
        )

    def connect(self, database: str | None = None):
        import psycopg2

        return psycopg2.connect(
            host="127.0.0.1",
            port=self.port,
            user=self.user,
            password=self.password,
            dbname=database or self.database,
            connect_timeout=5,
        )


@contextlib.contextmanager
def postgres_server() -> Iterator[Postgres]:
    """initdb + postgres in a temporary folder; as the `postgres` user when we are root,
    since PostgreSQL refuses to run as root."""
    initdb, postgres = postgres_bin("initdb"), postgres_bin("postgres")
    if not (initdb and postgres):
        raise RuntimeError("PostgreSQL's initdb/postgres not found (apt-get install postgresql)")
    root = Path(tempfile.mkdtemp(prefix="meshtrain-pg-"))
    as_root = os.geteuid() == 0
    run_as = {"user": "postgres", "group": "postgres"} if as_root else {}
    if as_root:
        shutil.chown(root, "postgres", "postgres")
    server = Postgres(port=free_port(), user="meshtrain", password=secrets.token_hex(12))
    pwfile = root / "pw"
    pwfile.write_text(server.password + "\n")
    if as_root:
        shutil.chown(pwfile, "postgres", "postgres")
    log = root / "postgres.log"
    process = None
    try:
        subprocess.run(
            [initdb, "-D", str(root / "data"), "-U", server.user, f"--pwfile={pwfile}"]
            + ["--auth=scram-sha-256", "--no-sync", "--no-locale", "-E", "UTF8"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
            **run_as,
        )
        with log.open("w") as out:
            process = subprocess.Popen(
                [postgres, "-D", str(root / "data"), "-p", str(server.port)]
                + ["-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={root}"]
                + ["-c", "fsync=off"],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **run_as,
            )

        def accepts() -> bool:
            try:
                server.connect("postgres").close()
            except Exception:
                return False
            return True

        _wait_until(accepts, process, log, "postgres", timeout=60)
        admin = server.connect("postgres")
        admin.autocommit = True
        with admin.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE {server.database}")
        admin.close()
        yield server
    finally:
        if process is not None:
            _stop(process, signal.SIGINT)  # SIGINT: PostgreSQL's "fast" shutdown
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class MlflowServer:
    port: int
    artifacts: Path

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def mlflow_server(backend_store_uri: str, root: Path) -> Iterator[MlflowServer]:
    """`mlflow server` on 127.0.0.1, serving artifacts from a folder under `root`."""
    server = MlflowServer(port=free_port(), artifacts=root / "mlartifacts")
    log = root / "mlflow-server.log"
    env = {**os.environ, **TELEMETRY_OPT_OUT}
    # The server's job runner (8 worker processes, for GenAI scorers) is not needed for
    # tracking; without it the server starts lighter and stops in seconds, not ~15 s.
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    env.pop("MLFLOW_TRACKING_URI", None)
    with log.open("w") as out:
        process = subprocess.Popen(
            [str(MLFLOW), "server", "--backend-store-uri", backend_store_uri]
            + ["--artifacts-destination", str(server.artifacts)]
            + ["--host", "127.0.0.1", "--port", str(server.port), "--workers", "1"],
            cwd=root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{server.uri}/health", timeout=2) as response:
                    return response.status == 200
            except OSError:
                return False

        _wait_until(healthy, process, log, "mlflow server", timeout=180)
        yield server
    finally:
        _stop(process)


def run_kedro(project: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(KEDRO), "run", *args],
        cwd=project,
        env=project_env(**env),
        capture_output=True,
        text=True,
        timeout=600,
    )


def output(result: subprocess.CompletedProcess) -> str:
    return result.stdout[-3000:] + result.stderr[-5000:]


# The two runs: the default dp=2 (ZeRO-1) and tp=2 (+ sequence parallel), on 2 ranks.
DP2_LAYOUT = "dp2-tp1-pp1-zero1"
TP2_LAYOUT = "dp1-tp2-pp1-sp"


@dataclass
class TeamTracking:
    """PostgreSQL, an MLflow server on it, and a scratch project with two runs logged there:
    `dp2` found the server through conf/local/credentials.yml, `tp2` through
    MLFLOW_TRACKING_URI."""

    postgres: Postgres
    server: MlflowServer
    project: Path
    dp2: subprocess.CompletedProcess
    tp2: subprocess.CompletedProcess
    started_s: float = 0.0

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.server.uri)


@dataclass
class _Shared:
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    value: TeamTracking | None = None
    error: BaseException | None = None


_SHARED = _Shared()


def team_tracking(tmp_path_factory: pytest.TempPathFactory) -> TeamTracking:
    """Start the shared stack on first use (under a new pytest tmp folder); later calls get
    the same one.

    A failed start is remembered and re-raised, so it costs the session only once.
    """
    require(bool(postgres_bin("initdb") and postgres_bin("postgres")), "postgresql")
    if _SHARED.value is not None:
        return _SHARED.value
    if _SHARED.error is not None:
        raise RuntimeError("the PostgreSQL + MLflow server stack failed to start") from (
            _SHARED.error
        )
    started = time.monotonic()
    root = tmp_path_factory.mktemp("team-tracking")
    try:
        postgres = _SHARED.stack.enter_context(postgres_server())
        server = _SHARED.stack.enter_context(mlflow_server(postgres.uri, root))
        project = make_project(root / "project")
        credentials = project / "conf" / "local" / "credentials.yml"
        credentials.write_text(f"mlflow:\n  tracking_uri: {server.uri}\n")
        dp2 = run_kedro(
            project,
            "--env",
            "team",
            "--pipelines",
            "data_processing,planning,training",
            "--params",
            SMALL_RUN,
            # MLflow publishes system metrics only once a sampling interval has passed
            # with the run open; 10 s (the project's default) can outlast a short run
            # on a fast machine, half a second cannot (the launch alone takes longer).
            MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL="0.5",
        )
        credentials.unlink()
        tp2 = run_kedro(
            project,
            "--env",
            "team",
            "--pipelines",
            "planning,training",
            "--params",
            SMALL_RUN + ",parallel.tensor_parallel_size=2",
            MLFLOW_TRACKING_URI=server.uri,
        )
    except Exception as error:
        _SHARED.error = error
        stop_team_tracking()
        raise
    _SHARED.value = TeamTracking(
        postgres, server, project, dp2, tp2, started_s=time.monotonic() - started
    )
    return _SHARED.value


def stop_team_tracking() -> None:
    """Stop the servers (idempotent: both test modules' fixtures call it at session end)."""
    _SHARED.stack.close()
