"""The model shapes `bench/throughput.py` measures, their run defaults and targets, and the
model FLOPs per token its "MFU" columns count. Not a benchmark itself.
"""

from __future__ import annotations

import argparse
from typing import Any

from transformers import PretrainedConfig

from meshtrain.planner import flops
from meshtrain.planner.shapes import ModelShape

# The model and batch of each preset, then what a run at it defaults to when the flags
# are not given: timed steps, warm-up steps, repeats, threads per process ("auto": the
# node's cores split between its processes, as a user would run), the extra world-2
# layouts, the A/A control side, and meshtrain with the reduction after the backward.
SHAPE_FIELDS = ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab", "block", "batch")
RUN_FIELDS = ("steps", "warmup", "repeats", "threads", "layouts", "control", "after")
SHAPES: dict[str, dict[str, Any]] = {
    "default": {
        **dict(zip(SHAPE_FIELDS, (128, 352, 4, 4, 2, 4096, 128, 8), strict=True)),
        **dict(zip(RUN_FIELDS, (20, 5, 2, "1", "", False, True), strict=True)),
    },
    "27m": {
        **dict(zip(SHAPE_FIELDS, (512, 1344, 8, 8, 4, 4096, 256, 4), strict=True)),
        **dict(zip(RUN_FIELDS, (8, 2, 3, "auto", "tp2,pp2", True, False), strict=True)),
    },
    "110m": {
        **dict(zip(SHAPE_FIELDS, (768, 3072, 12, 12, 4, 4096, 512, 2), strict=True)),
        **dict(zip(RUN_FIELDS, (4, 2, 3, "auto", "tp2,pp2", True, False), strict=True)),
    },
}
# The extra world-2 layouts `--layouts` names: parallel.* overrides (dp is what is left).
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {
        "pipeline_parallel_size": 2,
        "pipeline_schedule": "1f1b",
        "pipeline_parallel_num_microbatches": 4,
    },
}


def hf_fields(shape: dict[str, Any]) -> dict[str, Any]:
    """The Llama config fields of a shape (a SHAPES preset, or flags with their names), as
    `build_model_config` takes them (the vocabulary, blocks and batch stay apart)."""
    return {
        "hidden_size": shape["hidden"],
        "intermediate_size": shape["intermediate"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "max_position_embeddings": max(512, shape["block"]),
    }


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """`--shape`, its model flags and run flags; each left unset takes the preset's value
    (`apply_shape`). `--threads auto`: the cores split between the ranks; `--layouts`:
    extra meshtrain layouts at world 2 (LAYOUTS, or none); `--control`: meshtrain once
    more, the A/A side; `--after`: at world 2, the reduction after the backward."""
    parser.add_argument("--shape", choices=sorted(SHAPES), default="default")
    for name in (*SHAPE_FIELDS, "steps", "warmup", "repeats"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, help="default: --shape's")
    for name in ("threads", "layouts"):
        parser.add_argument(f"--{name}", help="default: --shape's")
    for name in ("control", "after"):
        parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction)


def apply_shape(args: argparse.Namespace) -> argparse.Namespace:
    """Fill every flag left at None from the preset of `args.shape`."""
    preset = SHAPES[args.shape]
    for name in (*SHAPE_FIELDS, *RUN_FIELDS):
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    return args


def model_flops_per_token(config: PretrainedConfig, seq: int) -> int:
    """Issue #19's model FLOPs per trained token, as every training run counts them for
    its `mfu` metric (`meshtrain.planner.flops.model_flops_per_token`): 6 x the matmul
    weights (the untied LM head counts, the input embedding not) + 12 x layers x
    attention width x sequence."""
    return int(flops.model_flops_per_token(ModelShape.from_config(config), seq))
