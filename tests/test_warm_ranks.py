"""Warm ranks (`launch.warm`): forked from a server that imported the engine once, and
otherwise what a spawned rank is: a fresh signal mask and dispositions, the launcher's
environment and working directory at this launch, and no life after its launcher."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kedro.config import OmegaConfigLoader
from kedro.io import MemoryDataset
from torch.distributed.elastic.multiprocessing.errors import record

from meshtrain import preflight, settings
from meshtrain.config import LaunchConfig, Refused
from meshtrain.hooks import RunChecksHook, run_checks
from meshtrain.launch import warm
from meshtrain.launch.elastic import run_workers
from meshtrain.launch.network import IFNAME_VARIABLES
from meshtrain.pipeline_registry import register_pipelines
from tests.conftest import child_processes, is_alive, worker_processes

ROOT = Path(__file__).resolve().parents[1]
PROBE = "MESHTRAIN_TEST_PROBE"
LATE = "MLFLOW_TRACKING_URI"  # what the launcher's MLflow run sets after a prestart

pytestmark = pytest.mark.skipif(not warm.supported(), reason="warm ranks need Linux's pidfd")


@record
def report() -> dict:
    """What a rank finds when its entrypoint starts."""
    return {
        "preloaded": "meshtrain.trainer" in sys.modules,
        "parent": os.getppid(),
        "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "handlers": {s.name: signal.getsignal(s) for s in warm.STOP_SIGNALS},
        "probe": os.environ.get(PROBE),
        "late": os.environ.get(LATE),
        "rank": os.environ["RANK"],
        "cwd": os.getcwd(),
        "root_logger": [logging.getLevelName(logging.root.level), len(logging.root.handlers)],
    }


@record
def sleep_forever(folder: str) -> None:
    Path(folder, f"rank-{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    time.sleep(3600)


def _launch(tmp_path: Path, name: str, warm_ranks: bool = True) -> dict[int, dict]:
    launch = LaunchConfig(nproc_per_node=2, warm_ranks=warm_ranks)
    return run_workers(report, (), launch, log_dir=tmp_path / name, run_id=name)


@pytest.mark.slow
def test_a_warm_rank_is_forked_warm_and_starts_as_a_spawned_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(PROBE, "first")
    monkeypatch.delenv(LATE, raising=False)
    monkeypatch.delenv("TORCHELASTIC_SIGNALS_TO_HANDLE", raising=False)  # each launch sets it
    warm.prestart(True)  # as a Kedro run does once its quick checks pass
    prestarted = warm.forkserver._forkserver._forkserver_pid
    monkeypatch.setenv(LATE, "sqlite:///late.db")  # a late variable: the server stays
    first = _launch(tmp_path, "first")
    again = _launch(tmp_path, "again")  # a second launch of one launcher: the same server
    monkeypatch.delenv(LATE)
    monkeypatch.setenv(PROBE, "second")  # the server started with "first": it is replaced
    second = _launch(tmp_path, "second")
    spawned = _launch(tmp_path, "spawned", warm_ranks=False)

    for rank in (0, 1):
        for seen, probe in ((first[rank], "first"), (second[rank], "second")):
            assert seen["preloaded"] and seen["parent"] != os.getpid()  # the server's child
            assert seen["probe"] == probe and seen["rank"] == str(rank)
            assert seen["cwd"] == str(tmp_path)
            assert seen["blocked"] == []
            assert seen["handlers"] == spawned[rank]["handlers"]
        assert first[rank]["parent"] == again[rank]["parent"] == prestarted
        assert first[rank]["late"] == "sqlite:///late.db" and second[rank]["late"] is None
        assert not spawned[rank]["preloaded"] and spawned[rank]["parent"] == os.getpid()
    assert spawned[0]["handlers"]["SIGUSR1"] == signal.SIG_DFL
    assert spawned[0]["handlers"]["SIGINT"] == signal.default_int_handler
    assert worker_processes(os.getpid()) == []


@pytest.mark.slow
def test_no_warm_rank_outlives_a_killed_launcher_and_the_server_ignores_stop_signals(
    tmp_path: Path,
):
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from meshtrain.config import LaunchConfig; "
            "from meshtrain.launch.elastic import run_workers; "
            "from tests.test_warm_ranks import sleep_forever; "
            "run_workers(sleep_forever, (sys.argv[1],), LaunchConfig(nproc_per_node=2), "
            "log_dir=Path(sys.argv[1]) / 'logs', run_id='orphans')",
            str(tmp_path),
        ],
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("rank-*.pid"))) < 2:
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        ranks = [int(p.read_text()) for p in tmp_path.glob("rank-*.pid")]
        assert sorted(ranks) == sorted(worker_processes(launcher.pid))
        server = next(pid for pid, cmd in child_processes(launcher.pid) if "forkserver" in cmd)
        # A stop signal to the server (as SLURM sends one to every process of a step) is
        # held blocked: the server stays up for the next restart.
        for number in (signal.SIGUSR1, signal.SIGTERM, signal.SIGHUP):
            os.kill(server, number)
        time.sleep(1)
        assert is_alive(server)

        launcher.kill()  # SIGKILL: the launcher tells no one
        launcher.wait()
        deadline = time.monotonic() + 20
        while any(is_alive(pid) for pid in [*ranks, server]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [pid for pid in [*ranks, server] if is_alive(pid)] == []
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


def test_a_launcher_that_stops_before_its_launch_leaves_no_server():
    """A run refused after the server was prestarted (by the slow checks): the launcher's
    exit ends the server even while it is still importing, and waits for it."""
    probe = (
        "from meshtrain.launch import warm; warm.prestart(True); "
        "print(warm.forkserver._forkserver._forkserver_pid, flush=True)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    server = int(done.stdout.split()[-1])
    assert not is_alive(server)


def test_a_training_run_starts_its_warm_rank_server_once_the_parameters_parse(monkeypatch):
    """The server's imports run beside the machine checks (`preflight`), not after them;
    a typo is refused before it starts, and a run that does not train never starts it."""
    events: list = []
    monkeypatch.setattr(warm, "prestart", lambda enabled: events.append(f"prestart {enabled}"))
    monkeypatch.setattr(
        preflight, "preflight", lambda *args, **kw: events.append("preflight") or []
    )
    monkeypatch.setattr(run_checks, "check_inputs_exist", lambda *args: events.append("inputs"))
    loader = OmegaConfigLoader(str(ROOT / "conf"), **settings.CONFIG_LOADER_ARGS)
    params = loader["parameters"]
    pipelines = register_pipelines()
    hook = RunChecksHook()

    def before(pipeline: str, **launch: Any) -> None:
        values = {**params, "launch": {**params["launch"], **launch}}
        hook.before_pipeline_run({}, pipelines[pipeline], {"parameters": MemoryDataset(values)})

    before("training")
    assert events == ["prestart True", "preflight", "inputs"]
    events.clear()
    before("training", warm_ranks=False)
    assert events == ["prestart False", "preflight", "inputs"]
    events.clear()
    with pytest.raises(Refused, match="launch.nproc_per_node"):
        before("training", nproc_per_node=0)
    before("consolidation")
    assert events == ["preflight", "inputs"]


# A launcher that already is what a warm-rank server would be: it holds the engine, then
# configures logging as Kedro does, forks its server, and launches twice.
FORKING_LAUNCHER = """
import json, logging, sys, threading
from pathlib import Path
from meshtrain.config import LaunchConfig
from meshtrain.launch import warm
from meshtrain.launch.elastic import run_workers
from tests.test_warm_ranks import report
warm.import_engine()
logging.basicConfig(level=logging.INFO)
assert warm.forkable()
warm.fork_server()
server = warm.forkserver._forkserver._forkserver_pid
out = Path(sys.argv[1])
seen = [run_workers(report, (), LaunchConfig(nproc_per_node=2), log_dir=out / name, run_id=name)
        for name in ("first", "again")]
