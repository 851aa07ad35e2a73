"""The device mesh: the one place that turns a layout into process groups.

Everything downstream asks `ParallelDims` for its coordinates and groups;
nobody re-derives world sizes. The mesh is ordered (pp, dp, cp, tp) so that the
tensor-parallel ranks, which talk most, are neighbours (same node first), and the
context-parallel ranks, which exchange keys and values every layer, next.

Under sharded data parallelism of degree N the dp axis is itself two axes,
(dp_replicate = dp / N, dp_shard = N): FSDP2 shards over `dp_shard` (a group of
N neighbouring dp ranks) and replicates over `dp_replicate`; the flattened
`dp` axis still names the data-parallel rank (the sampler's, the loss's).

Context parallelism splits each sequence's tokens over `cp` ranks that hold the
same parameters (torchtitan's `dp_shard_cp`): gradients are averaged, ZeRO-1 and
FSDP2 shard, over the `dp x cp` ranks (`dp_cp`), while the sampler still deals
batches over `dp` alone.

Expert parallelism of degree N splits a mixture of experts' experts over groups of N
neighbouring `dp_cp` ranks (`ep_group`); the `dp_cp / N` ranks that hold the same
experts, one in each such group, form the `expert_replica_group`, over which the
experts' gradients are summed (torchtitan and Megatron take ep from the data-parallel
ranks the same way). Both are process groups of their own beside the mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

if TYPE_CHECKING:
    from meshtrain.config import Layout


@dataclass
class ParallelDims:
    dp: int
    tp: int
    pp: int
    mesh: DeviceMesh
    sdp: int = 1  # sharded data parallelism's degree (1: off)
    cp: int = 1  # context parallelism's degree (1: off)
    ep: int = 1  # expert parallelism's degree (1: off)
    ep_group: dist.ProcessGroup | None = None
    expert_replica_group: dist.ProcessGroup | None = None
    # Under expert parallelism with sharding: the one-dimensional mesh of the expert
    # replica group, over which FSDP2 shards the experts.
    expert_shard_mesh: DeviceMesh | None = None

    @classmethod
    def build(
        cls,
        dp: int,
        tp: int,
        pp: int,
        device_type: str,
        sdp: int = 1,
        cp: int = 1,
        ep: int = 1,
    ) -> ParallelDims:
        world = dist.get_world_size()
        if dp * tp * pp * cp != world:
            raise ValueError(
                f"dp x tp x pp x cp = {dp * tp * pp * cp} but the world size is {world}"
            )
        if dp % sdp:
            raise ValueError(f"sharded data parallelism's degree {sdp} does not divide dp={dp}")
        shape, names = [pp], ["pp"]
        data_axes = ["dp"] if sdp == 1 else ["dp_replicate", "dp_shard"]
        shape += [dp] if sdp == 1 else [dp // sdp, sdp]
        names += data_axes
        if cp > 1:
            shape.append(cp)
            names.append("cp")
        mesh = init_device_mesh(device_type, (*shape, tp), mesh_dim_names=(*names, "tp"))
        if sdp > 1:
            mesh["dp_replicate", "dp_shard"]._flatten("dp")
        if cp > 1:
            mesh[(*data_axes, "cp")]._flatten("dp_cp")
            if sdp > 1:
                mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            if tp > 1:
                mesh["cp", "tp"]._flatten("cp_tp")
        dims = cls(dp=dp, tp=tp, pp=pp, mesh=mesh, sdp=sdp, cp=cp, ep=ep)
        if ep > 1:
            dims.ep_group, dims.expert_replica_group = _expert_groups(mesh, dp * cp, ep)
        if ep > 1 and sdp > 1:
            # Made here with the mesh, of real tensors (the dry run makes them outside its
            # fake mode).
            dims.expert_shard_mesh = DeviceMesh.from_group(
                dims.expert_replica_group, device_type, mesh_dim_names=("dp_shard_experts",)
            )
        return dims

    @classmethod
    def of_layout(cls, layout: Layout, device_type: str) -> ParallelDims:
        """The mesh of a planned layout."""
        return cls.build(
            layout.data_parallel_size,
            layout.tensor_parallel_size,
            layout.pipeline_parallel_size,
            device_type,
            sdp=layout.sharded_data_parallel_degree,
            cp=layout.context_parallel_size,
            ep=layout.expert_parallel_size,
        )

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
    def cp_rank(self) -> int:
        return self.mesh.get_local_rank("cp") if self.cp > 1 else 0

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("dp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("pp")

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return self.mesh.get_group("cp") if self.cp > 1 else None

    def sequence_group(self, sequence_parallel: bool) -> dist.ProcessGroup | None:
        """The ranks that hold the other tokens of this rank's microbatches: its cp group,
        and under sequence parallelism its tp group too (None: it holds them all)."""
        split_over_tp = self.tp > 1 and sequence_parallel
        if split_over_tp and self.cp > 1:
            return self.mesh.get_group("cp_tp")
        return self.mesh.get_group("tp") if split_over_tp else self.cp_group

    # -- the ranks that hold one copy of the parameters: dp x cp -------------------------

    @property
    def dp_cp(self) -> int:
        """Ranks whose gradients are averaged (and ZeRO-1 shards spread over)."""
        return self.dp * self.cp

    @property
    def dp_cp_rank(self) -> int:
        return self.mesh.get_local_rank("dp_cp") if self.cp > 1 else self.dp_rank

    @property
    def dp_cp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("dp_cp") if self.cp > 1 else self.dp_group

    # -- expert parallelism -------------------------------------------------------------------

    @property
    def ep_rank(self) -> int:
        """Which of its ep group's expert shards this rank holds."""
        return self.dp_cp_rank % self.ep

    @property
    def expert_replicas(self) -> int:
        """Ranks that hold the same experts: dp x cp / ep."""
        return self.dp_cp // self.ep

    @property
    def expert_replica_rank(self) -> int:
        """This rank's place among the ranks holding its experts."""
        return self.dp_cp_rank // self.ep

    def fsdp_shards(self, experts: bool = False) -> tuple[int, int, dist.ProcessGroup | None]:
        """(this rank's FSDP2 shard, how many shards, their group) of a parameter: under
        expert parallelism the experts are sharded over the ranks holding them (full
        sharding), the rest as always."""
        if not (experts and self.ep > 1):
            return self.shard_rank, self.shard_degree, self.shard_group
        if self.sdp == 1:
            return 0, 1, None
        return self.expert_replica_rank, self.expert_replicas, self.expert_replica_group

    # -- sharded data parallelism ----------------------------------------------------------

    @property
    def shard_degree(self) -> int:
        """How many ranks FSDP2 shards one model copy over: sdp, times cp."""
        return self.sdp * self.cp if self.sdp > 1 else 1

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards over: `dp_shard` (with cp, `dp_shard_cp`), with
        `dp_replicate` in front for hybrid sharding (HSDP: FSDP all-reduces the gradient
        shards across the replicas)."""
        shard = "dp_shard_cp" if self.cp > 1 else "dp_shard"
        if self.sdp == self.dp:
            return self.mesh[shard]
        return self.mesh["dp_replicate", shard]

    @property
    def shard_rank(self) -> int:
        """This rank's index within its group of `shard_degree` ranks that share one model
        copy."""
        if self.sdp == 1:
            return 0
        return self.mesh.get_local_rank("dp_shard_cp" if self.cp > 1 else "dp_shard")

    @property
    def shard_group(self) -> dist.ProcessGroup | None:
        if self.sdp == 1:
            return None
        return self.mesh.get_group("dp_shard_cp" if self.cp > 1 else "dp_shard")


def _expert_groups(
    mesh: DeviceMesh, dp_cp: int, ep: int
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's expert-parallel group (ep neighbouring dp x cp ranks) and its expert
    replica group (the dp x cp / ep ranks, one per ep group, holding the same experts).
    Every rank creates every group, in one order, as `new_group` requires."""
    if dp_cp % ep:
        raise ValueError(f"expert parallelism's degree {ep} does not divide dp x cp = {dp_cp}")
    names = mesh.mesh_dim_names
    data = [i for i, name in enumerate(names) if name not in ("pp", "tp")]
    order = [names.index("pp"), names.index("tp"), *data]
    rows = mesh.mesh.permute(order).reshape(-1, dp_cp // ep, ep)  # coordinate x replica x ep
    me = dist.get_rank()
    mine: dict[str, dist.ProcessGroup] = {}
    for coordinate in rows:
        for kind, groups in (("ep", coordinate), ("replica", coordinate.T)):
            for ranks in groups.tolist():
                group = dist.new_group(ranks)
                if me in ranks:
                    mine[kind] = group
    return mine["ep"], mine["replica"]
