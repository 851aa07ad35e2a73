"""AdamW over FSDP2's parameter shards, with the global gradient norm and clipping.

Under sharded data parallelism FSDP2 owns the gradient reduction: each
group's gradients are reduce-scattered (and, for hybrid sharding,
all-reduced across the replicas) during the backward, so after it every
parameter's `.grad` is the dp-mean of its shard. What is left is the same
step as the flat buffer's optimizer: the global norm (each shard's squares,
dividing out tensor-parallel copies, summed over the shard group and the tp
and pp groups; replicas hold the same shard and are not summed), clipping,
and AdamW, which is elementwise, so updating shards is updating the whole.

It keeps the run's optimizer contract (`components.optimizer.ModelOptimizer`),
as `zero.ShardedAdamW` does, so the training loop does not branch on which one
a run has; what it puts in a checkpoint is `components.fsdp_state`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtrain.distributed.grad_norm import clip_gradients_, global_grad_norm
from meshtrain.distributed.parallel_dims import ParallelDims
from meshtrain.distributed.tensor_parallel import ParameterSharding, local_tensor


class FSDPAdamW:
    def __init__(
        self,
        parameters: dict[str, torch.Tensor],
        sharding: dict[str, ParameterSharding],
        dims: ParallelDims,
        *,
        norm_groups: tuple[dist.ProcessGroup, ...] = (),
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        max_grad_norm: float,
        groups: int,
    ) -> None:
        """`parameters`: this rank's FSDP-sharded parameters by Hugging Face name (a tied
        weight once); `groups`: how many FSDP groups reduce them (for the summary)."""
        self.parameters = parameters
        self.dims = dims
        self.shard_group = dims.shard_group
        # Under expert parallelism: the experts, sharded over their replicas instead.
        self.experts = frozenset(n for n in parameters if sharding[n].ep > 1)
        self.norm_groups = norm_groups
        self.max_grad_norm = max_grad_norm
        self.groups = groups
        self._copies = {name: sharding[name].copies for name in parameters}
        decay = [p for p in parameters.values() if p.ndim >= 2]
        no_decay = [p for p in parameters.values() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=lr,
            betas=betas,
            eps=eps,
            fused=True,
        )
        first = local_tensor(next(iter(parameters.values())))
        self.device = first.device
        self.state_dtype = first.dtype  # fp32 shards: the master weights under bf16_master

    # -- the step -------------------------------------------------------------------------

    def reduce_gradients(self) -> torch.Tensor:
        """The backward already left the mean gradient shards: their global norm. (An
        expert's gradient under expert parallelism already holds what every ep rank's
        tokens gave it; FSDP2 averaged it over the dp / ep ranks holding the expert, so
        it is divided by ep for the mean over the dp ranks: FSDP2's own divide factor
        needs a reduction gloo has not.)"""
        for name in self.experts:
            grad = self.parameters[name].grad
            if grad is not None:
                local_tensor(grad).div_(self.dims.ep)
        return self.global_grad_norm()

    def apply(self, norm: torch.Tensor) -> None:
        """Clip to `norm`'s budget and update the shards."""
        clip_gradients_(self._local_grads().values(), self.max_grad_norm, norm)
        self.optimizer.step()

    def wait_for_parameters(self) -> None:
        """Nothing to wait for: each rank updated its own shards in place."""

    def zero_grad(self) -> None:
        # FSDP2 writes each step's reduced shard into a fresh `.grad`; its own hooks reduce
        # each group after its backward, so there is nothing to arm.
        self.optimizer.zero_grad(set_to_none=True)

    def set_learning_rate(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def global_grad_norm(self) -> torch.Tensor:
        """The shards' squares (tp copies weighted down), summed over the shard group and
        the `norm_groups`; replicas hold the same shards and are not summed. The experts'
        (expert parallelism) over their own shard group and the ep group, whose ranks
        hold different experts."""
        grads = self._local_grads()
        pieces = ((g, 1.0 / self._copies[n]) for n, g in grads.items() if n not in self.experts)
        shard = (self.shard_group,) if self.shard_group is not None else ()
        norm = global_grad_norm(pieces, shard + tuple(self.norm_groups), device=self.device)
        if not self.experts:
            return norm
        # (Whole on every tp rank, each counted once.)
        experts = ((g, 1.0 / self._copies[n]) for n, g in grads.items() if n in self.experts)
        _, _, replicas = self.dims.fsdp_shards(experts=True)
        groups = (replicas, self.dims.ep_group, *self.norm_groups)
        expert_norm = global_grad_norm(experts, groups, device=self.device)
        return torch.sqrt(norm.square() + expert_norm.square())

    def _local_grads(self) -> dict[str, torch.Tensor]:
        return {
            name: local_tensor(p.grad) for name, p in self.parameters.items() if p.grad is not None
        }

    # -- what the loop reports and checks --------------------------------------------------

    def check_views(self) -> None:
        """Fail loudly if a parameter stopped being a dp shard (something gathered it)."""
        for name, p in self.parameters.items():
            if not isinstance(p, DTensor) or not any(
                n.startswith("dp_shard") for n in p.device_mesh.mesh_dim_names or ()
            ):
                raise RuntimeError(f"parameter {name} is no longer sharded over the dp ranks")

    @property
    def state_bytes(self) -> int:
        """AdamW's two moments of this rank's shards."""
        return 2 * sum(local_tensor(p).nbytes for p in self.parameters.values())

    @property
    def model_states_bytes(self) -> int:
        """This rank's shards of the parameters, gradients (in the shards' dtype) and AdamW
        moments."""
        shard = sum(local_tensor(p).nbytes for p in self.parameters.values())
        return 2 * shard + self.state_bytes

    def held_tensors(self) -> list[torch.Tensor]:
        """What the optimizer holds through a step beyond the modules' parameters."""
        return [v for state in self.optimizer.state.values() for v in state.values()]

    def bucket_summary(self) -> dict[str, int]:
        """Every FSDP group is reduce-scattered from its own post-backward hook."""
        return {"count": self.groups, "started_in_backward": self.groups}

    # -- checkpoints ------------------------------------------------------------------------

    def step_count(self) -> float:
        for state in self.optimizer.state.values():
            if "step" in state:
                return float(state["step"])
        return 0.0

    def local_moment(self, name: str, key: str) -> torch.Tensor:
        """This rank's shard of AdamW's moment `key` for parameter `name` (zeros before the
        first step)."""
        p = self.parameters[name]
        moment = self.optimizer.state.get(p, {}).get(key)
        return local_tensor(moment) if moment is not None else torch.zeros_like(local_tensor(p))

    def load_moments(self, moments: dict[str, dict[str, torch.Tensor]], step: float) -> None:
        """Install each parameter's shards of the moments (`moments[name][key]`)."""
        for name, p in self.parameters.items():
            state = {"step": torch.tensor(float(step), dtype=torch.float32, device=self.device)}
            for key in ("exp_avg", "exp_avg_sq"):
                value = torch.zeros_like(p)
                local_tensor(value).copy_(moments[name][key])
                state[key] = value
            self.optimizer.state[p] = state
