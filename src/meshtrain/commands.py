"""`python -m meshtrain ...`: engine commands that need no Kedro project.

(Not named `cli.py`: Kedro would load that module as the project's own `kedro` commands.)

    python -m meshtrain consolidate CHECKPOINT_DIR [OUTPUT_DIR] [--max-shard-size 5GB]
        [--dtype bf16] [--no-verify]
    python -m meshtrain plan --model CONFIG_JSON --devices N --device trn1 [--seq-len 4096]
        [--global-batch 256] [--tp/--pp/--dp/--cp/--ep SIZE] [--zero-1 true] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

from meshtrain.checkpoint import CheckpointError, consolidate_checkpoint, resolve_checkpoint
from meshtrain.checkpoint.consolidate import check_dtype, parse_size
from meshtrain.checkpoint.consolidate.remote_io import consolidate_anywhere
from meshtrain.checkpoint.remote import find_checkpoint, is_url, join
from meshtrain.config import ConsolidationConfig
from meshtrain.pipeline_schedules import SCHEDULES

DEFAULT_OUTPUT = "consolidated"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m meshtrain", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    consolidate = commands.add_parser(
        "consolidate",
        help="merge a sharded checkpoint into a Hugging Face model folder",
        description="Merge a sharded meshtrain checkpoint into a folder that "
        "transformers.AutoModelForCausalLM.from_pretrained loads. Tensors are "
        "copied one at a time, file to file (no torch needed), so memory stays at a "
        "few MiB whatever the model's size.",
    )
    consolidate.add_argument(
        "checkpoint",
        metavar="CHECKPOINT_DIR",
        help="a checkpoint-<step> folder, its shards/ folder, or a run folder (its latest "
        "complete checkpoint); or their URL on object storage (s3://, gs://: downloaded)",
    )
    consolidate.add_argument(
        "output_dir",
        metavar="OUTPUT_DIR",
        nargs="?",
        help="where to write the Hugging Face model (a folder, or a URL: uploaded once "
        "written here); it is replaced if it exists "
        f"(default: {DEFAULT_OUTPUT}/ inside the resolved checkpoint folder, "
        f"e.g. run/checkpoint-100/{DEFAULT_OUTPUT})",
    )
    consolidate.add_argument(
        "--max-shard-size",
        default=ConsolidationConfig.max_shard_size,
        metavar="SIZE",
        help="largest weight file, in bytes or with a unit: 500MB, 5GB (decimal) or 2GiB "
        "(binary); past it the weights are split into model-0000i-of-0000N.safetensors "
        "files with an index (default: %(default)s)",
    )
    consolidate.add_argument(
        "--dtype",
        default=None,
        metavar="DTYPE",
        help="write the weights as float32 (fp32), bfloat16 (bf16) or float16 (fp16), cast "
        "while streaming (default: as the checkpoint holds them; a bf16_master run holds "
        "its fp32 master weights)",
    )
    consolidate.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the sha256 check of every file (sizes are still checked); the check "
        "runs alongside the copy and costs a read of the checkpoint",
    )
    consolidate.add_argument(
        "--merge-lora",
        metavar="MERGED_DIR",
        default=None,
        help="a LoRA checkpoint (whose OUTPUT_DIR is PEFT's adapter folder): also write its "
        "base with the adapters merged in, as a plain Hugging Face model, to MERGED_DIR",
    )
    consolidate.add_argument(
        "--base",
        default=None,
        metavar="BASE_DIR",
        help="with --merge-lora: the base model folder (default: the one the adapters were "
        "trained on; another is refused unless it is the same model)",
    )
    add_plan_parser(commands)
    add_dryrun_parser(commands)
    return parser


def add_dryrun_parser(commands: Any) -> None:
    dryrun = commands.add_parser(
        "dryrun",
        help="run the planned layout's real code for chosen ranks on fake tensors",
        description="Run one training step of chosen ranks of the planned layout, with the "
        "real code, on fake tensors under a fake process group of the full world size, and "
        "set its memory beside the planner's, term by term. Takes plan's flags.",
    )
    _plan_arguments(dryrun)
    dryrun.add_argument(
        "--rank",
        type=int,
        action="append",
        help="a global rank to run (repeatable; default: the first and last pipeline "
        "stage's first rank, and the planner's busiest)",
    )


def add_plan_parser(commands: Any) -> None:
    plan = commands.add_parser(
        "plan",
        help="choose dp/tp/pp/cp/ep, ZeRO-1, SP and checkpointing for a model on N devices",
        description="Choose a layout for a model and a cluster without the hardware: the "
        "fastest estimated layout that fits, its memory breakdown and step time, and why "
        "each other layout lost.",
    )
    _plan_arguments(plan)


def _plan_arguments(plan: Any) -> None:
    plan.add_argument("--model", required=True, help="a config.json or a folder with one")
    plan.add_argument("--devices", type=int, required=True, help="world size (all nodes)")
    plan.add_argument(
        "--device",
        default="cpu",
        help="device profile: cpu, h100, h200, trn1, trn2 (default: %(default)s)",
    )
    plan.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    plan.add_argument("--global-batch", type=int, default=256, help="sequences per step")
    plan.add_argument(
        "--micro-batch-size",
        type=int,
        default=1,
        help="largest per-device batch per forward (per pipeline microbatch)",
    )
    plan.add_argument("--devices-per-node", type=int, default=None)
    for size in ("dp", "tp", "pp"):
        plan.add_argument(f"--{size}", default="auto", help=f"fix the {size} size (default auto)")
    plan.add_argument(
        "--cp",
        default="auto",
        help="fix parallel.context_parallel_size (1: off; default auto: weighed where "
        "activations dominate or nothing fits without it)",
    )
    plan.add_argument(
        "--ep",
        default="auto",
        help="fix parallel.expert_parallel_size (1: off; default auto: on a mixture of experts "
        "every size dividing its experts and dp is weighed, without sharding)",
    )
    plan.add_argument(
        "--sdp",
        default="auto",
        help="fix parallel.sharded_data_parallel_degree (1: off; default auto)",
    )
    plan.add_argument(
        "--zero-1",
        default="auto",
        choices=("auto", "true", "false"),
        help="parallel.zero_1 (auto: on only where memory needs it; default auto)",
    )
    plan.add_argument(
        "--activation-checkpointing", default="auto", choices=("auto", "none", "selective", "full")
    )
    plan.add_argument("--schedule", default="1f1b", choices=(*SCHEDULES, "auto"))
    plan.add_argument(
        "--precision",
        default="no",
        choices=("no", "bf16", "bf16_master"),
        help="training.mixed_precision: fp32; bf16 autocast over fp32 parameters; bf16 "
        "parameters with fp32 master weights in the optimizer (default: %(default)s)",
    )
    plan.add_argument(
        "--bf16", action="store_const", const="bf16", dest="precision", help="--precision bf16"
    )
    plan.add_argument(
        "--loss-chunk-tokens",
        default="auto",
        help="training.loss_chunk_tokens: tokens the LM head and loss take at a time (0: the "
        "whole microbatch's logits at once; default auto)",
    )
    _lora_arguments(plan)
    plan.add_argument("--memory-margin", type=float, default=0.1)
    plan.add_argument("--json", action="store_true", help="print plan.json's content instead")


def _lora_arguments(plan: Any) -> None:
    """`--lora-*`: plan a LoRA run (`planner.command._lora`)."""
    plan.add_argument(
        "--lora-r",
        type=int,
        help="plan a LoRA run: model.lora.r (lora_alpha twice it); without, full fine-tuning",
    )
    plan.add_argument(
        "--lora-targets",
        default="all-linear",
        help="with --lora-r: model.lora.target_modules, comma-separated or all-linear "
        "(default: %(default)s; on a mixture of experts PEFT's reading, with the routers "
        "and experts)",
    )
    plan.add_argument(
        "--lora-dropout",
        type=float,
        default=0.0,
        help="with --lora-r: model.lora.lora_dropout (default: %(default)s)",
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "dryrun":
        from meshtrain.dryrun.command import run_dryrun  # noqa: PLC0415

        return run_dryrun(args)
    if args.command == "plan":
        from meshtrain.planner.command import run_plan  # noqa: PLC0415  (torch; consolidate needs none)

        return run_plan(args)
    if args.command == "consolidate":
        try:
            max_shard_size = parse_size(args.max_shard_size)
        except ValueError as error:
            print(f"error: --max-shard-size: {error}", file=sys.stderr)
            return 1
        try:
            dtype = check_dtype(args.dtype)
        except ValueError as error:
            print(f"error: --dtype: {error}", file=sys.stderr)
            return 1
        try:
            summary = consolidate_anywhere(
                args.checkpoint,
                args.output_dir or _default_output(args.checkpoint),
                partial(_consolidate, args, max_shard_size=max_shard_size, dtype=dtype),
                parameter="checkpoint",
                keep_local=False,
            )
        except (CheckpointError, OSError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        print(json.dumps(summary, indent=2))
    return 0


def _default_output(checkpoint: str) -> str | Path:
    """Beside the checkpoint (a bucket's checkpoint: beside it in the bucket)."""
    if is_url(checkpoint):
        return join(find_checkpoint(checkpoint, "checkpoint"), DEFAULT_OUTPUT)
    return resolve_checkpoint(Path(checkpoint)) / DEFAULT_OUTPUT


def _consolidate(
    args: argparse.Namespace,
    checkpoint: str | Path,
    output_dir: str | Path,
    *,
    max_shard_size: int,
    dtype: Any,
):
    """A full model's folder, or a LoRA checkpoint's adapter folder (and merged model), of
    a local checkpoint."""
    from meshtrain.checkpoint.consolidate.lora import (  # noqa: PLC0415  (torch: LoRA only)
        consolidate_lora,
        is_lora_checkpoint,
    )

    if is_lora_checkpoint(checkpoint):
        return consolidate_lora(
            checkpoint,
            output_dir,
            merged_dir=args.merge_lora,
            base=args.base,
            dtype=dtype,
            max_shard_size=max_shard_size,
        )
    if args.merge_lora:
        raise CheckpointError("--merge-lora: the checkpoint holds a full model, not LoRA adapters")
    return consolidate_checkpoint(
        checkpoint,
        output_dir,
        verify=not args.no_verify,
        max_shard_size=max_shard_size,
        dtype=dtype,
    )
