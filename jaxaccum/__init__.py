"""jaxaccum: exact, compiled, memory-true gradient accumulation for JAX."""

from jaxaccum import testing
from jaxaccum._reduce import masked_sum
from jaxaccum.distributed import count_collectives, shard_batch, shard_value_and_grad
from jaxaccum.grad import FiniteReport, grad, value_and_grad
from jaxaccum.memory import MemoryPlan, parse_memory_budget, plan
from jaxaccum.optimizer import MultiSteps, MultiStepsState, accumulate
from jaxaccum.split import split_batch

__version__ = "0.1.0"

__all__ = [
    "FiniteReport",
    "MemoryPlan",
    "MultiSteps",
    "MultiStepsState",
    "accumulate",
    "count_collectives",
    "grad",
    "masked_sum",
    "parse_memory_budget",
    "plan",
    "shard_batch",
    "shard_value_and_grad",
    "split_batch",
    "testing",
    "value_and_grad",
]
