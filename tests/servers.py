"""Real servers for the tracking tests: PostgreSQL, an MLflow tracking server on it with
MLflow's basic-auth app (its users in a second PostgreSQL database), and scratch projects
with two short `kedro run --env team` runs logged there by a team member (the dp=2 one
through consolidation and evaluation, so its model is registered), and three refused ones
(a wrong password, no credentials, no server named at all).

Everything listens on 127.0.0.1 only, on free ports, with its files in a temporary folder.
Starting these costs about a minute and a half on 2 cores (mostly Kedro's and the
workers' start-up in the five runs), so the stack is started once per pytest session
(the `team` fixture of tests/conftest.py) and shared by tests/test_team_env.py and
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from meshtrain.offline import TELEMETRY_OPT_OUT
from tests.kedro_project import SMALL_RUN, make_project, project_env

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
    auth_database: str = "mlflow_auth"  # the basic-auth app's users and permissions

    def uri_of(self, database: str) -> str:
        """SQLAlchemy URI; `+psycopg2` because SQLAlchemy 2.1 takes plain `postgresql://`
        to mean psycopg 3, and the test extra installs psycopg2-binary."""
        return f"postgresql+psycopg2://{self.user}:{self.password}@127.0.0.1:{self.port}/{database}"

    @property
    def uri(self) -> str:
        return self.uri_of(self.database)

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
            cursor.execute(f"CREATE DATABASE {server.auth_database}")
        admin.close()
        yield server
    finally:
        if process is not None:
            _stop(process, signal.SIGINT)  # SIGINT: PostgreSQL's "fast" shutdown
        shutil.rmtree(root, ignore_errors=True)


# The recipe's auth config (docs/tracking.md), with the auth database filled in. No
# password here: the admin's comes from MLFLOW_AUTH_ADMIN_PASSWORD at the first start.
BASIC_AUTH_INI = """\
[mlflow]
default_permission = EDIT
database_uri = {database_uri}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
auth_cache_ttl_seconds = 300
"""


@dataclass(frozen=True)
class User:
    username: str
    password: str = field(repr=False)


def new_user(username: str) -> User:
    return User(username, secrets.token_urlsafe(18))  # MLflow wants at least 12 characters


@contextlib.contextmanager
def mlflow_credentials(user: User | None) -> Iterator[None]:
    """MLflow's REST client reads the basic-auth credentials from the environment at each
    request: set them (or, for None, remove them) for the calls inside, then restore."""
    names = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
    saved = {name: os.environ.pop(name, None) for name in names}
    if user is not None:
        os.environ.update(dict(zip(names, (user.username, user.password), strict=True)))
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


class ClientAs:
    """An MlflowClient whose every call is made as `user` (None: with no credentials)."""

    def __init__(self, tracking_uri: str, user: User | None) -> None:
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=tracking_uri)
        self._user = user

    def __getattr__(self, name: str):
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute

        def call(*args, **kwargs):
            with mlflow_credentials(self._user):
                return attribute(*args, **kwargs)

        return call


@dataclass
class MlflowServer:
    port: int
    artifacts: Path
    log: Path
    admin: User

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def create_user(self, username: str) -> User:
        """A team member (not an admin), created by the admin through the auth app's API."""
        from mlflow.server import get_app_client

        user = new_user(username)
        with mlflow_credentials(self.admin):
            get_app_client("basic-auth", tracking_uri=self.uri).create_user(
                user.username, user.password
            )
        return user


