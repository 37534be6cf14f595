"""Every public numeric argument of the core, fed every kind of number.

One table (``ARGUMENTS``): each numeric argument of the core's public entry
points, a call that uses it, and a valid value. The test feeds each (all of
them, exhaustively: a finite table needs no sampling) the valid value as a
Python number, a 0-d NumPy value and a 0-d JAX value (concrete), and every
bad one: 0, -1, values past int32 or float32 (``2**40``,
``1e300``, ``1e-300``), NaN, a bool, a string, a shape-(2,) array. The three
spellings of the valid value give the same result, or jaxaccum's own error
naming the argument (a count that fixes a compiled loop's length must be a
Python or NumPy int); a bad value gives jaxaccum's own ``ValueError`` or
``TypeError`` naming the argument, never an error from inside JAX or Python,
never a result. The growth API's arguments are in test_growth_properties.py,
the command line's flags in test_cli.py.
"""

import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxaccum

PACKAGE = pathlib.Path(jaxaccum.__file__).parent


def loss(params, batch):
    return jnp.mean(jnp.tanh(batch["x"] @ params["w"]))


def weighted(params, batch, example_mask):
    losses = jnp.tanh(batch["x"] @ params["w"])
    return jaxaccum.masked_sum(losses, example_mask)


PARAMS = {"w": jnp.linspace(-1.0, 1.0, 3)}
BATCH = {"x": jnp.arange(24.0).reshape(8, 3) / 24}


def _multisteps_update(**kwargs: Any) -> Any:
    """Two calls of a 2-call window, the second passing ``kwargs``."""
    every_k = kwargs.pop("every_k_schedule", 2)
    opt = jaxaccum.MultiSteps(optax.sgd(1.0), every_k)
    state = opt.init(PARAMS)
    grads = jax.grad(loss)(PARAMS, BATCH)
    first = {} if every_k is not None else {"every_k": 2}
    _, state = opt.update(grads, state, PARAMS, **first)
    return opt.update(grads, state, PARAMS, **kwargs)[0]


class Argument(NamedTuple):
    """One public numeric argument: ``call(value)`` runs what it feeds."""

    name: str
    call: Callable[[Any], Any]
    valid: int | float
    integer: bool


ARGUMENTS = (
    Argument(
        "num_microbatches",
        lambda n: jaxaccum.value_and_grad(loss, n)(PARAMS, BATCH),
        2,
        True,
    ),
    Argument(
        "microbatch_size",
        lambda m: jaxaccum.value_and_grad(loss, microbatch_size=m)(PARAMS, BATCH),
        4,
        True,
    ),
    Argument(
        "unroll",
        lambda u: jaxaccum.value_and_grad(loss, 2, unroll=u)(PARAMS, BATCH),
        2,
        True,
    ),
    Argument(
        "active_microbatches",
        lambda k: jaxaccum.value_and_grad(loss, 2, masked=True)(
            PARAMS, BATCH, active_microbatches=k
        ),
        1,
        True,
    ),
    Argument(
        "microbatch_size",  # padded: one micro-batch longer than the batch
        lambda m: jaxaccum.value_and_grad(
            weighted, microbatch_size=m, pad=True, reduction="weighted"
        )(PARAMS, BATCH),
        16,
        True,
    ),
    Argument("num_microbatches", lambda n: jaxaccum.split_batch(BATCH, n), 4, True),
    Argument(
        "num_microbatches",
        lambda n: jaxaccum.pad_microbatches(BATCH, n, 4),
        2,
        True,
    ),
    Argument(
        "max_microbatches",
        lambda n: jaxaccum.pad_microbatches(BATCH, 2, n),
        4,
        True,
    ),
    Argument(
        "every_k_schedule",
        lambda k: _multisteps_update(every_k_schedule=k),
        2,
        True,
    ),
    Argument(
        "every_k",
        lambda k: _multisteps_update(every_k_schedule=None, every_k=k),
        2,
        True,
    ),
    Argument("weight", lambda w: _multisteps_update(weight=w), 3.0, False),
    Argument(
        "memory_budget",
        lambda b: (
            jaxaccum.plan(
                loss, PARAMS, BATCH, memory_budget=b, candidates=(1, 2)
            ).num_microbatches
        ),
        2**30,
        True,
    ),
)

