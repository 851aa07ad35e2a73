"""The planner's checks that belong to no parallelism axis, one concern each: the
activation checkpointing mode, the batch against the corpus, the model against the data.
(Each axis's own checks are in `planner.axes`.)

Each check returns its refusals (and the value it resolved, or its notes) instead of
raising, so the planner can run them all and report every problem of a layout at once.
Each refusal names the parameter, says why, and offers a value that would work.
"""

from __future__ import annotations

from meshtrain.config import DataConfig, TrainingConfig
from meshtrain.models.config_file import ArchitectureConfig
from meshtrain.models.moe_config import experts_per_token, num_experts
from meshtrain.planner.types import Refusal

# What the engine can run today. The planner is the one place that knows.
IMPLEMENTED_ACTIVATION_CHECKPOINTING = ("none", "full", "selective")


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
    data: DataConfig, model_config: ArchitectureConfig, tokenizer_size: int | None
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


def check_experts_beside_tensor_parallelism(
    model_config: ArchitectureConfig, tp: int, sequence_parallel: bool
) -> list[Refusal]:
    """Under tensor parallelism a mixture of experts' sparse layers run whole on every tp
    rank, each on its own sequence shard: that needs sequence parallelism (Megatron asks
    the same), or every tp rank would route and compute every token again."""
    if not num_experts(model_config) or tp == 1 or sequence_parallel:
        return []
    return [
        Refusal(
            "parallel.sequence_parallel",
            False,
            f"{model_config.model_type} is a mixture of experts, whose sparse layers run on "
            f"each tp rank's share of the sequence: with tensor parallelism (tp={tp}) they need "
            "sequence parallelism",
            "Use parallel.sequence_parallel=true (or auto).",
        )
    ]


def check_routing(model_config: ArchitectureConfig) -> list[Refusal]:
    """A mixture of experts routes each token to top-k of its experts: k between 1 and
    the experts (torch's top-k would fail inside the first sparse layer, on every rank)."""
    experts = num_experts(model_config)
    if not experts:
        return []
    k = experts_per_token(model_config)
    if 1 <= k <= experts:
        return []
    return [
        Refusal(
            "model.config.num_experts_per_tok",
            k,
            f"each token is routed to its top {k} of the {experts} experts of each sparse "
            "layer, which must be at least 1 and at most the experts",
            f"Use num_experts_per_tok between 1 and {experts}.",
        )
    ]
