"""Search the layouts `auto` allows, keep those that fit the device, and pick the fastest.

`plan_run` is the planner's entry point: with no knob at `auto` it plans (or
refuses) the one layout asked for; otherwise it plans every combination, and
keeps the losers in `Plan.candidates` with the reason each lost.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from meshtrain.config import AUTO, RunConfig
from meshtrain.config_dpo import check_preference_run
from meshtrain.config_lora import check_pretrained_base
from meshtrain.config_parsing import ConfigError
from meshtrain.device import accelerator, accelerator_count
from meshtrain.models.config_file import ArchitectureConfig
from meshtrain.models.shapes import lora_adapter_shapes, parameter_shapes
from meshtrain.pipeline_schedules import AUTO_CHOICES
from meshtrain.planner.axes import AXES, TIE_BREAK
from meshtrain.planner.axes import context as cp_axis
from meshtrain.planner.axes.context import (
    context_note,
    context_parallel_wanted,
)
from meshtrain.planner.devices import GIB, DeviceProfile, resolve_device
from meshtrain.planner.explain import candidates
from meshtrain.planner.layout import PlanContext, plan_one_layout
from meshtrain.planner.options import (
    candidate_from,
    fit_global_batch,
    packs_examples,
    resolve_backend,
    search_space,
    variant_name,
    with_parallel,
)
from meshtrain.planner.parameters import ParameterShapes
from meshtrain.planner.ranking import TIE, speed
from meshtrain.planner.types import LayoutError, Plan, Refusal

# Less recomputation first, among layouts as fast.
_AC_ORDER = {"none": 0, "selective": 1, "full": 2}


def plan_run(
    run: RunConfig,
    model_config: ArchitectureConfig,
    *,
    num_train_blocks: int,
    num_validation_blocks: int,
    tokenizer_size: int | None = None,
    cuda_available: bool | None = None,
) -> Plan:
    """Resolve `auto`, validate the layout against model, world, data and device memory.

    With tp, pp, sharding or `activation_checkpointing` at `auto`, every layout the fixed
    values allow is planned; those refused or over the device's memory (less
    `planner.memory_margin`) drop out, and the fastest estimated step wins,
    preferring (within 2% of the best estimated tokens/s) smaller cp, then tp, then
    pp, then less sharding and recomputation.
    The others are kept in `Plan.candidates` with the reason each lost.

    cp at `auto` plans cp 1 first, and the cp sizes only where no layout
    fits without them, activations and loss are most of the best one's memory (what cp
    divides), or blocks are long (`CP_LONG_BLOCK`): cp adds an exchange nothing hides,
    so it wins on memory, against tp's collectives, or where it frees dp ranks the
    batch cannot use.
    """
    _check_preference(run)
    cuda, cuda_devices = _visible_gpus(cuda_available)
    device = resolve_device(run.planner.device, run.planner.device_profiles, cuda)
    budget = device.memory_bytes * (1 - run.planner.memory_margin)
    backend, backend_refusals = resolve_backend(run.launch, cuda, cuda_devices)
    context = PlanContext(
        model_config=model_config,
        shapes=ParameterShapes(parameter_shapes(model_config)),
        adapter_shapes=ParameterShapes(adapter_shapes(run, model_config)),
        num_train_blocks=num_train_blocks,
        num_validation_blocks=num_validation_blocks,
        tokenizer_size=tokenizer_size,
        cuda=cuda,
        cuda_devices=cuda_devices,
        device=device,
        backend=backend,
        backend_refusals=backend_refusals,
        packed=packs_examples(run.data),
    )
    plan = functools.partial(_plan_settled, context=context, budget=budget)
    cp_auto = getattr(run.parallel, cp_axis.PARAMETER) == AUTO
    first = with_parallel(run, **{cp_axis.PARAMETER: 1}) if cp_auto else run
    variants = search_space(first, model_config)
    if len(variants) == 1 and not cp_auto:
        only = plan(fit_global_batch(variants[0]))
        if only.memory_estimate_per_rank["process_total"] > budget:
            raise LayoutError([_over_memory(only, device, run)])
        return only

    planned, rejected, errors = _plan_each(variants, plan)
    without_cp = list(planned)
    cp_reason = context_parallel_wanted(planned, budget, run.data.block_size) if cp_auto else None
    sizes = cp_axis.AXIS.degrees(run, model_config)
    if cp_reason and len(sizes) > 1:
        found, lost, failed = _plan_each(search_space(run, model_config, sizes[1:]), plan)
        planned, rejected, errors = planned + found, rejected + lost, errors + failed
    fitting = [p for p in planned if p.memory_estimate_per_rank["process_total"] <= budget]
    if not fitting:
        raise _none_fits(run, device, planned, rejected, errors)
    chosen = _choose(fitting)
    added = [axis.note(chosen, planned, budget) for axis in AXES]
    if cp_auto:
        added.append(context_note(chosen, planned, without_cp, budget, cp_reason))
    return dataclasses.replace(
        chosen,
        candidates=[*candidates(planned, chosen, budget), *rejected],
        notes=[
            *chosen.notes,
            *[note for note in added if note],
            f"chosen among {len(planned)} valid layouts on {device.name}",
        ],
    )


def _none_fits(
    run: RunConfig,
    device: DeviceProfile,
    planned: list[Plan],
    rejected: list[dict[str, Any]],
    errors: list[LayoutError],
) -> LayoutError:
    """Why no layout runs: the smallest over the memory, else the refusals."""
    if planned:
        smallest = min(planned, key=lambda p: p.memory_estimate_per_rank["process_total"])
        return LayoutError([_over_memory(smallest, device, run)])
    # A value that refuses every layout (e.g. launch.backend, data.block_size) is the
    # refusal itself: no layout is to blame.
    shared = _shared_refusals(errors)
    if shared:
        return LayoutError(shared)
    return LayoutError(
        [
            Refusal(
                "parallel",
                "auto",
                "no layout of this world size can run this model: " + _reasons(rejected),
                "Change launch.nproc_per_node or the model's head/layer counts.",
            )
        ]
    )


def _visible_gpus(cuda_available: bool | None) -> tuple[bool, int]:
    """Whether accelerators run the plan, and how many this machine has (`None`: ask torch,
    for a run here; a plan for another machine passes False and never imports torch)."""
    if cuda_available is False:
        return False, 0
    found = accelerator() is not None
    return found if cuda_available is None else cuda_available, accelerator_count()


def _check_preference(run: RunConfig) -> None:
    """A DPO run's refusals (`config_dpo.check_preference_run`)."""
    training = run.training
    if training.objective != "dpo":
        return
    check_preference_run(
        training.dpo,
        lora=run.model.lora is not None,
        init_from=run.model.init_from,
        loss_chunk_tokens=training.loss_chunk_tokens,
    )
    if run.planner.dry_run:
        raise ConfigError(
            "`planner.dry_run=true` runs the language-model loss only; a DPO run is planned "
            "by the memory model (docs/preference.md): set planner.dry_run=false."
        )


