"""One layout the search weighs, with every `auto` resolved: integers and choices only.

The search (`planner.options`) reads `auto` and makes candidates; everything after it
(plan one layout, memory, time, the explanation) reads only these, and asks
`chosen_by_search` where its words must say that a value was `auto`.

A candidate names no axis: each axis (`planner.axes`) finds its degree under its short
name in `degrees` and its own options under their `parallel.*` names in `choices`, so a
new axis adds entries here, not fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Candidate:
    """The degrees and choices of one layout, as the axes check and estimate them."""

    # Each axis's degree by its short name ("dp", "tp", ...); an axis absent is 1.
    # dp at `auto` is the rest of the world (or 1 where none fits).
    degrees: Mapping[str, int]
    # The axes' own options by their `parallel.*` names (ZeRO-1, sequence parallelism,
    # the pipeline's microbatches per schedule step), as asked or chosen at `auto`.
    choices: Mapping[str, Any]
    activation_checkpointing: str
    loss_chunk_tokens: int  # 0: the loss over the whole logits
    # The knobs that were `auto` in the layout planned (degrees by short name, choices by
    # parameter name), for refusals and notes that say so.
    chosen_by_search: frozenset[str] = field(default_factory=frozenset)

    def degree(self, short: str) -> int:
        return self.degrees.get(short, 1)

    def choice(self, name: str) -> Any:
        return self.choices[name]

    def chosen(self, knob: str) -> bool:
        """Whether `knob` was `auto` here (the search, not the run, set it)."""
        return knob in self.chosen_by_search

    def with_choice(self, name: str, value: Any) -> Candidate:
        """This layout with one option set by an axis (no longer the search's `auto`)."""
        return dataclasses.replace(
            self,
            choices={**self.choices, name: value},
            chosen_by_search=self.chosen_by_search - {name},
        )

    # The degrees the composing modules (`planner.layout`, the axes' cross terms) read.
    @property
    def dp(self) -> int:
        return self.degree("dp")

    @property
    def tp(self) -> int:
        return self.degree("tp")

    @property
    def pp(self) -> int:
        return self.degree("pp")

    @property
    def cp(self) -> int:
        return self.degree("cp")

    @property
    def sdp(self) -> int:
        return self.degree("sdp")
