"""Planning: resolve the parallel layout, refuse impossible ones, estimate memory."""

from meshtrain.planner.layout import LayoutError, Plan, Refusal, plan_run

__all__ = ["LayoutError", "Plan", "Refusal", "plan_run"]
