"""Data parallel checks on 8 CPU devices, run as a script by test_distributed.py.

The device count is fixed when JAX starts its backend, so these checks run in
their own process (``XLA_FLAGS=--xla_force_host_platform_device_count=8``) and
print one JSON object, ``{check name: {"ok": bool, "detail": str}}``, as the last
line of stdout. Each check compares a sharded accumulated step with the
single-device full-batch gradient (chex, RTOL, ATOL (tests/tolerances.py)) and reads the
collectives of its compiled HLO.
"""

import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from check_scripts import report
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from models import classification_batch, mlp_apply, mlp_loss, mlp_params
from noise_population import assert_unbiased, loss_for, population, sample, truth
from tolerances import ATOL, RTOL

import jaxaccum

# Float32 rounding bounds, derived in tests/tolerances.py.
NUM_DEVICES = 8
NUM_MICROBATCHES = 4
BATCH_SIZE = 64  # 8 rows per device, 2 per micro-batch

CHECKS = [
    f"{mode}_{reduction}_{axis_type}"
    for mode in ("per_microbatch", "deferred")
    for reduction in ("mean", "weighted")
    for axis_type in ("auto", "explicit")
] + [
    "model_sharded_params_auto",
    "explicit_indivisible_split_is_an_error",
    "contiguous_split_moves_rows",
    "deferred_keys_differ_per_device",
    "deferred_pad_weighted",
    "deferred_noise_scale_mean",
    "deferred_noise_scale_weighted",
    "fp8_metadata_maxed_over_devices",
]


