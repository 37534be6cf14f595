"""jaxaccum.growth: growing the batch while training.

Controllers that size the next window from what the last one measured (a
:class:`jaxaccum.WindowStats`), and a learning rate that follows the batch,
its schedule counted in examples seen. What it holds:

- the protocol every controller follows, :class:`BatchSizeController`, and
  the examples-seen counter in their states, :class:`ExamplesSeen`;
- the fixed ramp, :class:`BatchRamp` (state :class:`BatchRampState`);
- the noise-scale controller, :class:`NoiseScaleBatch` (state
  :class:`NoiseScaleBatchState`; the limits of its step cost,
  :data:`EXAMPLES_ONLY` and :data:`STEPS_ONLY`);
- the noise estimates averaged over examples seen, :class:`NoiseScaleEMA`
  (its sums, :class:`NoiseMoments`);
- a step's cost timed on the host, :func:`measure_step_cost` (:class:`StepCost`);
- the learning-rate rules, :func:`batch_scale` (:data:`LearningRateRule`) and
  the Optax transformation :func:`scale_by_batch_learning_rate`
  (:class:`ScaleByBatchState`).

Guide: "Growing the batch".
"""

from jaxaccum.growth._base import BatchSizeController as BatchSizeController
from jaxaccum.growth._base import ControllerState as ControllerState
from jaxaccum.growth._base import ExamplesSeen as ExamplesSeen
from jaxaccum.growth._base import WindowTotals as WindowTotals
from jaxaccum.growth._learning_rate import LearningRateRule as LearningRateRule
from jaxaccum.growth._learning_rate import ScaleByBatchState as ScaleByBatchState
from jaxaccum.growth._learning_rate import batch_scale as batch_scale
from jaxaccum.growth._learning_rate import (
    scale_by_batch_learning_rate as scale_by_batch_learning_rate,
)
from jaxaccum.growth._moments import NoiseMoments as NoiseMoments
from jaxaccum.growth._moments import NoiseScaleEMA as NoiseScaleEMA
from jaxaccum.growth._noise_batch import NoiseScaleBatch as NoiseScaleBatch
from jaxaccum.growth._noise_batch_state import EXAMPLES_ONLY as EXAMPLES_ONLY
from jaxaccum.growth._noise_batch_state import STEPS_ONLY as STEPS_ONLY
from jaxaccum.growth._noise_batch_state import (
    NoiseScaleBatchState as NoiseScaleBatchState,
)
from jaxaccum.growth._ramp import BatchRamp as BatchRamp
from jaxaccum.growth._ramp import BatchRampState as BatchRampState
from jaxaccum.growth._step_cost import StepCost as StepCost
from jaxaccum.growth._step_cost import measure_step_cost as measure_step_cost

__all__ = [
    "BatchRamp",
    "BatchRampState",
    "BatchSizeController",
    "ControllerState",
    "EXAMPLES_ONLY",
    "ExamplesSeen",
    "LearningRateRule",
    "NoiseMoments",
    "NoiseScaleBatch",
    "NoiseScaleBatchState",
    "NoiseScaleEMA",
    "STEPS_ONLY",
    "ScaleByBatchState",
    "StepCost",
    "WindowTotals",
    "batch_scale",
    "measure_step_cost",
    "scale_by_batch_learning_rate",
]
