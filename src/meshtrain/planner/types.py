"""What the planner hands out: the `Plan`, and the `Refusal`s when a layout cannot run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from meshtrain.config import Layout, Refused


@dataclass(frozen=True)
class Plan:
    """What the planner decided, as written to `plan.json` and handed to the workers."""

    layout: Layout
    world_size: int
    backend: str
    global_batch_size: int
    tokens_per_step: int
    num_parameters: int
    memory_estimate_per_rank: dict[str, int]
    model_config: dict[str, Any]
    num_train_blocks: int
    num_validation_blocks: int
    notes: list[str] = field(default_factory=list)
    device: str = "cpu"
    # Resolved batch split (they differ from the parameters when global_batch_size is set).
    per_device_train_batch_size: int = 0
    gradient_accumulation_steps: int = 1
    time_estimate: dict[str, float] = field(default_factory=dict)
    # The other layouts the planner weighed: name, estimates, and why each lost.
    candidates: list[dict[str, Any]] = field(default_factory=list)
    # The run's MFU: model FLOPs per token over the device's published peak (TFLOP/s per
    # rank, in the training dtype; 0 where the profile has none).
    model_flops_per_token: float = 0.0
    peak_tflops_per_rank: float = 0.0
    # sha256 of what the plan was made from (`planner.plan_inputs.plan_inputs_hash`): training
    # compares it with its own instead of planning again ("": a plan from before the hash).
    config_hash: str = ""
    # The parameters the optimizer updates: all of them, or a LoRA run's adapters.
    num_trainable_parameters: int = 0
    # `planner.dry_run`: the busiest ranks' step on fake tensors beside the estimate
    # (`meshtrain.dryrun.command.compare`, one entry per rank; empty: not run).
    dry_run: list[dict[str, Any]] = field(default_factory=list)

    def mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs utilisation at `tokens_per_s` over the whole world (None: no peak)."""
        if not self.peak_tflops_per_rank:
            return None
        peak = self.world_size * self.peak_tflops_per_rank * 1e12
        return tokens_per_s * self.model_flops_per_token / peak

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["layout_name"] = self.layout.name
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Plan:
        values = {k: v for k, v in values.items() if k != "layout_name"}
        return cls(**{**values, "layout": Layout(**values["layout"])})


@dataclass(frozen=True)
class Refusal:
    """One parameter that cannot run as given: why, and a value that would."""

    parameter: str
    value: Any
    reason: str
    fix: str

    def __str__(self) -> str:
        return f"{self.parameter}={self.value}: {self.reason}. {self.fix}"


class LayoutError(Refused, ValueError):
    """The requested layout cannot run; `refusals` says why, one line per parameter."""

    def __init__(self, refusals: list[Refusal]) -> None:
        self.refusals = refusals
        lines = "\n".join(f"  - {r}" for r in refusals)
        super().__init__(f"meshtrain refused the layout before starting any worker:\n{lines}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def format_values(values: list[int]) -> str:
    """Values for a refusal's fix, or `none` when nothing would work."""
    return ", ".join(str(v) for v in values) if values else "none"
