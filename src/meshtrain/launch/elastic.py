"""Start one worker process per rank with torch elastic, and wait for all of them.

This is torchrun's machinery called as a function: c10d rendezvous (so the
same code spans several nodes), ranks forked from a warm server that imported the
engine once (`launch.warm`; spawned where `launch.warm_ranks` is off), per-rank log
files. A
rank that raises makes the launcher stop the other ranks and raise
`WorkerFailedError` with that rank's own error message, so nothing hangs and
no worker is left behind.

Several nodes: every node calls `run_workers` with the same `launch.nnodes`,
`launch.rdzv_endpoint` and `launch.rdzv_id` and its own `launch.node_rank`
(`rendezvous` numbers the nodes by it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousTimeoutError
from torch.distributed.launcher.api import LaunchConfig as ElasticLaunchConfig
from torch.distributed.launcher.api import elastic_launch

from meshtrain.config import LaunchConfig, Refused, split_endpoint
from meshtrain.launch.network import NodeAddress, is_loopback, worker_interface
from meshtrain.launch.rendezvous import NodeLiveness, NodeRankRendezvous, free_port
from meshtrain.launch.warm import late_environment, start_method, warm_rank

# How long the launchers wait for every node to join: nodes of one job may start minutes
# apart (container pulls, a slow shared filesystem), but a missing node must not hang forever.
JOIN_TIMEOUT_S = 600

log = logging.getLogger(__name__)


# The launcher's signals that stop the workers: torch elastic's, and SIGUSR1, which SLURM
# sends ahead of a time limit (`sbatch --signal=USR1@120`). It forwards the one it got.
STOP_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


class Interrupted(Exception):
    """The launcher received a stop signal and stopped the workers (after their grace)."""

    def __init__(self, signal_name: str) -> None:
        self.signal_name = signal_name
        super().__init__(f"the launcher received {signal_name} and stopped the workers")


class WorkerFailedError(RuntimeError):
    """A worker rank failed; the message carries that rank's error."""

    def __init__(self, rank: int, message: str) -> None:
        self.rank = rank
        super().__init__(f"training worker rank {rank} failed: {message}")


def run_workers(
    entrypoint: Callable[..., Any],
    args: tuple[Any, ...],
    launch: LaunchConfig,
    *,
    log_dir: Path,
    run_id: str,
    node: NodeAddress | None = None,
) -> dict[int, Any]:
    """Run `entrypoint(*args)` on `launch.world_size` ranks; returns {global rank: result}.

    `entrypoint` must be a module-level function (the spawn start method
    pickles it by name) decorated with `torch.distributed.elastic...record`
    so its exceptions reach the launcher.

    On one node the dict holds every rank. On several, each node gets its
    own ranks plus rank 0's result under key 0 (sent through the rendezvous
    store, so it must be JSON-able): every node can report the run. `node` is
    this node's address and interface across hosts (`launch.network`).
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        with worker_interface(node):
            return _launch(entrypoint, args, launch, log_dir=log_dir, run_id=run_id, node=node)
    except SignalException as error:
        raise Interrupted(signal.Signals(error.sigval).name) from None


def _launch(
    entrypoint: Callable[..., Any],
    args: tuple[Any, ...],
    launch: LaunchConfig,
    *,
    log_dir: Path,
    run_id: str,
    node: NodeAddress | None,
) -> dict[int, Any]:
    method = start_method(launch.warm_ranks)
    if launch.nnodes == 1:
        target, target_args = _entry(method, entrypoint, args)
        try:
            config = _one_node_config(launch, log_dir, run_id, method)
            return elastic_launch(config, target)(*target_args)
        except ChildFailedError as error:
            failures = _all_failures(error)
            raise _stuck_ranks(failures, launch) or _failure_error(
                *_root_failure(failures)
            ) from None
    liveness = NodeLiveness()
    try:
        config = _multi_node_config(launch, log_dir, run_id, node, liveness, method)
        target, target_args = _entry(method, _run_and_share, (entrypoint, args))
        returned = elastic_launch(config, target)(*target_args)
    except ChildFailedError as error:
        raise _node_failure(error, launch, log_dir, liveness.silent()) from None
    except RendezvousTimeoutError as error:
        raise RendezvousTimeoutError(
            f"not all launch.nnodes={launch.nnodes} nodes joined rendezvous '{run_id}' at "
            f"{launch.rdzv_endpoint} within {JOIN_TIMEOUT_S} s: start the training on every "
            "node with the same launch.nnodes, launch.rdzv_endpoint and launch.rdzv_id, and "
            f"a different launch.node_rank. ({error})"
        ) from None
    except RendezvousError:
        if liveness.started and liveness.silent() is None:
            raise _cut_off(launch) from None
        raise
    finally:
        liveness.stop()
    results = {rank: own for rank, (own, _) in returned.items()}
    for _, rank0 in returned.values():
        if rank0 is not None:
            results.setdefault(0, rank0)
    return results


def _entry(
    method: str, entrypoint: Callable[..., Any], args: tuple[Any, ...]
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """What torch elastic runs on each rank: forked from the warm server, the entrypoint
    behind `warm.warm_rank`, which makes the rank a fresh process first."""
    if method == "forkserver":
        return warm_rank, (os.getpid(), late_environment(), entrypoint, args)
    return entrypoint, args


def _common_settings(
    launch: LaunchConfig, log_dir: Path, run_id: str, method: str
) -> dict[str, Any]:
    """torchrun's settings shared by one and several nodes: how ranks start (spawned, or
    forked from the warm server: `launch.warm`), per-rank log files."""
    return {
        "min_nodes": launch.nnodes,
        "max_nodes": launch.nnodes,
        "nproc_per_node": launch.nproc_per_node,
        "run_id": run_id,
        "max_restarts": launch.max_restarts,
        "monitor_interval": launch.monitor_interval,
        # A stop signal is forwarded to the workers, which checkpoint within this grace.
        "shutdown_timeout": math.ceil(launch.shutdown_grace_s),
        "signals_to_handle": STOP_SIGNALS,
        "start_method": method,
        "logs_specs": DefaultLogsSpecs(log_dir=str(log_dir), tee=Std.ALL),
        "log_line_prefix_template": "[rank${rank}] ",
    }


def _supported(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings this torch's launcher takes. meshtrain pins torch 2.13; an older torch
    (a cluster's or a GPU image's own) lacks the stop settings, and loses only a graceful
    stop's forwarding, which is said once."""
    known = {field.name for field in dataclasses.fields(ElasticLaunchConfig)}
    dropped = sorted(set(settings) - known)
    if dropped:
        log.warning("torch %s's launcher lacks %s: not set", torch.__version__, dropped)
    return {name: value for name, value in settings.items() if name in known}


