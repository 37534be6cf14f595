"""Flax integration: accumulate Linen and NNX models, their state carried in order.

Models carry state besides parameters: BatchNorm statistics (Linen's
``batch_stats`` collection, NNX's ``nnx.BatchStat``) and, in NNX, the RNG
streams' counters. These helpers build on :func:`jaxaccum.value_and_grad`: the
parameters are differentiated, the state is carried through the micro-batches
in order (micro-batch ``k`` sees the state micro-batch ``k - 1`` left), so after
a window it is what ``N`` sequential forward passes in training mode leave,
which is what PyTorch and Keras do when they accumulate.

BatchNorm cannot match the big batch. In training mode it normalizes each
example with the mean and variance of the batch it is in, so an example's
output, and the gradient, depend on the other examples: with micro-batches the
statistics come from ``B / N`` examples instead of ``B``, and no single-pass
accumulation can give the big-batch gradient (a multi-pass scheme can, with
one forward sweep over the micro-batches per BatchNorm layer for the
full-batch statistics before the gradient pass; :func:`linen_diagnose`,
:func:`nnx_diagnose` and ``jaxaccum.testing.diagnose`` name this). The running
statistics also average ``N`` micro-batch estimates, which are noisier than one
big-batch estimate. Micro-batch statistics are acceptable when a micro-batch is
large enough to estimate them (a few dozen examples per BatchNorm, as in
data-parallel training, where each device normalizes over its own shard
anyway). Otherwise use a per-example normalization, which makes the model exact
under accumulation: ``GroupNorm`` for convolutional networks, ``LayerNorm`` (or
``RMSNorm``) elsewhere.
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
