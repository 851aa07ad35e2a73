"""The planner's parallelism axes, one module each, behind `axes.base.Axis`.

`AXES` is the registry the planner loops over (in the order their refusals are
reported); a new axis is a module with an `AXIS` and one line here.
"""

import math

from meshtrain.planner.axes import context, data, expert, pipeline, sharding, tensor
from meshtrain.planner.axes.base import Axis, AxisChecks
from meshtrain.planner.parameters import Share
from meshtrain.planner.shapes import ModelShape, StepShape

# Expert parallelism before the pipeline: its all-to-alls run inside each microbatch, so
# they count in the busiest rank's microbatch that the bubble scales.
AXES: tuple[Axis, ...] = (tensor.AXIS, expert.AXIS, pipeline.AXIS, context.AXIS, data.AXIS)

# The order of the axes' lines in `python -m meshtrain plan`'s description.
DESCRIBE: tuple[Axis, ...] = (tensor.AXIS, pipeline.AXIS, data.AXIS, context.AXIS, expert.AXIS)

# The order of the axes' seconds in the description's step line (between compute and
# the optimizer).
STEP_LINE: tuple[Axis, ...] = (
    tensor.AXIS,
    context.AXIS,
    expert.AXIS,
    pipeline.AXIS,
    data.AXIS,
)

# The search's preference among layouts as fast, in order (each degree is paid only where
# it buys something): how to read the degree from a layout, the words, the short name.
TIE_BREAK = (
    (context.AXIS.degree, "less context parallelism", "cp"),
    (tensor.AXIS.degree, "less tensor parallelism", "tp"),
    (pipeline.AXIS.degree, "less pipeline parallelism", "pp"),
    (expert.AXIS.degree, "less expert parallelism", "ep"),
    (sharding.sharding_degree, "less sharding (paid only when it buys memory)", "sdp"),
)


def local_share(m: ModelShape, step: StepShape) -> Share:
    """A parameter's elements on one rank: each axis keeps its share of what is left."""

    def share(name: str, shape: tuple[int, ...]) -> int:
        numel = math.prod(shape)
        for axis in AXES:
            numel = axis.local_numel(name, numel, m, step)
        return numel

    return share


__all__ = ["AXES", "DESCRIBE", "STEP_LINE", "TIE_BREAK", "Axis", "AxisChecks", "local_share"]
