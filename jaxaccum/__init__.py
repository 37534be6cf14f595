"""jaxaccum: exact, compiled, memory-true gradient accumulation for JAX."""

from jaxaccum import testing
from jaxaccum._reduce import masked_sum
from jaxaccum.grad import grad, value_and_grad
from jaxaccum.split import split_batch

__version__ = "0.1.0"

__all__ = [
    "grad",
    "masked_sum",
    "split_batch",
    "testing",
    "value_and_grad",
]
