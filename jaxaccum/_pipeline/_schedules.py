"""The one place a ``schedule=`` string becomes its class: adding a schedule
is adding its class (a :class:`~jaxaccum._pipeline._schedule.Schedule`) to
SCHEDULES."""

from typing import Any

from jaxaccum._pipeline._1f1b import OneFOneB
from jaxaccum._pipeline._gpipe import GPipe
from jaxaccum._pipeline._interleaved import Interleaved
from jaxaccum._pipeline._schedule import Schedule
from jaxaccum._pipeline._spec import PipelineWindow
from jaxaccum._pipeline._v_shape import VHalf, VShape
from jaxaccum._pipeline._zero_bubble import ZeroBubble
from jaxaccum._types import SCHEDULES as SCHEDULE_NAMES

SCHEDULES: dict[str, type[Schedule]] = {
    cls.name: cls for cls in (GPipe, OneFOneB, ZeroBubble, VShape, VHalf)
}
assert tuple(SCHEDULES) == SCHEDULE_NAMES, "ScheduleName lists these"


def schedule_type(name: str, repeats: int) -> type[Schedule]:
    """The class of ``schedule=name`` (``"1f1b"`` with ``repeats > 1`` is
    :class:`~jaxaccum._pipeline._interleaved.Interleaved`), refusing a name
    it does not know and a ``repeats`` it is not built for, each saying
    why."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}, got {name!r}.")
    cls = SCHEDULES[name]
    if cls is OneFOneB and repeats > 1:
        return Interleaved  # interleaved 1F1B: "1f1b" with R stages a device
    cls.check_repeats(repeats)
    return cls


def builds(name: str, repeats: int) -> bool:
    """Whether ``schedule=name`` is built for ``repeats``."""
    try:
        schedule_type(name, repeats)
    except ValueError:
        return False
    return True


def schedule_on(mesh: Any, options: PipelineWindow) -> Schedule:
    """The window's schedule on ``mesh`` (``options.num_microbatches`` set)."""
    layout = options.layout
    num = options.num_microbatches
    assert num is not None, "the step resolves microbatch_size to M first"
    cls = schedule_type(layout.schedule, layout.repeats)
    return cls.for_window(
        mesh.shape[layout.stage_axis], num, layout.repeats, options.remat
    )