def token_loss(params, batch):
    """(sum of per-token losses over valid tokens, their count)."""
    logits = mlp_apply(params, batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return jaxaccum.masked_sum(losses, batch["mask"])


def token_mean(params, batch):
    loss_sum, count = token_loss(params, batch)
    return loss_sum / count


def token_batch(batch_size):
    """Sequences of 5 tokens with lengths 1..5, unevenly spread over devices."""
    batch = classification_batch(jax.random.key(1), batch_size * 5)
    lengths = (np.arange(batch_size) * 7 + np.arange(batch_size) // 8) % 5 + 1
    return {
        "x": batch["x"].reshape(batch_size, 5, -1),
        "y": batch["y"].reshape(batch_size, 5),
        "mask": jnp.asarray(np.arange(5) < lengths[:, None]),
    }


def problem(reduction):
    """(loss, full-batch reference loss, batch) for a reduction."""
    if reduction == "mean":
        return mlp_loss, mlp_loss, classification_batch(jax.random.key(2), BATCH_SIZE)
    return token_loss, token_mean, token_batch(BATCH_SIZE)


def make_mesh(axis_type, shape=(NUM_DEVICES,), names=("data",)):
    kind = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[axis_type]
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


def collectives(compiled):
    counts = jaxaccum.testing.count_collectives(compiled)
    assert " while(" in compiled.as_text(), "the micro-batch loop was unrolled"
    return counts


def assert_no_data_movement(counts):
    moved = {
        op: counts[op]
        for op in ("all-to-all", "collective-permute", "all-gather")
        if sum(counts[op].values())
    }
    assert not moved, f"batch rows move between devices: {moved}"


def assert_matches(actual, expected, what):
    try:
        chex.assert_trees_all_close(actual, expected, rtol=RTOL, atol=ATOL)
    except AssertionError as error:
        raise AssertionError(f"{what} differs from the full batch: {error}") from None


def check_step(mode, reduction, axis_type):
    loss, reference_loss, batch = problem(reduction)
    params = mlp_params(jax.random.key(0))
    expected = jax.jit(jax.value_and_grad(reference_loss))(params, batch)
    mesh = make_mesh(axis_type)
    sharded_batch = jaxaccum.shard_batch(batch, mesh)
    sharded_params = jax.device_put(params, NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        if mode == "deferred":
            fun = jaxaccum.shard_value_and_grad(
                loss, NUM_MICROBATCHES, reduction=reduction
            )
        else:
            fun = jaxaccum.value_and_grad(loss, NUM_MICROBATCHES, reduction=reduction)
        step = jax.jit(fun)
        compiled = step.lower(sharded_params, sharded_batch).compile()
        value, grads = step(sharded_params, sharded_batch)
    assert_matches((value, grads), expected, f"{mode} {reduction} {axis_type}")
    for (path, grad), param in zip(
        jax.tree_util.tree_leaves_with_path(grads),
        jax.tree.leaves(sharded_params),
        strict=True,
    ):
        assert grad.sharding.is_equivalent_to(param.sharding, param.ndim), (
            f"grads{jax.tree_util.keystr(path)} has sharding {grad.sharding}, "
            f"the parameter {param.sharding}"
        )
    counts = collectives(compiled)
    assert_no_data_movement(counts)
    reduces = counts["all-reduce"]
    num_leaves = len(jax.tree.leaves(params))
    if mode == "deferred":
        assert reduces["loop"] == 0, f"all-reduce inside the loop: {reduces}"
        # value, (weight), one per gradient leaf, or fewer once XLA fuses them
        assert 1 <= reduces["outside"] <= num_leaves + 2, reduces
    else:
        # GSPMD reduces the gradient of every micro-batch: what deferring saves.
        assert reduces["loop"] >= 1, f"expected per-micro-batch all-reduce: {reduces}"
    return f"all-reduce {reduces}, grad leaves {num_leaves}"


def check_model_sharded_params():
    """Data x model mesh: gradients keep the parameters' model sharding."""
    mesh = make_mesh("auto", (4, 2), ("data", "model"))
    params = mlp_params(jax.random.key(0))
    batch = problem("mean")[2]
    expected = jax.jit(jax.value_and_grad(mlp_loss))(params, batch)
    specs = [{"w": P(None, "model"), "b": P("model")} for _ in params[:-1]]
    specs.append({"w": P("model", None), "b": P()})
    sharded_params = jax.device_put(
        params, jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    )
    sharded_batch = jaxaccum.shard_batch(batch, mesh)
    details = []
    with jax.set_mesh(mesh):
        for name, fun in (
            ("per_microbatch", jaxaccum.value_and_grad(mlp_loss, NUM_MICROBATCHES)),
            ("deferred", jaxaccum.shard_value_and_grad(mlp_loss, NUM_MICROBATCHES)),
        ):
            value, grads = jax.jit(fun)(sharded_params, sharded_batch)
            assert_matches((value, grads), expected, name)
            for grad, param in zip(
                jax.tree.leaves(grads), jax.tree.leaves(sharded_params), strict=True
            ):
                assert grad.sharding.is_equivalent_to(param.sharding, param.ndim), (
                    f"{name}: grad sharding {grad.sharding.spec}, parameter "
                    f"{param.sharding.spec}"
                )
            details.append(
                f"{name}: shardings {[g.sharding.spec for g in grads[0].values()]}"
            )
    return "; ".join(details)


def check_explicit_indivisible():
    """48 rows over 8 devices is 6 per device: N=4 cannot split them evenly."""
    mesh = make_mesh("explicit")
    batch = classification_batch(jax.random.key(2), 48)
    with jax.set_mesh(mesh):
        fun = jax.jit(jaxaccum.value_and_grad(mlp_loss, 4))
        try:
            fun(mlp_params(jax.random.key(0)), jaxaccum.shard_batch(batch, mesh))
        except ValueError as error:
            message = str(error)
            for part in ("args[1]['x']", "48 rows", "8 devices", "6 per device"):
                assert part in message, f"{part!r} not in: {message}"
            return message
    raise AssertionError("no error for an indivisible explicit split")


def check_contiguous_split_moves_rows():
    """The detector works: micro-batch k = rows [k B/N, (k+1) B/N) moves data."""
    mesh = make_mesh("auto")
    params = mlp_params(jax.random.key(0))
    batch = problem("mean")[2]

    def contiguous(params, batch):
        micro = jax.tree.map(
            lambda x: x.reshape(NUM_MICROBATCHES, -1, *x.shape[1:]), batch
        )

        def body(total, micro_batch):
            return jax.tree.map(
                jnp.add, total, jax.grad(mlp_loss)(params, micro_batch)
            ), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        return jax.lax.scan(body, zeros, micro)[0]

    with jax.set_mesh(mesh):
        compiled = (
            jax.jit(contiguous)
            .lower(params, jaxaccum.shard_batch(batch, mesh))
            .compile()
        )
    counts = collectives(compiled)
    moved = {
        op: counts[op]
        for op in ("all-to-all", "collective-permute", "all-gather")
        if sum(counts[op].values())
    }
    assert moved, f"contiguous split compiled without data movement: {counts}"
    return f"contiguous split: {moved}"


def check_deferred_keys():
    """Each device folds its index into the key: no two draw the same numbers."""
    mesh = make_mesh("auto")
    batch = problem("mean")[2]

    def noisy(params, batch, key):
        draw = jax.random.uniform(key)
        return mlp_loss(params, batch), draw

    fun = jaxaccum.shard_value_and_grad(
        noisy, NUM_MICROBATCHES, mesh=mesh, key_argnums=2, has_aux=True
    )
    key = jax.random.key(3)
    (_, mean_draw), _ = jax.jit(fun)(
        mlp_params(jax.random.key(0)), jaxaccum.shard_batch(batch, mesh), key
    )
    same_key_mean = float(
        jnp.mean(jax.vmap(jax.random.uniform)(jax.random.split(key, NUM_MICROBATCHES)))
    )
    assert abs(float(mean_draw) - same_key_mean) > 1e-6, (
        f"mean draw {float(mean_draw)} equals the one with the same key on every "
        f"device ({same_key_mean})"
    )
    return f"mean draw {float(mean_draw):.4f} vs same-key {same_key_mean:.4f}"


def check_deferred_pad():
    """72 rows = 9 per device, N=4 with pad=True: each device pads its rows."""
    mesh = make_mesh("auto")
    batch = token_batch(72)
    params = mlp_params(jax.random.key(0))

    def padded_loss(params, batch, *, example_mask):
        return token_loss(
            params, {**batch, "mask": batch["mask"] & example_mask[:, None]}
        )

    expected = jax.jit(jax.value_and_grad(token_mean))(params, batch)
    fun = jaxaccum.shard_value_and_grad(
        padded_loss, 4, mesh=mesh, reduction="weighted", pad=True
    )
    result = jax.jit(fun)(params, jaxaccum.shard_batch(batch, mesh))
    assert_matches(result, expected, "deferred pad")
    return "matches"


def check_deferred_noise_scale(reduction):
    """Per-device micro-batch norms (b = B / (N D) = 2 rows), one reduction:
    the estimates average to the population's |G|^2 and tr(Sigma)."""
    mesh = make_mesh("auto")
    x, y = population()
    w = jnp.zeros(x.shape[1])
    loss, options = loss_for(reduction)
    step = jaxaccum.shard_value_and_grad(
        loss, NUM_MICROBATCHES, mesh=mesh, report_stats=True, **options
    )

    def window(key):
        return step(w, *sample(key, x, y, BATCH_SIZE, reduction))[1]

    stats = jax.jit(lambda keys: jax.lax.map(window, keys))(
        jax.random.split(jax.random.key(1), 600)
    )
    norm_sq, trace = truth(w, x, y)
    assert_unbiased(stats.gradient_norm_sq, norm_sq, "|G|^2")
    assert_unbiased(stats.gradient_noise_trace, trace, "tr(Sigma)")
    np.testing.assert_allclose(stats.small_batch.sum(axis=1), stats.big_batch)
    if reduction == "mean":
        np.testing.assert_array_equal(stats.big_batch, BATCH_SIZE)
    return f"unbiased over {stats.big_batch.shape[0]} windows"


def check_fp8_metadata():
    """FP8 metadata (tests/test_fp8.py's model) on 8 devices: each device's
    window maxes its micro-batches', the devices' are maxed once, and the
    result is the big batch's (input and kernel histories bitwise)."""
    from test_fp8 import OPS, batch_of, check_step, make_state

    state, loss = make_state(OPS["direct"])
    mesh = make_mesh("explicit")
    batch = batch_of(jax.random.key(1))
    expected = jax.jit(jax.value_and_grad(loss))(state.params, batch)
    step = jax.jit(jaxaccum.shard_value_and_grad(loss, NUM_MICROBATCHES, mesh=mesh))
    with jax.set_mesh(mesh):
        sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
        actual = step(state.params, sharded)
    check_step(actual, expected, 0)
    return "metadata and gradients equal the big batch's"


def run(name):
    if name == "fp8_metadata_maxed_over_devices":
        return check_fp8_metadata()
    if name.startswith("deferred_noise_scale_"):
        return check_deferred_noise_scale(name.rsplit("_", 1)[1])
    if name == "model_sharded_params_auto":
        return check_model_sharded_params()
    if name == "explicit_indivisible_split_is_an_error":
        return check_explicit_indivisible()
    if name == "contiguous_split_moves_rows":
        return check_contiguous_split_moves_rows()
    if name == "deferred_keys_differ_per_device":
        return check_deferred_keys()
    if name == "deferred_pad_weighted":
        return check_deferred_pad()
    mode, reduction, axis_type = name.rsplit("_", 2)
    return check_step(mode, reduction, axis_type)


def main():
    report(CHECKS, run, NUM_DEVICES)


if __name__ == "__main__":
    sys.exit(main())
