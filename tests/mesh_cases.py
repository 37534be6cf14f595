"""The ``mesh=`` / ``data_axis=`` cases of issue 66 for both windows per
device, shard_value_and_grad (run by sharded_checks.py) and
cached_value_and_grad (run by cached_checks.py), on 8 CPU devices:

- a 2-D Explicit mesh (``jax.make_mesh((4, 2), ("data", "model"))``) with
  ``data_axis="data"``, called outside ``jax.set_mesh`` on arrays as they
  come (on one device), eager and under jit: the big batch's;
- called inside the caller's own ``jax.shard_map`` already manual over the
  data axis: the window runs on the rows each device is given and reduces
  over the axis, the big batch's (N = 1, 2 and a micro-batch size; also
  with ``mesh=``, and on a 2-D mesh manual over "data" only); a parameter
  that varies over the axis, or a batch that does not, is refused, named.

Every result is compared with the single-device big batch (chex, RTOL and
ATOL of tests/tolerances.py: the same sums in another order, float32).
"""

import functools
import re

import cached_models as models
import chex
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tolerances import ATOL, RTOL  # float32 rounding bounds, derived there

import jaxaccum

FRONT_ENDS = ("shard", "cached")
ROWS_SPLIT = (P(), P("data"))  # the parameters replicated, the batch's rows split


def row_loss(params, batch):
    """A mean over rows of the towers' embeddings: what shard_value_and_grad
    accumulates (every parameter used, the temperature too)."""
    image = models.tower(params["image"], batch["image"])
    text = models.tower(params["text"], batch["text"])
    return jnp.exp(params["log_scale"]) * jnp.mean(jnp.sum(image * text, axis=-1))


def step_of(front_end, num_microbatches=None, **options):
    """The front end's step on the towers (cached: CLIP's loss, which sees
    the whole batch)."""
    if front_end == "shard":
        return jaxaccum.shard_value_and_grad(row_loss, num_microbatches, **options)
    return jaxaccum.cached_value_and_grad(
        models.encode, models.clip_loss, num_microbatches, **options
    )


@functools.cache
def big_batch(front_end):
    """The contract: jax.value_and_grad of the loss on the whole batch."""
    if front_end == "shard":
        return jax.jit(jax.value_and_grad(row_loss))
    return models.big_batch(models.encode, models.clip_loss)


def check_outside_set_mesh(front_end):
    """A 2-D Explicit mesh, data_axis="data", outside jax.set_mesh, the
    arguments on one device: eager and jitted, N = 1 and 2, the big batch's
    (it failed inside JAX: "Length of device assignment ...")."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    params, batch = models.towers()
    want = big_batch(front_end)(params, batch)
    for num in (1, 2):
        step = step_of(front_end, num, mesh=mesh, data_axis="data")
        for how, run in (("eager", step), ("jit", jax.jit(step))):
            chex.assert_trees_all_close(
                run(params, batch),
                want,
                rtol=RTOL,
                atol=ATOL,
                custom_message=f"{front_end} {how} N={num}",
            )
    return "eager and jit, N = 1 and 2: the big batch's"


def in_users_shard_map(step, mesh, axis_names=None, specs=ROWS_SPLIT):
    """``step`` called inside the caller's own jitted shard_map over ``mesh``
    (manual over ``axis_names``, all of the mesh's by default), its arguments
    placed as ``specs`` say (an Explicit shard_map does not reshard them)."""
    names = {} if axis_names is None else {"axis_names": set(axis_names)}
    mapped = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=P(), **names)
    )

    def placed(*args):
        shardings = tuple(NamedSharding(mesh, spec) for spec in specs)
        return mapped(*jax.device_put(args, shardings))

    return placed


def check_inside_shard_map(front_end):
    """Inside the caller's shard_map manual over "data" (8 devices, 2 rows
    each): the window on each device's rows, reduced over the axis: the big
    batch's at N = 1, 2, microbatch_size=8 (1 row a device), with mesh=, and
    on a 4 x 2 mesh manual over "data" only; what cannot be right refused."""
    mesh = jax.make_mesh((8,), ("data",))
    params, batch = models.towers()
    want = big_batch(front_end)(params, batch)
    cases = {
        "N=1": {"num_microbatches": 1},
        "N=2": {"num_microbatches": 2},
        "microbatch_size=8": {"microbatch_size": 8},
        "N=2 with mesh=": {"num_microbatches": 2, "mesh": mesh},
    }
    for name, split in cases.items():
        mapped = in_users_shard_map(step_of(front_end, data_axis="data", **split), mesh)
        chex.assert_trees_all_close(
            mapped(params, batch),
            want,
            rtol=RTOL,
            atol=ATOL,
            custom_message=f"{front_end} {name}",
        )
    mesh_2d = jax.make_mesh((4, 2), ("data", "model"))
    mapped = in_users_shard_map(
        step_of(front_end, 2, data_axis="data"), mesh_2d, axis_names=("data",)
    )
    chex.assert_trees_all_close(
        mapped(params, batch), want, rtol=RTOL, atol=ATOL, custom_message="4 x 2"
    )
    check_refused_in_shard_map(front_end, mesh, params, batch)
    return f"{', '.join(cases)} and on 4 x 2: the big batch's; misuse refused"


def check_refused_in_shard_map(front_end, mesh, params, batch):
    """A parameter varying over the manual data axis (its gradient would be
    summed over devices that hold different values) and a batch the same on
    every device (its rows counted 8 times) are refused, named."""
    step = step_of(front_end, 2, data_axis="data")

    def varying_params(params, batch):
        return step(jax.lax.pcast(params, "data", to="varying"), batch)

    refusals = (
        (
            in_users_shard_map(varying_params, mesh),
            r"args\[0\]\['image'\]\[0\].*varies over \('data',\)",
        ),
        (
            in_users_shard_map(step, mesh, specs=(P(), P())),
            r"args\[1\]\['\w+'\] of shape \(16, 6\) is the same on every device",
        ),
    )
    for mapped, message in refusals:
        try:
            mapped(params, batch)
        except ValueError as error:
            assert re.search(message, str(error)), error
        else:
            raise AssertionError(f"not refused: {message}")
