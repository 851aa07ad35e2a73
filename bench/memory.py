"""Memory per rank beside the planner, one real run per side: precisions, sharding and
start-up (docs/benchmarks.md has each group's figures and what they say).

Each side is meshtrain's own worker in its own spawned group, in turn: model states
counted from the rank's tensors beside the planner's, the step's peak of live tensors
beside the predicted one, the peak resident set at start-up and over the run beside the
planner's `process_total`, tokens/s and the last loss; a side named `X-again` is `X`
once more, the A/A control. Nothing is asserted.

    .venv/bin/python bench/memory.py precision   # 27M dp2 ZeRO-1, fp32/bf16/bf16_master
    .venv/bin/python bench/memory.py sharding    # 27M plain dp, ZeRO-1, FSDP2 at dp2/dp4
    .venv/bin/python bench/memory.py startup     # 428M tp4 x pp2, random and init_from
    .venv/bin/python bench/memory.py startup --small --sides random   # the smoke run
    .venv/bin/python bench/memory.py experts     # 103M MoE (8 experts, top 2), ep4 and ep2 vs ep1
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench_runs import SHAPE_27M, planned_side, print_side_table, run_side, token_blocks

from meshtrain.models import build_model, build_model_config

ZERO1 = {"data_parallel_size": 2, "zero_1": True}
SDP = "sharded_data_parallel_degree"
# The 428M-parameter Llama of issue #14; `--small` shrinks it to start in seconds.
STARTUP = {
    "hidden_size": 1536,
    "intermediate_size": 4096,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "max_position_embeddings": 512,
}
SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4}
TP4_PP2 = {"tensor_parallel_size": 4, "pipeline_parallel_size": 2}


def _precision(name: str) -> tuple[int, dict, dict]:
    return 2, ZERO1, {"per_device_train_batch_size": 4, "mixed_precision": name}


# A Qwen3-MoE of 103M parameters (8 experts, top 2, in each of 6 layers: 94M of experts;
# 33M active a token), for expert parallelism at dp4.
EXPERTS = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "moe_intermediate_size": 1280,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 512,
}


def _experts(ep: int) -> tuple[int, dict, dict]:
    return 4, {"data_parallel_size": 4, "expert_parallel_size": ep}, {"architecture": "qwen3_moe"}


# group: model fields, vocab, block, steps, {side: (world, parallel, training)}, the sides
# run by default, and the (side, against) pairs whose ratios are printed.
GROUPS = {
    "precision": (
        SHAPE_27M,
        4096,
        256,
        6,
        {name: _precision(name) for name in ("no", "bf16", "bf16_master")}
        | {"no-again": _precision("no")},
        "no,bf16,bf16_master,no-again",
        [("bf16", "no"), ("bf16_master", "no")],
    ),
    "sharding": (
        SHAPE_27M,
        4096,
        256,
        8,
        {
            "dp2-zero1": (2, ZERO1, {"per_device_train_batch_size": 4}),
            "dp4-plain": (4, {"data_parallel_size": 4, "zero_1": False}, {}),
            "dp4-zero1": (4, {"data_parallel_size": 4, "zero_1": True}, {}),
            "dp4-sdp2": (4, {"data_parallel_size": 4, SDP: 2}, {}),
            "dp4-sdp4": (4, {"data_parallel_size": 4, SDP: 4}, {}),
            "dp2-sdp2": (2, {"data_parallel_size": 2, SDP: 2}, {"per_device_train_batch_size": 4}),
            "dp2-zero1-again": (2, ZERO1, {"per_device_train_batch_size": 4}),
            # Sharding under a pipeline (each stage kept gathered through the step).
            "dp2-pp2-sdp2": (4, {"data_parallel_size": 2, "pipeline_parallel_size": 2, SDP: 2}, {}),
        },
        "dp2-zero1,dp4-plain,dp4-zero1,dp4-sdp2,dp4-sdp4,dp2-sdp2,dp2-zero1-again",
        [("dp4-sdp4", "dp4-zero1"), ("dp4-sdp4", "dp4-plain"), ("dp2-sdp2", "dp2-zero1")],
    ),
    "startup": (
        STARTUP,
        4096,
        256,
        2,
        {"random": (8, TP4_PP2, {}), "init_from": (8, TP4_PP2, {"init_from": True})},
        "random,init_from",
        [("init_from", "random")],
    ),
    "experts": (
        EXPERTS,
        4096,
        256,
        6,
        {"ep1": _experts(1), "ep2": _experts(2), "ep4": _experts(4), "ep1-again": _experts(1)},
        "ep1,ep4,ep2,ep1-again",
        [("ep4", "ep1"), ("ep2", "ep1")],
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("group", choices=GROUPS)
    parser.add_argument("--steps", type=int, help="default: the group's")
    parser.add_argument("--sides", help="comma-separated, from the group's (default: its own)")
    parser.add_argument("--small", action="store_true", help="startup: hidden 256, 4 layers")
    args = parser.parse_args()
    shape, vocab, block, steps, sides, default, pairs = GROUPS[args.group]
    shape = {**shape, **SMALL} if args.small else shape
    steps = args.steps or steps
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        blocks = token_blocks(root / "blocks", 8 * (steps + 2) + 8, vocab, block)
        for name in (args.sides or default).split(","):
            world, parallel, training = sides[name]
            training = {"per_device_train_batch_size": 2, "max_steps": steps, **training}
            architecture = training.pop("architecture", "llama")
            init_from = None
            if training.pop("init_from", False):
                init_from = str(root / "pretrained")  # the same model in several files
                config = build_model_config("llama", shape, vocab_size=vocab)
                build_model(config, seed=1).save_pretrained(init_from, max_shard_size="200MB")
            spec, plan = planned_side(
                blocks,
                root,
                name,
                world=world,
                parallel=parallel,
                training=training,
                shape=shape,
                vocab=vocab,
                block=block,
                init_from=init_from,
                architecture=architecture,
            )
            rows.append((name, run_side(spec, world, root, name), plan))
    report(rows, pairs)


def report(rows: list, pairs: list[tuple[str, str]]) -> None:
    """The table, each A/A ratio, and each pair's ratios."""
    table = print_side_table(rows)
    for name in table:
        if name.endswith("-again") and name.removesuffix("-again") in table:
            first = table[name.removesuffix("-again")]
            print(f"A/A control, {name} / first tokens/s: {table[name][3] / first[3]:.3f}")
    for side, against in pairs:
        if side in table and against in table:
            both = zip(table[side], table[against], strict=True)
            ratios = [a / b if a and b else float("nan") for a, b in both]
            print(
                f"{side} / {against}: model states {ratios[0]:.3f}, step peak {ratios[1]:.3f}, "
                f"run RSS {ratios[2]:.3f}, tokens/s {ratios[3]:.3f}"
            )


if __name__ == "__main__":
    main()
