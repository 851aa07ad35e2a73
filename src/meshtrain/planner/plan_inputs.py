"""What a plan is made from, and its hash: a run asks whether plan.json is its own
without planning again (the planning node writes the hash, the training node compares).

Nothing here searches or imports the search; the hash is sha256 of canonical JSON, the
same in every process and on every machine that sees the same inputs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from meshtrain.config import AUTO, Refused, RunConfig
from meshtrain.device import accelerator, device_name
from meshtrain.planner.types import Plan

# The fields no plan reads: the optimiser's numbers, when to checkpoint, evaluate and log,
# where things are written, and how the nodes meet (every node has its own node_rank; a
# resumed run adds resume_from). A field not named here is hashed, so a new one makes old
# plans stale rather than letting a plan that ignored it through.
NOT_PLANNED: dict[str, frozenset[str]] = {
    "training": frozenset(
        {
            "learning_rate",
            "min_learning_rate_ratio",
            "warmup_steps",
            "weight_decay",
            "adam_beta1",
            "adam_beta2",
            "adam_epsilon",
            "max_grad_norm",
            "max_steps",
            "seed",
            "checkpoint_every",
            "keep_last",
            "resume_from",
            "eval_every",
            "log_every",
            "output_dir",
            "run_name",
        }
    ),
    "launch": frozenset(
        {
            "node_rank",
            "rdzv_endpoint",
            "rdzv_id",
            "network_interface",
            "max_restarts",
            "monitor_interval",
            "shutdown_grace_s",
            "collective_timeout_s",
            "warm_ranks",
        }
    ),
    "data": frozenset({"num_proc"}),
}


def plan_inputs(
    run: RunConfig, tokenizer: Any, *, num_train_blocks: int, num_validation_blocks: int
) -> dict[str, Any]:
    """What a plan of `run` depends on: the parameters the planner reads, the data's sizes,
    the tokenizer's size and special tokens, the model folder's config, and what `auto`
    resolves against on this machine (a visible accelerator and its name)."""
    groups = {
        group: {k: v for k, v in values.items() if k not in NOT_PLANNED.get(group, ())}
        for group, values in run.to_dict().items()
    }
    found = accelerator()
    return {
        "parameters": groups,
        "data": {
            "num_train_blocks": num_train_blocks,
            "num_validation_blocks": num_validation_blocks,
            "tokenizer_size": len(tokenizer),
            "special_token_ids": [
                tokenizer.bos_token_id,
                tokenizer.eos_token_id,
                tokenizer.pad_token_id,
            ],
        },
        "init_from_config": _folder_config(run.model.init_from),
        "machine": {
            "accelerator": found,
            "name": device_name(0) if found and run.planner.device == AUTO else "",
        },
    }


def plan_inputs_hash(
    run: RunConfig, tokenizer: Any, *, num_train_blocks: int, num_validation_blocks: int
) -> str:
    """sha256 of `plan_inputs` as canonical JSON: the same in every process and machine
    that sees the same inputs."""
    inputs = plan_inputs(
        run,
        tokenizer,
        num_train_blocks=num_train_blocks,
        num_validation_blocks=num_validation_blocks,
    )
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _folder_config(init_from: str | None) -> str | None:
    """The text of a local `model.init_from` folder's config.json (its model's shape), so
    that a folder changed in place makes the plan stale; None without one."""
    config = Path(init_from) / "config.json" if init_from else None
    return config.read_text() if config is not None and config.is_file() else None


class StalePlanError(Refused, ValueError):
    """plan.json was made from other parameters or data than this run's."""


RE_PLAN = (
    "run the planning pipeline again, e.g. `kedro run --pipeline planning` with the same "
    "--params, or run the whole default pipeline."
)


def check_plan_matches(plan: Plan, config_hash: str) -> None:
    """Refuse to train on a plan.json made from other parameters, data or machine than
    this run's: its hash of what it was made from differs from the run's."""
    if plan.config_hash == config_hash:
        return
    made = (
        f"was made from other parameters or data (configuration hash {plan.config_hash[:12]} "
        f"in plan.json, {config_hash[:12]} now)"
        if plan.config_hash
        else "has no hash of the parameters and data it was made from (an older plan)"
    )
    raise StalePlanError(f"plan.json {made}: {RE_PLAN}")
