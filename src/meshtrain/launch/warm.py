"""Warm ranks: worker processes forked from a server that imported torch, transformers
and the engine once, instead of each spawned fresh and importing them again (about 4 s
of CPU per rank: 4 ranks on 2 cores waited about 10 s before training).

The server is Python's forkserver (`multiprocessing.forkserver`), started by the
launcher (a Kedro run starts it once its parameters parse, `prestart`, so its imports
overlap the run's own start), preloading `meshtrain.launch.worker`; torch elastic starts
and supervises the ranks through it (`start_method="forkserver"`) as it does spawned
ones: restarts, stop signals forwarded, failures collected. What makes a forked rank
behave as a spawned one:

- The server never acts on a stop signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1):
  it starts with them blocked and ignores them once it runs (`launch.warm_server`), so
  a signal sent to the whole process group (SLURM signals every process of a step)
  reaches the launcher and the ranks, and the server stays up for the next restart.
- Each rank starts as a fresh process would: the mask emptied and the stop signals at
  their default dispositions. multiprocessing gives it the launcher's working directory
  and `sys.path`; its environment is the server's (with torch elastic's per-rank
  variables on top), which is the launcher's (below).
- Each rank dies with its launcher. Its parent is the server, so neither torch elastic
  nor a parent-death signal would stop it when the launcher is SIGKILLed: a thread
  watches the launcher's pid (a pidfd) and kills the rank when it exits.
- The server starts with the launcher's environment; when the launcher's has changed
  since, the server is replaced before the launch, since the variables read when a
  module is imported (the Hugging Face offline switches, torch's and the BLAS's thread
  settings) keep the values the server imported them with. Except the late variables
  (`is_late`): those the launcher's own MLflow run and torch set after a prestarted
  server started, which no import reads; each rank takes their launch-time values.

The server is a new interpreter that imports the engine (about 10 s of CPU). A launcher
that already is what the server would be (it holds the engine, runs one Python thread
and has configured nothing its ranks must not inherit: the end-to-end tests' `kedro`
processes, forked from a process that imported it all) can start it as a fork of
itself instead (`fork_server`), for next to nothing.

Off with `launch.warm_ranks=false`, and off where this cannot be made safe: outside
Linux (no pidfd), or where this Python's forkserver lacks what is used here.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing.forkserver as forkserver
import os
import select
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing import connection, resource_tracker
from typing import Any

log = logging.getLogger(__name__)

# What the server imports once: its signal dispositions, the ranks' entry points and
# everything they import.
PRELOAD = ["meshtrain.launch.warm_server"]

# The signals that stop a job (torch elastic's and SLURM's), which the server never acts on.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)

# Variables (by prefix) a change in which keeps the server: `is_late`. torch elastic
# writes TORCHELASTIC_SIGNALS_TO_HANDLE into the launcher's environment at every launch,
# so without it a launcher's second launch would start a new server. A launcher of
# several nodes names its network interface to the ranks at the launch
# (`network.IFNAME_VARIABLES`, read when a rank joins its process group). Kedro adds the
# project's source folder to PYTHONPATH when it bootstraps a project; an interpreter
# reads it when it starts, and a rank's `sys.path` is the launcher's (multiprocessing
# passes it).
LATE_VARIABLES = (
    "MLFLOW_",
    "TORCHINDUCTOR_CACHE_DIR",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "PYTHONPATH",
)

# In the launcher: the environment the running server started with.
_started_with: dict[str, str] | None = None
_lock = threading.Lock()


def supported() -> bool:
    """Whether warm ranks can be made safe here."""
    return (
        sys.platform == "linux"
        and hasattr(os, "pidfd_open")
        and hasattr(forkserver._forkserver, "_stop")
        and hasattr(forkserver._forkserver, "_forkserver_pid")
    )


def ensure_server() -> None:
    """Start this launcher's server, or replace it when the environment has changed since
    it started (beyond the late variables); it preloads the engine with the stop signals
    blocked."""
    global _started_with
    with _lock:
        changed = _changed_names(_started_with) if _started_with is not None else set()
        if changed - {name for name in changed if is_late(name)}:
            log.info(
                "the environment changed since the warm-rank server started (%s): restarting it",
                ", ".join(sorted(changed)),  # names only: values may be secrets
            )
            _end_server()
            _started_with = None
        forkserver.set_forkserver_preload(PRELOAD)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            forkserver.ensure_running()  # a no-op while the server runs
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if _started_with is None:
            _note_started()


def _note_started() -> None:
    """Remember the environment the server started with; stop it at this launcher's exit."""
    global _started_with
    _started_with = dict(os.environ)
    atexit.unregister(_stop_server)  # registered once, however often restarted
    atexit.register(_stop_server)


def import_engine() -> None:
    """What the server imports before it serves (`warm_server`, less its signal
    dispositions): torch, transformers, the trainer, and rank 0's MLflow client, which
    is imported here, not while rank 0 builds its model."""
    import meshtrain.launch.worker  # noqa: F401, PLC0415
    from meshtrain.tracking.rank_metrics import import_client  # noqa: PLC0415

    import_client()


