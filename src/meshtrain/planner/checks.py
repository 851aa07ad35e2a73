"""The planner's checks, one concern each: what the model, world, data and devices allow.

Each check returns its refusals (and the value it resolved, or its notes) instead of
raising, so the planner can run them all and report every problem of a layout at once.
Each refusal names the parameter, says why, and offers a value that would work.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from meshtrain.config import AUTO, DataConfig, LaunchConfig, ParallelConfig, TrainingConfig
from meshtrain.planner.types import Refusal, divisors, format_values

# What the engine can run today. The planner is the one place that knows.
IMPLEMENTED_ACTIVATION_CHECKPOINTING = ("none", "full", "selective")


def tensor_parallel_degrees(world: int, model_config: PretrainedConfig) -> list[int]:
    """tp degrees the model and this engine accept: they divide the world and the attention
    heads, and the KV heads divide tp or tp divides them (then KV heads are replicated)."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    return [
        d for d in divisors(world) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)
    ]


def pipeline_parallel_degrees(world: int, model_config: PretrainedConfig) -> list[int]:
    """pp degrees that divide the world and leave every stage a decoder layer."""
    return [d for d in divisors(world) if d <= model_config.num_hidden_layers]


def balanced_split(layers: int, stages: int) -> list[int]:
    """Decoder layers per stage, as even as possible (earlier stages take the remainder)."""
    base, extra = divmod(layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def check_tensor_parallel(tp: int, world: int, model_config: PretrainedConfig) -> list[Refusal]:
    tp_ok = tensor_parallel_degrees(world, model_config)
    if tp in tp_ok:
        return []
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
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
    return [
        Refusal(
            "parallel.tensor_parallel_size",
            tp,
            "; ".join(why) or "this degree is not supported",
            f"Values that work here: {format_values(tp_ok)}.",
        )
    ]


def check_pipeline_parallel(pp: int, world: int, model_config: PretrainedConfig) -> list[Refusal]:
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


def resolve_data_parallel(
    par: ParallelConfig,
    launch: LaunchConfig,
    tp: int,
    pp: int,
    model_config: PretrainedConfig,
    cp: int = 1,
) -> tuple[int, list[Refusal]]:
    """dp (the rest of the world at `auto`), which must make dp x tp x pp x cp the world."""
    world, others = launch.world_size, tp * pp * cp
    ranks = f"launch.nproc_per_node={launch.nproc_per_node} x launch.nnodes={launch.nnodes}"
    sizes = "tensor_parallel_size x pipeline_parallel_size" + (
        " x context_parallel_size" if cp > 1 else ""
    )
    if par.data_parallel_size == AUTO:
        dp, rest = divmod(world, others)
        if not rest and dp >= 1:
            return dp, []
        tp_ok = tensor_parallel_degrees(world, model_config)
        pp_ok = pipeline_parallel_degrees(world, model_config)
        also = f", and context_parallel_size among {format_values(divisors(world))}"
        refusal = Refusal(
            "parallel.data_parallel_size",
            AUTO,
            f"world size {world} ({ranks}) is not a multiple of {sizes} = {others}",
            f"Choose tensor_parallel_size among {format_values(tp_ok)} and "
            f"pipeline_parallel_size among {format_values(pp_ok)}{also if cp > 1 else ''}.",
        )
        return 1, [refusal]
    dp = par.data_parallel_size
    if dp * others == world:
        return dp, []
    fit = world // others if world % others == 0 else None
    fix = (
        f"Use data_parallel_size={fit} (or auto), or change launch.nproc_per_node."
        if fit
        else f"Use launch.nproc_per_node={dp * others // launch.nnodes or 1} or change the sizes."
    )
    names = "dp x tp x pp x cp" if cp > 1 else "dp x tp x pp"
    values = " x ".join(str(v) for v in (dp, tp, pp, cp)[: 4 if cp > 1 else 3])
    refusal = Refusal(
        "parallel.data_parallel_size",
        dp,
        f"{names} = {values} = {dp * others} must equal the world size {world} ({ranks})",
        fix,
    )
    return dp, [refusal]


def context_parallel_degrees(world: int, block_size: int, *, search: bool = False) -> list[int]:
    """cp degrees the engine accepts: they divide the world, and each block into 2 x cp
    equal chunks (1, off, always). `search`: only the powers of two, which `auto` weighs."""
    return [
        cp
        for cp in divisors(world)
        if cp == 1 or (block_size % (2 * cp) == 0 and (not search or cp & (cp - 1) == 0))
    ]


def check_context_parallel(cp: int, world: int, block_size: int) -> list[Refusal]:
    """cp must divide the world, and each block must cut into 2 x cp equal chunks (rank r
    of the group holds chunks r and 2cp-1-r, which balances causal attention's work)."""
    if cp == 1:
        return []
    refusals = []
    degrees = context_parallel_degrees(world, block_size)
    if world % cp:
        refusals.append(
            Refusal(
                "parallel.context_parallel_size",
                cp,
                f"it must divide the world size {world}",
                f"Values that work here: {format_values(degrees)}.",
            )
        )
    elif block_size % (2 * cp):  # (a size that cannot fill the world is refused alone)
        sizes = [c for c in degrees if c > 1]
        works = (
            f"or parallel.context_parallel_size={' or '.join(map(str, sizes))}"
            if sizes
            else "or parallel.context_parallel_size=1 (off)"
        )
        lower = block_size - block_size % (2 * cp)
        refusals.append(
            Refusal(
                "data.block_size",
                block_size,
                f"context_parallel_size={cp} cuts each block into 2 x {cp} = {2 * cp} equal "
                "chunks (for causal load balance)",
                f"Use a block size divisible by {2 * cp} (e.g. {lower or 2 * cp}), {works}.",
            )
        )
    return refusals


@dataclass(frozen=True)
class PipelineSplit:
    """How a rank's batch and the decoder layers are cut for the pipeline schedule."""

    microbatches: int
    virtual_stages: int
    stage_layers: list[int] | None  # None without pipeline parallelism, or when refused
    refusals: list[Refusal]
    notes: list[str]


def resolve_pipeline(
    par: ParallelConfig, pp: int, batch: int, model_config: PretrainedConfig
) -> PipelineSplit:
    """Microbatches, virtual stages and the layer split for a per-device batch of `batch`."""
    requested = par.pipeline_parallel_num_microbatches
    if pp == 1:
        notes: list[str] = []
        if requested not in (AUTO, 1):
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

    schedule = par.pipeline_schedule
    virtual = par.pipeline_parallel_virtual_stages if schedule == "interleaved_1f1b" else 1
    if requested == AUTO:
        # Two microbatches per stage keeps the 1F1B bubble under a third; fewer if the batch
        # cannot be cut that finely.
        microbatches = max(m for m in divisors(batch) if m <= 2 * pp)
    else:
        microbatches = requested
    stage_layers, layer_refusals = check_stage_layers(
        par.pipeline_parallel_layers, pp, virtual, model_config.num_hidden_layers
    )
    refusals = [*check_microbatches(microbatches, schedule, pp, batch), *layer_refusals]
    return PipelineSplit(microbatches, virtual, stage_layers, refusals, [])


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
    if schedule in ("1f1b", "interleaved_1f1b") and microbatches < pp:
        usable = [m for m in usable if m >= pp]
        return [
            Refusal(
                parameter,
                microbatches,
                f"{schedule} needs at least one microbatch per stage (pipeline_parallel_size={pp})",
                f"Use one of {format_values(usable)}"
                if usable
                else f"Raise training.per_device_train_batch_size to at least {pp}, "
                "or use pipeline_schedule=gpipe.",
            )
        ]
    if schedule == "interleaved_1f1b" and microbatches % pp:
        usable = [m for m in usable if m % pp == 0]
        return [
            Refusal(
                parameter,
                microbatches,
                f"interleaved_1f1b runs microbatches in rounds of pipeline_parallel_size={pp}",
                f"Use a multiple of {pp} that divides the per-device batch: "
                f"{format_values(usable)}."
                if usable
                else f"Raise training.per_device_train_batch_size to a multiple of {pp}.",
            )
        ]
    return []


def check_stage_layers(
    requested: list[int] | None, pp: int, virtual: int, layers: int
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
    refusal = Refusal(
        "parallel.pipeline_parallel_virtual_stages",
        virtual,
        f"{pp} ranks x {virtual} virtual stages = {stages} stages need at least one "
        f"decoder layer each and the model has num_hidden_layers={layers}",
        f"Use at most {layers // pp} virtual stages per rank.",
    )
    return None, [refusal]


def resolve_sequence_parallel(
    par: ParallelConfig, tp: int, block_size: int, cp: int = 1
) -> tuple[bool, list[Refusal]]:
    """On with tensor parallelism at `auto`; a rank's share of each block (block / cp
    tokens) must split over the tp ranks."""
    refusals: list[Refusal] = []
    if par.sequence_parallel == AUTO:
        sequence_parallel = tp > 1
    else:
        sequence_parallel = par.sequence_parallel
        if sequence_parallel and tp == 1:
            chosen = (
                " (the only size auto can choose here)" if par.tensor_parallel_size == AUTO else ""
            )
            refusals.append(
                Refusal(
                    "parallel.sequence_parallel",
                    True,
                    f"it needs parallel.tensor_parallel_size > 1, and that is 1{chosen}: "
                    "sequence parallelism shards activations over the tensor-parallel ranks",
                    "Use sequence_parallel=auto (on whenever tp > 1) or false, or "
                    "parallel.tensor_parallel_size=2 or more.",
                )
            )
    step = tp * cp  # under cp each rank's block / cp tokens are split over tp
    if sequence_parallel and block_size % step and (cp == 1 or block_size % (2 * cp) == 0):
        over = f" x context_parallel_size={cp}" if cp > 1 else ""
        refusals.append(
            Refusal(
                "data.block_size",
                block_size,
                f"sequence parallelism splits each block over tensor_parallel_size={tp}{over} "
                "ranks",
                f"Use a block size divisible by {step} (e.g. "
                f"{block_size - block_size % step or step}), "
                "or parallel.sequence_parallel=false.",
            )
        )
    return sequence_parallel, refusals


def resolve_zero_1(
    par: ParallelConfig, dp: int, sharded: int = 1, cp: int = 1
) -> tuple[bool, list[str]]:
    """Off at `auto` (the search plans `auto` both ways and keeps ZeRO-1 only where memory
    needs it); off, with a note, when there is nothing to shard (it shards over the
    dp x cp ranks, which hold the same parameters); off under sharded data parallelism
    (which shards the optimizer states itself)."""
    if par.zero_1 == AUTO:
        return False, []
    if par.zero_1 and dp * cp == 1:
        return False, ["parallel.zero_1 has nothing to shard at data_parallel_size=1; off."]
    return par.zero_1, []


def sharded_data_parallel_degrees(
    dp: int, tp: int, devices_per_node: int, cp: int = 1
) -> list[int]:
    """The degrees `auto` weighs: 1 (off), dp (full sharding) and, when the dp group spans
    nodes, hybrid sharding within a node (N x cp x tp = devices per node: FSDP2 shards over
    the N x cp ranks), so the all-gathers and reduce-scatters stay on the fast link and
    only the replicas' all-reduce crosses."""
    options = {1, dp}
    spans_nodes = dp * cp * tp > devices_per_node
    hybrid = devices_per_node // (tp * cp)
    if spans_nodes and 1 < hybrid < dp and dp % hybrid == 0:
        options.add(hybrid)
    return sorted(options)


def resolve_sharded_data_parallel(
    par: ParallelConfig, dp: int, zero_1: bool | str
) -> tuple[int, list[Refusal]]:
    """The degree N of sharded data parallelism; N must divide data_parallel_size, and
    ZeRO-1 on top of it is refused (it is already included). The search expands `auto`
    into `sharded_data_parallel_degrees` and plans each; a layout planned alone at `auto`
    is not sharded."""
    degree = par.sharded_data_parallel_degree
    if degree == AUTO:
        return 1, []
    if degree < 1 or dp % degree:
        works = format_values(divisors(dp))
        return 1, [
            Refusal(
                "parallel.sharded_data_parallel_degree",
                degree,
                f"the parameters are sharded over groups of that many of the "
                f"data_parallel_size={dp} ranks, so it must divide {dp}",
                f"Use one of {works} (1: off; {dp}: full sharding).",
            )
        ]
    if degree > 1 and zero_1 is True:
        return degree, [
            Refusal(
                "parallel.zero_1",
                True,
                f"sharded_data_parallel_degree={degree} already shards the optimizer "
                "states (and the gradients and parameters) over the data-parallel ranks",
                "Set parallel.zero_1=false (or auto) with sharded data parallelism.",
            )
        ]
    return degree, []


def check_activation_checkpointing(mode: str) -> list[Refusal]:
    if mode in IMPLEMENTED_ACTIVATION_CHECKPOINTING:
        return []
    return [
        Refusal(
            "parallel.activation_checkpointing",
            mode,
            "this mode is not available in this version of meshtrain yet",
            f"Use one of: {', '.join(IMPLEMENTED_ACTIVATION_CHECKPOINTING)}.",
        )
    ]


def global_batch_size(train: TrainingConfig, dp: int) -> int:
    return train.per_device_train_batch_size * train.gradient_accumulation_steps * dp


def check_batch_vs_data(
    train: TrainingConfig, dp: int, *, num_train_blocks: int, num_validation_blocks: int
) -> tuple[list[Refusal], list[str]]:
    """One step must not need more blocks than the corpus has; few validation blocks warn."""
    refusals: list[Refusal] = []
    notes: list[str] = []
    global_batch = global_batch_size(train, dp)
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
    return refusals, notes


def check_model_vs_data(
    data: DataConfig, model_config: PretrainedConfig, tokenizer_size: int | None
) -> list[Refusal]:
    """Blocks must fit the model's positions, and every token id its embedding table."""
    refusals: list[Refusal] = []
    max_positions = getattr(model_config, "max_position_embeddings", None)
    if max_positions is not None and data.block_size > max_positions:
        refusals.append(
            Refusal(
                "data.block_size",
                data.block_size,
                f"the model has max_position_embeddings={max_positions}",
                f"Use data.block_size<={max_positions} or raise "
                "model.config.max_position_embeddings.",
            )
        )
    if tokenizer_size is not None and tokenizer_size > model_config.vocab_size:
        refusals.append(
            Refusal(
                "data.tokenizer",
                data.tokenizer,
                f"the tokenizer has {tokenizer_size} tokens but the model's vocab_size is "
                f"{model_config.vocab_size}",
                "Use the tokenizer that ships with model.init_from.",
            )
        )
    return refusals


def resolve_backend(
    launch: LaunchConfig, cuda: bool, cuda_devices: int
) -> tuple[str, list[Refusal]]:
    """NCCL with CUDA, gloo without (at `auto`); NCCL needs a GPU for each local rank."""
    refusals: list[Refusal] = []
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
    if cuda and backend == "nccl" and launch.nproc_per_node > cuda_devices:
        refusals.append(
            Refusal(
                "launch.nproc_per_node",
                launch.nproc_per_node,
                f"only {cuda_devices} CUDA devices are visible",
                f"Use launch.nproc_per_node<={cuda_devices}.",
            )
        )
    return backend, refusals
