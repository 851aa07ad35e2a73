"""The training summary later nodes read: typed, and written back as the same JSON."""

from __future__ import annotations

import json

from meshtrain.training_summary import TrainingSummary

# As rank 0 returns it (Trainer.summary, the peaks, the launcher's run_name), in its order.
WRITTEN = {
    "run_dir": "data/06_models/checkpoints/dp2-tp1-pp1",
    "final_checkpoint": "data/06_models/checkpoints/dp2-tp1-pp1/checkpoint-8",
    "layout_name": "dp2-tp1-pp1",
    "steps": 8,
    "losses": [[1, 6.9], [2, 6.5]],
    "final_loss": 6.5,
    "initial_val_loss": 7.0,
    "final_val_loss": None,
    "mean_tokens_per_s": 1234.5,
    "mean_mfu": None,
    "median_step_s": 0.2,
    "converters": [],
    "backend": "gloo",
    "mixed_precision": "no",
    "train_time_s": 3.5,
    "peak_rss_mb_rank0": 900.0,
    "measured_peak_memory": {"rank0": 1},
    "run_name": "dp2-tp1-pp1",
}


def test_the_summary_reads_typed_and_writes_the_same_json():
    summary = TrainingSummary.from_dict(json.loads(json.dumps(WRITTEN)))
    assert summary.layout_name == "dp2-tp1-pp1" and summary.steps == 8
    assert summary.final_val_loss is None and summary.converters == []
    assert json.dumps(summary.to_dict(), indent=2) == json.dumps(WRITTEN, indent=2)


def test_a_partial_summary_reads_none_and_writes_nothing_more():
    summary = TrainingSummary.from_dict({"final_checkpoint": "c"})
    assert summary.layout_name is None and summary.converters == []
    assert summary.to_dict() == {"final_checkpoint": "c"}
    assert TrainingSummary.from_dict({"converters": None}).to_dict() == {"converters": None}
