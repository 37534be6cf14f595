"""jaxaccum: exact, compiled, memory-true gradient accumulation for JAX.

The core every user of accumulation needs (why each name is here:
docs/api/index.md); the implementation lives in private modules named for
their concept. Three sub-namespaces: ``jaxaccum.growth`` (batch-size
controllers, the learning-rate rule, step cost, noise-scale averages),
``jaxaccum.losses`` (contrastive losses that never hold the B x B logits) and
``jaxaccum.testing`` (chex assertions, diagnosis, the compiled program's
collectives); the last two load on first use, so that ``import jaxaccum``
stays what a training step needs (``testing`` loads chex). ``jaxaccum.flax``
and ``jaxaccum.equinox`` load when imported.
"""

import importlib
import importlib.metadata
import warnings
from typing import TYPE_CHECKING, Any

from jaxaccum import growth as growth
from jaxaccum._cached import cached_value_and_grad as cached_value_and_grad
from jaxaccum._multisteps._accumulate import accumulate as accumulate
from jaxaccum._multisteps._multisteps import MultiSteps as MultiSteps
from jaxaccum._multisteps._state import MultiStepsState as MultiStepsState
from jaxaccum._pipeline import PipelinePlan as PipelinePlan
from jaxaccum._pipeline import PipelinePlanRow as PipelinePlanRow
from jaxaccum._pipeline import pipeline_stage_order as pipeline_stage_order
from jaxaccum._pipeline import pipeline_value_and_grad as pipeline_value_and_grad
from jaxaccum._pipeline import plan_pipeline as plan_pipeline
from jaxaccum._plan._memory_budget import parse_memory_budget as parse_memory_budget
from jaxaccum._plan._modes import ModePlan as ModePlan
from jaxaccum._plan._modes import ModePlanRow as ModePlanRow
from jaxaccum._plan._modes import plan_modes as plan_modes
from jaxaccum._plan._plan import MemoryPlan as MemoryPlan
from jaxaccum._plan._plan import MemoryPlanRow as MemoryPlanRow
from jaxaccum._plan._plan import plan as plan
from jaxaccum._precision._loss_scale import DynamicLossScale as DynamicLossScale
from jaxaccum._precision._loss_scale import LossScaleReport as LossScaleReport
from jaxaccum._precision._loss_scale import dynamic_loss_scale as dynamic_loss_scale
from jaxaccum._precision._loss_scale import select_if_finite as select_if_finite
from jaxaccum._precision._loss_scale import update_loss_scale as update_loss_scale
from jaxaccum._shard._shard import shard_batch as shard_batch
from jaxaccum._shard._shard import shard_value_and_grad as shard_value_and_grad
from jaxaccum._types import ScheduleName as ScheduleName
from jaxaccum._types import StageOrder as StageOrder
from jaxaccum._value_and_grad import grad as grad
from jaxaccum._value_and_grad import value_and_grad as value_and_grad
from jaxaccum._window._batch_nodes import register_batch_node as register_batch_node
from jaxaccum._window._micro_result import FiniteReport as FiniteReport
from jaxaccum._window._noise_scale import NoiseEstimates as NoiseEstimates
from jaxaccum._window._noise_scale import WindowStats as WindowStats
from jaxaccum._window._reduce import masked_sum as masked_sum
from jaxaccum._window._split import pad_microbatches as pad_microbatches
from jaxaccum._window._split import split_batch as split_batch

if TYPE_CHECKING:
    from jaxaccum import losses as losses
    from jaxaccum import testing as testing

try:
    __version__ = importlib.metadata.version("jaxaccum")
except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH
    __version__ = "0+unknown"

