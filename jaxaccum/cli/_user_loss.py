"""The user's loss as the command line names it: ``module:attribute``
references, batches given as shapes, the flags' keywords, and which flag a
loss's output does not match."""

import argparse
import importlib
import re
import sys
from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum._checks import check_scalar
from jaxaccum._types import PyTree

LEAF = re.compile(r"\s*([A-Za-z_]\w*)\s*=\s*(\w+)\[([\d\s,]*)\]\s*(?:,|$)")


ARRAY = re.compile(r"\s*(\w+)\[([\d\s,]*)\]\s*")


def resolve(reference: str, flag: str = "LOSS") -> Any:
    """The object ``module:attribute`` (dotted attributes allowed) names; the
    errors name ``flag``, the argument that gave the reference."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise ValueError(
            f"{flag} {reference!r} is not module:attribute, e.g. "
            "mypackage.train:loss_fn."
        )
    if "" not in sys.path:  # console scripts leave the working directory out
        sys.path.insert(0, "")
    try:
        value: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"cannot import {module_name!r} for {flag} {reference!r}: {error} "
            "(the current directory and sys.path are searched)."
        ) from error
    path = module_name
    for name in attribute.split("."):
        if not hasattr(value, name):
            raise ValueError(
                f"{path} has no attribute {name!r} ({flag} {reference!r})."
            )
        value = getattr(value, name)
        path += f"{':' if path == module_name else '.'}{name}"
    return value


def value_of(reference: str, flag: str) -> Any:
    """``resolve``; a function of no arguments is called."""
    value = resolve(reference, flag)
    return value() if callable(value) else value


def shape_dtype(dtype: str, dims: str) -> jax.ShapeDtypeStruct:
    shape = tuple(int(d) for d in dims.replace(" ", "").split(",") if d)
    try:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    except TypeError as error:
        raise ValueError(f"--batch: {dtype!r} is not a dtype ({error}).") from error


def parse_batch(spec: str) -> PyTree:
    """``--batch``: ``module:attribute``; one array as ``dtype[d0,d1,...]``; or
    leaves as ``name=dtype[d0,d1,...]`` separated by commas (a dict, e.g.
    ``x=float32[8192,784],y=int32[8192]``)."""
    array = ARRAY.fullmatch(spec)
    if array is not None:
        return shape_dtype(*array.groups())
    if "=" not in spec:
        return value_of(spec, "--batch")
    leaves, position = {}, 0
    while position < len(spec):
        match = LEAF.match(spec, position)
        if match is None:
            raise ValueError(
                f"cannot read --batch {spec!r} from character {position}: write "
                "one array as dtype[d0,d1,...] or leaves as name=dtype[d0,d1,...] "
                "separated by commas, e.g. x=float32[8192,784],y=int32[8192]."
            )
        name, dtype, dims = match.groups()
        leaves[name] = shape_dtype(dtype, dims)
        position = match.end()
    return leaves


def argnums(text: str) -> tuple[int, ...]:
    """An argparse type: ``"1,2"`` -> ``(1, 2)``."""
    try:
        nums = tuple(int(part) for part in text.split(","))
    except ValueError:
        nums = ()
    if not nums or min(nums) < 1 or len(set(nums)) != len(nums):
        raise argparse.ArgumentTypeError(
            "expected distinct argument numbers >= 1 separated by commas, e.g. "
            f"1,2 (argument 0 is the params); got {text!r}."
        )
    try:
        for num in nums:
            check_scalar("an argument number", num, integer=True, low=1)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return nums


def loss_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keywords of :func:`jaxaccum.value_and_grad` the flags set, as the
    training step will pass them (defaults left out)."""
    options: dict[str, Any] = {
        "has_aux": args.has_aux,
        "reduction": args.reduction,
        "aux_reduction": args.aux_reduction,
        "batch_argnums": args.batch_argnums,
        "key_argnums": args.key_argnums,
        "remat": args.remat,
    }
    return {
        name: value for name, value in options.items() if value not in (None, False)
    }


def loss_arguments(args: argparse.Namespace, options: dict[str, Any]) -> tuple:
    """The positional arguments of the user's loss: the params (argument 0),
    the batch arguments and the PRNG keys, as shapes (numbered as
    :func:`check_flags` checked)."""
    values = {0: value_of(args.params, "--params")}
    for num, spec in zip(options.get("batch_argnums", (1,)), args.batch, strict=True):
        values[num] = parse_batch(spec)
    for num in options.get("key_argnums", ()):
        values[num] = jax.random.key(0)  # a key's shape is all a plan needs
    return tuple(values[num] for num in range(len(values)))


def describe(tree: PyTree) -> str:
    """A pytree of shapes as ``(float32[], {aux: float32[4]})``."""
    shapes = jax.tree.map(lambda leaf: f"{leaf.dtype}{list(leaf.shape)}", tree)
    return str(shapes).replace("'", "")


def output_hint(loss: PyTree, call_args: tuple, options: dict[str, Any]) -> str | None:
    """Which flag the loss's output does not match, if any (else None)."""
    try:
        out = jax.eval_shape(loss, *call_args)
    except Exception:  # the loss's own error is the one to report
        return None

    def is_pair(tree: PyTree) -> bool:
        return isinstance(tree, tuple | list) and len(tree) == 2

    def is_scalar(tree: PyTree) -> bool:
        return isinstance(tree, jax.ShapeDtypeStruct) and tree.shape == ()

    returned = f"it returns {describe(out)}."
    if options.get("has_aux"):
        if not is_pair(out):
            return f"with --has-aux, LOSS must return (loss, aux); {returned}"
        out = out[0]
    if options.get("reduction") == "weighted":
        if not (is_pair(out) and all(map(is_scalar, out))):
            return (
                "with --reduction weighted, LOSS must return scalars (loss_sum, "
                f"weight) (with --has-aux: ((loss_sum, weight), aux)); {returned}"
            )
    elif is_pair(out):
        return (
            "LOSS returns a pair: pass --has-aux if it is (loss, aux), or "
            f"--reduction weighted if it is (loss_sum, weight); {returned}"
        )
    elif not is_scalar(out):
        return f"LOSS must return a scalar loss; {returned}"
    return None
