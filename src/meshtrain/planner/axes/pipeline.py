"""Pipeline parallelism (pp): stages of decoder layers over ranks, microbatches, the
schedule (GPipe, 1F1B, interleaved 1F1B with virtual stages). Its degrees, checks and
refusals, how many microbatches a rank holds in flight (the multipliers of
`planner.memory`'s per-microbatch terms, under each of torch's schedules), and each
rank's share of the FLOPs and the bubble it leaves.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.config import AUTO, ParallelConfig, RunConfig
from meshtrain.models.config_file import ArchitectureConfig
from meshtrain.pipeline_schedules import (
    AUTO_CHOICES,
    V_SHAPED,
    ZERO_BUBBLE,
    microbatch_rule,
    stages_per_rank,
)
from meshtrain.planner.axes.base import AxisBase, AxisChecks
from meshtrain.planner.candidate import Candidate
from meshtrain.planner.collectives import link, ring
from meshtrain.planner.devices import DeviceProfile
from meshtrain.planner.flops import attention_excess, layer_forward_flops
from meshtrain.planner.ranking import speed
from meshtrain.planner.schedule_walk import simulated_idle, split_backward_peak
from meshtrain.planner.shapes import AxisTime, ModelShape, StepShape, StepTiming
from meshtrain.planner.types import Plan, Refusal, divisors, format_values

# The parameter (and `config.Layout` field) this axis owns; other modules name it here.
PARAMETER = "pipeline_parallel_size"
MICROBATCHES = "pipeline_parallel_num_microbatches"


def in_flight_microbatches(step: StepShape, rank: int) -> int:
    """Model chunks x microbatches whose activations a pipeline rank holds at once."""
    m, p = step.microbatches, step.pp
    if p == 1:
        return 1
    if step.schedule in ZERO_BUBBLE:
        return split_backward_peak(step, rank).in_flight
    if step.schedule == "gpipe":  # one model chunk per rank: virtual stages interleave only
        return m
    if step.schedule == "interleaved_1f1b":
        warmup = (step.virtual_stages - 1) * p + 2 * (p - 1 - rank)
        return min(m * step.virtual_stages, warmup + 1)
    return min(m, p - rank)


def interleaved_order(step: StepShape, rank: int) -> list[tuple[bool, int]]:
    """Rank `rank`'s forwards and backwards under interleaved 1F1B, in the order torch's
    `ScheduleInterleaved1F1B` runs them: (is a backward, local chunk). Microbatches go in
    rounds of m / max(1, m // pp); a warm-up of forwards, then one forward and one
    backward at a time, then the backwards left."""
    p, v, m = step.pp, step.virtual_stages, step.microbatches
    per_round = m // max(1, m // p)
    total = m * v
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), total)

    def forward_chunk(op: int) -> int:
        return (op // per_round) % v

    def backward_chunk(op: int) -> int:
        return v - 1 - ((op - warmup) // per_round) % v

    order = [(False, forward_chunk(op)) for op in range(warmup)]
    for op in range(warmup, total):
        order += [(False, forward_chunk(op)), (True, backward_chunk(op))]
    return order + [(True, backward_chunk(op)) for op in range(total, total + warmup)]


def interleaved_gradient_chunks(step: StepShape, rank: int) -> int:
    """Chunks of rank `rank` whose unsharded gradients are alive at its activations' peak
    (most microbatches in flight), under sharded data parallelism: a chunk accumulates
    them from its first backward and reduce-scatters them after its last microbatch's.
    With one round of microbatches the warm-up holds every forward and the first chunk
    to go backward is done before the next starts; with more rounds the steady phase
    runs backwards of every chunk before any has finished (405B at 16 microbatches:
    both chunks, 25 GiB, measured by the dry run)."""
    backwards = [0] * step.virtual_stages  # done so far, per chunk
    in_flight, most, live_at_most = 0, 0, 1
    for backward, chunk in interleaved_order(step, rank):
        if not backward:
            in_flight += 1
            continue
        live = sum(
            1
            for c, n in enumerate(backwards)
            if (n > 0 or c == chunk) and n < step.microbatches  # started, not reduced
        )
        if in_flight > most:
            most, live_at_most = in_flight, live
        elif in_flight == most:
            live_at_most = max(live_at_most, live)
        backwards[chunk] += 1
        in_flight -= 1
    return live_at_most


def last_stage_in_flight(step: StepShape) -> int:
    """Microbatches whose logits the last stage's rank holds at once (interleaved: its
    first chunk holds all of them before its last chunk, the last stage, starts)."""
    if step.pp == 1 or step.schedule == "1f1b":
        return 1
    if step.schedule == "gpipe":
        return step.microbatches
    if step.schedule in ZERO_BUBBLE:
        return max(1, split_backward_peak(step, step.last_stage_rank).last_stage)
    last_rank = step.last_stage_rank
    earlier_chunks = (step.virtual_stages - 1) * step.microbatches
    return max(1, in_flight_microbatches(step, last_rank) - earlier_chunks)


def pipeline_parallel_degrees(world: int, model_config: ArchitectureConfig) -> list[int]:
    """pp degrees that divide the world and leave every stage a decoder layer."""
    return [d for d in divisors(world) if d <= model_config.num_hidden_layers]


def balanced_split(layers: int, stages: int) -> list[int]:
    """Decoder layers per stage, as even as possible (earlier stages take the remainder)."""
    base, extra = divmod(layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def check_pipeline_parallel(pp: int, world: int, model_config: ArchitectureConfig) -> list[Refusal]:
    pp_ok = pipeline_parallel_degrees(world, model_config)
    if pp in pp_ok:
        return []
    layers = model_config.num_hidden_layers
    if pp > layers:
        reason = f"there are only num_hidden_layers={layers} layers to split into stages"
    else:
        reason = f"it must divide the world size {world}"
    return [
        Refusal(
            "parallel.pipeline_parallel_size",
            pp,
            reason,
            f"Values that work here: {format_values(pp_ok)}.",
        )
    ]


@dataclass(frozen=True)
class PipelineSplit:
    """How a rank's batch and the decoder layers are cut for the pipeline schedule."""

    microbatches: int
    virtual_stages: int
    stage_layers: list[int] | None  # None without pipeline parallelism, or when refused
    refusals: list[Refusal]
    notes: list[str]
    schedule: str = "1f1b"


