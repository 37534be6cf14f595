"""jaxaccum: exact, compiled, memory-true gradient accumulation for JAX.

The public surface; the implementation lives in private modules named for
their concept. ``jaxaccum.testing`` (chex assertions) loads on first use,
``jaxaccum.flax`` and ``jaxaccum.equinox`` when imported.
"""

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

from jaxaccum._growth import EXAMPLES_ONLY as EXAMPLES_ONLY
from jaxaccum._growth import STEPS_ONLY as STEPS_ONLY
from jaxaccum._growth import BatchRamp as BatchRamp
from jaxaccum._growth import BatchRampState as BatchRampState
from jaxaccum._growth import LearningRateRule as LearningRateRule
from jaxaccum._growth import NoiseMoments as NoiseMoments
from jaxaccum._growth import NoiseScaleBatch as NoiseScaleBatch
from jaxaccum._growth import NoiseScaleBatchState as NoiseScaleBatchState
from jaxaccum._growth import ScaleByBatchState as ScaleByBatchState
from jaxaccum._growth import StepCost as StepCost
from jaxaccum._growth import batch_ramp as batch_ramp
from jaxaccum._growth import batch_scale as batch_scale
from jaxaccum._growth import measure_step_cost as measure_step_cost
from jaxaccum._growth import noise_scale_batch as noise_scale_batch
from jaxaccum._growth import (
    scale_by_batch_learning_rate as scale_by_batch_learning_rate,
)
from jaxaccum._hlo import collective_bytes as collective_bytes
from jaxaccum._hlo import count_collectives as count_collectives
from jaxaccum._hlo import window_bytes as window_bytes
from jaxaccum._multisteps import MultiSteps as MultiSteps
from jaxaccum._multisteps import MultiStepsState as MultiStepsState
from jaxaccum._multisteps import accumulate as accumulate
from jaxaccum._noise_scale import NoiseEstimates as NoiseEstimates
from jaxaccum._noise_scale import NoiseScaleEMA as NoiseScaleEMA
from jaxaccum._noise_scale import NoiseScaleState as NoiseScaleState
from jaxaccum._noise_scale import WindowStats as WindowStats
from jaxaccum._plan import MemoryPlan as MemoryPlan
from jaxaccum._plan import MemoryPlanRow as MemoryPlanRow
from jaxaccum._plan import ModePlan as ModePlan
from jaxaccum._plan import ModePlanRow as ModePlanRow
from jaxaccum._plan import parse_memory_budget as parse_memory_budget
from jaxaccum._plan import plan as plan
from jaxaccum._plan import plan_modes as plan_modes
from jaxaccum._reduce import masked_sum as masked_sum
from jaxaccum._shard import shard_batch as shard_batch
from jaxaccum._shard import shard_value_and_grad as shard_value_and_grad
from jaxaccum._split import pad_microbatches as pad_microbatches
from jaxaccum._split import register_batch_node as register_batch_node
from jaxaccum._split import split_batch as split_batch
from jaxaccum._value_and_grad import grad as grad
from jaxaccum._value_and_grad import value_and_grad as value_and_grad
from jaxaccum._window import FiniteReport as FiniteReport

if TYPE_CHECKING:
    from jaxaccum import testing as testing

__version__ = importlib.metadata.version("jaxaccum")

__all__ = [
    "BatchRamp",
    "BatchRampState",
    "EXAMPLES_ONLY",
    "FiniteReport",
    "LearningRateRule",
    "MemoryPlan",
    "MemoryPlanRow",
    "ModePlan",
    "ModePlanRow",
    "MultiSteps",
    "MultiStepsState",
    "NoiseEstimates",
    "NoiseMoments",
    "NoiseScaleBatch",
    "NoiseScaleBatchState",
    "NoiseScaleEMA",
    "NoiseScaleState",
    "STEPS_ONLY",
    "ScaleByBatchState",
    "StepCost",
    "accumulate",
    "batch_ramp",
    "batch_scale",
    "collective_bytes",
    "count_collectives",
    "grad",
    "masked_sum",
    "measure_step_cost",
    "noise_scale_batch",
    "pad_microbatches",
    "parse_memory_budget",
    "plan",
    "plan_modes",
    "register_batch_node",
    "scale_by_batch_learning_rate",
    "shard_batch",
    "shard_value_and_grad",
    "split_batch",
    "testing",
    "value_and_grad",
    "window_bytes",
    "WindowStats",
]


def __getattr__(name: str) -> Any:
    # `jaxaccum.testing` without importing it first, as before; chex loads then.
    if name == "testing":
        return importlib.import_module("jaxaccum.testing")
    raise AttributeError(f"module 'jaxaccum' has no attribute {name!r}")
