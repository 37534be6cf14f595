"""``jaxaccum plan --stages S``: the pipeline's planner on the demo MLP cut
into ``S`` stages (:func:`jaxaccum.cli.models.pipelined_mlp_task`), on a
mesh of ``S`` stages by ``--data-shards`` devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        jaxaccum plan --stages 4 --data-shards 2 --memory-budget 64MiB

The micro-batch is fixed (``--microbatch-rows`` on each data shard) and the
window grows: it prints :func:`jaxaccum.plan_pipeline`'s table of ``M`` and
``remat`` and the one it chooses (gradients only: no optimizer state).
"""

import argparse
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum.cli import models
from jaxaccum.cli._console import console
from jaxaccum.cli._flags import loss_flags_given


def check_flags(args: argparse.Namespace) -> None:
    """Refuses the flags a pipelined plan does not use, before any work: the
    user's loss and the flags describing it, the optimizer's and the batch
    size (``--learning-rate`` and ``--batch-size`` are given when not their
    defaults)."""
    others = (
        ("--optimizer", args.optimizer),
        ("--learning-rate", args.learning_rate != 1e-3),
        ("--batch-size", args.batch_size != 8192),
    )
    given = ["LOSS"] if args.loss is not None else []
    given += loss_flags_given(args)
    given += [flag for flag, value in others if value not in (None, False)]
    if given:
        raise ValueError(
            f"{', '.join(given)}: not with --stages, which plans the demo MLP "
            "pipelined (LOSS and the flags describing it are for plan without "
            "--stages), gradients only (no optimizer), its batch M x "
            "--microbatch-rows x --data-shards (M chosen)."
        )


def _mesh(args: argparse.Namespace) -> jax.sharding.Mesh:
    needed = args.stages * args.data_shards
    devices = jax.devices()
    if len(devices) < needed:
        raise ValueError(
            f"--stages {args.stages} x --data-shards {args.data_shards} needs "
            f"{needed} devices; this machine has {len(devices)} "
            f"({devices[0].platform}). On CPU, run with XLA_FLAGS="
            f"--xla_force_host_platform_device_count={needed}."
        )
    if args.data_shards == 1:
        return jax.make_mesh((args.stages,), ("stage",), devices=devices[:needed])
    return jax.make_mesh(
        (args.stages, args.data_shards), ("stage", "data"), devices=devices[:needed]
    )


def pipeline_plan_command(args: argparse.Namespace) -> jaxaccum.PipelinePlan:
    """Plans the pipelined demo MLP and prints the table."""
    mesh = _mesh(args)
    task = models.pipelined_mlp_task(
        args.features, args.width, args.stages * args.repeats, seed=args.seed
    )
    stage_sharding = NamedSharding(mesh, P("stage"))
    params = (
        task.params[0],
        jax.tree.map(lambda p: jax.device_put(p, stage_sharding), task.params[1]),
        task.params[2],
    )
    rows = args.microbatch_rows * args.data_shards
    microbatch = jax.eval_shape(lambda: task.make_batch(jax.random.key(0), rows))
    data_axis = "data" if args.data_shards > 1 else None
    options: dict[str, Any] = {"remat": True} if args.remat else {}
    result = jaxaccum.plan_pipeline(
        task.stage_fn,
        task.loss_fn,
        params,
        microbatch,
        memory_budget=args.memory_budget,
        mesh=mesh,
        embed_fn=task.embed_fn,
        data_axis=data_axis,
        repeats=args.repeats,
        candidates=args.candidates,
        **options,
    )
    console.print(
        f"Model {task.name} on {dict(mesh.shape)}; gradients only.",
        markup=False,
        soft_wrap=True,
    )
    console.print(str(result), markup=False, soft_wrap=True)
    console.print(
        "Use jaxaccum.pipeline_value_and_grad(stage_fn, loss_fn, "
        f"num_microbatches={result.num_microbatches}, "
        f"schedule={result.schedule!r}, remat={result.remat!r}, "
        f"repeats={args.repeats}, data_axis={data_axis!r}, ...).",
        markup=False,
        soft_wrap=True,
    )
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a pipelined plan (``--stages`` turns it on)."""
    from jaxaccum.cli._flags import count

    parser.add_argument(
        "--stages",
        type=count("the number of pipeline stages"),
        default=None,
        help="plan the demo MLP pipelined over this many stage devices "
        "(jaxaccum.plan_pipeline); --candidates are then M",
    )
    parser.add_argument(
        "--data-shards",
        type=count("the number of data shards"),
        default=1,
        help="with --stages: data-parallel devices per stage (default 1)",
    )
    parser.add_argument(
        "--repeats",
        type=count("the number of stages per device"),
        default=1,
        help="with --stages: stages per device, circular (default 1)",
    )
    parser.add_argument(
        "--microbatch-rows",
        type=count("the rows of a micro-batch"),
        default=256,
        help="with --stages: rows of a micro-batch on each data shard (default 256)",
    )