def resolve_pipeline(
    par: ParallelConfig, c: Candidate, batch: int, model_config: ArchitectureConfig
) -> PipelineSplit:
    """Microbatches, virtual stages and the layer split for a per-device batch of `batch`."""
    pp, requested = c.pp, c.choice(MICROBATCHES)
    if pp == 1:
        notes: list[str] = []
        if not c.chosen(MICROBATCHES) and requested != 1:
            notes.append(
                f"parallel.pipeline_parallel_num_microbatches={requested} has no effect without "
                "pipeline parallelism; using 1."
            )
        refusals: list[Refusal] = []
        pinned = par.pipeline_parallel_layers
        if pinned is not None and len(pinned) != 1:
            # Pinned stages without a pipeline would be ignored without a word.
            refusals.append(
                Refusal(
                    "parallel.pipeline_parallel_layers",
                    list(pinned),
                    f"it pins {len(pinned)} stages and parallel.pipeline_parallel_size is 1 "
                    "(no pipeline)",
                    "Set parallel.pipeline_parallel_size to the number of stages (or auto), "
                    "or pipeline_parallel_layers=null.",
                )
            )
        return PipelineSplit(1, 1, None, refusals, notes)

    schedule = "1f1b" if par.pipeline_schedule == AUTO else par.pipeline_schedule
    virtual = stages_per_rank(schedule, par.pipeline_parallel_virtual_stages)
    microbatches = requested
    stage_layers, layer_refusals = check_stage_layers(
        par.pipeline_parallel_layers, pp, virtual, model_config.num_hidden_layers, schedule
    )
    refusals = [*check_microbatches(microbatches, schedule, pp, batch), *layer_refusals]
    return PipelineSplit(microbatches, virtual, stage_layers, refusals, [], schedule)


def check_microbatches(microbatches: int, schedule: str, pp: int, batch: int) -> list[Refusal]:
    """The batch must cut into equal microbatches, as many as the schedule needs."""
    parameter = "parallel.pipeline_parallel_num_microbatches"
    usable = divisors(batch)
    if batch % microbatches:
        return [
            Refusal(
                parameter,
                microbatches,
                f"the per-device batch of {batch} does not split into {microbatches} "
                "equal microbatches",
                f"Use a divisor of training.per_device_train_batch_size: {format_values(usable)}.",
            )
        ]
    reason = microbatch_rule(schedule, microbatches, pp)
    if reason is None:
        return []
    allowed = [m for m in usable if microbatch_rule(schedule, m, pp) is None]
    return [
        Refusal(
            parameter,
            microbatches,
            reason,
            f"Use one of {format_values(allowed)} (divisors of the per-device batch {batch})."
            if allowed
            else "Raise training.per_device_train_batch_size, or use pipeline_schedule=gpipe "
            "or zbv.",
        )
    ]


