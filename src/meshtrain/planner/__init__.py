"""Planning: resolve the parallel layout, refuse impossible ones, estimate memory."""

from meshtrain.planner.search import plan_run
from meshtrain.planner.types import LayoutError, Plan, Refusal

__all__ = ["LayoutError", "Plan", "Refusal", "plan_run"]