SPELLINGS = {
    "python": lambda value: value,
    "numpy": lambda value: np.asarray(value)[()],
    "jax": jnp.asarray,
}
BAD_VALUES = (0, -1, 2**40, 1e300, 1e-300, float("nan"), True, "2", np.ones(2))
# Values of BAD_VALUES that are valid for an argument: a weight of 0 (a call
# that counts for nothing) or 2**40 (tokens), unroll=True (the whole loop), a
# budget of 2**40 or 1e300 bytes.
ALSO_VALID = {
    "weight": (0, 2**40),
    "unroll": (True,),
    "memory_budget": (2**40, 1e300),
}


def _outcome(argument: Argument, value: Any) -> Any:
    """The call's result, or its jaxaccum error (which must name the argument)."""
    try:
        return argument.call(value)
    except (ValueError, TypeError) as error:
        assert argument.name in str(error), (argument.name, value, str(error))
        return error


@pytest.mark.parametrize("argument", ARGUMENTS, ids=lambda arg: arg.name)
def test_numeric_arguments_take_every_number_or_name_themselves(argument):
    reference = argument.call(argument.valid)
    for spelling, spell in SPELLINGS.items():
        got = _outcome(argument, spell(argument.valid))
        if not isinstance(got, Exception):
            chex.assert_trees_all_equal(got, reference)
        else:  # only a count fixing a loop's length may refuse a JAX value
            assert spelling == "jax" and argument.integer, (argument, spelling, got)
    for bad in BAD_VALUES:
        if any(
            type(bad) is type(valid) and bad == valid
            for valid in ALSO_VALID.get(argument.name, ())
        ):
            continue
        with pytest.raises((ValueError, TypeError)) as error:
            argument.call(bad)
        message = str(error.value)
        assert argument.name in message, (argument.name, bad, message)
        # jaxaccum's own error, not one from inside JAX or Python.
        raised_in = pathlib.Path(error.traceback[-1].path)
        assert PACKAGE in raised_in.parents, (argument.name, bad, raised_in)


@pytest.mark.parametrize("remat", ["yes", 1, 0.5])
def test_remat_is_a_bool_or_a_checkpoint_policy(remat):
    """remat="yes" failed inside JAX's checkpoint ("'str' object is not
    callable") at trace time; it is refused when the step is built."""
    with pytest.raises(TypeError, match=r"remat must be True, False \(or None\)"):
        jaxaccum.value_and_grad(loss, 2, remat=remat)


def test_has_aux_with_a_bare_loss_says_so():
    """has_aux=True with a loss returning a scalar failed with JAX's
    "iteration over a 0-d array" (issue 45)."""
    with pytest.raises(TypeError, match=r"With has_aux=True, fun must return a pair"):
        jaxaccum.value_and_grad(loss, 2, has_aux=True)(PARAMS, BATCH)


def _front_ends_building(**options: Any) -> dict[str, Callable[[], Any]]:
    """Each entry point that takes ``accum_dtype``, built with ``options``."""
    import jaxaccum.equinox
    import jaxaccum.flax

    return {
        "value_and_grad": lambda: jaxaccum.value_and_grad(loss, 2, **options),
        "cached_value_and_grad": lambda: jaxaccum.cached_value_and_grad(
            loss, loss, 2, **options
        ),
        "shard_value_and_grad": lambda: jaxaccum.shard_value_and_grad(
            loss, 2, **options
        ),
        "equinox.filter_value_and_grad": lambda: jaxaccum.equinox.filter_value_and_grad(
            loss, 2, **options
        ),
        "flax.linen_value_and_grad": lambda: jaxaccum.flax.linen_value_and_grad(
            loss, 2, **options
        ),
    }


@pytest.mark.parametrize("accum_dtype", ["floot32", jnp.int32, jnp.complex64, 3])
def test_accum_dtype_is_a_floating_dtype_or_none(accum_dtype):
    """accum_dtype="floot32" built and failed at the call with NumPy's
    message; jnp.int32 behaved like None (issue 66, 10). Every front end
    refuses them when built, naming accum_dtype; MultiSteps its
    accumulator_dtype."""
    for build in _front_ends_building(accum_dtype=accum_dtype).values():
        with pytest.raises(TypeError, match="accum_dtype=.* (is not a|floating) "):
            build()  # when built: no call, no trace
    with pytest.raises(TypeError, match="accumulator_dtype=.* (is not a|floating) "):
        jaxaccum.MultiSteps(optax.sgd(1.0), 2, accumulator_dtype=accum_dtype)
    for valid in (None, "float32", jnp.bfloat16, np.float64):
        for build in _front_ends_building(accum_dtype=valid).values():
            build()