def adapter_shapes(run: RunConfig, model_config: ArchitectureConfig) -> dict[str, tuple[int, ...]]:
    """The LoRA adapters' shapes, from the config and the LoRA settings as the converter
    makes them (refusing a target the model does not have, before any worker starts);
    empty without LoRA."""
    settings = run.model.lora
    if settings is None:
        return {}
    check_pretrained_base(settings, run.model.init_from)
    return lora_adapter_shapes(model_config, settings)


def _plan_settled(run: RunConfig, *, context: PlanContext, budget: float) -> Plan:
    """The layout `run` asks for, each axis then settling the options it turns on only
    where memory needs them (ZeRO-1 at `auto`)."""
    candidate = candidate_from(run, context.model_config)
    plan = plan_one_layout(run, candidate, context)
    replan = functools.partial(plan_one_layout, run, context=context)
    for axis in AXES:
        plan = axis.settle(plan, candidate, budget, replan)
    return plan


def _plan_each(
    variants: list[RunConfig], plan: Callable[[RunConfig], Plan]
) -> tuple[list[Plan], list[dict[str, Any]], list[LayoutError]]:
    """The plans of the variants that pass every check, why each of the others did not,
    and their errors."""
    planned: list[Plan] = []
    rejected: list[dict[str, Any]] = []
    errors: list[LayoutError] = []
    for variant in variants:
        try:
            planned.append(plan(fit_global_batch(variant)))
        except LayoutError as error:
            errors.append(error)
            rejected.append(
                {
                    "layout": variant_name(variant),
                    "rejected": "; ".join(str(r) for r in error.refusals),
                }
            )
    return planned, rejected, errors


