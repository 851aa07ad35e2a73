"""Expert parallelism (`parallel.expert_parallel_size`, ep): a mixture of experts' experts
split over groups of ep consecutive data-parallel ranks, as `distributed/expert_parallel.py`
runs it. Its degrees, checks and refusals, the experts' share of a rank's parameters, the
dispatch buffers, the all-to-all time and its lines in the explanation.

- Each rank holds E/ep of the E experts of every sparse layer (the 3-D `gate_up_proj`
  and `down_proj`); attention, routers, norms, embeddings and dense MLPs stay replicated
  over dp. The experts' gradients are summed over the dp/ep ranks holding the same
  experts (the replica group, stride ep), and ZeRO-1 splits their optimizer states over
  those replicas (`axes.data.replicated_model_states`).
- Per sparse layer and microbatch the routed (token, expert) pairs' hidden states go to
  their experts' ranks by an uneven all-to-all and come back the same way: two forward,
  the same two backward, and under full checkpointing the forward's two again. Of each,
  (ep - 1)/ep leaves the rank. The all-to-all of E counts before each is left out (tiny).
- Dropless routing is uneven: the busiest rank receives `planner.moe_imbalance` x the
  mean rows (1.25 by default; a run logs what it measured). It sizes what that rank
  keeps beyond the mean for each sparse layer's backward (the expert side of its
  activations), the all-to-alls (the busiest rank gates each one) and that rank's extra
  expert compute.
"""

from __future__ import annotations

from collections.abc import Mapping

from meshtrain.config import AUTO, Layout, ParallelConfig, RunConfig
from meshtrain.models.config_file import ArchitectureConfig, ConfigFile
from meshtrain.models.moe_config import DOWN, GATE_UP, num_experts
from meshtrain.planner.axes.base import AxisBase, AxisChecks
from meshtrain.planner.axes.sharding import SHARDING
from meshtrain.planner.candidate import Candidate
from meshtrain.planner.collectives import all_to_all, link
from meshtrain.planner.devices import GIB, DeviceProfile
from meshtrain.planner.flops import attention_excess, training_flops_per_token
from meshtrain.planner.parameters import Share, group_parameters, stage_parameter_counts
from meshtrain.planner.ranking import model_states, peak, speed, versus
from meshtrain.planner.shapes import (
    BYTES_BF16,
    BYTES_FP32,
    AxisTime,
    MemoryTerms,
    ModelShape,
    StepShape,
    StepTiming,
)
from meshtrain.planner.types import Plan, Refusal, divisors, format_values

# The parameter (and `config.Layout` field) this axis owns; other modules name it here.
PARAMETER = "expert_parallel_size"


def expert_degree(layout: Layout) -> int:
    """The ep of a resolved layout (1: the experts replicated over dp)."""
    return getattr(layout, PARAMETER)


def is_expert_weight(name: str) -> bool:
    """A sparse layer's 3-D experts, the parameters ep splits (not its router), and their
    LoRA adapters (`<experts>.lora_A.gate_up_proj`: the expert first, split alike)."""
    module = name.rpartition(".")[0]
    adapter = module.endswith((".mlp.experts.lora_A", ".mlp.experts.lora_B"))
    return adapter or name.endswith((f".{GATE_UP}", f".{DOWN}"))


def expert_degrees(experts: int, ranks: int) -> list[int]:
    """The ep sizes the engine runs: they divide the experts and the dp x cp ranks."""
    return [d for d in divisors(ranks) if experts % d == 0] if experts else [1]


def expert_stage_counts(
    shapes: Mapping[str, tuple[int, ...]], step: StepShape, share: Share
) -> list[int]:
    """Each pipeline stage's local expert elements where ep > 1 keeps them in a flat buffer
    of their own (zeros at ep 1: one buffer holds everything, as before ep)."""
    if expert_degree(step.layout) == 1:
        return [0] * len(step.stage_layers)
    experts = tuple(group for group in group_parameters(shapes) if is_expert_weight(group.name))
    return stage_parameter_counts(experts, step.stage_layers, share=share)


def activation_bytes(step: StepShape) -> int:
    """The dtype the dispatched hidden states travel in: bf16 under bf16, else fp32."""
    return BYTES_BF16 if step.bf16 else BYTES_FP32


