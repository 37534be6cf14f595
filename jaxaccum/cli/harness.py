"""Side-by-side benchmark of gradient-accumulation methods, measured in one run:
the harness behind ``jaxaccum bench``, public so that ``benchmarks/`` measure
with the same code.

For a model, a batch and ``N`` micro-batches, every contender runs one whole
training window: the gradient of the batch and one Adam update.

* ``full_batch``: ``jax.value_and_grad`` on the whole batch (the reference;
  needs the whole batch's activations);
* ``jaxaccum``: :func:`jaxaccum.value_and_grad` (one ``lax.scan``);
* ``optax_microbatching``: ``optax.microbatching.microbatch`` of
  ``jax.value_and_grad`` (materialises the micro-batched copy of the batch);
* ``unrolled``: a Python loop over the ``N`` micro-batches inside one
  ``jax.jit`` (the program grows with ``N``);
* ``optax_multisteps``: ``optax.MultiSteps`` driven by a host loop of ``N``
  jitted calls, one per micro-batch, as with a data loader.

The harness compiles ahead of time (compile time measured apart), warms up,
and reports the median wall time of several repeats, plus XLA's compiled
memory (``memory_analysis()``). Ratios are taken within one run on one
machine, never across runs.
"""

import dataclasses
import os
import platform
import statistics
import time
import timeit
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxaccum
from jaxaccum._plan._plan import total_bytes
from jaxaccum._types import Batch, Fun, PyTree
from jaxaccum.cli.models import Task

CONTENDERS = (
    "full_batch",
    "jaxaccum",
    "optax_microbatching",
    "unrolled",
    "optax_multisteps",
)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One contender at one ``N``.

    Attributes:
      contender: the method's name (see the module docstring).
      num_microbatches: ``N``.
      step_seconds: median wall time of one window (gradient + update).
      compile_seconds: time to lower and compile (for the host loop: its one
        jitted mini-step).
      temp_bytes: compiled temporary memory (host loop: of one mini-step).
      total_bytes: arguments + outputs + temporaries - aliased bytes.
    """

    contender: str
    num_microbatches: int
    step_seconds: float
    compile_seconds: float
    temp_bytes: int
    total_bytes: int


def machine() -> str:
    """The machine the figures come from, for result files."""
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, "
        f"{jax.device_count()} x {jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}, optax {optax.__version__}"
    )


def compile_timed(fun: Fun, *args: PyTree) -> tuple[Any, float]:
    """``jax.jit(fun).lower(*args).compile()`` and the seconds it took."""
    start = time.perf_counter()
    compiled = jax.jit(fun).lower(*args).compile()
    return compiled, time.perf_counter() - start


def footprint(compiled: Any) -> tuple[int, int]:
    """``(temp bytes, total bytes)`` of a compiled program."""
    analysis = compiled.memory_analysis()
    return analysis.temp_size_in_bytes, total_bytes(analysis)


def median_seconds(run: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``run()`` (blocked until ready) after one warm-up."""

    def blocked() -> None:
        jax.block_until_ready(run())

    blocked()
    return statistics.median(timeit.repeat(blocked, number=1, repeat=repeats))


def window_step(grad_fn: Fun, optimizer: optax.GradientTransformation) -> Fun:
    """``step(params, opt_state, batch)``: ``grad_fn`` then one optimizer update."""

    def step(params, opt_state, batch):
        loss, grads = grad_fn(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def _unrolled(loss: Fun, num: int) -> Fun:
    def value_and_grads(params, batch):
        total_loss, total_grads = 0.0, jax.tree.map(jnp.zeros_like, params)
        for k in range(num):
            micro = jax.tree.map(lambda x, k=k: x[k::num], batch)
            value, grads = jax.value_and_grad(loss)(params, micro)
            total_loss = total_loss + value
            total_grads = jax.tree.map(jnp.add, total_grads, grads)
        return total_loss / num, jax.tree.map(lambda g: g / num, total_grads)

    return value_and_grads


def _grad_fn(contender: str, loss: Fun, num: int, batch_size: int):
    if contender == "full_batch":
        return jax.value_and_grad(loss)
    if contender == "jaxaccum":
        return jaxaccum.value_and_grad(loss, num)
    if contender == "optax_microbatching":
        return optax.microbatching.microbatch(
            jax.value_and_grad(loss),
            argnums=1,
            microbatch_size=batch_size // num,
            accumulator=optax.microbatching.AccumulationType.MEAN,
        )
    if contender == "unrolled":
        return _unrolled(loss, num)
    raise ValueError(f"Unknown contender {contender!r}; use one of {CONTENDERS}.")


def measure(
    task: Task, batch: Batch, contender: str, num: int, repeats: int
) -> Measurement:
    """Measures one contender on one batch at ``N = num``."""
    optimizer = optax.adam(1e-3)
    params, opt_state = task.params, optimizer.init(task.params)
    batch_size = jax.tree.leaves(batch)[0].shape[0]
    if contender != "optax_multisteps":
        step = window_step(_grad_fn(contender, task.loss, num, batch_size), optimizer)
        compiled, compile_seconds = compile_timed(step, params, opt_state, batch)
        seconds = median_seconds(lambda: compiled(params, opt_state, batch), repeats)
        return Measurement(
            contender, num, seconds, compile_seconds, *footprint(compiled)
        )

    multi = optax.MultiSteps(optimizer, every_k_schedule=num)
    micro_batches = [
        jax.tree.map(lambda x, k=k: x[k], jaxaccum.split_batch(batch, num))
        for k in range(num)
    ]
    mini_step = window_step(jax.value_and_grad(task.loss), multi)
    state = multi.init(params)
    compiled, compile_seconds = compile_timed(
        mini_step, params, state, micro_batches[0]
    )

    def window():
        current_params, current_state = params, state
        for micro in micro_batches:
            current_params, current_state, loss = compiled(
                current_params, current_state, micro
            )
        return current_params, loss

    seconds = median_seconds(window, repeats)
    return Measurement(contender, num, seconds, compile_seconds, *footprint(compiled))


def run_suite(
    task: Task,
    batch_size: int,
    num_microbatches: Sequence[int],
    contenders: Sequence[str] = CONTENDERS,
    repeats: int = 5,
    progress: Callable[[str], None] = lambda _: None,
) -> list[Measurement]:
    """Measures every contender at every ``N`` (full batch once, at N=1)."""
    batch = task.make_batch(jax.random.key(0), batch_size)
    results = []
    for contender in contenders:
        for num in (1,) if contender == "full_batch" else num_microbatches:
            progress(f"{task.name}: {contender} N={num}")
            results.append(measure(task, batch, contender, num, repeats))
    return results


def compile_seconds_vs_n(
    task: Task,
    batch_size: int,
    num_microbatches: Sequence[int],
    contenders: Sequence[str] = ("jaxaccum", "unrolled"),
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, dict[int, float]]:
    """Lower-and-compile seconds of one window, per contender and ``N``."""
    optimizer = optax.adam(1e-3)
    params, opt_state = task.params, optimizer.init(task.params)
    batch = jax.eval_shape(lambda: task.make_batch(jax.random.key(0), batch_size))
    seconds: dict[str, dict[int, float]] = {}
    for contender in contenders:
        seconds[contender] = {}
        for num in num_microbatches:
            progress(f"compile {task.name}: {contender} N={num}")
            step = window_step(
                _grad_fn(contender, task.loss, num, batch_size), optimizer
            )
            seconds[contender][num] = compile_timed(step, params, opt_state, batch)[1]
    return seconds
