"""The device mesh: the one place that turns a layout into process groups.

Everything downstream asks `ParallelDims` for its coordinates and groups;
nobody re-derives world sizes. The mesh is ordered (pp, dp, tp) so that the
tensor-parallel ranks, which talk most, are neighbours (same node first).

Under sharded data parallelism of degree N the dp axis is itself two axes,
(dp_replicate = dp / N, dp_shard = N): FSDP2 shards over `dp_shard` (a group of
N neighbouring dp ranks) and replicates over `dp_replicate`; the flattened
`dp` axis still names the data-parallel rank (the sampler's, the loss's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class ParallelDims:
    dp: int
    tp: int
    pp: int
    mesh: DeviceMesh
    sdp: int = 1  # sharded data parallelism's degree (1: off)

    @classmethod
    def build(cls, dp: int, tp: int, pp: int, device_type: str, sdp: int = 1) -> ParallelDims:
        world = dist.get_world_size()
        if dp * tp * pp != world:
            raise ValueError(f"dp x tp x pp = {dp * tp * pp} but the world size is {world}")
        if dp % sdp:
            raise ValueError(f"sharded data parallelism's degree {sdp} does not divide dp={dp}")
        if sdp == 1:
            mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        else:
            names = ("pp", "dp_replicate", "dp_shard", "tp")
            mesh = init_device_mesh(device_type, (pp, dp // sdp, sdp, tp), mesh_dim_names=names)
            mesh["dp_replicate", "dp_shard"]._flatten("dp")
        return cls(dp=dp, tp=tp, pp=pp, mesh=mesh, sdp=sdp)

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def tp_rank(self) -> int:
        return self.mesh.get_local_rank("tp")

    @property
    def pp_rank(self) -> int:
        return self.mesh.get_local_rank("pp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("dp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("pp")

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards over: `dp_shard`, with `dp_replicate` in front for hybrid
        sharding (HSDP: FSDP all-reduces the gradient shards across the replicas)."""
        if self.sdp == self.dp:
            return self.mesh["dp_shard"]
        return self.mesh["dp_replicate", "dp_shard"]

    @property
    def shard_rank(self) -> int:
        """This rank's index within its group of `sdp` ranks that share one model copy."""
        return self.mesh.get_local_rank("dp_shard") if self.sdp > 1 else 0

    @property
    def shard_group(self) -> dist.ProcessGroup | None:
        return self.mesh.get_group("dp_shard") if self.sdp > 1 else None