try:
    warm.fork_server()
    again = "forked twice"
except RuntimeError as error:
    again = str(error)
threading.Thread(target=threading.Event().wait, daemon=True).start()
warm._end_server()
try:
    warm.fork_server()
    threaded = "forked beside a thread"
except RuntimeError as error:
    threaded = str(error)
found = {"server": server, "seen": seen, "again": again, "threaded": threaded}
print(json.dumps(found, default=repr))
"""


@pytest.mark.slow
def test_a_launcher_holding_the_engine_forks_its_server_and_its_ranks_start_as_spawned_ones(
    tmp_path: Path,
):
    """`warm.fork_server`: the server is a fork of the launcher (its command line, its
    child), serves both launches, and its ranks are what the ranks of a new server are:
    a fresh signal mask and dispositions, and the root logger of a new interpreter, not
    the launcher's; it refuses a second server and a launcher running another thread."""
    done = subprocess.run(
        [sys.executable, "-c", FORKING_LAUNCHER, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    for seen in found["seen"]:
        for rank in ("0", "1"):
            assert seen[rank]["preloaded"] and seen[rank]["parent"] == found["server"]
            assert seen[rank]["blocked"] == [] and seen[rank]["root_logger"] == ["WARNING", 0]
            assert seen[rank]["handlers"]["SIGUSR1"] == signal.SIG_DFL
            assert seen[rank]["handlers"]["SIGINT"] == repr(signal.default_int_handler)
            assert seen[rank]["cwd"] == str(ROOT)
    assert "one Python thread and no server" in found["again"] == found["threaded"]
    assert not is_alive(found["server"])


def test_what_a_launch_sets_in_the_launcher_keeps_its_server():
    """The variables a launcher sets between its server's start and its launch (the
    network interface of a launch over several nodes, Kedro's PYTHONPATH) are read by no
    import: a change in them keeps the server (a multi-node run restarted it)."""
    for name in (*IFNAME_VARIABLES, "PYTHONPATH", "TORCHELASTIC_SIGNALS_TO_HANDLE"):
        assert warm.is_late(name), name
    assert not warm.is_late("HF_HUB_OFFLINE") and not warm.is_late("OMP_NUM_THREADS")