def fork_server() -> None:
    """Start the server as a fork of this launcher (`forkable`), which imports the engine
    first (`import_engine`: nothing where it holds it), as `multiprocessing.forkserver`
    starts a new one: a listening socket private to this user, and the "alive" pipe
    whose end of file (this launcher gone) ends the server."""
    with _lock:
        if not forkable():
            raise RuntimeError(
                "the warm-rank server is forked only from a launcher running one Python "
                "thread and no server, on a Python whose forkserver needs no key"
            )
        import_engine()
        resource_tracker.ensure_running()  # first: the server and its ranks share it
        forkserver.set_forkserver_preload(PRELOAD)
        address = connection.arbitrary_address("AF_UNIX")
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            for stream in (sys.stdout, sys.stderr):  # or the server would write it again
                stream.flush()
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            pid = os.fork()
            if pid == 0:
                os.close(alive_w)
                _serve_forked(listener.fileno(), alive_r)  # never returns
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            os.close(alive_r)
        server = forkserver._forkserver
        server._forkserver_address, server._forkserver_alive_fd = address, alive_w
        server._forkserver_pid = pid
        _note_started()


def forkable() -> bool:
    """Whether this launcher can fork its server: it must be what a new server would be
    once its imports are done. It runs one Python thread (a fork copies the calling
    thread alone, with any lock another one held; the native threads of the engine's
    libraries, Arrow's and jemalloc's, run in a new server too and survive a fork), no
    server yet, and this Python's forkserver takes no key (3.14's does). What it must
    also be is its caller's to know: having configured nothing a rank must not inherit
    but the root logger (reset in the server)."""
    return (
        supported()
        and threading.active_count() == 1
        and forkserver._forkserver._forkserver_pid is None
        and not hasattr(forkserver._forkserver, "_forkserver_authkey")
    )


def _serve_forked(listener: int, alive_r: int) -> None:
    """In the forked server: serve until the launcher is gone, then exit without running
    the launcher's exit handlers (they would stop this server, as the launcher's)."""
    code = 1
    try:
        # The root logger as a new interpreter has it (the launcher's, Kedro's, would
        # print its ranks' INFO records); the libraries' own loggers are as imported.
        logging.root.handlers.clear()
        logging.root.setLevel(logging.WARNING)
        forkserver.main(listener, alive_r, PRELOAD)
    except SystemExit:  # the launcher is gone
        code = 0
    except BaseException:  # noqa: BLE001 - as an interpreter would: print it, exit 1
        traceback.print_exc()
    finally:
        os._exit(code)


def _changed_names(before: dict[str, str]) -> set[str]:
    return {name for name, _ in set(before.items()) ^ set(os.environ.items())}


def is_late(name: str) -> bool:
    """A variable the launcher's own run sets once the server may have started (its MLflow
    run's, torch's compile cache, torch elastic's signal list, the network interface of a
    launch over several nodes, Kedro's PYTHONPATH), which nothing the server imports
    reads at import."""
    return name.startswith(LATE_VARIABLES)


def late_environment() -> dict[str, str]:
    """The launcher's late variables now, which each rank takes (`warm_rank`)."""
    return {name: value for name, value in os.environ.items() if is_late(name)}


def _stop_server() -> None:
    """At the launcher's exit: end the server and wait for it, so that nothing of the job
    outlives its launcher (left alone, the server ends a moment later, on its own)."""
    global _started_with
    with _lock:
        _end_server()
        _started_with = None


def _end_server() -> None:
    """Kill the server (it ignores the stop signals, and a server still importing would
    finish its imports before it saw its end) and reap it. Its ranks do not depend on it:
    each dies with the launcher."""
    pid = forkserver._forkserver._forkserver_pid
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    forkserver._forkserver._stop()


def warm_rank(
    launcher_pid: int,
    late: dict[str, str],
    entrypoint: Callable[..., Any],
    args: tuple[Any, ...],
) -> Any:
    """A rank forked from the server: made as a spawned one would be (`late`: the launcher's
    late variables at the launch), then `entrypoint` (which, as with spawn, records its own
    errors for torch elastic)."""
    _fresh_signals()
    _die_with(launcher_pid)
    for name in [name for name in os.environ if is_late(name) and name not in late]:
        del os.environ[name]
    os.environ.update(late)
    return entrypoint(*args)


def _fresh_signals() -> None:
    """The signal mask and stop signals' dispositions of a new process."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for number in STOP_SIGNALS:
        default = signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL
        signal.signal(number, default)


def _die_with(launcher_pid: int) -> None:
    """Kill this rank when the launcher exits (a SIGKILLed launcher tells no one)."""
    try:
        watched = os.pidfd_open(launcher_pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return

    def watch() -> None:
        select.select([watched], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="meshtrain-launcher-watch", daemon=True).start()


def prestart(enabled: bool) -> None:
    """Start the server ahead of the launch (a Kedro run does once its parameters parse),
    so its imports overlap the launcher's own work; the launch then finds it running."""
    if enabled and supported():
        ensure_server()


def start_method(enabled: bool) -> str:
    """torch elastic's start method: the server's where warm ranks are on and safe here."""
    if enabled and supported():
        ensure_server()
        return "forkserver"
    return "spawn"
