"""The device mesh: the one place that turns a layout into process groups.

Everything downstream asks `ParallelDims` for its coordinates and groups;
nobody re-derives world sizes. The mesh is ordered (pp, dp, tp) so that the
tensor-parallel ranks, which talk most, are neighbours (same node first).
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

    @classmethod
    def build(cls, dp: int, tp: int, pp: int, device_type: str) -> ParallelDims:
        world = dist.get_world_size()
        if dp * tp * pp != world:
            raise ValueError(f"dp x tp x pp = {dp * tp * pp} but the world size is {world}")
        mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        return cls(dp=dp, tp=tp, pp=pp, mesh=mesh)

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
