"""Linen, NNX and ``TrainState``, and their checks, behind ``jaxaccum.flax``."""
