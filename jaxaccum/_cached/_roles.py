"""The user's two functions called with a window's arguments by role."""

from collections.abc import Callable

from jaxaccum._cached._library import WindowSpec
from jaxaccum._types import Fun, PyTree

# ``encode_at(diff, micro_batch, micro_keys)``: the encoder's outputs.
Encoder = Callable[[tuple, tuple, tuple], PyTree]
# ``loss_at(diff, outputs)``: the loss's value, or ``(value, aux)``.
WholeLoss = Callable[[tuple, PyTree], PyTree]


def placed(args: tuple, nums: tuple[int, ...], values: tuple) -> list:
    """``args`` with ``values`` at positions ``nums``."""
    call_args = list(args)
    for num, value in zip(nums, values, strict=True):
        call_args[num] = value
    return call_args


def bind_encode(encode: Fun, args: tuple, spec: WindowSpec) -> Encoder:
    """``encode`` called with the call's arguments, its differentiated, batch
    and key arguments replaced by a micro-batch's."""

    def encode_at(diff: tuple, micro_batch: tuple, micro_keys: tuple) -> PyTree:
        call_args = placed(args, spec.diff_nums, diff)
        call_args = placed(tuple(call_args), spec.batch_nums, micro_batch)
        return encode(*placed(tuple(call_args), spec.key_nums, micro_keys))

    return encode_at


def bind_loss(loss: Fun, args: tuple, spec: WindowSpec) -> WholeLoss:
    """``loss`` called with the call's arguments (its keys unsplit), the
    differentiated ones replaced, the first batch argument replaced by the
    encoder's outputs and any other batch argument by ``None``."""
    first, *others = spec.batch_nums

    def loss_at(diff: tuple, outputs: PyTree) -> PyTree:
        call_args = placed(args, spec.diff_nums, diff)
        call_args[first] = outputs
        for num in others:
            call_args[num] = None
        return loss(*call_args)

    return loss_at
