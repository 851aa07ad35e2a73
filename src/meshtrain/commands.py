"""`python -m meshtrain ...`: engine commands that need no Kedro project.

(Not named `cli.py`: Kedro would load that module as the project's own `kedro` commands.)

    python -m meshtrain consolidate CHECKPOINT_DIR [OUTPUT_DIR] [--max-shard-size 5GB]
        [--no-verify]
    python -m meshtrain plan --model CONFIG_JSON --devices N --device trn1 [--seq-len 4096]
        [--global-batch 256] [--tp/--pp/--dp SIZE] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshtrain.checkpoint import CheckpointError, consolidate_checkpoint, resolve_checkpoint
from meshtrain.checkpoint.consolidate import parse_size
from meshtrain.planner import command as plan_command

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
        "complete checkpoint)",
    )
    consolidate.add_argument(
        "output_dir",
        metavar="OUTPUT_DIR",
        nargs="?",
        help="where to write the Hugging Face model; it is replaced if it exists "
        f"(default: {DEFAULT_OUTPUT}/ inside the resolved checkpoint folder, "
        f"e.g. run/checkpoint-100/{DEFAULT_OUTPUT})",
    )
    consolidate.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest weight file, in bytes or with a unit: 500MB, 5GB (decimal) or 2GiB "
        "(binary); past it the weights are split into model-0000i-of-0000N.safetensors "
        "files with an index (default: %(default)s)",
    )
    consolidate.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the sha256 check of every file (sizes are still checked); the check "
        "runs alongside the copy and costs a read of the checkpoint",
    )
    plan_command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "plan":
        return plan_command.run_plan(args)
    if args.command == "consolidate":
        try:
            max_shard_size = parse_size(args.max_shard_size)
        except ValueError as error:
            print(f"error: --max-shard-size: {error}", file=sys.stderr)
            return 1
        try:
            output_dir = args.output_dir
            if output_dir is None:
                output_dir = resolve_checkpoint(Path(args.checkpoint)) / DEFAULT_OUTPUT
            summary = consolidate_checkpoint(
                args.checkpoint,
                output_dir,
                verify=not args.no_verify,
                max_shard_size=max_shard_size,
            )
        except (CheckpointError, OSError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        print(json.dumps(summary, indent=2))
    return 0
