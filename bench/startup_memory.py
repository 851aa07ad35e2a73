"""Peak resident memory per rank at start-up and over a short run, from the seeded init
and from `init_from` a checkpoint in several safetensors files, beside the planner.

The 428M-parameter Llama of issue #14 (hidden 1536, 16 layers, 16 heads, 8 KV heads,
intermediate 4096, vocab 4096) on 8 ranks, tp 4 x pp 2, sequence 256, trained by
meshtrain's own worker: the model is built on the meta device and each rank allocates
and fills only its own shards. Each rank's peak resident set is the kernel's (VmHWM),
after the model and optimizer are built and at the end of the run; the planner's
per-rank `process_total` stands beside it. (The side that built the whole model on
every rank first, as meshtrain did before, was measured and dropped with it: its
figures are in docs/benchmarks.md.)

    .venv/bin/python bench/startup_memory.py [--steps 2] [--no-init-from] [--small]

Prints a table; asserts nothing. About 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench_runs import MIB, planned_side, run_side, token_blocks  # (bench/bench_runs.py)

from meshtrain.models import build_model, build_model_config

SHAPE = {
    "hidden_size": 1536,
    "intermediate_size": 4096,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "max_position_embeddings": 512,
}
# `--small`: the same layout on a model that starts in seconds (the smoke run).
SMALL = {**SHAPE, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4}
VOCAB, BLOCK, WORLD = 4096, 256, 8
PARALLEL = {"tensor_parallel_size": 4, "pipeline_parallel_size": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--no-init-from", action="store_true", help="random init only")
    parser.add_argument("--small", action="store_true", help="hidden 256, 4 layers")
    args = parser.parse_args()
    shape = SMALL if args.small else SHAPE
    print(f"{'side':<16}{'start-up peak MiB':>20}{'run peak MiB':>16}{'planner MiB':>14}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        blocks = token_blocks(root / "blocks", 2 * (args.steps + 2) + 4, VOCAB, BLOCK)
        sources: list[str | None] = [None]
        if not args.no_init_from:
            folder = root / "pretrained"
            config = build_model_config("llama", shape, vocab_size=VOCAB)
            build_model(config, seed=1).save_pretrained(folder, max_shard_size="200MB")
            sources.append(str(folder))
        for source in sources:
            name = "meta, init_from" if source else "meta, random"
            spec, plan = planned_side(
                blocks,
                root,
                name.replace(", ", "-"),
                world=WORLD,
                parallel=PARALLEL,
                training={"per_device_train_batch_size": 2, "max_steps": args.steps},
                shape=shape,
                vocab=VOCAB,
                block=BLOCK,
                init_from=source,
            )
            summary = run_side(spec, WORLD, root, name.replace(", ", "-"))
            run = summary["peak_rss_mb_per_rank"]
            predicted = plan.memory_estimate_per_rank["process_total"] / MIB
            print(
                f"{name:<16}{max(summary['startup_peak_rss_mb_per_rank']):>20,.0f}"
                f"{max(run):>16,.0f}{predicted:>14,.0f}   measured / planner "
                f"{max(run) / predicted:.2f}; per rank {[round(x) for x in run]}"
            )


if __name__ == "__main__":
    main()