__all__ = [
    "DynamicLossScale",
    "FiniteReport",
    "LossScaleReport",
    "MemoryPlan",
    "MemoryPlanRow",
    "ModePlan",
    "ModePlanRow",
    "MultiSteps",
    "MultiStepsState",
    "NoiseEstimates",
    "PipelinePlan",
    "PipelinePlanRow",
    "ScheduleName",
    "StageOrder",
    "WindowStats",
    "accumulate",
    "cached_value_and_grad",
    "dynamic_loss_scale",
    "grad",
    "growth",
    "losses",
    "masked_sum",
    "pad_microbatches",
    "parse_memory_budget",
    "pipeline_stage_order",
    "pipeline_value_and_grad",
    "plan",
    "plan_modes",
    "plan_pipeline",
    "register_batch_node",
    "select_if_finite",
    "shard_batch",
    "shard_value_and_grad",
    "split_batch",
    "testing",
    "update_loss_scale",
    "value_and_grad",
]

_LAZY_NAMESPACES = ("losses", "testing")

# Top-level names of 0.1 that moved: (module, name) of their new home. They
# keep working, with a DeprecationWarning, until jaxaccum 0.3.0.
_MOVED = {
    "count_collectives": ("jaxaccum.testing", "count_collectives"),
    "collective_bytes": ("jaxaccum.testing", "collective_bytes"),
    "window_bytes": ("jaxaccum.testing", "window_bytes"),
    "BatchRamp": ("jaxaccum.growth", "BatchRamp"),
    "BatchRampState": ("jaxaccum.growth", "BatchRampState"),
    "batch_ramp": ("jaxaccum.growth", "BatchRamp"),
    "NoiseScaleBatch": ("jaxaccum.growth", "NoiseScaleBatch"),
    "NoiseScaleBatchState": ("jaxaccum.growth", "NoiseScaleBatchState"),
    "noise_scale_batch": ("jaxaccum.growth", "NoiseScaleBatch"),
    "EXAMPLES_ONLY": ("jaxaccum.growth", "EXAMPLES_ONLY"),
    "STEPS_ONLY": ("jaxaccum.growth", "STEPS_ONLY"),
    "NoiseMoments": ("jaxaccum.growth", "NoiseMoments"),
    "NoiseScaleEMA": ("jaxaccum._shims", "NoiseScaleEMA"),
    "StepCost": ("jaxaccum.growth", "StepCost"),
    "measure_step_cost": ("jaxaccum.growth", "measure_step_cost"),
    "LearningRateRule": ("jaxaccum.growth", "LearningRateRule"),
    "batch_scale": ("jaxaccum.growth", "batch_scale"),
    "ScaleByBatchState": ("jaxaccum.growth", "ScaleByBatchState"),
    "scale_by_batch_learning_rate": ("jaxaccum.growth", "scale_by_batch_learning_rate"),
}
_REMOVED_IN = "0.3.0"
# Top-level names of 0.1 with no new home.
_GONE = {
    "NoiseScaleState": "NoiseScaleEMA now averages per example; its state is "
    "jaxaccum.growth.NoiseMoments (see the changelog).",
    "ramp_from_schedule": "it lost to the same decay at a fixed batch on the "
    "growth benchmark; build a ramp with jaxaccum.growth.BatchRamp.",
    "ScheduleRamp": "it went with ramp_from_schedule.",
}


def __dir__() -> list[str]:
    """The public names: the core and the three sub-namespaces."""
    return sorted(__all__)


def __getattr__(name: str) -> Any:
    # `jaxaccum.testing` (chex loads then) and `jaxaccum.losses` without
    # importing them first.
    if name in _LAZY_NAMESPACES:
        return importlib.import_module(f"jaxaccum.{name}")
    if name in _MOVED:
        module, new_name = _MOVED[name]
        warnings.warn(
            f"jaxaccum.{name} moved to {module}.{new_name}; the old path is "
            f"removed in jaxaccum {_REMOVED_IN}.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module), new_name)
    if name in _GONE:
        from jaxaccum import _shims

        raise _shims.removed_error(name, _GONE[name])
    raise AttributeError(f"module 'jaxaccum' has no attribute {name!r}")
