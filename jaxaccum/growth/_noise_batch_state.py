"""The noise-scale controller's state, and the limits of its step cost and of
its averages."""

import math
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import jax

from jaxaccum.growth._base import ExamplesSeen
from jaxaccum.growth._moments import NoiseMoments

EXAMPLES_ONLY = 0.0


STEPS_ONLY = math.inf


# Fewer windows' spread is no measure of the error: a band from 2 or 3 of them
# is as often too narrow as right.
MIN_EFFECTIVE_WINDOWS = 4.0


# The averages' effective windows, weight**2 / weight_sq, tend to
# (1 + k) / (1 - k) for windows of B with k = 2**(-B / half_life): the
# controller's MIN_EFFECTIVE_WINDOWS = 4 needs k >= 3/5, half_life >= 1.36 B.
# Two largest windows give 5.83, reached after 5 windows.
MIN_HALF_LIFE_WINDOWS = 2.0


# A window of B whose weight 1 - 2**(-B / half_life) float32 keeps above 0.
MAX_HALF_LIFE_WINDOWS = 2.0**24


class NoiseScaleBatchState(NamedTuple):
    """The state of :class:`NoiseScaleBatch`: a pytree, checkpointable as it is.

    Attributes:
      examples_seen: the :class:`ExamplesSeen` (``.total``, the windows'
        ``big_batch`` summed).
      num_microbatches: int32, the next window's number of micro-batches.
      microbatches_seen: int32, the sum of the windows' sizes; with
        ``examples_seen`` it gives a micro-batch's weight in the noise
        scale's unit (``examples_seen.total / microbatches_seen``).
      noise: the :class:`NoiseMoments` of the estimates (read them with
        ``controller.noise_ema``).
    """

    examples_seen: ExamplesSeen
    num_microbatches: jax.Array
    microbatches_seen: jax.Array
    noise: NoiseMoments


class Settings(Protocol):
    """What the checks and the update read of a :class:`NoiseScaleBatch`, its
    fields and derived sizes (a protocol, so that they need not import the
    class that calls them)."""

    @property
    def microbatch_size(self) -> int: ...

    @property
    def max_microbatches(self) -> int: ...

    @property
    def min_microbatches(self) -> int: ...

    @property
    def step_cost(self) -> float: ...

    @property
    def tokens_per_example(self) -> float | None: ...

    @property
    def kappa(self) -> float | None: ...

    @property
    def half_life(self) -> float | None: ...

    @property
    def standard_errors(self) -> float: ...

    @property
    def sizes(self) -> Sequence[int] | None: ...

    @property
    def shrink(self) -> bool: ...

    @property
    def possible_num_microbatches(self) -> tuple[int, ...]: ...

    @property
    def unit(self) -> str: ...

    @property
    def microbatch_weight(self) -> float: ...

    @property
    def effective_half_life(self) -> float: ...