def pair_rows(m: ModelShape, step: StepShape) -> int:
    """(token, expert) pairs of one microbatch on a rank: its tokens x top-k (under
    tensor parallelism its share of the sequence: the sparse layers run under SP)."""
    return step.microbatch_size * step.local_seq_len // step.tp * m.experts_per_token


def dispatch_bytes(m: ModelShape, step: StepShape) -> float:
    """What one sparse layer keeps per microbatch for its backward on the busiest rank
    beyond the mean, which the sparse layer's activations already count (0 at ep 1;
    under selective recomputation what the exchange keeps, below). The
    dispatch saves what one rank holding every expert saves: its experts' gathered input
    rows and their gate, up, activation and product on the rank that computes them, the
    results on the rank whose tokens they are (`distributed.expert_parallel`: the buffers
    sent and received are not kept); only the computing side follows the imbalance."""
    if expert_degree(step.layout) == 1:
        return 0.0
    rows = pair_rows(m, step) * activation_bytes(step)
    if step.activation_checkpointing == "selective":
        # Selective recomputation keeps every collective's output and recomputes the
        # experts (`distributed/activation_checkpoint.py`): the rows the rank received
        # (the busiest: moe_imbalance x the mean) and the results it got back.
        return (step.moe_imbalance + 1) * rows * m.hidden
    receiving_side = m.hidden + 4 * m.expert_intermediate
    return (step.moe_imbalance - 1) * rows * receiving_side


def dispatch_breakdown(m: ModelShape, step: StepShape, *, layers: float, in_flight: int) -> int:
    """The dispatch buffers at the rank's peak, part of its activations: every sparse
    layer's for each microbatch in flight (under full checkpointing or offloading only
    the one layer recomputed or running)."""
    per_layer = dispatch_bytes(m, step) * m.per_layer(0, 1)  # averaged, as `memory` adds it
    if step.activation_checkpointing == "full" or step.offload_effective:
        return int(per_layer)
    return int(per_layer * layers * in_flight)


def check_expert_parallel(
    c: Candidate, model_config: ArchitectureConfig, world_ranks: int
) -> tuple[list[Refusal], list[Refusal]]:
    """(degree refusals, option refusals) of ep: a mixture of experts only, ep dividing
    its experts and the `world_ranks` (dp x cp) it is taken from, and no sharding beside."""
    ep, experts = c.degree("ep"), num_experts(model_config)
    if ep == 1:
        return [], []
    name = f"parallel.{PARAMETER}"
    if not experts:
        why = (
            f"{model_config.model_type} is not a mixture of experts: expert parallelism "
            "splits the experts of sparse layers, and it has none"
        )
        return [Refusal(name, ep, why, f"Use parallel.{PARAMETER}=1 (or auto).")], []
    works = f"Values that work here: {format_values(expert_degrees(experts, world_ranks))}."
    why = []
    if experts % ep:
        why.append(f"it must divide the {experts} experts of each sparse layer")
    if world_ranks % ep:
        ranks = "data-parallel" if c.cp == 1 else "data- x context-parallel"
        why.append(
            f"its ranks are taken from the {world_ranks} {ranks} ranks, so it must "
            f"divide {world_ranks}"
        )
    degree = [Refusal(name, ep, "; ".join(why), works)] if why else []
    options = []
    if 1 < c.sdp < c.dp:
        options.append(
            Refusal(
                name,
                ep,
                f"expert parallelism beside hybrid sharded data parallelism "
                f"({SHARDING}={c.sdp} of {c.dp} data-parallel ranks) is not built yet",
                f"Use {SHARDING}=1 or {c.dp} (full sharding), or {PARAMETER}=1.",
            )
        )
    return degree, options


def sparse_layers_on_busiest_rank(m: ModelShape, step: StepShape) -> float:
    """Sparse layers on the pipeline rank holding the most layers (all of them at pp 1)."""
    layers = max(sum(step.stage_layers[s] for s in step.stages_of(rank)) for rank in range(step.pp))
    return m.sparse_layers * layers / m.layers


def expert_compute_share(m: ModelShape, step: StepShape, compute_per_token: float) -> float:
    """The routed experts' share of a rank's training FLOPs (`compute_per_token`: all of
    them): k experts' three matmuls per sparse layer, forward and backward (the weights'
    gradients skipped on a frozen base), again forward under full checkpointing."""
    passes = (2 if step.frozen_base else 3) + (step.activation_checkpointing == "full")
    forward = 2 * m.experts_per_token * 3 * m.hidden * m.expert_intermediate * m.sparse_layers
    return passes * forward / compute_per_token


