"""``jaxaccum plan``: the memory planner on your own loss, or the demo MLP.

    jaxaccum plan mypackage.train:loss_fn --params mypackage.train:init_params \\
        --batch "x=float32[8192,784],y=int32[8192]" --memory-budget 2GiB

``LOSS`` is ``module:function``, ``loss(params, batch)`` as for
:func:`jaxaccum.value_and_grad`. ``--params`` and ``--batch`` name a
``module:attribute`` holding a pytree of arrays or ``jax.ShapeDtypeStruct``
(or a function of no arguments returning one); ``--batch`` may instead give
its leaves' dtypes and shapes inline. Nothing is run and no data is needed:
the step is compiled for shapes. The current directory is importable, as with
``python -m``. In Python, call :func:`jaxaccum.plan` directly.
"""

import argparse
import importlib
import re
import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxaccum
from jaxaccum.cli._console import console

_LEAF = re.compile(r"\s*([A-Za-z_]\w*)\s*=\s*(\w+)\[([\d\s,]*)\]\s*(?:,|$)")


def resolve(reference: str) -> Any:
    """The object ``module:attribute`` (dotted attributes allowed) names; a
    function of no arguments is called."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise SystemExit(
            f"jaxaccum plan: {reference!r} is not module:attribute, e.g. "
            "mypackage.train:loss_fn."
        )
    if "" not in sys.path:  # console scripts leave the working directory out
        sys.path.insert(0, "")
    value: Any = importlib.import_module(module_name)
    for name in attribute.split("."):
        value = getattr(value, name)
    return value


def _value(reference: str) -> Any:
    value = resolve(reference)
    return value() if callable(value) else value


def parse_batch(spec: str) -> Any:
    """``--batch``: ``module:attribute``, or leaves as ``name=dtype[d0,d1,...]``
    separated by commas (e.g. ``x=float32[8192,784],y=int32[8192]``)."""
    if "=" not in spec:
        return _value(spec)
    leaves, position = {}, 0
    while position < len(spec):
        match = _LEAF.match(spec, position)
        if match is None:
            raise SystemExit(
                f"jaxaccum plan: cannot read --batch {spec!r} from character "
                f"{position}: write leaves as name=dtype[d0,d1,...] separated by "
                "commas, e.g. x=float32[8192,784],y=int32[8192]."
            )
        name, dtype, dims = match.groups()
        shape = tuple(int(d) for d in dims.replace(" ", "").split(",") if d)
        leaves[name] = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
        position = match.end()
    return leaves


def _optimizer(name: str, learning_rate: float) -> optax.GradientTransformation | None:
    if name == "none":
        return None
    if not callable(getattr(optax, name, None)):
        raise SystemExit(f"jaxaccum plan: optax has no optimizer {name!r}.")
    return getattr(optax, name)(learning_rate)


def plan_command(args: argparse.Namespace) -> jaxaccum.MemoryPlan:
    """Plans the user's loss (``args.loss``), else the demo MLP."""
    if args.loss is None:
        from jaxaccum.cli._demo import batch_shapes, demo_task

        task = demo_task(args)
        loss, params, batch = (
            task.loss,
            task.params,
            batch_shapes(task, args.batch_size),
        )
        name = f"Model {task.name}"
    else:
        if args.params is None or args.batch is None:
            raise SystemExit("jaxaccum plan LOSS needs --params and --batch.")
        loss, params, batch = (
            resolve(args.loss),
            _value(args.params),
            parse_batch(args.batch),
        )
        name = f"Loss {args.loss}"
    optimizer = _optimizer(args.optimizer, args.learning_rate)
    result = jaxaccum.plan(
        loss,
        params,
        batch,
        memory_budget=args.memory_budget,
        candidates=args.candidates,
        optimizer=optimizer,
        remat=args.remat,
    )
    counted = "parameters and optimizer state count" if optimizer else "gradients only"
    console.print(f"{name}, optimizer {args.optimizer}; {counted}.")
    console.print(str(result))
    console.print(
        "Use jaxaccum.value_and_grad(loss, "
        f"num_microbatches={result.num_microbatches})."
    )
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The plan command's own arguments (the demo model's are added apart)."""
    parser.add_argument(
        "loss",
        nargs="?",
        default=None,
        help="module:function, loss(params, batch); default: the demo MLP",
    )
    parser.add_argument("--params", help="module:attribute holding the params")
    parser.add_argument(
        "--batch",
        help="module:attribute, or leaves like x=float32[8192,784],y=int32[8192]",
    )
    parser.add_argument(
        "--optimizer",
        default="adam",
        help="an optax optimizer taking a learning rate, or none (default adam)",
    )
    parser.add_argument("--candidates", type=int, nargs="+", default=None)
    parser.add_argument("--remat", action="store_true", help="jax.checkpoint the loss")
