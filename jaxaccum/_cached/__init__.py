"""Losses that see the whole batch, exact at micro-batch memory: gradient
caching in one compiled step. A module per pass: ``_encode`` (pass 1, the
encoder forward), ``_loss`` (the loss and its cotangent, once), ``_pullback``
(pass 2, the encoder's pullbacks); ``_sharded`` the window per device (the
outputs' gather, the device's rows, the one reduction); ``_roles`` the user's
functions called by role; ``_api`` the public function; ``_library`` what
they take from the core; ``_contrastive`` the blockwise losses behind
:mod:`jaxaccum.losses`."""

from jaxaccum._cached._api import cached_value_and_grad as cached_value_and_grad

__all__ = ["cached_value_and_grad"]
