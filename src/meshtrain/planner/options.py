"""Where `auto` is read: the layouts the search weighs, each made a `Candidate`.

`search_space` combines the options each axis offers (`planner.axes`) into run
variants; `candidate_from` resolves what is still `auto` in one of them (dp takes the
rest of the world, sequence parallelism follows tp, ZeRO-1 starts off, the pipeline's
microbatches and the loss chunk follow the batch), so nothing after the search reads
`auto`. The run's own `auto` facts (backend, packed examples) are resolved here once.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from meshtrain.config import AUTO, DataConfig, LaunchConfig, ParallelConfig, RunConfig
from meshtrain.device import backend_device, planned_backend
from meshtrain.models.config_file import ArchitectureConfig
from meshtrain.pipeline_schedules import AUTO_CHOICES
from meshtrain.planner.axes import expert, pipeline, sharding, tensor
from meshtrain.planner.candidate import Candidate
from meshtrain.planner.checks import IMPLEMENTED_ACTIVATION_CHECKPOINTING
from meshtrain.planner.loss_memory import auto_loss_chunk_tokens
from meshtrain.planner.types import LayoutError, Refusal, divisors

# The degrees a layout can leave at `auto`, by their axes' short names, and the axes'
# options, by their `parallel.*` names (`Candidate.degrees` and `Candidate.choices`).
_DEGREES = {
    "dp": "data_parallel_size",
    "tp": "tensor_parallel_size",
    "pp": "pipeline_parallel_size",
    "cp": "context_parallel_size",
    "sdp": "sharded_data_parallel_degree",
    "ep": "expert_parallel_size",
}
_CHOICES = ("zero_1", "sequence_parallel", "pipeline_parallel_num_microbatches")


def _degrees(par: ParallelConfig, world: int) -> tuple[int | None, int, int, int]:
    """dp, tp, pp and cp as asked, a size at `auto` taken as 1 and dp at `auto` as the rest
    of the world (None where the other sizes do not divide it)."""
    tp, pp, cp = (
        1 if getattr(par, _DEGREES[k]) == AUTO else getattr(par, _DEGREES[k])
        for k in ("tp", "pp", "cp")
    )
    if par.data_parallel_size != AUTO:
        return par.data_parallel_size, tp, pp, cp
    others = tp * pp * cp
    return (None if world % others else world // others), tp, pp, cp


def candidate_from(run: RunConfig, model_config: ArchitectureConfig) -> Candidate:
    """The layout `run` asks for, every `auto` resolved (`run`: one variant of the search,
    its batch already fitted)."""
    par, world = run.parallel, run.launch.world_size
    chosen = frozenset(k for k, name in _DEGREES.items() if getattr(par, name) == AUTO)
    chosen |= {name for name in _CHOICES if getattr(par, name) == AUTO}
    fitted, tp, pp, cp = _degrees(par, world)
    dp = 1 if fitted is None else fitted  # 1: the sizes are refused, with the reason
    microbatches = par.pipeline_parallel_num_microbatches
    if microbatches == AUTO:
        microbatches = pipeline.auto_microbatches(pp, run.training.per_device_train_batch_size)
    sdp, ep = par.sharded_data_parallel_degree, par.expert_parallel_size
    return Candidate(
        degrees={
            "dp": dp,
            "tp": tp,
            "pp": pp,
            "cp": cp,
            "sdp": 1 if sdp == AUTO else sdp,
            "ep": 1 if ep == AUTO else ep,
        },
        choices={
            "zero_1": False if par.zero_1 == AUTO else par.zero_1,
            "sequence_parallel": tp > 1 if par.sequence_parallel == AUTO else par.sequence_parallel,
            "pipeline_parallel_num_microbatches": microbatches,
        },
        activation_checkpointing=par.activation_checkpointing,
        loss_chunk_tokens=_loss_chunk(run, model_config, tp, microbatches if pp > 1 else 1, cp),
        chosen_by_search=chosen,
    )


def _loss_chunk(
    run: RunConfig, model_config: ArchitectureConfig, tp: int, microbatches: int, cp: int
) -> int:
    """`training.loss_chunk_tokens`, `auto` resolved for this layout's microbatch (under cp,
    the rank's block / cp tokens of each row)."""
    chunk = run.training.loss_chunk_tokens
    if chunk != AUTO:
        return chunk
    rows = run.training.per_device_train_batch_size // microbatches
    tokens = rows * (run.data.block_size // cp)
    return auto_loss_chunk_tokens(model_config.vocab_size, tp, tokens)


def packs_examples(data: DataConfig) -> bool:
    """Whether the blocks hold packed examples (best-fit packing, positions restarting),
    whose attention masks are made per row; a text corpus streams (one mask for all rows).
    Where the format is only known from the data's columns, packed: the larger estimate."""
    if data.packing != AUTO:
        return data.packing == "bfd"
    if data.format != AUTO:
        return data.format != "text"
    return data.source not in ("builtin", "text_files", "hub")


def with_parallel(run: RunConfig, **changes: Any) -> RunConfig:
    return dataclasses.replace(run, parallel=dataclasses.replace(run.parallel, **changes))


def search_space(
    run: RunConfig, model_config: ArchitectureConfig, cp_options: list[int] | None = None
) -> list[RunConfig]:
    """Every combination of the `auto` knobs the fixed values allow (one if none is auto);
    `cp_options`: the context parallel sizes to weigh (None: the one given, and the run
    as it is when nothing combines, for the planner to refuse with its reasons)."""
    par, world = run.parallel, run.launch.world_size
    tp_options = tensor.AXIS.options(run, model_config)
    pp_options = pipeline.AXIS.options(run, model_config)
    ac_options = (
        list(IMPLEMENTED_ACTIVATION_CHECKPOINTING)
        if par.activation_checkpointing == AUTO
        else [par.activation_checkpointing]
    )
    sizes = [
        (tp, pp, cp)
        for cp in cp_options or [par.context_parallel_size]
        for tp in tp_options
        for pp in pp_options
        if world % (tp * pp * cp) == 0 and par.data_parallel_size in (AUTO, world // (tp * pp * cp))
    ]
    variants = []
    for tp, pp, cp in sizes:
        dp = world // (tp * pp * cp)
        for sdp in sharding_options(run, dp, tp, cp):
            for ep in expert.AXIS.search_degrees(run, model_config, ranks=dp * cp, sdp=sdp):
                for ac, schedule in itertools.product(ac_options, schedule_options(par, pp)):
                    parallel = dataclasses.replace(
                        par,
                        tensor_parallel_size=tp,
                        pipeline_parallel_size=pp,
                        context_parallel_size=cp,
                        sharded_data_parallel_degree=sdp,
                        expert_parallel_size=ep,
                        activation_checkpointing=ac,
                        pipeline_schedule=schedule,
                    )
                    variants.append(dataclasses.replace(run, parallel=parallel))
    if cp_options is not None:
        return variants  # the cp sizes weighed beside cp 1: none may fit the fixed sizes
    return variants or [run]


def schedule_options(par: ParallelConfig, pp: int) -> list[str]:
    """The pipeline schedules to weigh: as given, or at `auto` each of
    `pipeline_schedules.AUTO_CHOICES` (1F1B without a pipeline: none runs)."""
    if par.pipeline_schedule != AUTO:
        return [par.pipeline_schedule]
    return list(AUTO_CHOICES) if pp > 1 else ["1f1b"]


def sharding_options(run: RunConfig, dp: int, tp: int, cp: int = 1) -> list[int | str]:
    """The sharded data parallel degrees to weigh: as given, or at `auto` off, full and
    (across nodes) hybrid; only off when ZeRO-1 is asked for (sharding includes it) and
    on Neuron; beside a fixed expert parallelism off and full only (hybrid sharding is
    not built beside it)."""
    degree = run.parallel.sharded_data_parallel_degree
    if degree != AUTO:
        return [degree]
    # The engine shards with torch's FSDP2, which the Neuron (XLA) backend does not run.
    if run.parallel.zero_1 is True or run.launch.backend == "neuron":
        return [1]
    degrees = sharding.sharded_data_parallel_degrees(dp, tp, run.launch.nproc_per_node, cp)
    if run.parallel.expert_parallel_size not in (1, AUTO):
        return [d for d in degrees if d in (1, dp)]
    return list(degrees)


def fit_global_batch(run: RunConfig) -> RunConfig:
    """With `training.global_batch_size`, split it for this layout's dp and pp.

    The per-device batch is the largest that divides the rank's share and is at most
    `per_device_train_batch_size` per forward (times the pipeline microbatches, at most
    2 x pp of them); the rest is gradient accumulation.
    """
    train, par = run.training, run.parallel
    target = train.global_batch_size
    if target is None:
        return run
    dp, _, pp, _ = _degrees(par, run.launch.world_size)
    if dp is None:
        return run  # the planner refuses the sizes themselves, with the reason
    if target % dp:
        raise LayoutError(
            [
                Refusal(
                    "training.global_batch_size",
                    target,
                    f"it does not split evenly over data_parallel_size={dp}",
                    f"Use a multiple of {max(dp, 1)}.",
                )
            ]
        )
    share = target // dp
    forwards = 2 * pp if pp > 1 else 1
    limit = train.per_device_train_batch_size * forwards
    per_device = max(d for d in divisors(share) if d <= limit)
    training = dataclasses.replace(
        train,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=share // per_device,
    )
    return dataclasses.replace(run, training=training)


def variant_name(run: RunConfig) -> str:
    par = run.parallel
    sdp, cp, ep = (
        par.sharded_data_parallel_degree,
        par.context_parallel_size,
        par.expert_parallel_size,
    )
    pp = par.pipeline_parallel_size
    schedule = f"-{par.pipeline_schedule}" if pp not in (1, AUTO) else ""
    return (
        f"tp{par.tensor_parallel_size}-pp{pp}{schedule}"
        + (f"-cp{cp}" if cp not in (1, AUTO) else "")
        + (f"-ep{ep}" if ep not in (1, AUTO) else "")
        + (f"-sdp{sdp}" if sdp not in (1, AUTO) else "")
        + f"-ac-{par.activation_checkpointing}"
    )


def resolve_backend(
    launch: LaunchConfig, accelerated: bool, devices: int
) -> tuple[str, list[Refusal]]:
    """At `auto`, the accelerator's own backend where the plan is for accelerators, else
    gloo; a backend whose device type torch knows needs such devices, one per local rank
    (`neuron` without torch-neuronx is refused at the launch, naming the install)."""
    refusals: list[Refusal] = []
    backend = launch.backend
    if backend == AUTO:
        backend = planned_backend(accelerated)
    serves = backend_device(backend)
    if serves is not None and not accelerated:
        refusals.append(
            Refusal(
                "launch.backend",
                backend,
                f"{backend} needs {serves} devices and none is visible",
                "Use launch.backend=gloo (or auto) on CPU machines.",
            )
        )
    elif serves is not None and launch.nproc_per_node > devices:
        refusals.append(
            Refusal(
                "launch.nproc_per_node",
                launch.nproc_per_node,
                f"only {devices} {serves} devices are visible",
                f"Use launch.nproc_per_node<={devices}.",
            )
        )
    return backend, refusals
