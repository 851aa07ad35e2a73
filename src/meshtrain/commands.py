"""`python -m meshtrain ...`: engine commands that need no Kedro project.

(Not named `cli.py`: Kedro would load that module as the project's own `kedro` commands.)

    python -m meshtrain consolidate CHECKPOINT_DIR OUTPUT_DIR
"""

from __future__ import annotations

import argparse
import json
import sys

from meshtrain.checkpoint import CheckpointError, consolidate_checkpoint


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m meshtrain", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    consolidate = commands.add_parser(
        "consolidate",
        help="merge a sharded checkpoint into a Hugging Face model folder",
        description="Merge a sharded meshtrain checkpoint into a folder that "
        "transformers.AutoModelForCausalLM.from_pretrained loads.",
    )
    consolidate.add_argument(
        "checkpoint",
        help="a checkpoint-<step> folder, its shards/ folder, or a run folder (its latest)",
    )
    consolidate.add_argument("output_dir", help="where to write the Hugging Face model")
    consolidate.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the sha256 check of every file (sizes are still checked)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "consolidate":
        try:
            summary = consolidate_checkpoint(
                args.checkpoint, args.output_dir, verify=not args.no_verify
            )
        except CheckpointError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        print(json.dumps(summary, indent=2))
    return 0
