"""Strided splitting and the errors bad input gets."""

import dataclasses
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaccum


def loss(params, batch):
    return jnp.mean(batch["x"] @ params["w"])


PARAMS = {"w": jnp.ones(3)}


def test_split_batch_is_strided():
    batch = {"x": jnp.arange(12).reshape(6, 2), "y": jnp.arange(6)}
    micro = jaxaccum.split_batch(batch, 3)
    assert micro["x"].shape == (3, 2, 2)
    np.testing.assert_array_equal(micro["y"], [[0, 3], [1, 4], [2, 5]])
    np.testing.assert_array_equal(micro["x"][1], batch["x"][1::3])


def test_split_batch_matches_the_accumulation_order():
    """Micro-batch k of split_batch is what value_and_grad feeds as micro-batch k."""
    batch = {"x": jnp.arange(24.0).reshape(8, 3)}

    def first_row(params, batch):
        return loss(params, batch), batch["x"][0]

    (_, firsts), _ = jaxaccum.value_and_grad(
        first_row, 4, has_aux=True, aux_reduction="stack"
    )(PARAMS, batch)
    np.testing.assert_array_equal(firsts, jaxaccum.split_batch(batch, 4)["x"][:, 0])


def errors(*args, **kwargs):
    """Calls value_and_grad(loss, ...)(*args) and returns the exception raised."""
    construct_kwargs = {k: v for k, v in kwargs.items() if k != "args"}
    call_args = kwargs.get("args", (PARAMS, {"x": jnp.ones((12, 3))}))
    with pytest.raises((ValueError, TypeError)) as info:
        jaxaccum.value_and_grad(loss, *args, **construct_kwargs)(*call_args)
    return info.value


def test_not_divisible_lists_the_counts_that_work():
    error = errors(5)
    assert isinstance(error, ValueError)
    message = str(error)
    assert "Batch size 12 is not divisible by num_microbatches=5" in message
    assert "[1, 2, 3, 4, 6, 12]" in message


def test_microbatch_size_not_dividing():
    message = str(errors(microbatch_size=5))
    assert "microbatch_size=5" in message and "[1, 2, 3, 4, 6, 12]" in message


def test_leaves_with_different_leading_sizes_are_named():
    batch = {"x": jnp.ones((12, 3)), "mask": jnp.ones((10,))}
    message = str(errors(2, args=(PARAMS, batch)))
    assert "args[1]['mask']: 10" in message and "args[1]['x']: 12" in message
    assert "same leading" in message


@pytest.mark.parametrize("bad", [0, -2])
def test_count_below_one(bad):
    with pytest.raises(
        ValueError, match=re.escape(f"num_microbatches must be >= 1, got {bad}")
    ):
        jaxaccum.value_and_grad(loss, bad)


@pytest.mark.parametrize("bad", [2.0, True, jnp.array(2), "4"])
def test_count_not_an_int(bad):
    with pytest.raises(
        TypeError, match="num_microbatches must be a positive Python int"
    ):
        jaxaccum.value_and_grad(loss, bad)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_microbatches": 2**31}, ValueError, "at most 2\\*\\*31 - 1"),
        ({"num_microbatches": 2, "unroll": "2"}, TypeError, "unroll must be"),
        ({"num_microbatches": 2, "unroll": 0}, ValueError, "unroll must be >= 1"),
    ],
)
def test_counts_are_checked_with_their_name(kwargs, error, message):
    with pytest.raises(error, match=message):
        jaxaccum.value_and_grad(loss, **kwargs)


@pytest.mark.parametrize("kwargs", [{}, {"num_microbatches": 2, "microbatch_size": 6}])
def test_exactly_one_of_count_and_size(kwargs):
    with pytest.raises(ValueError, match="exactly one of num_microbatches"):
        jaxaccum.value_and_grad(loss, **kwargs)


def test_scalar_batch_leaf_is_named():
    batch = {"x": jnp.ones((12, 3)), "temperature": jnp.float32(0.5)}
    message = str(errors(2, args=(PARAMS, batch)))
    assert "args[1]['temperature'] is a scalar" in message
    assert "non-batch argument" in message


def test_integer_leaf_in_differentiated_argument_is_named():
    params = {"w": jnp.ones(3), "step": jnp.array(3, jnp.int32)}
    error = errors(2, args=(params, {"x": jnp.ones((12, 3))}))
    assert isinstance(error, TypeError)
    message = str(error)
    assert "args[0]['step']" in message and "int32" in message
    assert "Cast it to a float dtype" in message