def check_compiled_schedule(pp: int, run: RunConfig) -> list[Refusal]:
    """torch's zero-bubble schedules refuse compiled stages: they split each backward
    into its input and weight parts, which a compiled layer's graph does not."""
    schedule = run.parallel.pipeline_schedule
    if pp == 1 or schedule not in ZERO_BUBBLE or not run.training.compile:
        return []
    return [
        Refusal(
            "training.compile",
            True,
            f"pipeline_schedule={schedule} splits each backward into its input and weight "
            "gradients, which torch cannot do through compiled layers",
            "Set training.compile=false, or use pipeline_schedule=1f1b or interleaved_1f1b.",
        )
    ]


def check_stage_layers(
    requested: list[int] | None, pp: int, virtual: int, layers: int, schedule: str = "1f1b"
) -> tuple[list[int] | None, list[Refusal]]:
    """The decoder layers per stage: as requested, or balanced; every stage needs one."""
    stages = pp * virtual
    if requested is not None:
        split = list(requested)
        if len(split) == stages and sum(split) == layers and min(split) >= 1:
            return split, []
        refusal = Refusal(
            "parallel.pipeline_parallel_layers",
            split,
            f"it must give {stages} stages at least one layer each, {layers} layers in all",
            f"For example {balanced_split(layers, stages)}."
            if layers >= stages
            else "Use fewer stages.",
        )
        return split, [refusal]
    if layers >= stages:
        return balanced_split(layers, stages), []
    if pp > layers:
        return None, []  # pipeline_parallel_size itself is refused
    if schedule in V_SHAPED:
        refusal = Refusal(
            "parallel.pipeline_schedule",
            schedule,
            f"{schedule} places two stages on every rank: {stages} stages need at least one "
            f"decoder layer each and the model has num_hidden_layers={layers}",
            f"Use pipeline_parallel_size={layers // 2} or less, or pipeline_schedule=1f1b.",
        )
        return None, [refusal]
    refusal = Refusal(
        "parallel.pipeline_parallel_virtual_stages",
        virtual,
        f"{pp} ranks x {virtual} virtual stages = {stages} stages need at least one "
        f"decoder layer each and the model has num_hidden_layers={layers}",
        f"Use at most {layers // pp} virtual stages per rank.",
    )
    return None, [refusal]


def stage_shares(m: ModelShape, step: StepShape) -> list[float]:
    """Each pipeline rank's share of the model's FLOPs: its stages' layers, and the LM head
    on the rank of the last stage ([1.0] without pp)."""
    if step.pp == 1:
        return [1.0]
    costs = stage_costs(m, step)
    return [sum(costs[s] for s in step.stages_of(rank)) / sum(costs) for rank in range(step.pp)]


def stage_costs(m: ModelShape, step: StepShape) -> list[float]:
    """Each stage's forward FLOPs per token: its decoder layers, and the LM head on the
    last."""
    layer = layer_forward_flops(m, step.seq_len, attention_excess(step))
    costs = [layers * layer for layers in step.stage_layers]
    costs[-1] += 2 * m.hidden * m.vocab
    return costs


def fill_and_drain(shares: list[float], virtual_stages: int) -> float:
    """The pipeline bubble in microbatch times of the busiest rank (`shares`: each rank's,
    from `stage_shares`): the busiest rank sets the pace, and the other ranks' microbatch
    (forwards before its first, backwards after its last) is the fill and drain around
    it, over the virtual stages. With balanced stages this is the textbook `(p - 1) / v`;
    with the LM head making the last rank the busiest, less (tiny pp2: 0.43, not 1, as
    its schedule's picture shows)."""
    return (sum(shares) - max(shares)) / max(shares) / virtual_stages


