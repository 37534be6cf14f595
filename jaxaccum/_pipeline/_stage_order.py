"""The stacked stages' two orders. In model order row ``i`` is model stage
``i``; in device order row ``d R + r`` is the ``r``-th stage device ``d``
runs, so that the stage axis's even split gives each device its own stages
and a step with ``R > 1`` moves no parameter (``_run.Run.laid_out``: a
reshape and a transpose that XLA keeps local)."""

import numpy as np

from jaxaccum._pipeline._schedules import schedule_type
from jaxaccum._types import ScheduleName


def pipeline_stage_order(
    num_stages: int, repeats: int = 1, schedule: ScheduleName = "gpipe"
) -> np.ndarray:
    """The device order of ``schedule``'s ``S R`` stages: row ``d R + r`` of
    the device-ordered stack is model stage ``order[d R + r]``, the
    ``r``-th stage device ``d`` runs (``r S + d``; the V schedules: ``d``,
    then ``2 S - 1 - d``).

    Stack once in device order, ``jax.tree.map(lambda p: p[order],
    stages)``, and pass ``stage_order="device"`` to
    :func:`jaxaccum.pipeline_value_and_grad`: its gradients come back in
    the same order, so the optimizer updates in place; ``p[np.argsort(order)]``
    is model order again (a checkpoint's, another schedule's).

    Args:
      num_stages: ``S``, the size of the stage axis.
      repeats: ``R``, stages per device.
      schedule: a :data:`jaxaccum.ScheduleName` built for ``repeats``.

    Returns:
      ``(S R,)`` int array, a permutation of ``range(S R)``.

    Examples:
      >>> import jaxaccum
      >>> jaxaccum.pipeline_stage_order(4, 2, "1f1b").tolist()
      [0, 4, 1, 5, 2, 6, 3, 7]
      >>> jaxaccum.pipeline_stage_order(4, 2, "v-half").tolist()
      [0, 7, 1, 6, 2, 5, 3, 4]
    """
    cls = schedule_type(schedule, repeats)
    if not (isinstance(num_stages, int) and num_stages >= 1):
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}.")
    devices, rows = range(num_stages), range(repeats)
    return np.array([cls.stage_on(num_stages, d, r) for d in devices for r in rows])