@contextlib.contextmanager
def mlflow_server(postgres: Postgres, root: Path) -> Iterator[MlflowServer]:
    """`mlflow server --app-name basic-auth` on 127.0.0.1, runs in `postgres`'s database,
    users in its auth database, artifacts in a folder under `root`; as in the recipe of
    docs/tracking.md, every secret comes through the environment, none on the command line."""
    server = MlflowServer(
        port=free_port(),
        artifacts=root / "mlartifacts",
        log=root / "mlflow-server.log",
        admin=new_user("admin"),
    )
    auth_config = root / "basic_auth.ini"
    auth_config.write_text(
        BASIC_AUTH_INI.format(database_uri=postgres.uri_of(postgres.auth_database))
    )
    auth_config.chmod(0o600)
    env = {**os.environ, **TELEMETRY_OPT_OUT}
    # The server's job runner (8 worker processes, for GenAI scorers) is not needed for
    # tracking; without it the server starts lighter and stops in seconds, not ~15 s.
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    env["MLFLOW_BACKEND_STORE_URI"] = postgres.uri
    env["MLFLOW_AUTH_CONFIG_PATH"] = str(auth_config)
    env["MLFLOW_AUTH_ADMIN_USERNAME"] = server.admin.username
    env["MLFLOW_AUTH_ADMIN_PASSWORD"] = server.admin.password
    env["MLFLOW_FLASK_SERVER_SECRET_KEY"] = secrets.token_hex(16)
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        env.pop(name, None)
    with server.log.open("w") as out:
        process = subprocess.Popen(
            [str(MLFLOW), "server", "--app-name", "basic-auth"]
            + ["--artifacts-destination", str(server.artifacts)]
            + ["--host", "127.0.0.1", "--port", str(server.port), "--workers", "1"],
            cwd=root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def healthy() -> bool:  # /health answers without credentials
            try:
                with urllib.request.urlopen(f"{server.uri}/health", timeout=2) as response:
                    return response.status == 200
            except OSError:
                return False

        _wait_until(healthy, process, server.log, "mlflow server", timeout=180)
        yield server
    finally:
        _stop(process)


def run_kedro(project: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`kedro run` in `project`; MLflow credentials only those given in `env`."""
    from tests import warm_kedro

    environ = project_env(**env)
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        if name not in env:
            environ.pop(name, None)
    return warm_kedro.run(["run", *args], project, environ, timeout=600)


def output(result: subprocess.CompletedProcess) -> str:
    return result.stdout[-3000:] + result.stderr[-5000:]


# The two runs: the default dp=2 (ZeRO-1) and tp=2 (+ sequence parallel), on 2 ranks.
DP2_LAYOUT = "dp2-tp1-pp1"
TP2_LAYOUT = "dp1-tp2-pp1-sp"
# The dp=2 run goes on to consolidation and evaluation, so its model is logged to the run
# and registered on the server (conf/team/mlflow.yml: registered_model_name: meshtrain).
DP2_PIPELINES = "data_processing,planning,training,consolidation,evaluation"
REGISTERED_MODEL = "meshtrain"


@dataclass
class TeamTracking:
    """PostgreSQL, an MLflow server with basic auth on it, and scratch projects whose runs
    went there as the team member `member`: `dp2` (in `project`) found the server and the
    member's credentials through conf/local/credentials.yml (the password read from the
    environment by `oc.env`), then `tp2` (in `tp2_project`) through MLFLOW_TRACKING_URI /
    _USERNAME / _PASSWORD. After them, side by side, `refused`
    holds two runs the server turned away: `wrong_password` (the credentials file with
    another password, in `project`) and `anonymous` (MLFLOW_TRACKING_URI alone, in
    `tp2_project`), with what the admin saw on the server (`seen_before_refused`,
    `seen_after_refused`) and each one's project's plan.json (`plan_before_refused`,
    `plan_after_refused`, by the refused run's name) just before and after them; and
    `no_credentials`, `--env team` with no server anywhere, in the empty `bare_project`."""

    postgres: Postgres
    server: MlflowServer
    project: Path
    tp2_project: Path
    bare_project: Path
    member: User
    dp2: subprocess.CompletedProcess
    tp2: subprocess.CompletedProcess
    refused: dict[str, subprocess.CompletedProcess]
    no_credentials: subprocess.CompletedProcess
    wrong_password: str = field(repr=False)
    seen_before_refused: tuple = ()
    seen_after_refused: tuple = ()
    plan_before_refused: dict = field(default_factory=dict)
    plan_after_refused: dict = field(default_factory=dict)
    started_s: float = 0.0

    @property
    def projects(self) -> list[Path]:
        return [self.project, self.tp2_project, self.bare_project]

    def client(self, user: User | None | str = "admin") -> ClientAs:
        """A client of the server as the admin (default), another user, or None: nobody."""
        return ClientAs(self.server.uri, self.server.admin if user == "admin" else user)


def seen_by(client: ClientAs) -> tuple[list[str], list[str]]:
    """Every experiment and run on the server, deleted ones included."""
    from mlflow.entities import ViewType

    experiments = client.search_experiments(view_type=ViewType.ALL)
    ids = [e.experiment_id for e in experiments]
    runs = client.search_runs(ids, run_view_type=ViewType.ALL) if ids else []
    return sorted(e.name for e in experiments), sorted(r.info.run_id for r in runs)


def file_state(path: Path) -> tuple:
    return (path.read_bytes(), path.stat().st_mtime_ns) if path.exists() else ()


PLAN = Path("data") / "05_model_input" / "plan.json"


def run_together(**runs: tuple) -> dict[str, subprocess.CompletedProcess]:
    """`run_kedro(*args, **env)` for each named (args, env), all at once: a refused run is
    mostly Kedro's start-up, one busy core for ~10 s, so three side by side share the
    machine's cores instead of queueing (the tests run on 2 cores)."""
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        futures = {name: pool.submit(run_kedro, *args, **env) for name, (args, env) in runs.items()}
        return {name: future.result() for name, future in futures.items()}


def _trained_runs(server: MlflowServer, member: User, project: Path, tp2_project: Path) -> dict:
    """The member's two runs, each in its own project, one after the other: the first
    creates the experiment (two first runs at once on a fresh server can race there)."""
    credentials = project / "conf" / "local" / "credentials.yml"
    # As docs/tracking.md suggests: the file names the variables, not the secrets.
    credentials.write_text(
        f"mlflow:\n  tracking_uri: {server.uri}\n"
        "  username: ${oc.env:TEAM_MLFLOW_USER}\n"
        "  password: ${oc.env:TEAM_MLFLOW_PASSWORD}\n"
    )
    team = ("--env", "team", "--params")
    dp2 = run_kedro(
        project,
        *team,
        SMALL_RUN,
        "--pipelines",
        DP2_PIPELINES,
        TEAM_MLFLOW_USER=member.username,
        TEAM_MLFLOW_PASSWORD=member.password,
        # MLflow publishes system metrics only once a sampling interval has passed with
        # the run open; 10 s (the project's default) can outlast a short run on a fast
        # machine, half a second cannot (the launch alone takes longer).
        MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL="0.5",
    )
    tp2 = run_kedro(
        tp2_project,
        *team,
        SMALL_RUN + ",parallel.tensor_parallel_size=2",
        "--pipelines",
        "data_processing,planning,training",
        MLFLOW_TRACKING_URI=server.uri,
        MLFLOW_TRACKING_USERNAME=member.username,
        MLFLOW_TRACKING_PASSWORD=member.password,
    )
    return {"dp2": dp2, "tp2": tp2}


def _refused_runs(
    server: MlflowServer, member: User, wrong_password: str, projects: dict[str, Path]
) -> dict[str, subprocess.CompletedProcess]:
    """Three who do not get in, side by side: the two the server turns away would each
    rewrite their project's plan.json if they got past the hook; with no server named
    anywhere, the run stops before data processing writes its first file."""
    planning = ("--env", "team", "--pipeline", "planning", "--params", SMALL_RUN)
    return run_together(
        wrong_password=(
            (projects["wrong_password"], *planning),
            {"TEAM_MLFLOW_USER": member.username, "TEAM_MLFLOW_PASSWORD": wrong_password},
        ),
        anonymous=((projects["anonymous"], *planning), {"MLFLOW_TRACKING_URI": server.uri}),
        # data_processing reads nothing earlier pipelines write, so the missing-input
        # check (which runs first, see settings.py) has nothing to say and the tracking
        # check speaks.
        no_credentials=(
            (projects["no_credentials"], "--env", "team", "--pipeline", "data_processing")
            + ("--params", SMALL_RUN),
            {},
        ),
    )


def _start_team_tracking(root: Path) -> TeamTracking:
    started = time.monotonic()
    postgres = _SHARED.stack.enter_context(postgres_server())
    server = _SHARED.stack.enter_context(mlflow_server(postgres, root))
    member = server.create_user("alice")
    project, tp2_project, bare_project = (
        make_project(root / name) for name in ("project", "tp2-project", "bare-project")
    )
    trained = _trained_runs(server, member, project, tp2_project)
    admin = ClientAs(server.uri, server.admin)
    projects = {"wrong_password": project, "anonymous": tp2_project}
    seen_before = seen_by(admin)
    plan_before = {how: file_state(where / PLAN) for how, where in projects.items()}
    wrong_password = new_user(member.username).password
    refused = _refused_runs(
        server, member, wrong_password, {**projects, "no_credentials": bare_project}
    )
    seen_after = seen_by(admin)
    plan_after = {how: file_state(where / PLAN) for how, where in projects.items()}
    return TeamTracking(
        postgres,
        server,
        project,
        tp2_project,
        bare_project,
        member,
        trained["dp2"],
        trained["tp2"],
        {how: refused[how] for how in projects},
        refused["no_credentials"],
        wrong_password=wrong_password,
        seen_before_refused=seen_before,
        seen_after_refused=seen_after,
        plan_before_refused=plan_before,
        plan_after_refused=plan_after,
        started_s=time.monotonic() - started,
    )


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
    try:
        _SHARED.value = _start_team_tracking(tmp_path_factory.mktemp("team-tracking"))
    except Exception as error:
        _SHARED.error = error
        stop_team_tracking()
        raise
    return _SHARED.value


def stop_team_tracking() -> None:
    """Stop the servers (idempotent: the session fixture's teardown calls it)."""
    _SHARED.stack.close()
