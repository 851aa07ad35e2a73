"""The chunked loss on the layouts that change it, each equal to one process over the whole
logits (fp32, 12 steps, weights after): the vocabulary-parallel loss under tp2 with
sequence parallelism (tied and untied), the last stage of pp2 with tied embeddings, and
packed fine-tuning blocks whose masks leave most tokens untrained on dp2; beside them the
same layouts over the whole logits (`loss_chunk_tokens: 0`). One spawned group of two."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY_MODEL
from tests.distributed.packed import packed_reference_run
from tests.distributed.reference import (
    References,
    assert_matches_reference,
    assert_memory_model_holds,
    make_spec,
    run_group,
)

STEPS = 12
TIED = {**TINY_MODEL, "tie_word_embeddings": True}
# Microbatches of 64 to 256 tokens: two to six chunks, the last one short.
CHUNKED = {"loss_chunk_tokens": 48, "max_steps": STEPS}
WHOLE = {"loss_chunk_tokens": 0, "max_steps": STEPS}
TP2_SP = {"tensor_parallel_size": 2, "sequence_parallel": True}
PP2 = {"pipeline_parallel_size": 2, "pipeline_parallel_num_microbatches": 4}

# name: (parallel, training, model fields) on the token blocks
CASES = {
    "tp2-sp-chunked": (TP2_SP, CHUNKED, TINY_MODEL),
    "tied-tp2-sp-chunked": (TP2_SP, CHUNKED, TIED),
    "tp2-whole": ({"tensor_parallel_size": 2}, WHOLE, TINY_MODEL),
    "tied-pp2-1f1b-chunked": ({**PP2, "pipeline_schedule": "1f1b"}, CHUNKED, TIED),
    "tied-pp2-gpipe-whole": ({**PP2, "pipeline_schedule": "gpipe"}, WHOLE, TIED),
}
# On the packed fine-tuning blocks (completion-only masks, padded tails).
PACKED = {"sft-dp2-chunked": ({}, {**CHUNKED, "per_device_train_batch_size": 4}, TINY_MODEL)}


def _specs(blocks, cases: dict, out: Path) -> list:
    return [
        make_spec(
            blocks,
            out,
            name,
            world=2,
            parallel=parallel,
            training=training,
            architecture="llama",
            fields=fields,
        )
        for name, (parallel, training, fields) in cases.items()
    ]


@pytest.mark.slow
def test_chunked_loss_on_two_ranks_matches_one_process_over_the_whole_logits(
    tiny_blocks, packed_blocks, tmp_path: Path
):
    specs = _specs(tiny_blocks, CASES, tmp_path) + _specs(packed_blocks, PACKED, tmp_path)
    for name, spec in zip([*CASES, *PACKED], specs, strict=True):
        assert spec.plan["layout"]["loss_chunk_tokens"] == (48 if "chunked" in name else 0)
    summaries = dict(zip([*CASES, *PACKED], run_group(specs, 2, tmp_path, "t-chunk2"), strict=True))
    for name, summary in summaries.items():
        assert_memory_model_holds(name, summary)
    references = References(tiny_blocks, STEPS)
    for name, (_, _, fields) in CASES.items():
        losses, weights = references("llama", fields)
        assert_matches_reference(name, summaries[name], losses, weights, tmp_path / f"{name}-hf")
    losses, weights = packed_reference_run(packed_blocks, TINY_MODEL, STEPS)
    name = "sft-dp2-chunked"
    assert_matches_reference(name, summaries[name], losses, weights, tmp_path / f"{name}-hf")