def _one_node_config(
    launch: LaunchConfig, log_dir: Path, run_id: str, method: str
) -> ElasticLaunchConfig:
    return ElasticLaunchConfig(
        **_supported(_common_settings(launch, log_dir, run_id, method)),
        rdzv_backend="c10d",
        rdzv_endpoint=launch.rdzv_endpoint or f"127.0.0.1:{free_port()}",
        rdzv_configs={"join_timeout": JOIN_TIMEOUT_S},
        local_addr="127.0.0.1",
    )


def _multi_node_config(
    launch: LaunchConfig,
    log_dir: Path,
    run_id: str,
    node: NodeAddress | None,
    liveness: NodeLiveness,
    method: str,
) -> ElasticLaunchConfig:
    host, port = split_endpoint(launch.rdzv_endpoint or "")
    # The address the other nodes reach this one at (its workers' MASTER_ADDR when it
    # holds rank 0): the chosen interface's across hosts, loopback on one machine. Never
    # the host name, which often resolves to 127.0.0.1 or 127.0.1.1 (`launch.network`).
    local_addr = node.address if node is not None else "127.0.0.1" if is_loopback(host) else None
    return ElasticLaunchConfig(
        **_supported(_common_settings(launch, log_dir, run_id, method)),
        rdzv_backend=NodeRankRendezvous.BACKEND,
        rdzv_endpoint=f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
        rdzv_configs={
            "join_timeout": JOIN_TIMEOUT_S,
            # Node 0 hosts the store. c10d would guess from the host name, and with every
            # node on 127.0.0.1 each launcher guesses "me".
            "is_host": launch.node_rank == 0,
            "node_rank": launch.node_rank,
            "liveness": liveness,
        },
        local_addr=local_addr,
    )


def _node_failure(
    error: ChildFailedError,
    launch: LaunchConfig,
    log_dir: Path,
    silent: dict[int, float] | None,
) -> WorkerFailedError:
    """This node's failure; when every rank here only lost a peer, say to look elsewhere,
    and name the node that went silent, or say that this one is cut off."""
    failures = _all_failures(error)
    stuck = _stuck_ranks(failures, launch)
    if stuck is not None:
        return stuck
    if all(_is_timeout(text) or _is_peer_symptom(text) for _, text in failures.values()):
        if silent is None:
            return _cut_off(launch)
        if silent:
            return _silent_nodes(launch, silent, sorted(failures))
    rank, message = _root_failure(failures)
    if all(_is_peer_symptom(text) for _, text in failures.values()):
        message = (
            f"every rank on this node (launch.node_rank={launch.node_rank}) lost a peer, "
            "so the cause is most likely on another node: look at that node's launcher "
            f"output and its logs under {log_dir.parent}. This node's first error: {message}"
        )
    return _failure_error(rank, message)


class NodeLostError(Refused, WorkerFailedError):
    """A node stopped answering (a failed link, a frozen or powered-off machine), or this
    node lost the others: which one, and since when."""


