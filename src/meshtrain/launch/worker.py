"""What the launcher starts on every rank: join the process group, train, leave it."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from meshtrain.config import RunConfig
from meshtrain.device import on_host, rank_device
from meshtrain.launch.network import IFNAME_VARIABLES, connected_peers
from meshtrain.planner import Plan
from meshtrain.trainer import WorkerSpec, train


@record
def worker_main(spec: WorkerSpec) -> dict[str, Any] | None:
    """Entry point of a launched rank: join the group, train, leave the group."""
    return worker_main_sequence([spec])[0]


@record
def worker_main_sequence(specs: list[WorkerSpec]) -> list[dict[str, Any] | None]:
    """Train several specs one after the other in one process group.

    Process start-up (importing torch and transformers, the rendezvous) costs
    more than a small run, so sweeps over options of one world size and the
    equivalence tests share one group.
    """
    plan = Plan.from_dict(specs[0].plan)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not on_host(plan.backend):
        rank_device(plan.backend, local_rank)  # this rank's accelerator, its current one
    else:
        # Share the cores between the ranks of this node instead of oversubscribing them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    timeout = RunConfig.from_dict(specs[0].run).launch.collective_timeout_s
    dist.init_process_group(plan.backend, timeout=timedelta(seconds=timeout))
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:  # several nodes: say over what
        interface = next((os.environ[v] for v in IFNAME_VARIABLES if os.environ.get(v)), None)
        print(
            f"rank {dist.get_rank()}: {plan.backend} on interface {interface or '(its own pick)'}"
            f", TCP connections to {connected_peers()}",
            flush=True,
        )
    try:
        return [train(spec) for spec in specs]
    finally:
        dist.destroy_process_group()
