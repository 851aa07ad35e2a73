"""Planning: resolve the parallel layout, refuse impossible ones, estimate memory."""

from meshtrain.planner.layout import Layout, LayoutError, Plan, Refusal, plan_run

__all__ = ["Layout", "LayoutError", "Plan", "Refusal", "plan_run"]
