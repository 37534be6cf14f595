"""``jaxaccum plan``: the memory planner on your own loss, or the demo MLP.

    jaxaccum plan mypackage.train:loss_fn --params mypackage.train:init_params \\
        --batch "x=float32[8192,784],y=int32[8192]" --memory-budget 2GiB

``LOSS`` is ``module:function``, ``loss(params, batch)`` as for
:func:`jaxaccum.value_and_grad`. ``--params`` and ``--batch`` name a
``module:attribute`` holding a pytree of arrays or ``jax.ShapeDtypeStruct``
(or a function of no arguments returning one); ``--batch`` may instead give
its leaves' dtypes and shapes inline, or one array as ``dtype[d0,d1,...]``.
Nothing is run and no data is needed: the step is compiled for shapes. The
current directory is importable, as with ``python -m``.

Describe the loss as you will to :func:`jaxaccum.value_and_grad`:

    --has-aux                 loss returns (loss, aux)
    --reduction weighted      loss returns (loss_sum, weight)
    --batch-argnums 1,2       loss(params, x, y): one --batch per batch argument
    --key-argnums 2           loss(params, batch, key): a PRNG key (dropout)

For example, ``loss(params, x, y, key)`` returning ``(loss, aux)``:

    jaxaccum plan train:loss --params train:init_params --has-aux \\
        --batch-argnums 1,2 --batch "float32[8192,784]" --batch "int32[8192]" \\
        --key-argnums 3

Errors print one line; ``--debug`` shows the traceback. In Python, call
:func:`jaxaccum.plan` directly.
"""

import argparse
import inspect
from typing import Any, NamedTuple

import optax

import jaxaccum
from jaxaccum._types import AUX_REDUCTIONS, REDUCTIONS, Fun
from jaxaccum.cli import _pipeline_plan
from jaxaccum.cli._console import console
from jaxaccum.cli._flags import check_divides, count, loss_flags_given
from jaxaccum.cli._user_loss import (
    argnums,
    loss_arguments,
    loss_options,
    output_hint,
    resolve,
)

_SCALAR_OUTPUT = "Gradient only defined for scalar-output functions"


# Left out of the choices: lbfgs's update needs the loss's value and function
# (value_fn=...), which a step of gradients alone does not give it;
# optimistic_adam is deprecated (optimistic_adam_v2 is offered); noisy_sgd
# wants a PRNG key that the planned step does not thread.
_LEFT_OUT = ("lbfgs", "optimistic_adam", "noisy_sgd")


def optimizers() -> tuple[str, ...]:
    """The ``--optimizer`` choices: optax's optimizers, the functions taking
    the learning rate first, less its ``scale_by_*`` building blocks and
    those a step of gradients alone cannot run well (``_LEFT_OUT``)."""
    names = []
    for name in dir(optax):
        function = getattr(optax, name)
        if (
            not inspect.isfunction(function)
            or name.startswith(("_", "scale_by_"))
            or name in _LEFT_OUT
        ):
            continue
        parameters = list(inspect.signature(function).parameters)
        if parameters[:1] == ["learning_rate"]:
            names.append(name)
    return tuple(names)


def _optimizer(
    name: str | None, learning_rate: float
) -> optax.GradientTransformation | None:
    """``optax.<name>(learning_rate)`` (``adam`` when not given); None for
    ``none`` (a choice of :func:`optimizers`, checked when parsed)."""
    name = name or "adam"
    return None if name == "none" else getattr(optax, name)(learning_rate)


def check_flags(args: argparse.Namespace) -> None:
    """Checks the flags together, before anything is imported or compiled:
    the demo MLP's (without LOSS) or the user's loss's.

    Raises:
      ValueError: naming the flags.
    """
    if args.stages is not None:
        _pipeline_plan.check_flags(args)
    elif args.loss is None:
        _check_demo_flags(args)
    else:
        _check_loss_flags(args)


def _check_demo_flags(args: argparse.Namespace) -> None:
    given = loss_flags_given(args)
    if given:
        raise ValueError(
            f"{', '.join(given)}: for your own loss, named as LOSS (module:function);"
            " without LOSS, plan plans the demo MLP."
        )
    if args.candidates is not None:
        check_divides("--candidates", args.candidates, "--batch-size", args.batch_size)


def _check_loss_flags(args: argparse.Namespace) -> None:
    if args.params is None or args.batch is None:
        raise ValueError("LOSS needs --params and --batch.")
    if args.aux_reduction is not None and not args.has_aux:
        raise ValueError("--aux-reduction needs --has-aux: it reduces the aux.")
    batch_nums = args.batch_argnums or (1,)
    key_nums = args.key_argnums or ()
    if len(args.batch) != len(batch_nums):
        raise ValueError(
            f"LOSS has {len(batch_nums)} batch argument(s) (--batch-argnums "
            f"{','.join(map(str, batch_nums))}) but --batch was given "
            f"{len(args.batch)} time(s): give one --batch per batch argument, "
            "in the same order."
        )
    both = sorted(set(batch_nums) & set(key_nums))
    if both:
        raise ValueError(
            f"argument(s) {both} are in both --batch-argnums and --key-argnums."
        )
    numbered = {0, *batch_nums, *key_nums}
    # Not range(max(numbered)): a number may be as large as 2**31 - 1.
    missing = set(range(len(numbered))) - numbered
    if missing:
        raise ValueError(
            f"LOSS argument {min(missing)} has no value: argument 0 is --params, "
            f"the others, up to {max(numbered)}, must each be in --batch-argnums "
            "or --key-argnums."
        )


