"""Flax integration: accumulate Linen and NNX models, their state carried in order.

Models carry state besides parameters: BatchNorm statistics (Linen's
``batch_stats`` collection, NNX's ``nnx.BatchStat``) and, in NNX, the RNG
streams' counters. These helpers build on :func:`jaxaccum.value_and_grad`: the
parameters are differentiated, the state is carried through the micro-batches
in order (micro-batch ``k`` sees the state micro-batch ``k - 1`` left), so after
a window it is what ``N`` sequential forward passes in training mode leave,
which is what PyTorch and Keras do when they accumulate.

BatchNorm normalizes each example with the statistics of the batch it is in.
By default that batch is the micro-batch (``B / N`` examples, as each device's
shard under data parallelism), so the gradient is not the big batch's and the
running statistics average ``N`` noisier estimates (:func:`linen_diagnose`,
:func:`nnx_diagnose` and ``jaxaccum.testing.diagnose`` name this). Give
BatchNorm an ``axis_name`` and pass the same ``axis_name=`` here: the window
is then an axis its statistics are taken over, and the statistics, the
gradient and the running averages (updated once a window) are the big
batch's. Per-example normalizations (``GroupNorm``, ``LayerNorm``,
``RMSNorm``) are exact either way. Guide: docs/guides/flax.md#batchnorm.
"""

# Checked before the modules that use it, so that a missing extra names its
# install command.
try:
    import flax.core  # noqa: F401
    from flax import nnx  # noqa: F401
    from flax.training import train_state  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised in a core-only venv
    raise ImportError(
        "jaxaccum.flax needs Flax, which the core install leaves out: pip install "
        '"jaxaccum[flax]"'
    ) from error

from jaxaccum._flax._diagnose import linen_diagnose as linen_diagnose
from jaxaccum._flax._diagnose import nnx_diagnose as nnx_diagnose
from jaxaccum._flax._linen import linen_value_and_grad as linen_value_and_grad
from jaxaccum._flax._nnx import nnx_value_and_grad as nnx_value_and_grad
from jaxaccum._flax._train_state import TrainState as TrainState
from jaxaccum._flax._train_state import linen_train_step as linen_train_step

__all__ = [
    "TrainState",
    "linen_diagnose",
    "linen_train_step",
    "linen_value_and_grad",
    "nnx_diagnose",
    "nnx_value_and_grad",
]