def test_overlapping_argnums():
    with pytest.raises(ValueError, match="Argument 1 is in argnums and batch_argnums"):
        jaxaccum.value_and_grad(loss, 2, argnums=1, batch_argnums=1)


def test_unknown_reduction():
    with pytest.raises(ValueError, match="reduction must be one of"):
        jaxaccum.value_and_grad(loss, 2, reduction="median")


def test_bad_aux_reduction_names_the_options():
    def with_aux(params, batch):
        return loss(params, batch), {"a": jnp.ones(())}

    for bad in ("median", {"b": "mean"}):
        with pytest.raises(ValueError, match="aux"):
            jaxaccum.value_and_grad(with_aux, 2, has_aux=True, aux_reduction=bad)(
                PARAMS, {"x": jnp.ones((12, 3))}
            )


def test_too_few_arguments():
    with pytest.raises(TypeError, match="at least 2 positional arguments"):
        jaxaccum.value_and_grad(loss, 2)(PARAMS)


def test_empty_batch():
    with pytest.raises(ValueError, match="contain no arrays"):
        jaxaccum.value_and_grad(loss, 2)(PARAMS, {})


def test_split_batch_errors_name_the_leaf():
    with pytest.raises(ValueError, match=r"batch\['y'\]: 5"):
        jaxaccum.split_batch({"x": jnp.ones(4), "y": jnp.ones(5)}, 2)
    with pytest.raises(ValueError, match="not divisible"):
        jaxaccum.split_batch(jnp.ones(5), 2)


def test_errors_are_raised_at_trace_time_under_jit():
    fun = jax.jit(jaxaccum.value_and_grad(loss, 5))
    with pytest.raises(ValueError, match="not divisible"):
        fun(PARAMS, {"x": jnp.ones((12, 3))})


def test_split_does_not_copy_the_batch():
    """The strided view is indexed inside the scan: no (N, B/N, ...) copy."""
    batch = {"x": jnp.ones((4096, 512)), "y": jnp.ones((4096,))}
    params = {"w": jnp.ones(512)}

    def linear_loss(params, batch):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    batch_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(batch))
    compiled = (
        jax.jit(jaxaccum.value_and_grad(linear_loss, 16)).lower(params, batch).compile()
    )
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 0.25 * batch_bytes, f"temp {temp} B vs batch {batch_bytes} B"


@dataclasses.dataclass(frozen=True)
class Axis:
    """A named axis that keeps its size, as haliax's ``Axis`` does."""

    name: str
    size: int


class NamedRows:
    """A pytree node whose static data holds its axes' sizes (haliax-like)."""

    def __init__(self, array, axes):
        self.array, self.axes = array, axes


jax.tree_util.register_pytree_node(
    NamedRows,
    lambda node: ((node.array,), node.axes),
    lambda axes, children: NamedRows(children[0], axes),
)


@pytest.mark.parametrize(
    "axes",
    [
        (Axis("batch", 32), Axis("feature", 3)),
        (32, 3),
        (np.int64(32), 3),  # issue 30, case 3: every integer type
        (Axis("batch", np.int32(32)),),
        (jnp.int32(32),),
    ],
)
def test_static_batch_size_in_a_node_is_refused(axes):
    """Splitting would cut the arrays but not the size in the node's static data."""
    batch = {"x": NamedRows(jnp.ones((32, 3)), axes)}

    def named_loss(params, batch):
        return jnp.mean(batch["x"].array @ params["w"])

    with pytest.raises(ValueError) as error:
        jaxaccum.value_and_grad(named_loss, 4)(PARAMS, batch)
    message = str(error.value)
    for part in (
        "args[1]['x']",
        "NamedRows",
        "batch size 32",
        "jaxaccum.register_batch_node(NamedRows",
        "raw arrays",
    ):
        assert part in message, message


class Classes:
    """A node whose static data is an unrelated int (its number of classes)."""

    def __init__(self, labels, num_classes):
        self.labels, self.num_classes = labels, num_classes


jax.tree_util.register_pytree_node(
    Classes,
    lambda node: ((node.labels,), node.num_classes),
    lambda num_classes, children: Classes(children[0], num_classes),
)


