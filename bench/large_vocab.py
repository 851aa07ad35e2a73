"""The loss over large vocabularies: chunked (`training.loss_chunk_tokens: auto`) against the
whole logits (0), at 32k and 128k tokens of vocabulary, one invocation.

The 27M shape (bench/shapes.py) with blocks of 1,024 tokens and a batch of 4 in one
process (fp32, the node's threads), each side meshtrain's own worker in its own spawned
group: the step's peak of live tensors and the run's peak RSS beside the planner's,
tokens/s, the last loss. `whole-128k-again` repeats `whole-128k` (the A/A control). Then
per vocabulary: chunked / whole tokens/s, the measured fall of the step peak beside the
planner's fall of its loss term, and that fall in fp32 logits tensors. Nothing is asserted.

    .venv/bin/python bench/large_vocab.py              # ~15 min on 2 cores
    .venv/bin/python bench/large_vocab.py --steps 3 --vocabs 32000   # shorter
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench_runs import MIB, SHAPE_27M, planned_side, print_side_table, run_side, token_blocks

BLOCK, BATCH = 1024, 4
HOST_GIB = 20.0
SIDES = {"whole": 0, "chunked": "auto"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="steps per side (the first untimed)")
    parser.add_argument("--vocabs", default="32000,128256", help="comma-separated sizes")
    args = parser.parse_args()
    rows, plans = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for vocab in (int(v) for v in args.vocabs.split(",")):
            blocks = token_blocks(root / f"blocks-{vocab}", BATCH * (args.steps + 1), vocab, BLOCK)
            names = (
                [*SIDES, "whole-again"] if vocab == max(map(int, args.vocabs.split(","))) else SIDES
            )
            for side in names:
                name = f"{side.replace('-again', '')}-{vocab // 1000}k" + (
                    "-again" if side.endswith("-again") else ""
                )
                chunk = SIDES[side.removesuffix("-again")]
                spec, plan = planned_side(
                    blocks,
                    root,
                    name,
                    world=1,
                    parallel={},
                    training={
                        "per_device_train_batch_size": BATCH,
                        "max_steps": args.steps,
                        "loss_chunk_tokens": chunk,
                    },
                    shape={**SHAPE_27M, "max_position_embeddings": BLOCK},
                    vocab=vocab,
                    block=BLOCK,
                    # One rank on the whole host: the whole logits at 128k need ~10 GiB.
                    planner={"device_profiles": {"cpu": {"memory_gib": HOST_GIB}}},
                )
                rows.append((name, run_side(spec, 1, root, name), plan))
                plans[name] = plan
    report(rows, plans)


def report(rows: list, plans: dict) -> None:
    table = print_side_table(rows)
    for name, row in table.items():
        if name.endswith("-again"):
            print(f"A/A control, {name} / first tokens/s: {row[3] / table[name[:-6]][3]:.3f}")
    for name in table:
        if not name.startswith("chunked-"):
            continue
        whole = name.replace("chunked", "whole")
        vocab, tokens = plans[name].model_config["vocab_size"], BATCH * BLOCK
        measured = table[whole][1] - table[name][1]
        predicted = (
            plans[whole].memory_estimate_per_rank["loss"]
            - plans[name].memory_estimate_per_rank["loss"]
        )
        logits = tokens * vocab * 4
        print(
            f"{name} / {whole}: tokens/s {table[name][3] / table[whole][3]:.3f}; step peak "
            f"{table[name][1] / MIB:,.0f} vs {table[whole][1] / MIB:,.0f} MiB, down "
            f"{measured / MIB:,.0f} MiB = {measured / logits:.2f} fp32 logits tensors "
            f"(planner: {predicted / MIB:,.0f} MiB, {predicted / measured:.3f}x); chunk "
            f"{plans[name].layout.loss_chunk_tokens:,} tokens"
        )


if __name__ == "__main__":
    main()
