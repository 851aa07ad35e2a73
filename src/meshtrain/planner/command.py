"""`python -m meshtrain plan`: choose a layout for a model and a cluster, without hardware.

    python -m meshtrain plan --model examples/model_configs/llama-3.1-8b.json \
        --devices 8 --device h100 --seq-len 4096 --global-batch 256

The model comes from a Hugging Face `config.json` (or a folder holding one), read as
JSON (`models/config_file.py`): nothing is downloaded, no weights are built, and neither
torch nor transformers is imported. Prints the chosen layout, its memory breakdown and step-time
estimate, and every other layout with the reason it lost.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from meshtrain.config import AUTO, ConfigError, RunConfig
from meshtrain.models.config_file import ConfigFile, read_config_file
from meshtrain.models.moe_config import experts_per_token, inactive_expert_parameters, num_experts
from meshtrain.planner.axes import DESCRIBE, STEP_LINE
from meshtrain.planner.axes.expert import expert_degree
from meshtrain.planner.devices import BUILTIN_PROFILES, GIB
from meshtrain.planner.search import plan_run
from meshtrain.planner.types import LayoutError, Plan


def run_plan(args: argparse.Namespace) -> int:
    planned = plan_from_args(args)
    if isinstance(planned, str):
        print(f"error: {planned}")
        return 1
    _, plan = planned
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2, sort_keys=True))
    else:
        print(describe(plan, args))
    return 0


def plan_from_args(args: argparse.Namespace) -> tuple[RunConfig, Plan] | str:
    """The run and the plan `plan`'s (and `dryrun`'s) flags describe, or why there is none."""
    path = Path(args.model)
    if not path.exists():
        return f"--model {path}: no such file or folder (give a config.json)"
    try:
        config = read_config_file(path)
    except ConfigError as error:
        return f"--model {path}: {error}"
    per_node = args.devices_per_node or min(args.devices, _per_node(args.device))
    if args.devices % per_node:
        return f"--devices {args.devices} is not a multiple of {per_node} per node"
    try:
        run = RunConfig.from_params(
            parallel={
                "data_parallel_size": args.dp,
                "tensor_parallel_size": args.tp,
                "pipeline_parallel_size": args.pp,
                "context_parallel_size": getattr(args, "cp", AUTO),
                "sharded_data_parallel_degree": getattr(args, "sdp", AUTO),
                "expert_parallel_size": getattr(args, "ep", AUTO),
                "zero_1": {"true": True, "false": False}.get(getattr(args, "zero_1", AUTO), AUTO),
                "activation_checkpointing": args.activation_checkpointing,
                "pipeline_schedule": args.schedule,
            },
            training={
                "per_device_train_batch_size": args.micro_batch_size,
                "global_batch_size": args.global_batch,
                "mixed_precision": args.precision,
                "loss_chunk_tokens": _chunk(getattr(args, "loss_chunk_tokens", AUTO)),
            },
            launch={
                "nproc_per_node": per_node,
                "nnodes": args.devices // per_node,
                # Planning for another machine: only trn devices name their backend here; a
                # GPU plan is made without looking for GPUs on this one.
                "backend": "neuron" if args.device.startswith("trn") else AUTO,
            },
            model={"architecture": config.model_type, **_lora(args)},
            data={"block_size": args.seq_len},
            planner={"device": args.device, "memory_margin": args.memory_margin},
        )
        plan = plan_run(
            run,
            config,
            num_train_blocks=args.global_batch * 10**6,
            num_validation_blocks=args.devices,
            cuda_available=False,
        )
    except (ConfigError, LayoutError) as error:
        return str(error)
    return run, plan


def _lora(args: argparse.Namespace) -> dict:
    """`model.lora` of `--lora-r`, `--lora-targets` and `--lora-dropout` (none without
    --lora-r). A plan
    reads no weights, so the base is no folder."""
    r = getattr(args, "lora_r", None)
    if r is None:
        return {}
    targets = args.lora_targets
    modules = targets if targets == "all-linear" else targets.split(",")
    lora = {
        "r": r,
        "lora_alpha": 2 * r,
        "lora_dropout": getattr(args, "lora_dropout", 0.0),
        "target_modules": modules,
        "allow_random_base": True,
    }
    return {"lora": lora}


def _chunk(value: str) -> int | str:
    return int(value) if str(value).isdigit() else value


def _per_node(device: str) -> int:
    profile = BUILTIN_PROFILES.get(device)
    return profile.devices_per_node if profile else 8


PRECISION_BYTES = {
    "no": "per parameter 4 B fp32 weight + 4 B gradient + 8 B moments (/dp with ZeRO-1)",
    "bf16": "per parameter 4 B fp32 weight + 4 B gradient + 8 B moments (/dp with ZeRO-1); "
    "bf16 matmuls",
    "bf16_master": "per parameter 2 B bf16 weight + 4 B fp32 gradient + 12 B fp32 master "
    "and moments (/dp with ZeRO-1); bf16 activations",
}


def _parameters(plan: Plan) -> str:
    """The model's size; a mixture of experts' also as the parameters a token passes."""
    total = f"{plan.num_parameters / 1e9:.2f}B parameters"
    config = ConfigFile(plan.model_config)
    if not num_experts(config):
        return total
    active = plan.num_parameters - inactive_expert_parameters(config)
    routed = f"{experts_per_token(config)} of {num_experts(config)} experts a token"
    return f"{total} ({active / 1e9:.2f}B active: {routed})"


def describe(plan: Plan, args: argparse.Namespace) -> str:
    """The choice, its breakdown and the runners-up, as a person reads them."""
    memory, time = plan.memory_estimate_per_rank, plan.time_estimate
    lines = [
        f"{args.devices} x {plan.device}, {_parameters(plan)}, "
        f"sequence {args.seq_len}, global batch {plan.global_batch_size}",
        f"chosen: {plan.layout.name}  (per-device batch {plan.per_device_train_batch_size}, "
        f"accumulation {plan.gradient_accumulation_steps})",
        f"  precision {args.precision}: {_precision_bytes(plan, args.precision)}",
        f"  memory per rank (peak, pipeline rank {memory['peak_pipeline_rank']}): "
        f"{memory['process_total'] / GIB:.2f} GiB, of which the step's tensors "
        f"{memory['total'] / GIB:.2f} GiB",
    ]
    parts = ["parameters", "gradients", "optimizer_states", "activations", "loss", "runtime"]
    if memory.get("gathered"):
        parts.insert(3, "gathered")
    for part in parts:
        lines.append(f"    {part:22} {memory.get(part, 0) / GIB:8.2f} GiB{_note(plan, part)}")
        if part == "activations" and plan.layout.context_parallel_size > 1:
            for inner, words in (("context_kv", "gathered K/V"), ("context_mask", "masks")):
                if inner == "context_mask" and not memory.get(inner):
                    continue  # packed examples only
                lines.append(f"      of which {words:13} {memory.get(inner, 0) / GIB:8.2f} GiB")
        if part == "activations" and memory.get("expert_dispatch"):
            dispatch = memory["expert_dispatch"] / GIB
            lines.append(f"      of which {'ep dispatch':13} {dispatch:8.2f} GiB")
    lines.append(
        f"  step {time['step_s']:.2f} s, {time['tokens_per_s']:,.0f} tokens/s: "
        + ", ".join(f"{k[:-2].replace('_', ' ')} {time[k]:.2f} s" for k in TIME_PARTS if k in time)
    )
    mfu = plan.mfu(time["tokens_per_s"])
    if mfu is not None:
        lines.append(
            f"  MFU {mfu:.2f} at that rate, of {plan.world_size} x {plan.peak_tflops_per_rank:g} "
            f"TFLOP/s ({plan.device}'s published peak; a run logs what it reaches as `mfu`)"
        )
    lines += [line for axis in DESCRIBE if (line := axis.describe(plan, args.seq_len))]
    if plan.candidates:
        lines.append("other layouts:")
        lines.append(f"  {'layout':44} {'GiB/rank':>9} {'tokens/s':>12}  why not")
        for c in plan.candidates:
            if "rejected" in c:
                lines.append(f"  {c['layout']:44} {'':>9} {'':>12}  refused: {c['rejected']}")
            else:
                lines.append(
                    f"  {c['layout']:44} {c['memory_per_rank_bytes'] / GIB:9.2f} "
                    f"{c['tokens_per_s']:12,.0f}  {c['lost_because']}"
                )
    for note in plan.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _note(plan: Plan, part: str) -> str:
    if part != "loss":
        return ""
    chunk = plan.layout.loss_chunk_tokens
    return f"  (in chunks of {chunk:,} tokens)" if chunk else "  (over the whole logits)"


TIME_PARTS = ("compute_s", *(part for axis in STEP_LINE for part in axis.time_parts), "optimizer_s")


def _precision_bytes(plan: Plan, precision: str) -> str:
    if not plan.layout.sharded:
        words = PRECISION_BYTES[precision]
        # ZeRO-1 shards over the dp x cp ranks that hold the same parameters.
        if plan.layout.context_parallel_size > 1:
            words = words.replace("/dp", "/(dp x cp)")
        ep = expert_degree(plan.layout)
        # Each rank holds E/ep experts; ZeRO-1 splits their moments over the dp/ep replicas.
        return f"{words}; the experts' /{ep}, their moments /dp with ZeRO-1" if ep > 1 else words
    gathered = "bf16" if precision == "bf16_master" else "fp32"
    shards = plan.layout.sharded_data_parallel_degree * plan.layout.context_parallel_size
    return (
        "per parameter 4 B fp32 weight (the master) + 4 B fp32 gradient + 8 B moments, "
        f"/{shards} sharded; layers gathered in {gathered}"
    )
