"""One layout the search weighs, with every `auto` resolved: integers and choices only.

The search (`planner.options`) reads `auto` and makes candidates; everything after it
(plan one layout, memory, time, the explanation) reads only these fields, and asks
`chosen_by_search` where its words must say that a value was `auto`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Candidate:
    """The degrees and choices of one layout, as the axes check and estimate them."""

    dp: int  # data parallel ranks (at `auto`: the rest of the world, or 1 where none fits)
    tp: int  # tensor parallel ranks
    pp: int  # pipeline stages' ranks
    cp: int  # context parallel ranks
    sdp: int  # sharded data parallel degree (1: off)
    zero_1: bool
    sp: bool  # sequence parallelism
    activation_checkpointing: str
    microbatches: int  # per pipeline schedule step, as asked (or chosen at `auto`)
    loss_chunk_tokens: int  # 0: the loss over the whole logits
    # The knobs that were `auto` in the layout planned (dp, tp, pp, cp, sdp, zero_1, sp,
    # microbatches), for refusals and notes that say so.
    chosen_by_search: frozenset[str] = field(default_factory=frozenset)

    def chosen(self, knob: str) -> bool:
        """Whether `knob` was `auto` here (the search, not the run, set it)."""
        return knob in self.chosen_by_search