def test_registered_node_without_a_batch_size_is_split():
    """num_classes=10 on 10 rows looks like a batch size; registering the type
    without resize says it is not (the refusal's way out)."""

    def classes_loss(params, batch):
        one_hot = jax.nn.one_hot(batch.labels, batch.num_classes)
        return jnp.mean(one_hot[:, :3] @ params["w"])

    batch = Classes(jnp.arange(10) % 4, 10)
    with pytest.raises(ValueError, match=r"register_batch_node\(Classes\)"):
        jaxaccum.value_and_grad(classes_loss, 2)(PARAMS, batch)
    jaxaccum.register_batch_node(Classes)
    chex.assert_trees_all_close(
        jaxaccum.value_and_grad(classes_loss, 2)(PARAMS, batch),
        jax.value_and_grad(classes_loss)(PARAMS, batch),
    )


class SizedRows:
    """A node whose static data is its number of rows, as a NumPy int."""

    def __init__(self, x, size):
        self.x, self.size = x, size


jax.tree_util.register_pytree_node(
    SizedRows,
    lambda node: ((node.x,), node.size),
    lambda size, children: SizedRows(children[0], size),
)


def test_registered_resize_labels_every_micro_batch():
    """With resize, each micro-batch says its own size: a loss that divides by
    it (issue 30, case 3, halved at N=2 before) gives the full-batch mean."""

    def sized_loss(params, batch):
        assert batch.size == batch.x.shape[0], (batch.size, batch.x.shape)
        return jnp.sum(batch.x @ params["w"]) / batch.size

    jaxaccum.register_batch_node(SizedRows, lambda size, rows: np.int64(rows))
    batch = SizedRows(jnp.arange(24.0).reshape(8, 3), np.int64(8))
    for num in (2, 4):
        chex.assert_trees_all_close(
            jaxaccum.value_and_grad(sized_loss, num)(PARAMS, batch),
            jax.value_and_grad(sized_loss)(PARAMS, batch),
        )
    assert jaxaccum.split_batch(batch, 4).size == 2
    window = jaxaccum.pad_microbatches(batch, 2, 3)
    assert (window.size, window.x.shape[0]) == (12, 12)


def test_static_data_without_the_batch_size_is_split():
    """A node whose static data does not hold the batch size splits as usual."""
    batch = {"x": NamedRows(jnp.arange(96.0).reshape(32, 3), ("rows", "features"))}

    def named_loss(params, batch):
        return jnp.mean(jnp.sin(batch["x"].array @ params["w"]))

    accumulated = jaxaccum.value_and_grad(named_loss, 4)(PARAMS, batch)
    # Float32 sums of 32 terms in two orders: within 2 * 32 * 2**-24 = 3.8e-6.
    chex.assert_trees_all_close(
        accumulated, jax.value_and_grad(named_loss)(PARAMS, batch), rtol=1e-5
    )


def test_pad_with_prng_key_leaves_equals_the_full_batch():
    """Per-example keys are padded with valid keys; their rows are masked out."""
    batch = {"x": jnp.arange(30.0), "key": jax.random.split(jax.random.key(0), 30)}

    def noisy_loss(w, batch, example_mask=None):
        noise = jax.vmap(jax.random.normal)(batch["key"])
        losses = (w * batch["x"] + noise) ** 2
        mask = jnp.ones(losses.shape) if example_mask is None else example_mask
        return jnp.sum(losses * mask), jnp.sum(mask)

    def mean_loss(w, batch):
        total, weight = noisy_loss(w, batch)
        return total / weight

    accumulated = jaxaccum.value_and_grad(
        noisy_loss, 4, reduction="weighted", pad=True
    )(1.0, batch)
    # Float32 sums of 30 terms in two orders: within 2 * 30 * 2**-24 = 3.6e-6.
    chex.assert_trees_all_close(
        accumulated, jax.value_and_grad(mean_loss)(1.0, batch), rtol=1e-5
    )


class Labelled:
    """A node whose static data is its number of rows (for the issue 35
    cases: each test registers it as it needs)."""

    def __init__(self, x, size):
        self.x, self.size = x, size


jax.tree_util.register_pytree_node(
    Labelled,
    lambda node: ((node.x,), node.size),
    lambda size, children: Labelled(children[0], size),
)


def labelled_loss(params, batch):
    return jnp.sum(jnp.tanh(batch.x @ params["w"])) / batch.size