def _shared_refusals(errors: list[LayoutError]) -> list[Refusal]:
    """The refusals every variant met, word for word (in the first one's order)."""
    if not errors:
        return []
    common = set.intersection(*({str(r) for r in error.refusals} for error in errors))
    return [r for r in errors[0].refusals if str(r) in common]


def _reasons(rejected: list[dict[str, Any]], most: int = 4) -> str:
    """Each distinct refusal once, with the layouts it refused (they often share one)."""
    layouts_by_reason: dict[str, list[str]] = {}
    for entry in rejected:
        layouts_by_reason.setdefault(entry["rejected"], []).append(entry["layout"])
    return " | ".join(
        f"{', '.join(layouts)}: {reason.rstrip('.')}"
        for reason, layouts in list(layouts_by_reason.items())[:most]
    )


def _choose(fitting: list[Plan]) -> Plan:
    """The fastest; among those within `TIE` of it, the least parallel (cp, tp, then pp,
    then sharding: each is paid only when it buys something), recomputed, and the simplest
    pipeline schedule."""
    best = max(speed(p) for p in fitting)

    def preference(p: Plan) -> tuple:
        lay = p.layout
        tied = speed(p) * TIE >= best
        return (
            not tied,
            0.0 if tied else -speed(p),
            *(degree(lay) for degree, _, _ in TIE_BREAK),
            _AC_ORDER[lay.activation_checkpointing],
            AUTO_CHOICES.index(lay.pipeline_schedule)
            if lay.pipeline_schedule in AUTO_CHOICES
            else len(AUTO_CHOICES),
        )

    return sorted(fitting, key=preference)[0]


def _over_memory(plan: Plan, device: DeviceProfile, run: RunConfig) -> Refusal:
    need = plan.memory_estimate_per_rank["process_total"] / GIB
    budget = device.memory_bytes * (1 - run.planner.memory_margin) / GIB
    changes = [*_memory_changes(plan, run), "more devices"]
    return Refusal(
        "parallel",
        plan.layout.name,
        f"the estimated peak is {need:.2f} GiB per rank and a {device.name} device offers "
        f"{budget:.2f} GiB after planner.memory_margin={run.planner.memory_margin}",
        f"Use {', '.join(changes[:-1])} or {changes[-1]}."
        if len(changes) > 1
        else "Use more devices.",
    )


def _memory_changes(plan: Plan, run: RunConfig) -> list[str]:
    """What would lower the refused layout's memory and is not already what it does:
    knobs the search already weighed at `auto`, and values already at their most
    frugal, are left out."""
    layout, par = plan.layout, run.parallel
    fixed = [a.name for a in AXES if a.splits_model and getattr(par, a.parameter) != AUTO]
    changes = [f"more {' or '.join(fixed)} parallelism (or `auto`)"] if fixed else []
    for axis in AXES:
        changes.extend(axis.memory_relief(layout, par))
    more_recompute = {"none": "selective or full", "selective": "full"}
    if layout.activation_checkpointing in more_recompute and par.activation_checkpointing != AUTO:
        changes.append(
            "parallel.activation_checkpointing=" + more_recompute[layout.activation_checkpointing]
        )
    if plan.per_device_train_batch_size > 1:
        changes.append(
            "a smaller training.per_device_train_batch_size with more gradient_accumulation_steps"
        )
    return changes
