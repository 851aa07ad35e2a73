"""The planner's parallelism axes, one module each, behind `axes.base.Axis`.

`AXES` is the registry the planner loops over (in the order their refusals are
reported); a new axis is a module with an `AXIS` and one line here.
"""

from meshtrain.planner.axes import context, data, pipeline, tensor
from meshtrain.planner.axes.base import Axis, AxisChecks

AXES: tuple[Axis, ...] = (tensor.AXIS, pipeline.AXIS, context.AXIS, data.AXIS)

__all__ = ["AXES", "Axis", "AxisChecks"]
