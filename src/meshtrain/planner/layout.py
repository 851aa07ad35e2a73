"""Resolve `parallel.*` into a concrete layout, or refuse it before any worker starts.

Every check collects a `Refusal` that names the parameter, says why, and
offers a value that would work, so one run of the planner reports every
problem at once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig

from meshtrain.config import AUTO, Layout, RunConfig
from meshtrain.models.llama.parameter_names import llama_family_shapes
from meshtrain.planner.cost import estimate_step_time
from meshtrain.planner.devices import GIB, DeviceProfile, device_profile
from meshtrain.planner.memory import ModelShape, StepShape, estimate_memory

# What the engine can run today. The planner is the one place that knows.
IMPLEMENTED_ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
# Preference among layouts whose estimated step times are within this factor of the best.
TIE = 1.02


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
    parameter: str
    value: Any
    reason: str
    fix: str

    def __str__(self) -> str:
        return f"{self.parameter}={self.value}: {self.reason}. {self.fix}"


class LayoutError(ValueError):
    """The requested layout cannot run; `refusals` says why, one line per parameter."""

    def __init__(self, refusals: list[Refusal]) -> None:
        self.refusals = refusals
        lines = "\n".join(f"  - {r}" for r in refusals)
        super().__init__(f"meshtrain refused the layout before starting any worker:\n{lines}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fmt(values: list[int]) -> str:
    return ", ".join(str(v) for v in values) if values else "none"


def tensor_parallel_degrees(world: int, model_config: PretrainedConfig) -> list[int]:
    """tp degrees the model and this engine accept: they divide the world and the attention
    heads, and the KV heads divide tp or tp divides them (then KV heads are replicated)."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    return [
        d for d in _divisors(world) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)
    ]


def pipeline_parallel_degrees(world: int, model_config: PretrainedConfig) -> list[int]:
    """pp degrees that divide the world and leave every stage a decoder layer."""
    return [d for d in _divisors(world) if d <= model_config.num_hidden_layers]


