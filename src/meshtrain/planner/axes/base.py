"""The protocol every parallelism axis of the planner follows, and what its checks return.

An axis (`planner.axes.data`, `.tensor`, `.pipeline`, `.context`, `.expert`) owns its
degree: the options it offers the search, its checks and refusals on a
`Candidate`, the layout fields it resolves, its line in `python -m meshtrain plan`'s
description (`describe`, in `axes.DESCRIBE`'s order), the bytes it adds to a rank's
activations (`memory_terms`, which `planner.memory` adds up over `AXES`) and its seconds
in a step (`time_terms`, which `planner.cost` adds up over `AXES`; `TimeEstimate` keeps
them by name, so plan.json gains the axis's keys without a field anywhere), an option it
turns on only where memory needs it (`settle`: ZeRO-1 at `auto`), what of it would lower
a layout refused as over memory (`memory_relief`, `splits_model`), and its words on the
chosen layout and the ones that lost (`note`, `lost_clause`). What composes
several axes stays where it composes them: activations x microbatches in flight
(`planner.memory`), each pipeline rank's stages, the model states of dp/ZeRO-1/FSDP2.

How the expert axis (ep, `axes.expert`) plugs in, the pattern for the next one: a module
with an `ExpertAxis(AxisBase)` and `AXIS`, and its line in `axes/__init__.py`'s `AXES`
(before `pipeline.AXIS`, so that its all-to-alls, which run inside each microbatch, count
in the busiest rank's microbatch the bubble scales) and in `DESCRIBE`, `STEP_LINE` and
`TIE_BREAK`. Its terms: `memory_terms` -> `MemoryTerms(layer={"expert_dispatch": ...})`;
`time_terms` -> `AxisTime({"expert_parallel_s": ...}, report)`; `local_numel`: the expert
weights' elements / ep (gradients, moments and ZeRO-1 follow what is local; the experts'
own flat buffer is `axes.data`'s, its degree read through `axes.expert.expert_degree`).
Its degree reaches it as `c.degree("ep")` on a candidate and through the resolved layout
on a step (no planner field to add; the layout field is `config.Layout`'s). Still outside
the protocol: `planner.options` reading and resolving the `parallel.*` degree (as it does
every degree, the expert axis's `search_degrees` telling it which to weigh),
`ModelShape`'s expert counts, and an MoE layer's compute and activations
(`planner.flops`, `planner.layer_memory`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from meshtrain.config import AUTO, Layout, ParallelConfig, RunConfig
from meshtrain.models.config_file import ArchitectureConfig
from meshtrain.planner.candidate import Candidate
from meshtrain.planner.devices import DeviceProfile
from meshtrain.planner.shapes import AxisTime, MemoryTerms, ModelShape, StepShape, StepTiming
from meshtrain.planner.types import Plan, Refusal


@dataclass(frozen=True)
class AxisChecks:
    """An axis's verdict on one candidate. Refusals come in the order the planner reports
    them across axes: first each degree against the world and model (`degree`), then how
    the batch and layers are cut (`split`), then the options on top (`options`)."""

    degree: list[Refusal] = field(default_factory=list)
    split: list[Refusal] = field(default_factory=list)
    options: list[Refusal] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # The `config.Layout` fields this axis resolved (names as plan.json writes them).
    layout: dict[str, Any] = field(default_factory=dict)


class Axis(Protocol):
    """One parallelism axis."""

    name: str  # "data", "tensor", ...
    short: str  # its degree's name in layout names and words: "dp", "tp", ...
    time_parts: tuple[str, ...]  # its `time_terms` seconds the description's step line shows
    parameter: str  # the `parallel.*` parameter and `config.Layout` field of its degree
    splits_model: bool  # more of it divides a rank's model or activations

    def degree(self, layout: Layout) -> int:
        """Its degree in a resolved layout."""
        ...

    def options(self, run: RunConfig, model_config: ArchitectureConfig) -> list[int]:
        """The degrees this axis offers the search (its parameter as given, or every
        degree that can run where it is `auto`)."""
        ...

    def check(self, c: Candidate, run: RunConfig, model_config: ArchitectureConfig) -> AxisChecks:
        """Its refusals, notes and layout fields for candidate `c` of `run`."""
        ...

    def describe(self, plan: Plan, seq_len: int) -> str | None:
        """Its line in the plan's description (None: nothing to say for this layout)."""
        ...

    def local_numel(self, name: str, numel: int, m: ModelShape, step: StepShape) -> int:
        """Of `numel` elements of parameter `name`, those a rank of this axis keeps."""
        ...

    def memory_terms(self, m: ModelShape, step: StepShape) -> MemoryTerms:
        """The bytes it adds to a rank's activations (named, by how often they are held)."""
        ...

    def time_terms(
        self,
        m: ModelShape,
        step: StepShape,
        device: DeviceProfile,
        timing: StepTiming,
        earlier: dict[str, float],
    ) -> AxisTime:
        """Its seconds in one step (`earlier`: the parts of the axes before it in `AXES`,
        per step; pipeline parallelism's bubble scales the busiest rank's microbatch)."""
        ...

    def settle(
        self, plan: Plan, c: Candidate, budget: float, replan: Callable[[Candidate], Plan]
    ) -> Plan:
        """The plan of `c`, or of `c` with an option of this axis that the search turns
        on only where memory needs it (`replan` plans a changed candidate), with a note."""
        ...

    def memory_relief(self, layout: Layout, parallel: ParallelConfig) -> list[str]:
        """What of this axis would lower the memory of `layout`, refused as over the
        device's, that the run fixed (options at `auto` the search already weighed)."""
        ...

    def note(self, chosen: Plan, planned: list[Plan], budget: float) -> str | None:
        """Why the chosen layout does (or does not) use this axis's option, against the
        other layouts planned (None: nothing to say)."""
        ...

    def lost_clause(self, plan: Plan, planned: list[Plan], budget: float) -> str:
        """What this axis did for (or cost) a layout the search did not choose ("": none)."""
        ...