def pipeline_time(
    m: ModelShape,
    step: StepShape,
    device: DeviceProfile,
    *,
    activation_bytes: float,
    microbatch_s: float,
    shares: list[float],
    accumulation: int,
) -> float:
    """Seconds pp adds to a step (pp > 1): the bubble around the busiest rank, one
    activation and one gradient send per microbatch and stage boundary, and with tied
    embeddings the first and last stages' sum of their copies' gradients."""
    microbatches = step.microbatches * accumulation
    pp_link = link(device, step.tp * step.pp)
    send = activation_bytes / step.tp / (pp_link * 1e9) + device.send_latency_us * 1e-6
    if step.schedule in ZERO_BUBBLE:  # the schedule's own order, simulated
        idle = simulated_idle(step, stage_costs(m, step))
    else:
        idle = fill_and_drain(shares, step.virtual_stages)
    bubble = idle * microbatch_s * accumulation
    pipeline = bubble + 2 * send * microbatches
    if m.tied_embeddings:
        # The first and last stages sum their copies' gradients once per step.
        tied_grad = m.vocab * m.hidden / step.tp * step.gradient_bytes
        pipeline += ring(tied_grad, 2, pp_link, device.latency_us, 2.0)
    return pipeline


def auto_microbatches(pp: int, batch: int) -> int:
    """`pipeline_parallel_num_microbatches: auto`: two microbatches per stage keeps the
    1F1B bubble under a third; fewer if the batch cannot be cut that finely (1 without pp)."""
    if pp == 1:
        return 1
    return max(m for m in divisors(batch) if m <= 2 * pp)


class PipelineAxis(AxisBase):
    """Pipeline parallelism: stages, microbatches, the schedule."""

    name = "pipeline"
    short = "pp"
    time_parts = ("pipeline_s",)
    parameter = PARAMETER
    splits_model = True

    def degrees(self, run: RunConfig, model_config: ArchitectureConfig) -> list[int]:
        return pipeline_parallel_degrees(run.launch.world_size, model_config)

    def note(self, chosen: Plan, planned: list[Plan], budget: float) -> str | None:
        """With `pipeline_schedule: auto`, the schedule chosen against the best layout of
        each other schedule weighed (its tokens/s, or that none fits)."""
        layout = chosen.layout
        if layout.pipeline_parallel_size == 1:
            return None
        best: dict[str, Plan] = {}
        for plan in planned:
            schedule = plan.layout.pipeline_schedule
            if plan.layout.pipeline_parallel_size > 1 and (
                schedule not in best or speed(plan) > speed(best[schedule])
            ):
                best[schedule] = plan
        if len(best) < 2:
            return None
        others = []
        for schedule, plan in sorted(best.items(), key=lambda item: -speed(item[1])):
            if schedule == layout.pipeline_schedule:
                continue
            fits = plan.memory_estimate_per_rank["process_total"] <= budget
            others.append(f"{schedule} {speed(plan):,.0f}" + ("" if fits else " (over memory)"))
        return (
            f"pipeline_schedule: {layout.pipeline_schedule}, the fastest that fits or the "
            f"simplest within 2% of it ({speed(chosen):,.0f} tokens/s estimated; "
            f"{', '.join(others)}; simplest first: {', '.join(AUTO_CHOICES)})."
        )

    def check(self, c: Candidate, run: RunConfig, model_config: ArchitectureConfig) -> AxisChecks:
        batch = run.training.per_device_train_batch_size
        split = resolve_pipeline(run.parallel, c, batch, model_config)
        return AxisChecks(
            degree=check_pipeline_parallel(c.pp, run.launch.world_size, model_config),
            split=[*split.refusals, *check_compiled_schedule(c.pp, run)],
            notes=split.notes,
            layout={
                "pipeline_parallel_size": c.pp,
                "pipeline_parallel_num_microbatches": split.microbatches,
                "pipeline_schedule": split.schedule,
                "pipeline_parallel_virtual_stages": split.virtual_stages,
                "pipeline_parallel_layers": split.stage_layers,
            },
        )

    def time_terms(
        self,
        m: ModelShape,
        step: StepShape,
        device: DeviceProfile,
        timing: StepTiming,
        earlier: dict[str, float],
    ) -> AxisTime:
        if step.pp == 1:
            return AxisTime({"pipeline_s": 0.0})
        busiest = timing.compute_s  # the busiest rank's step: its compute, earlier axes' parts
        for seconds in earlier.values():
            busiest += seconds
        seconds = pipeline_time(
            m,
            step,
            device,
            activation_bytes=timing.activation_bytes,
            microbatch_s=busiest / timing.microbatches,
            shares=list(timing.shares),
            accumulation=timing.accumulation,
        )
        return AxisTime({"pipeline_s": seconds})


AXIS = PipelineAxis()
