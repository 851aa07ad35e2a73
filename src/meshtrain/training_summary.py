"""The training summary: what a training run hands to the nodes after it (consolidation,
evaluation) and to the MLflow hook, typed.

Rank 0 of the trainer returns it as a dict (`Trainer.summary` and the peak memory per
rank, `run_name` added by the launcher); the training node saves it as
`training_summary.json`. Later nodes read the fields below by name instead of indexing
the dict; every entry the trainer wrote is kept, in its order, so `to_dict()` gives the
same JSON back, byte for byte.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TrainingSummary:
    """The fields of a training summary that later nodes read; None where the summary has
    none (one written by hand, or by an older meshtrain)."""

    final_checkpoint: str | None = None
    layout_name: str | None = None
    steps: int | None = None
    initial_val_loss: float | None = None
    final_val_loss: float | None = None
    mean_tokens_per_s: float | None = None
    mean_mfu: float | None = None
    train_time_s: float | None = None
    # Where and in what precision it trained: evaluation loads the model the same way.
    backend: str | None = None
    mixed_precision: str | None = None
    # The model converters the run applied (models/converters.py), e.g. ["lora"].
    converters: list[str] = field(default_factory=list)
    # Every entry as the trainer wrote it, in its order (the fields above included).
    entries: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainingSummary:
        names = [f.name for f in dataclasses.fields(cls) if f.name != "entries"]
        typed = {name: values[name] for name in names if name in values}
        typed = {name: value for name, value in typed.items() if value is not None}
        return cls(**typed, entries=dict(values))

    def to_dict(self) -> dict[str, Any]:
        """The summary as the trainer wrote it (the typed fields' values where they
        differ), for `training_summary.json`."""
        values = dict(self.entries)
        for f in dataclasses.fields(self):
            if f.name == "entries":
                continue
            value = getattr(self, f.name)
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            if f.name in values and values[f.name] is None and value == default:
                continue  # written as null, read as the default
            if f.name in values or value != default:
                values[f.name] = value
        return values