LABELLED = Labelled(jnp.arange(24.0).reshape(8, 3) / 24, 8)


def test_resize_that_keeps_the_batch_size_is_refused():
    """Issue 35, case 2: a resize returning the static data unchanged gave a
    value off by N (1.9547 for 5.8642); the size jaxaccum asked for is not in
    what it returned, so it is refused, naming both sizes."""
    jaxaccum.register_batch_node(Labelled, lambda static, size: static)
    with pytest.raises(ValueError) as error:
        jaxaccum.value_and_grad(labelled_loss, 2)(PARAMS, LABELLED)
    for part in ("Labelled", "static data of 4 rows", "of 8 rows", "returned 8"):
        assert part in str(error.value), str(error.value)


def test_registering_again_retraces_jitted_functions():
    """Issue 35, case 3: a step jitted before a type is registered again uses
    the new resize (the old one stayed in JAX's cache before)."""
    calls = []

    def resize(static, size):
        calls.append("first")
        return size

    jaxaccum.register_batch_node(Labelled, resize)
    step = jax.jit(jaxaccum.value_and_grad(labelled_loss, 2))
    first = step(PARAMS, LABELLED)

    def corrected(static, size):
        calls.append("second")
        return size

    jaxaccum.register_batch_node(Labelled, corrected)
    second = step(PARAMS, LABELLED)
    assert "second" in calls, calls
    chex.assert_trees_all_equal(first, second)
    chex.assert_trees_all_close(
        first, jax.value_and_grad(labelled_loss)(PARAMS, LABELLED)
    )


def test_one_padded_micro_batch_is_labelled_with_its_rows():
    """Issue 35, case 4: pad=True with one micro-batch longer than the batch
    (microbatch_size=16, 10 rows) labels it 16 rows (it said 10)."""
    jaxaccum.register_batch_node(Labelled, lambda static, size: size)
    seen = []

    def weighted(params, batch, example_mask):
        seen.append((batch.size, batch.x.shape[0]))
        losses = jnp.tanh(batch.x @ params["w"]) * batch.x.shape[0] / batch.size
        return jnp.sum(losses * example_mask), jnp.sum(example_mask) * 1.0

    batch = Labelled(jnp.arange(30.0).reshape(10, 3) / 30, 10)
    value, grads = jaxaccum.value_and_grad(
        weighted, microbatch_size=16, pad=True, reduction="weighted"
    )(PARAMS, batch)
    assert seen == [(16, 16)], seen

    def mean_loss(params, batch):
        return jnp.mean(jnp.tanh(batch.x @ params["w"]))

    chex.assert_trees_all_close(
        (value, grads), jax.value_and_grad(mean_loss)(PARAMS, batch)
    )


class NotANode:
    """A class JAX takes as a leaf (issue 45, case 8: registering it was
    accepted silently and could never apply)."""


@pytest.mark.parametrize(
    ("node_type", "resize", "message"),
    [
        (int, None, "int is a leaf type"),
        (np.ndarray, None, "ndarray is a leaf type"),
        (Labelled, lambda static: static, "two positional arguments"),
        (Labelled, "size", "must be a function"),
        ("Labelled", None, "must be a class"),
        (NotANode, None, "NotANode is not a pytree node type"),
    ],
)
def test_register_batch_node_refuses_what_cannot_work(node_type, resize, message):
    """Issue 35: a leaf type or a one-argument resize was accepted, failing
    later with a bare TypeError."""
    with pytest.raises(TypeError, match=message):
        jaxaccum.register_batch_node(node_type, resize)


@pytest.mark.parametrize("accumulate", ["value_and_grad", "split_batch", "plan"])
def test_batch_of_no_rows_is_refused(accumulate):
    """Issue 35: an empty batch raised ZeroDivisionError (_split.py) or
    IndexError (_plan.py)."""
    batch = {"x": jnp.ones((0, 3))}
    with pytest.raises(
        ValueError, match=r"args\[1\]\['x'\] has 0 rows|batch\['x'\] has 0 rows"
    ):
        if accumulate == "value_and_grad":
            jaxaccum.value_and_grad(loss, microbatch_size=2)(PARAMS, batch)
        elif accumulate == "split_batch":
            jaxaccum.split_batch(batch, 1)
        else:
            jaxaccum.plan(loss, PARAMS, batch, memory_budget="1MiB")
