"""`kedro run` for the end-to-end tests, forked from a server that imported Kedro, torch,
transformers, mlflow and meshtrain once.

A cold `kedro` process spends about 10 s of a core importing them before its first node
(a refused run about 2 s), and the suite starts a few dozen of them; the runs themselves
are what the tests check. Forked from this server, a run starts as a fresh `kedro`
process would: its own session and working directory, the test's environment, stdin
from /dev/null, stdout and stderr to files, the stop signals at their defaults, Python's
`random` reseeded, `sys.argv` and `sys.path[0]` as the `kedro` script sets them,
uncaught exceptions through `sys.excepthook` (the project's refusal printer) and
`atexit` run before it exits. The server itself never bootstraps a project or runs a
node, so each run loads its project's settings, hooks and pipelines itself.

A run whose environment differs from the server's beyond the variables no import reads
(`LATE`) gets a new server started with its environment (with a warning naming the
variables). Every run is a cold process while `MESHTRAIN_TESTS_COLD_KEDRO=1` (the whole
suite can run cold). The tests of start-up itself (imports, refusal times, signals to
the launcher's process group) start their own processes.

Each run has a supervisor (forked from the server, the run's parent) that tells the
test the run's pid and then its exit status over the request's socket, so the server
stays single-threaded and never waits.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

KEDRO = Path(sys.executable).with_name("kedro")

# What the server imports: everything a run imports before its first node, and the
# nodes' own heavy modules.
PRELOAD = (
    "kedro.framework.cli.cli",
    "kedro.framework.session",
    "mlflow",
    "mlflow.store.tracking.sqlalchemy_store",  # a run's own database
    "IPython",  # MLflow looks for a notebook when it starts a run
    "torch",
    "torch.distributed.launcher.api",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "datasets",
    "peft",
    "meshtrain.preflight",
    "meshtrain.preflight_builds",
    "meshtrain.data.prepare",
    "meshtrain.dryrun.command",  # the planning node's dry run
    "meshtrain.evaluation",
    "meshtrain.hooks",
    "meshtrain.launch.job",
    "meshtrain.tracking.plots",
)

# Variables (by prefix) that no import reads: a run whose environment differs from the
# server's in these alone is still forked (meshtrain sets torch's compile cache when it
# imports torch in the test's process; threadpoolctl sets the flag Intel's OpenMP runtime
# reads when it loads, which torch's GNU one here never does).
LATE = (
    "MLFLOW_",
    "TEAM_MLFLOW_",
    "TORCHINDUCTOR_CACHE_DIR",
    "KMP_DUPLICATE_LIB_OK",
    "MESHTRAIN_TESTS_NEW_RANK_SERVER",
)

COLD = "MESHTRAIN_TESTS_COLD_KEDRO"
# A forked run's warm-rank server is a new interpreter, as a cold run's, while this is
# "1" (bench/kedro_runs.py compares the two).
NEW_RANK_SERVER = "MESHTRAIN_TESTS_NEW_RANK_SERVER"

_server: subprocess.Popen | None = None
_server_env: dict[str, str] | None = None
_address: str | None = None
_lock = threading.Lock()


# --- the test's side ---------------------------------------------------------------


class _FileOutput:
    """`communicate` for a run whose stdout and stderr went to files: the run is killed
    when it outlasts `timeout`, as `subprocess.run` does."""

    _out: Path
    _err: Path | None

    def communicate(self, input=None, timeout: float | None = None) -> tuple[str, str]:  # noqa: A002
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise
        return _read(self._out, self._err)


class WarmRun(_FileOutput):
    """A forked `kedro` process, as much of `subprocess.Popen` as the tests use."""

    def __init__(self, args: list[str], connection: socket.socket, out: Path, err: Path | None):
        self.args = args
        self._connection = connection
        self._buffer = b""
        self._out, self._err = out, err
        self.pid: int = self._message(None)["pid"]
        self.returncode: int | None = None

    def _message(self, timeout: float | None) -> dict:
        """The supervisor's next line; {} when none came within `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._connection], [], [], left)[0]:
                return {}
            chunk = self._connection.recv(4096)
            if not chunk:  # the supervisor is gone without a word: as if killed
                return {"returncode": -signal.SIGKILL}
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        return self._status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        if self._status(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            message = self._message(timeout)
            if message:
                self.returncode = message["returncode"]
                self._connection.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ColdRun(_FileOutput, subprocess.Popen):
    """A fresh `kedro` process, its output to files as a `WarmRun`'s."""

    def __init__(
        self, args: list[str], cwd: Path, env: dict[str, str], out: Path, err: Path | None
    ):
        self._out, self._err = out, err
        with open(out, "w") as stdout, open(err or os.devnull, "w") as stderr:
            super().__init__(
                [str(KEDRO), *args],
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr if err else subprocess.STDOUT,
            )


def _read(out: Path, err: Path | None) -> tuple[str, str]:
    return out.read_text(errors="replace"), err.read_text(errors="replace") if err else ""


def _changed(env: dict[str, str]) -> set[str]:
    """The variables, beyond `LATE`, in which `env` differs from the server's."""
    assert _server_env is not None
    differ = {k for k in env.keys() | _server_env.keys() if env.get(k) != _server_env.get(k)}
    return {k for k in differ if not k.startswith(LATE)}


def _ensure_server(env: dict[str, str]) -> bool:
    """Start the server with `env` (a run's environment beyond `LATE`) once per test
    process, and again for a run whose environment differs from it beyond `LATE` (an
    import reads it); False where no run is forked (`COLD`, no `os.fork`)."""
    if os.environ.get(COLD) == "1" or not hasattr(os, "fork"):
        return False
    with _lock:
        if _server is not None and _server.poll() is not None:
            warnings.warn(
                f"the warm kedro server exited ({_server.returncode}): restarting it", stacklevel=2
            )
        elif _server is not None:
            changed = _changed(env)
            if not changed:
                return True
            warnings.warn(
                f"the warm kedro server restarts: a run's environment differs in {sorted(changed)}",
                stacklevel=2,
            )
            _server.kill()  # the server alone: the runs in flight and their supervisors stay
            _server.wait()
            _server.stdin.close()
        _start_server({k: v for k, v in env.items() if not k.startswith(LATE)})
        return True


def _start_server(env: dict[str, str]) -> None:
    global _server, _server_env, _address
    folder = tempfile.mkdtemp(prefix="warm-kedro-")
    _address = os.path.join(folder, "socket")
    _server_env = env
    _server = subprocess.Popen(
        [sys.executable, __file__, _address],
        cwd=folder,
        env=env,
        stdin=subprocess.PIPE,  # its end of file: this process is gone
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # a test's signal to its own group never reaches it
    )
    atexit.unregister(_stop_server)
    atexit.register(_stop_server)
    while not os.path.exists(_address):  # it listens once its imports are done
        if _server.poll() is not None:
            raise RuntimeError(f"the warm kedro server exited with {_server.returncode}")
        time.sleep(0.05)


def _stop_server() -> None:
    if _server is not None and _server.poll() is None:
        os.killpg(_server.pid, signal.SIGKILL)
        _server.wait()


def start(
    args: list[str],
    cwd: Path,
    env: dict[str, str],
    out: Path,
    err: Path | None,
) -> WarmRun | ColdRun:
    """`kedro *args` in `cwd` with `env`, its stdout to `out` and its stderr to `err`
    (None: to `out`); forked where it can be, else a cold `subprocess.Popen`."""
    if not _ensure_server(env):
        return ColdRun(args, cwd, env, out, err)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(_address)
    request = {
        "argv": [str(KEDRO), *args],
        "cwd": str(cwd),
        "env": env,
        "stdout": str(out),
        "stderr": str(err) if err else None,
    }
    connection.sendall(json.dumps(request).encode() + b"\n")
    return WarmRun(args, connection, out, err)


def run(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    """`subprocess.run([kedro, *args], capture_output=True, text=True)`, forked where it can be."""
    with tempfile.TemporaryDirectory(prefix="kedro-run-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        process = start(args, cwd, env, out, err)
        stdout, stderr = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess([str(KEDRO), *args], process.returncode, stdout, stderr)


# --- the server's side -------------------------------------------------------------


def _serve(address: str) -> None:
    import importlib

    from meshtrain.launch import warm

    for module in PRELOAD:
        importlib.import_module(module)
    warm.import_engine()  # what a warm-rank server imports: each run forks its own for nothing
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address + ".binding")
    listener.listen(64)
    os.rename(address + ".binding", address)  # the path appears once it accepts
    while True:
        readable = select.select([listener, sys.stdin], [], [])[0]
        if sys.stdin in readable:  # the test process is gone (killed): so is the server
            os._exit(0)
        connection, _ = listener.accept()
        try:
            request = json.loads(connection.makefile("r").readline())
        except (OSError, ValueError):  # a client gone before its request: serve the next
            connection.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            _supervise(connection, request)  # never returns
        connection.close()
        _reap()


def _reap() -> None:
    """Reap the supervisors that have ended."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _supervise(connection: socket.socket, request: dict) -> None:
    """In the supervisor: fork the run, report its pid, wait for it, report its status."""
    try:
        pid = os.fork()
        if pid == 0:
            connection.close()
            _run(request)  # never returns
        connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        connection.sendall(json.dumps({"returncode": code}).encode() + b"\n")
    finally:
        os._exit(0)


def _run(request: dict) -> None:
    """In the run: become what a fresh `kedro` process would be, then run Kedro's CLI."""
    import random

    code = 1
    try:
        os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        if request["stderr"]:
            err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(err, 2)
        else:
            os.dup2(out, 2)
        random.seed()
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(sys.argv[0])
        _fork_warm_rank_server()
        code = _main()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream: nothing to flush
                stream.flush()
        os._exit(code)


def _fork_warm_rank_server() -> None:
    """The run's warm-rank server, a fork of the run before Kedro starts: as a server
    started by the run would be once its imports are done (PRELOAD holds them), a child
    of the run in its session, for no imports. A run whose environment changes before
    its launch replaces it as any launcher does (`launch.warm`)."""
    from meshtrain.launch import warm

    if os.environ.get(NEW_RANK_SERVER) != "1" and warm.forkable():
        warm.fork_server()


def _main() -> int:
    """Kedro's CLI, then what the interpreter does at exit: the exit code from SystemExit,
    an uncaught exception through `sys.excepthook`, non-daemon threads joined, `atexit`."""
    from kedro.framework.cli import main

    try:
        main()
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter: print it, exit 1
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    return code


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    _serve(sys.argv[1])
