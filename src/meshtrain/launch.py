"""Start one worker process per rank with torch elastic, and wait for all of them.

This is torchrun's machinery called as a function: c10d rendezvous (so the
same code spans several nodes), `spawn` start method, per-rank log files. A
rank that raises makes the launcher stop the other ranks and raise
`WorkerFailedError` with that rank's own error message, so nothing hangs and
no worker is left behind.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig as ElasticLaunchConfig
from torch.distributed.launcher.api import elastic_launch

from meshtrain.config import LaunchConfig


class WorkerFailedError(RuntimeError):
    """A worker rank failed; the message carries that rank's error."""

    def __init__(self, rank: int, message: str) -> None:
        self.rank = rank
        super().__init__(f"training worker rank {rank} failed: {message}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_workers(
    entrypoint: Callable[..., Any],
    args: tuple[Any, ...],
    launch: LaunchConfig,
    *,
    log_dir: Path,
    run_id: str,
) -> dict[int, Any]:
    """Run `entrypoint(*args)` on `launch.world_size` ranks; returns {global rank: result}.

    `entrypoint` must be a module-level function (the spawn start method
    pickles it by name) decorated with `torch.distributed.elastic...record`
    so its exceptions reach the launcher.
    """
    endpoint = launch.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    config = ElasticLaunchConfig(
        min_nodes=launch.nnodes,
        max_nodes=launch.nnodes,
        nproc_per_node=launch.nproc_per_node,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"join_timeout": 600},
        max_restarts=launch.max_restarts,
        monitor_interval=launch.monitor_interval,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), tee=Std.ALL),
        local_addr="127.0.0.1" if launch.nnodes == 1 else None,
        log_line_prefix_template="[rank${rank}] ",
    )
    try:
        return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as error:
        rank, message = _root_failure(_all_failures(error))
        raise WorkerFailedError(rank, message) from None


def _all_failures(error: ChildFailedError) -> dict[int, tuple[int, str]]:
    """{global rank: (timestamp, message)} for every rank that left an error.

    The agent stops the group at the first dead rank it sees, which is often
    not the one that raised first (that one may still be writing its error
    file); so the error files of the whole attempt are read, not just the
    failures the agent had collected.
    """
    found = {r: (f.timestamp, _failure_message(f)) for r, f in error.failures.items()}
    rank, failure = next(iter(error.failures.items()))
    if not failure.error_file:
        return found
    offset = rank - failure.local_rank
    for path in Path(failure.error_file).parent.parent.glob("*/error.json"):
        if not path.parent.name.isdigit() or offset + int(path.parent.name) in found:
            continue
        try:
            message = json.loads(path.read_text())["message"]
            timestamp = int(message["extraInfo"]["timestamp"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        found[offset + int(path.parent.name)] = (timestamp, _message_text(message))
    return found


# What a rank reports when a *peer* died under it: a symptom, not the cause.
_PEER_SYMPTOMS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "Broken pipe",
    "communicator was aborted",
)


def _root_failure(failures: dict[int, tuple[int, str]]) -> tuple[int, str]:
    """The rank whose own error started it: any real error before a peer-died symptom.

    Timestamps alone mislead: error files carry whole seconds, so the rank that
    raised and the rank whose collective then broke often tie, and a rank
    killed outright has no error file and is only noticed later.
    """

    def key(item: tuple[int, tuple[int, str]]) -> tuple[bool, int, int]:
        rank, (timestamp, message) = item
        return any(s in message for s in _PEER_SYMPTOMS), timestamp, rank

    rank, (_, message) = min(failures.items(), key=key)
    return rank, message


def _failure_message(failure: Any) -> str:
    """The failing rank's exception text, from the error file `record` wrote."""
    message = _message_text(failure.message)
    if not message or message == "<N/A>":
        message = f"exit code {failure.exitcode} (see the rank's log under the run's logs/)"
    return message


def _message_text(message: Any) -> str:
    if isinstance(message, dict):
        extra = message.get("extraInfo", {})
        return str(extra.get("py_callstack") or message.get("message") or json.dumps(message))
    return str(message)