def estimate_expert_time(
    m: ModelShape, step: StepShape, device: DeviceProfile, timing: StepTiming, flops: float
) -> dict[str, float]:
    """ep's seconds in one step (`flops`: the model's training FLOPs per token): the
    all-to-alls, none hidden (the experts wait for their rows), on the busiest rank, and
    that rank's extra expert compute (`moe_imbalance` - 1 of the mean)."""
    ep = expert_degree(step.layout)
    payload = pair_rows(m, step) * m.hidden * activation_bytes(step)  # one, the mean rank
    imbalance = step.moe_imbalance
    one = all_to_all(imbalance * payload, ep, link(device, ep * step.tp), device.latency_us)
    per_layer = 4 + 2 * (step.activation_checkpointing == "full")
    rounds = sparse_layers_on_busiest_rank(m, step) * timing.microbatches
    exchange = rounds * per_layer * one
    extra = timing.compute_s * expert_compute_share(m, step, flops) * (imbalance - 1)
    return {
        "expert_parallel_s": exchange + extra,
        "ep_replicas": float(step.grad_ranks // ep),
        "ep_all_to_all_s": exchange,
        "ep_all_to_all_per_layer_s": one,
        "ep_all_to_alls_per_layer": float(per_layer),
        "ep_all_to_all_bytes": float(payload),
        "ep_imbalance": imbalance,
        "ep_imbalance_compute_s": extra,
    }


def expert_line(plan: Plan) -> str:
    """The ep layout's experts per rank, its all-to-alls and the imbalance it assumes."""
    t, lay = plan.time_estimate, plan.layout
    ep, experts = expert_degree(lay), num_experts(ConfigFile(plan.model_config))
    replicas = int(t["ep_replicas"])
    held = (
        f"their gradients summed over the {replicas} ranks holding the same ones"
        if replicas > 1
        else "held by no other rank"
    )
    n = int(t["ep_all_to_alls_per_layer"])
    return (
        f"  expert parallel over {ep} ranks: {experts // ep} of each sparse layer's {experts} "
        f"experts per rank, {held}; per sparse layer and microbatch {n} "
        f"all-to-alls of {t['ep_all_to_all_bytes'] / 2**20:.1f} MiB a rank ({(ep - 1) / ep:.0%} "
        f"leaving it), {t['ep_all_to_all_per_layer_s'] * 1e3:.2f} ms each: "
        f"{t['ep_all_to_all_s']:.2f} s per step, none hidden behind compute; routing "
        f"imbalance {t['ep_imbalance']:g} assumed (the busiest rank receives "
        f"{t['ep_imbalance'] - 1:.0%} more rows than the mean): its dispatch buffers, and "
        f"{t['ep_imbalance_compute_s']:.2f} s of extra expert compute per step"
    )


def expert_note(chosen: Plan, planned: list[Plan], budget: float) -> str | None:
    """Why the chosen layout's ep, against the best layout the other way (None where every
    layout planned has one ep: a dense model, or ep fixed)."""
    if len({expert_degree(p.layout) for p in planned}) < 2:
        return None
    ep = expert_degree(chosen.layout)
    others = [p for p in planned if (expert_degree(p.layout) > 1) != (ep > 1)]
    fits = [p for p in others if peak(p) <= budget]
    kind = "expert parallelism" if ep == 1 else "the experts replicated (ep1)"
    head = f"expert parallelism: ep{ep} ({_experts_words(chosen)})"
    if fits:
        rival = max(fits, key=speed)
        rival_words = f"the fastest layout with {kind}, {rival.layout.name}"
        return f"{head}; {rival_words}, is {versus(chosen, rival)}"
    smallest = min(others, key=peak)
    return (
        f"{head}; no layout with {kind} fits: the smallest, {smallest.layout.name}, needs "
        f"{peak(smallest) / GIB:.2f} GiB per rank, over the {budget / GIB:.2f} GiB budget "
        f"(model states {model_states(smallest) / GIB:.2f} GiB against "
        f"{model_states(chosen) / GIB:.2f})"
    )


def _experts_words(p: Plan) -> str:
    """A layout's expert states per rank and all-to-all seconds, in a few words."""
    m = p.memory_estimate_per_rank
    if expert_degree(p.layout) == 1 or "expert_parameters" not in m:  # or LoRA's states
        return f"model states {model_states(p) / GIB:.2f} GiB per rank"
    states = m["expert_parameters"] + m["expert_gradients"] + m["expert_optimizer_states"]
    return (
        f"expert states {states / GIB:.2f} GiB of {model_states(p) / GIB:.2f} GiB model states "
        f"per rank, all-to-alls {p.time_estimate['ep_all_to_all_s']:.2f} s per step"
    )


class ExpertAxis(AxisBase):
    """Expert parallelism: a mixture of experts' experts over groups of dp ranks. Not
    `splits_model` for the over-memory words: those name fixed axes to raise for any
    model, and ep only helps a mixture of experts."""

    name = "expert"
    short = "ep"
    time_parts = ("expert_parallel_s",)
    parameter = PARAMETER

    def degrees(self, run: RunConfig, model_config: ArchitectureConfig) -> list[int]:
        """1 on a dense model; on a mixture of experts every size dividing the experts and
        the world (the search keeps those dividing each layout's dp: `search_degrees`)."""
        return expert_degrees(num_experts(model_config), run.launch.world_size)

    def search_degrees(
        self, run: RunConfig, model_config: ArchitectureConfig, *, ranks: int, sdp: int
    ) -> list[int]:
        """The ep sizes to weigh on one layout of the search: as given, or at `auto` those
        dividing its `ranks` (dp x cp), unsharded or fully sharded (hybrid sharding is not
        built beside ep)."""
        degree = getattr(run.parallel, PARAMETER)
        if degree != AUTO:
            return [degree]
        if 1 < sdp < ranks:
            return [1]
        return [d for d in self.degrees(run, model_config) if ranks % d == 0]

    def check(self, c: Candidate, run: RunConfig, model_config: ArchitectureConfig) -> AxisChecks:
        degree, options = check_expert_parallel(c, model_config, c.dp * c.cp)
        return AxisChecks(degree=degree, options=options, layout={PARAMETER: c.degree("ep")})

    def describe(self, plan: Plan, seq_len: int) -> str | None:
        return expert_line(plan) if expert_degree(plan.layout) > 1 else None

    def local_numel(self, name: str, numel: int, m: ModelShape, step: StepShape) -> int:
        ep = expert_degree(step.layout)
        return numel // ep if ep > 1 and is_expert_weight(name) else numel

    def memory_terms(self, m: ModelShape, step: StepShape) -> MemoryTerms:
        if expert_degree(step.layout) == 1:
            return MemoryTerms()
        # Per decoder layer, averaged over dense and sparse ones (`ModelShape.per_layer`).
        return MemoryTerms(layer={"expert_dispatch": dispatch_bytes(m, step) * m.per_layer(0, 1)})

    def time_terms(
        self,
        m: ModelShape,
        step: StepShape,
        device: DeviceProfile,
        timing: StepTiming,
        earlier: dict[str, float],
    ) -> AxisTime:
        if expert_degree(step.layout) == 1:
            return AxisTime({})
        flops = training_flops_per_token(
            m,
            step.seq_len,
            step.activation_checkpointing,
            frozen_base=step.frozen_base,
            excess=attention_excess(step),
        )
        report = estimate_expert_time(m, step, device, timing, flops)
        return AxisTime({"expert_parallel_s": report["expert_parallel_s"]}, report)

    def memory_relief(self, layout: Layout, parallel: ParallelConfig) -> list[str]:
        """ep at `auto` where the run fixed one above 1 (a mixture of experts, then): the
        search then weighs every ep, and sharding beside ep1; at ep 1 the layout does not
        say whether the model has experts."""
        if expert_degree(layout) == 1 or getattr(parallel, PARAMETER) == AUTO:
            return []
        return [f"expert parallelism at auto (parallel.{PARAMETER}=auto)"]

    def note(self, chosen: Plan, planned: list[Plan], budget: float) -> str | None:
        return expert_note(chosen, planned, budget)

    def lost_clause(self, plan: Plan, planned: list[Plan], budget: float) -> str:
        if expert_degree(plan.layout) == 1 or peak(plan) > budget:
            return ""
        return f"; ep{expert_degree(plan.layout)}: {_experts_words(plan)}"


AXIS = ExpertAxis()
