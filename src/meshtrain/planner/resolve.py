"""Plan from the run's parameters and the prepared data, as the pipeline does."""

from __future__ import annotations

import dataclasses
from typing import Any

from meshtrain.config import RunConfig
from meshtrain.models.config_fields import build_model_config
from meshtrain.models.llama.pretrained import check_pretrained, resolve_init_from
from meshtrain.planner.plan_inputs import StalePlanError, plan_inputs_hash
from meshtrain.planner.search import plan_run
from meshtrain.planner.types import Plan

__all__ = ["StalePlanError", "plan_before_data", "plan_for_run"]


def plan_for_run(
    run: RunConfig, tokenizer: Any, *, num_train_blocks: int, num_validation_blocks: int
) -> Plan:
    """Resolve the model config against the tokenizer, then plan the layout.

    With `model.init_from` the folder's config is the model's, and its weights are
    checked against it (names and shapes, from the file headers) before anything starts.
    """
    init_from = resolve_init_from(run.model.init_from) if run.model.init_from else None
    model_config = build_model_config(
        run.model.architecture,
        run.model.config,
        vocab_size=len(tokenizer),
        init_from=init_from,
        special_token_ids={
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
    )
    if init_from:
        check_pretrained(init_from, model_config)
    plan = plan_run(
        run,
        model_config,
        num_train_blocks=num_train_blocks,
        num_validation_blocks=num_validation_blocks,
        tokenizer_size=len(tokenizer),
    )
    if run.model.init_from and run.model.config:
        note = (
            f"model.config is not applied: the model is model.init_from={run.model.init_from}"
            " with its own config.json."
        )
        plan = dataclasses.replace(plan, notes=[*plan.notes, note])
    config_hash = plan_inputs_hash(
        run,
        tokenizer,
        num_train_blocks=num_train_blocks,
        num_validation_blocks=num_validation_blocks,
    )
    return dataclasses.replace(plan, config_hash=config_hash)


# Blocks without limit: before the data is read, the corpus is taken to hold any batch.
_ANY_NUMBER_OF_BLOCKS = 10**12


def plan_before_data(run: RunConfig, tokenizer_size: int) -> Plan:
    """The plan as far as it is known before any data is read: the layout, the model and
    the memory, with the tokenizer's size (`data.vocab_size` for one trained here, an
    upper bound) and a corpus taken to hold any batch. `preflight` refuses with it before
    the first node; the planning node plans again with the real tokenizer and blocks."""
    init_from = resolve_init_from(run.model.init_from) if run.model.init_from else None
    model_config = build_model_config(
        run.model.architecture, run.model.config, vocab_size=tokenizer_size, init_from=init_from
    )
    return plan_run(
        run,
        model_config,
        num_train_blocks=_ANY_NUMBER_OF_BLOCKS,
        num_validation_blocks=_ANY_NUMBER_OF_BLOCKS,
        tokenizer_size=tokenizer_size,
    )