class _Step(NamedTuple):
    """What is planned: a loss, its arguments and value_and_grad's keywords."""

    name: str
    loss: Fun
    args: tuple
    options: dict[str, Any]


def _user_step(args: argparse.Namespace) -> _Step:
    loss = resolve(args.loss)
    if not callable(loss):
        raise ValueError(
            f"LOSS {args.loss!r} names a {type(loss).__name__}, not a function: "
            "name the loss function, e.g. mypackage.train:loss_fn."
        )
    options = loss_options(args)
    return _Step(f"Loss {args.loss}", loss, loss_arguments(args, options), options)


def _demo_step(args: argparse.Namespace) -> _Step:
    from jaxaccum.cli._demo import batch_shapes, demo_task

    task = demo_task(args)
    call_args = (task.params, batch_shapes(task, args.batch_size))
    options = {"remat": True} if args.remat else {}
    return _Step(f"Model {task.name}", task.loss, call_args, options)


def plan_command(args: argparse.Namespace) -> Any:
    """Plans the user's loss (``args.loss``), else the demo MLP (pipelined,
    with ``--stages``)."""
    if args.stages is not None:
        return _pipeline_plan.pipeline_plan_command(args)
    step = _demo_step(args) if args.loss is None else _user_step(args)
    optimizer = _optimizer(args.optimizer, args.learning_rate)
    try:
        result = jaxaccum.plan(
            step.loss,
            *step.args,
            memory_budget=args.memory_budget,
            candidates=args.candidates,
            optimizer=optimizer,
            **step.options,
        )
    except TypeError as error:
        hint = output_hint(step.loss, step.args, step.options)
        if hint is None:
            raise
        raise ValueError(hint) from error
    counted = "parameters and optimizer state count" if optimizer else "gradients only"
    console.print(
        f"{step.name}, optimizer {args.optimizer or 'adam'}; {counted}.",
        markup=False,
        soft_wrap=True,
    )
    console.print(str(result), markup=False, soft_wrap=True)
    keywords = "".join(f", {key}={value!r}" for key, value in step.options.items())
    console.print(
        "Use jaxaccum.value_and_grad(loss, "
        f"num_microbatches={result.num_microbatches}{keywords}).",
        markup=False,
        soft_wrap=True,
    )
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The plan command's own arguments (the demo model's are added apart)."""
    parser.add_argument(
        "loss",
        metavar="LOSS",
        nargs="?",
        default=None,
        help="module:function, loss(params, batch) returning a scalar (see "
        "--has-aux, --reduction, --batch-argnums); default: the demo MLP",
    )
    parser.add_argument(
        "--params", help="module:attribute holding the params (argument 0)"
    )
    parser.add_argument(
        "--batch",
        action="append",
        help="module:attribute, one array like float32[8192,784], or leaves like "
        "x=float32[8192,784],y=int32[8192]; once per batch argument",
    )
    parser.add_argument(
        "--has-aux", action="store_true", help="LOSS returns (loss, aux)"
    )
    parser.add_argument(
        "--reduction",
        choices=REDUCTIONS,
        default=None,
        help="what LOSS's loss is over its batch; weighted: LOSS returns "
        "(loss_sum, weight) (default mean)",
    )
    parser.add_argument(
        "--aux-reduction",
        choices=AUX_REDUCTIONS,
        default=None,
        help="how aux combines over micro-batches, with --has-aux (default mean)",
    )
    parser.add_argument(
        "--batch-argnums",
        type=argnums,
        default=None,
        metavar="I[,J...]",
        help="LOSS's batch arguments, e.g. 1,2 for loss(params, x, y) (default 1)",
    )
    parser.add_argument(
        "--key-argnums",
        type=argnums,
        default=None,
        metavar="I[,J...]",
        help="LOSS's PRNG key arguments (dropout), e.g. 2 for "
        "loss(params, batch, key); planned with jax.random.key(0)",
    )
    parser.add_argument(
        "--optimizer",
        choices=("none", *optimizers()),
        default=None,
        metavar="NAME",
        help="an optax optimizer, built with --learning-rate, or none (gradients "
        "only): %(choices)s (default adam)",
    )
    parser.add_argument(
        "--candidates",
        type=count("each candidate number of micro-batches"),
        nargs="+",
        default=None,
        help="the numbers of micro-batches to consider, each dividing the batch "
        "size (default every divisor); with --stages, the window's M (default "
        "S, 2S, ..., 32S)",
    )
    parser.add_argument("--remat", action="store_true", help="jax.checkpoint the loss")
    _pipeline_plan.add_arguments(parser)