def _ranks_of(node: int, launch: LaunchConfig) -> str:
    first = node * launch.nproc_per_node
    last = first + launch.nproc_per_node - 1
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def _silent_nodes(
    launch: LaunchConfig, silent: dict[int, float], waiting: list[int]
) -> NodeLostError:
    nodes = "; ".join(
        f"node {n} ({_ranks_of(n, launch)}), last heard {seconds:.0f} s ago"
        for n, seconds in sorted(silent.items())
    )
    return NodeLostError(
        waiting[0],
        f"{nodes}: stopped answering (its launcher's heartbeat in the rendezvous store "
        "stopped: a failed network link, a frozen or powered-off machine). This node's "
        f"{_ranks_of(launch.node_rank, launch)} waited for it in a collective until "
        f"launch.collective_timeout_s={launch.collective_timeout_s:g} s, then stopped. "
        "Once every node is back, start the job again on every node with "
        "training.resume_from=latest.",
    )


def _cut_off(launch: LaunchConfig) -> NodeLostError:
    return NodeLostError(
        launch.node_rank * launch.nproc_per_node,
        f"this node (launch.node_rank={launch.node_rank}, "
        f"{_ranks_of(launch.node_rank, launch)}) lost the rendezvous store at "
        f"launch.rdzv_endpoint={launch.rdzv_endpoint} on node 0: this node's own network "
        "link, or node 0, is down. Its ranks were stopped. Once every node is back, start the "
        "job again on every node with training.resume_from=latest.",
    )


class WorkerRefusedError(Refused, WorkerFailedError):
    """A worker stopped the run on purpose (a refusal it raised, such as a non-finite
    loss): the message is that refusal's own line, without the rank's traceback."""

    def __init__(self, rank: int, kind: str, text: str) -> None:
        self.kind, self.text = kind, text
        super().__init__(rank, f"{kind}: {text}")


def _failure_error(rank: int, message: str) -> WorkerFailedError:
    """The error for rank `rank`'s failure: a refusal's line alone, else its traceback."""
    last = message.strip().splitlines()[-1] if message.strip() else ""
    kind, separator, text = last.partition(": ")
    short = kind.rsplit(".", 1)[-1]
    if separator and short in _refusal_kinds():
        return WorkerRefusedError(rank, short, text)
    return WorkerFailedError(rank, message)


class StuckRankError(Refused, WorkerFailedError):
    """A rank made no progress: its peers timed out waiting for it in a collective."""


def _stuck_ranks(
    failures: dict[int, tuple[int, str]], launch: LaunchConfig
) -> WorkerFailedError | None:
    """When every rank that failed timed out in a collective, the ranks that did not fail
    are the ones they waited for (stopped, hung, or on a dead link): name those."""
    if not failures or not all(_is_timeout(text) for _, text in failures.values()):
        return None
    offset = launch.node_rank * launch.nproc_per_node
    silent = [r for r in range(offset, offset + launch.nproc_per_node) if r not in failures]
    if not silent:
        return None
    waiting = ", ".join(str(r) for r in sorted(failures))
    return StuckRankError(
        silent[0],
        f"rank {', '.join(map(str, silent))} made no progress for "
        f"launch.collective_timeout_s={launch.collective_timeout_s:g} s: rank {waiting} timed "
        "out waiting for it in a collective (a hung or stopped process, a dead GPU or "
        "network link). Its log is in the run's logs/ folder; it was stopped with the job.",
    )


def _is_timeout(text: str) -> bool:
    return "timed out" in text.lower() or "timeout" in text.lower()


def _refusal_kinds() -> set[str]:
    """The names of every deliberate refusal class meshtrain has loaded."""
    kinds, pending = set(), [Refused]
    while pending:
        kind = pending.pop()
        kinds.add(kind.__name__)
        pending.extend(kind.__subclasses__())
    return kinds


@record
def _run_and_share(entrypoint: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, Any]:
    """Run the entrypoint on this rank; on other nodes' first ranks, also fetch rank 0's result.

    The agents' shared store (the workers' MASTER_ADDR:MASTER_PORT) outlives every
    worker of the job, because each agent waits at the exit barrier for all others.
    """
    result = entrypoint(*args)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return result, None  # the store went with rank 0's process group: nothing to share
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if rank != 0 and local_rank != 0:
        return result, None
    store = dist.PrefixStore(
        f"meshtrain/rank0_result/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
        dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(minutes=10),
        ),
    )
    if rank == 0:
        store.set("result", json.dumps(result))
        return result, None
    return result, json.loads(store.get("result").decode())


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


def _is_peer_symptom(message: str) -> bool:
    return any(symptom in message for symptom in _PEER_SYMPTOMS)


def _root_failure(failures: dict[int, tuple[int, str]]) -> tuple[int, str]:
    """The rank whose own error started it: any real error before a peer-died symptom.

    Timestamps alone mislead: error files carry whole seconds, so the rank that
    raised and the rank whose collective then broke often tie, and a rank
    killed outright has no error file and is only noticed later.
    """

    def key(item: tuple[int, tuple[int, str]]) -> tuple[bool, int, int]:
        rank, (timestamp, message) = item
        return _is_peer_symptom(message), timestamp, rank

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