class AxisBase:
    """What the axes share: the degree read from a layout by the parameter's name, and
    the options (the parameter as given, or at `auto` every degree `degrees` allows)."""

    name: str
    short: str
    time_parts: tuple[str, ...] = ()
    parameter: str  # the `parallel.*` parameter and `config.Layout` field of its degree
    splits_model: bool = False

    def degree(self, layout: Layout) -> int:
        return getattr(layout, self.parameter)

    def options(self, run: RunConfig, model_config: ArchitectureConfig) -> list[int]:
        degree = getattr(run.parallel, self.parameter)
        return self.degrees(run, model_config) if degree == AUTO else [degree]

    def degrees(self, run: RunConfig, model_config: ArchitectureConfig) -> list[int]:
        """Every degree that can run here (what `auto` weighs)."""
        raise NotImplementedError

    def describe(self, plan: Plan, seq_len: int) -> str | None:
        return None

    def local_numel(self, name: str, numel: int, m: ModelShape, step: StepShape) -> int:
        return numel

    def memory_terms(self, m: ModelShape, step: StepShape) -> MemoryTerms:
        return MemoryTerms()

    def time_terms(
        self,
        m: ModelShape,
        step: StepShape,
        device: DeviceProfile,
        timing: StepTiming,
        earlier: dict[str, float],
    ) -> AxisTime:
        return AxisTime({})

    def settle(
        self, plan: Plan, c: Candidate, budget: float, replan: Callable[[Candidate], Plan]
    ) -> Plan:
        return plan

    def memory_relief(self, layout: Layout, parallel: ParallelConfig) -> list[str]:
        return []

    def note(self, chosen: Plan, planned: list[Plan], budget: float) -> str | None:
        return None

    def lost_clause(self, plan: Plan, planned: list[Plan], budget: float) -> str:
        return ""