def balanced_split(layers: int, stages: int) -> list[int]:
    """Decoder layers per stage, as even as possible (earlier stages take the remainder)."""
    base, extra = divmod(layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def _plan_pipeline(
    par: Any,
    pp: int,
    layers: int,
    batch: int,
    model_config: PretrainedConfig,
    refusals: list[Refusal],
    notes: list[str],
) -> tuple[int, int, list[int] | None]:
    """Microbatches, virtual stages and the layer split; refusals for what cannot run."""
    requested = par.pipeline_parallel_num_microbatches
    if pp == 1:
        if requested not in (AUTO, 1):
            notes.append(
                f"parallel.pipeline_parallel_num_microbatches={requested} has no effect without "
                "pipeline parallelism; using 1."
            )
        return 1, 1, None

    schedule = par.pipeline_schedule
    virtual = par.pipeline_parallel_virtual_stages if schedule == "interleaved_1f1b" else 1
    stages = pp * virtual
    if requested == AUTO:
        # Two microbatches per stage keeps the 1F1B bubble under a third; fewer if the batch
        # cannot be cut that finely.
        fitting = [m for m in _divisors(batch) if m <= 2 * pp]
        microbatches = max(fitting)
    else:
        microbatches = requested
    divisors = _divisors(batch)
    if batch % microbatches:
        refusals.append(
            Refusal(
                "parallel.pipeline_parallel_num_microbatches",
                microbatches,
                f"the per-device batch of {batch} does not split into {microbatches} "
                "equal microbatches",
                f"Use a divisor of training.per_device_train_batch_size: {_fmt(divisors)}.",
            )
        )
    elif schedule in ("1f1b", "interleaved_1f1b") and microbatches < pp:
        usable = [m for m in divisors if m >= pp]
        refusals.append(
            Refusal(
                "parallel.pipeline_parallel_num_microbatches",
                microbatches,
                f"{schedule} needs at least one microbatch per stage (pipeline_parallel_size={pp})",
                f"Use one of {_fmt(usable)}"
                if usable
                else f"Raise training.per_device_train_batch_size to at least {pp}, "
                "or use pipeline_schedule=gpipe.",
            )
        )
    elif schedule == "interleaved_1f1b" and microbatches % pp:
        usable = [m for m in divisors if m % pp == 0]
        refusals.append(
            Refusal(
                "parallel.pipeline_parallel_num_microbatches",
                microbatches,
                f"interleaved_1f1b runs microbatches in rounds of pipeline_parallel_size={pp}",
                f"Use a multiple of {pp} that divides the per-device batch: {_fmt(usable)}."
                if usable
                else f"Raise training.per_device_train_batch_size to a multiple of {pp}.",
            )
        )

    if par.pipeline_parallel_layers is not None:
        split = list(par.pipeline_parallel_layers)
        if len(split) != stages or sum(split) != layers or min(split) < 1:
            refusals.append(
                Refusal(
                    "parallel.pipeline_parallel_layers",
                    split,
                    f"it must give {stages} stages at least one layer each, {layers} layers in all",
                    f"For example {balanced_split(layers, stages)}."
                    if layers >= stages
                    else "Use fewer stages.",
                )
            )
    elif layers < stages:
        split = None
        if pp <= layers:  # else pipeline_parallel_size itself was refused
            refusals.append(
                Refusal(
                    "parallel.pipeline_parallel_virtual_stages",
                    virtual,
                    f"{pp} ranks x {virtual} virtual stages = {stages} stages need at least one "
                    f"decoder layer each and the model has num_hidden_layers={layers}",
                    f"Use at most {layers // pp} virtual stages per rank.",
                )
            )
    else:
        split = balanced_split(layers, stages)
    if getattr(model_config, "tie_word_embeddings", False):
        refusals.append(
            Refusal(
                "parallel.pipeline_parallel_size",
                pp,
                "the model ties its input and output embeddings, which pipeline parallelism "
                "puts on different stages; meshtrain does not synchronise them across stages yet",
                "Use pipeline_parallel_size=1 (tensor parallelism keeps tied embeddings), "
                "or model.config.tie_word_embeddings=false.",
            )
        )
    return microbatches, virtual, split


def _plan_layout(
    run: RunConfig,
    model_config: PretrainedConfig,
    *,
    num_train_blocks: int,
    num_validation_blocks: int,
    tokenizer_size: int | None,
    cuda_available: bool | None,
    device: DeviceProfile,
    shapes: dict[str, tuple[int, ...]],
) -> Plan:
    """Validate one layout (only dp may be `auto`) and estimate its memory and step time."""
    refusals: list[Refusal] = []
    notes: list[str] = []
    par, train, launch = run.parallel, run.training, run.launch
    world = launch.world_size
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    layers = model_config.num_hidden_layers

    tp_ok = tensor_parallel_degrees(world, model_config)
    tp = 1 if par.tensor_parallel_size == AUTO else par.tensor_parallel_size
    if tp not in tp_ok:
        why = []
        if heads % tp:
            why.append(f"it must divide num_attention_heads={heads}")
        if kv_heads % tp and tp % kv_heads:
            why.append(
                f"it must divide num_key_value_heads={kv_heads} or be a multiple of it "
                "(then each KV head is replicated)"
            )
        if world % tp:
            why.append(f"it must divide the world size {world}")
        refusals.append(
            Refusal(
                "parallel.tensor_parallel_size",
                tp,
                "; ".join(why) or "this degree is not supported",
                f"Values that work here: {_fmt(tp_ok)}.",
            )
        )

    pp_ok = pipeline_parallel_degrees(world, model_config)
    pp = 1 if par.pipeline_parallel_size == AUTO else par.pipeline_parallel_size
    if pp not in pp_ok:
        if pp > layers:
            reason = f"there are only num_hidden_layers={layers} layers to split into stages"
        else:
            reason = f"it must divide the world size {world}"
        refusals.append(
            Refusal(
                "parallel.pipeline_parallel_size",
                pp,
                reason,
                f"Values that work here: {_fmt(pp_ok)}.",
            )
        )

    if par.data_parallel_size == AUTO:
        dp, rest = divmod(world, tp * pp)
        if rest or dp < 1:
            refusals.append(
                Refusal(
                    "parallel.data_parallel_size",
                    AUTO,
                    f"world size {world} (launch.nproc_per_node={launch.nproc_per_node} x "
                    f"launch.nnodes={launch.nnodes}) is not a multiple of "
                    f"tensor_parallel_size x pipeline_parallel_size = {tp * pp}",
                    f"Choose tensor_parallel_size among {_fmt(tp_ok)} and "
                    f"pipeline_parallel_size among {_fmt(pp_ok)}.",
                )
            )
            dp = 1
    else:
        dp = par.data_parallel_size
        if dp * tp * pp != world:
            fit = world // (tp * pp) if world % (tp * pp) == 0 else None
            fix = (
                f"Use data_parallel_size={fit} (or auto), or change launch.nproc_per_node."
                if fit
                else f"Use launch.nproc_per_node={dp * tp * pp // launch.nnodes or 1} "
                "or change the sizes."
            )
            refusals.append(
                Refusal(
                    "parallel.data_parallel_size",
                    dp,
                    f"dp x tp x pp = {dp} x {tp} x {pp} = {dp * tp * pp} must equal the world "
                    f"size {world} (launch.nproc_per_node={launch.nproc_per_node} x "
                    f"launch.nnodes={launch.nnodes})",
                    fix,
                )
            )

    microbatches, virtual_stages, stage_layers = _plan_pipeline(
        par, pp, layers, run.training.per_device_train_batch_size, model_config, refusals, notes
    )

    if par.sequence_parallel == AUTO:
        sequence_parallel = tp > 1
    else:
        sequence_parallel = par.sequence_parallel
        if sequence_parallel and tp == 1:
            refusals.append(
                Refusal(
                    "parallel.sequence_parallel",
                    True,
                    "sequence parallelism shards activations over the tensor-parallel ranks, "
                    "and tensor_parallel_size is 1",
                    "Use sequence_parallel=auto (or false), or tensor_parallel_size > 1.",
                )
            )
    if sequence_parallel and run.data.block_size % tp:
        refusals.append(
            Refusal(
                "data.block_size",
                run.data.block_size,
                f"sequence parallelism splits each block over tensor_parallel_size={tp} ranks",
                f"Use a block size divisible by {tp} (e.g. "
                f"{run.data.block_size - run.data.block_size % tp or tp}), "
                "or parallel.sequence_parallel=false.",
            )
        )

    if par.zero_1 == AUTO:
        zero_1 = dp > 1
    else:
        zero_1 = par.zero_1
        if zero_1 and dp == 1:
            notes.append("parallel.zero_1 has nothing to shard at data_parallel_size=1; off.")
            zero_1 = False

    if par.activation_checkpointing not in IMPLEMENTED_ACTIVATION_CHECKPOINTING:
        refusals.append(
            Refusal(
                "parallel.activation_checkpointing",
                par.activation_checkpointing,
                "this mode is not available in this version of meshtrain yet",
                f"Use one of: {', '.join(IMPLEMENTED_ACTIVATION_CHECKPOINTING)}.",
            )
        )
    global_batch = train.per_device_train_batch_size * train.gradient_accumulation_steps * dp
    if global_batch > num_train_blocks:
        accumulation = train.gradient_accumulation_steps
        if num_train_blocks >= accumulation * dp:
            fix = (
                f"Use per_device_train_batch_size<={num_train_blocks // (accumulation * dp)}, "
                "or a larger corpus or smaller data.block_size."
            )
        elif num_train_blocks >= dp:
            fix = (
                "No per-device batch is small enough at this accumulation: use "
                f"per_device_train_batch_size=1 with training.gradient_accumulation_steps<="
                f"{num_train_blocks // dp}, or a larger corpus or smaller data.block_size."
            )
        else:
            fix = (
                f"There are fewer training blocks than the {dp} data-parallel ranks: use a "
                "larger corpus or a smaller data.block_size."
            )
        refusals.append(
            Refusal(
                "training.per_device_train_batch_size",
                train.per_device_train_batch_size,
                f"the global batch (per-device {train.per_device_train_batch_size} x "
                f"accumulation {accumulation} x dp {dp} = {global_batch}) "
                f"is larger than the {num_train_blocks} training blocks",
                fix,
            )
        )
    if num_validation_blocks < dp and train.eval_batches > 0:
        notes.append(
            f"only {num_validation_blocks} validation blocks for {dp} data-parallel ranks; "
            "some ranks evaluate nothing."
        )

    block_size = run.data.block_size
    max_positions = getattr(model_config, "max_position_embeddings", None)
    if max_positions is not None and block_size > max_positions:
        refusals.append(
            Refusal(
                "data.block_size",
                block_size,
                f"the model has max_position_embeddings={max_positions}",
                f"Use data.block_size<={max_positions} or raise "
                "model.config.max_position_embeddings.",
            )
        )
    if tokenizer_size is not None and tokenizer_size > model_config.vocab_size:
        refusals.append(
            Refusal(
                "data.tokenizer",
                run.data.tokenizer,
                f"the tokenizer has {tokenizer_size} tokens but the model's vocab_size is "
                f"{model_config.vocab_size}",
                "Use the tokenizer that ships with model.init_from.",
            )
        )

    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    backend = launch.backend
    if backend == AUTO:
        backend = "nccl" if cuda else "gloo"
    elif backend == "nccl" and not cuda:
        refusals.append(
            Refusal(
                "launch.backend",
                "nccl",
                "NCCL needs CUDA devices and none is visible",
                "Use launch.backend=gloo (or auto) on CPU machines.",
            )
        )
    if cuda and backend == "nccl" and launch.nproc_per_node > torch.cuda.device_count():
        refusals.append(
            Refusal(
                "launch.nproc_per_node",
                launch.nproc_per_node,
                f"only {torch.cuda.device_count()} CUDA devices are visible",
                f"Use launch.nproc_per_node<={torch.cuda.device_count()}.",
            )
        )

    if refusals:
        raise LayoutError(refusals)

    num_parameters = sum(math.prod(s) for s in shapes.values())
    layout = Layout(
        data_parallel_size=dp,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        pipeline_parallel_num_microbatches=microbatches,
        pipeline_schedule=par.pipeline_schedule,
        pipeline_parallel_virtual_stages=virtual_stages,
        pipeline_parallel_layers=stage_layers,
        sequence_parallel=sequence_parallel,
        zero_1=zero_1,
        activation_checkpointing=par.activation_checkpointing,
        activation_offloading=par.activation_offloading,
    )
    shape = ModelShape.from_config(model_config)
    step = StepShape(
        dp=dp,
        tp=tp,
        pp=pp,
        zero_1=zero_1,
        sequence_parallel=sequence_parallel,
        activation_checkpointing=par.activation_checkpointing,
        activation_offloading=par.activation_offloading,
        microbatch_size=train.per_device_train_batch_size // microbatches,
        microbatches=microbatches,
        schedule=par.pipeline_schedule if pp > 1 else "none",
        virtual_stages=virtual_stages,
        stage_layers=tuple(stage_layers or [layers]),
        seq_len=block_size,
        bf16=train.mixed_precision == "bf16",
        offload_effective=par.activation_offloading and device.name != "cpu",
    )
    memory = estimate_memory(shapes, shape, step)
    time_estimate = estimate_step_time(
        shape,
        step,
        device,
        accumulation=train.gradient_accumulation_steps,
        memory=memory,
        overlap_grad_reduce=train.overlap_grad_reduce,
        bucket_bytes=train.grad_bucket_mb * 2**20,
    )
    if par.activation_offloading and device.name == "cpu":
        notes.append(
            "parallel.activation_offloading has no effect on CPU (activations already live in "
            "host memory); it is kept for accelerators."
        )
    return Plan(
        layout=layout,
        world_size=world,
        backend=backend,
        global_batch_size=global_batch,
        tokens_per_step=global_batch * block_size,
        num_parameters=num_parameters,
        memory_estimate_per_rank=memory.to_dict(),
        model_config=model_config.to_dict(),
        num_train_blocks=num_train_blocks,
        num_validation_blocks=num_validation_blocks,
        notes=notes,
        device=device.name,
        per_device_train_batch_size=train.per_device_train_batch_size,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        time_estimate={
            **time_estimate.to_dict(),
            "tokens_per_s": global_batch * block_size / time_estimate.step_s,
        },
    )


def plan_run(
    run: RunConfig,
    model_config: PretrainedConfig,
    *,
    num_train_blocks: int,
    num_validation_blocks: int,
    tokenizer_size: int | None = None,
    cuda_available: bool | None = None,
) -> Plan:
    """Resolve `auto`, validate the layout against model, world, data and device memory.

    With `tensor_parallel_size`, `pipeline_parallel_size` or
    `activation_checkpointing` at `auto`, every layout the fixed values allow is
    planned; those refused or over the device's memory (less
    `planner.memory_margin`) drop out, and the fastest estimated step wins,
    preferring (within 2% of the best estimated tokens/s) smaller tp, then smaller
    pp, then less recomputation.
    The others are kept in `Plan.candidates` with the reason each lost.
    """
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    device = resolve_device(run.planner.device, run.planner.device_profiles, cuda)
    budget = device.memory_bytes * (1 - run.planner.memory_margin)
    kwargs = {
        "shapes": llama_family_shapes(model_config),
        "num_train_blocks": num_train_blocks,
        "num_validation_blocks": num_validation_blocks,
        "tokenizer_size": tokenizer_size,
        "cuda_available": cuda,
        "device": device,
    }
    variants = _search_space(run, model_config)
    if len(variants) == 1:
        plan = _plan_layout(_fit_global_batch(variants[0]), model_config, **kwargs)
        if plan.memory_estimate_per_rank["total"] > budget:
            raise LayoutError([_over_memory(plan, device, run)])
        return plan

    planned: list[Plan] = []
    rejected: list[dict[str, Any]] = []
    for variant in variants:
        try:
            planned.append(_plan_layout(_fit_global_batch(variant), model_config, **kwargs))
        except LayoutError as error:
            rejected.append(
                {
                    "layout": _variant_name(variant),
                    "rejected": "; ".join(str(r) for r in error.refusals),
                }
            )
    fitting = [p for p in planned if p.memory_estimate_per_rank["total"] <= budget]
    if not fitting:
        if planned:
            smallest = min(planned, key=lambda p: p.memory_estimate_per_rank["total"])
            raise LayoutError([_over_memory(smallest, device, run)])
        raise LayoutError(
            [
                Refusal(
                    "parallel",
                    "auto",
                    "no layout of this world size can run this model: "
                    + " | ".join(f"{r['layout']}: {r['rejected']}" for r in rejected[:4]),
                    "Change launch.nproc_per_node or the model's head/layer counts.",
                )
            ]
        )

    # Throughput, not step time: without training.global_batch_size the global batch
    # grows with dp, so steps of different layouts hold different numbers of tokens.
    def speed(p: Plan) -> float:
        return p.time_estimate["tokens_per_s"]

    best = max(speed(p) for p in fitting)
    ac_order = {"none": 0, "selective": 1, "full": 2}

    def preference(p: Plan) -> tuple:
        lay = p.layout
        tied = speed(p) * TIE >= best
        return (
            not tied,
            0.0 if tied else -speed(p),
            lay.tensor_parallel_size,
            lay.pipeline_parallel_size,
            ac_order[lay.activation_checkpointing],
        )

    ranked = sorted(fitting, key=preference)
    chosen = ranked[0]
    candidates = []
    for p in sorted(planned, key=speed, reverse=True):
        if p is chosen:
            continue
        ratio = speed(chosen) / speed(p)
        if p.memory_estimate_per_rank["total"] > budget:
            why = (
                f"does not fit: {p.memory_estimate_per_rank['total'] / GIB:.2f} GiB per rank "
                f"over the {budget / GIB:.2f} GiB budget"
            )
        elif ratio > TIE:
            why = f"slower: the chosen layout's estimated tokens/s is {ratio:.2f}x"
        else:
            why = "as fast within 2%; the chosen one needs less parallelism or recomputation"
        candidates.append(_summary(p) | {"lost_because": why})
    candidates.extend(rejected)
    return dataclasses.replace(
        chosen,
        candidates=candidates,
        notes=[*chosen.notes, f"chosen among {len(planned)} valid layouts on {device.name}"],
    )


def resolve_device(name: str, overrides: dict[str, dict[str, Any]], cuda: bool) -> DeviceProfile:
    """`auto`: the visible GPU's profile (h100/h200 by name, else h100) or `cpu`."""
    if name == AUTO:
        if not cuda:
            name = "cpu"
        else:
            gpu = torch.cuda.get_device_name(0).lower() if torch.cuda.is_available() else ""
            name = "h200" if "h200" in gpu else "h100"
    try:
        return device_profile(name, overrides)
    except ValueError as error:
        raise LayoutError([Refusal("planner.device", name, str(error), "")]) from None


def _summary(plan: Plan) -> dict[str, Any]:
    return {
        "layout": plan.layout.name,
        "memory_per_rank_bytes": plan.memory_estimate_per_rank["total"],
        "step_s": plan.time_estimate["step_s"],
        "tokens_per_s": plan.time_estimate["tokens_per_s"],
    }


def _over_memory(plan: Plan, device: DeviceProfile, run: RunConfig) -> Refusal:
    need = plan.memory_estimate_per_rank["total"] / GIB
    budget = device.memory_bytes * (1 - run.planner.memory_margin) / GIB
    return Refusal(
        "parallel",
        plan.layout.name,
        f"the estimated peak is {need:.2f} GiB per rank and a {device.name} device offers "
        f"{budget:.2f} GiB after planner.memory_margin={run.planner.memory_margin}",
        "Use more tensor or pipeline parallelism (or `auto`), ZeRO-1, "
        "parallel.activation_checkpointing=selective or full, a smaller "
        "training.per_device_train_batch_size with more gradient_accumulation_steps, "
        "or more devices.",
    )


def _search_space(run: RunConfig, model_config: PretrainedConfig) -> list[RunConfig]:
    """Every combination of the `auto` knobs the fixed values allow (one if none is auto)."""
    par, world = run.parallel, run.launch.world_size
    tp_options = (
        tensor_parallel_degrees(world, model_config)
        if par.tensor_parallel_size == AUTO
        else [par.tensor_parallel_size]
    )
    pp_options = (
        pipeline_parallel_degrees(world, model_config)
        if par.pipeline_parallel_size == AUTO
        else [par.pipeline_parallel_size]
    )
    ac_options = (
        list(IMPLEMENTED_ACTIVATION_CHECKPOINTING)
        if par.activation_checkpointing == AUTO
        else [par.activation_checkpointing]
    )
    if len(tp_options) == len(pp_options) == len(ac_options) == 1:
        return [run]
    variants = []
    for tp in tp_options:
        for pp in pp_options:
            if world % (tp * pp):
                continue
            if par.data_parallel_size != AUTO and par.data_parallel_size * tp * pp != world:
                continue
            for ac in ac_options:
                parallel = dataclasses.replace(
                    par,
                    tensor_parallel_size=tp,
                    pipeline_parallel_size=pp,
                    activation_checkpointing=ac,
                )
                variants.append(dataclasses.replace(run, parallel=parallel))
    return variants or [run]


def _fit_global_batch(run: RunConfig) -> RunConfig:
    """With `training.global_batch_size`, split it for this layout's dp and pp.

    The per-device batch is the largest that divides the rank's share and is at most
    `per_device_train_batch_size` per forward (times the pipeline microbatches, at most
    2 x pp of them); the rest is gradient accumulation.
    """
    train, par = run.training, run.parallel
    target = train.global_batch_size
    if target is None:
        return run
    tp = 1 if par.tensor_parallel_size == AUTO else par.tensor_parallel_size
    pp = 1 if par.pipeline_parallel_size == AUTO else par.pipeline_parallel_size
    world = run.launch.world_size
    if par.data_parallel_size == AUTO:
        if world % (tp * pp):
            return run  # the planner refuses the sizes themselves, with the reason
        dp = world // (tp * pp)
    else:
        dp = par.data_parallel_size
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
    per_device = max(d for d in _divisors(share) if d <= limit)
    training = dataclasses.replace(
        train,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=share // per_device,
    )
    return dataclasses.replace(run, training=training)


def _variant_name(run: RunConfig) -> str:
    par = run.parallel
    return (
        f"tp{par.tensor_parallel_size}-pp{par.pipeline_parallel_size}"
        f"-ac-{par.activation_checkpointing}"
    )
