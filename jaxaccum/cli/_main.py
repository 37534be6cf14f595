"""The ``jaxaccum`` command line: one parser, three commands."""

import argparse
from collections.abc import Sequence

from jaxaccum.cli import _bench_command, _demo, _plan_command


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxaccum", description="Exact, compiled gradient accumulation for JAX."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def model_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--batch-size",
            type=int,
            default=8192,
            help="effective batch size (default 8192)",
        )
        sub.add_argument("--features", type=int, default=784)
        sub.add_argument("--width", type=int, default=512, help="hidden width")
        sub.add_argument(
            "--memory-budget",
            default="48MiB",
            help="bytes or e.g. 48MiB, 1GB, 'device' (default 48MiB)",
        )
        sub.add_argument("--learning-rate", type=float, default=1e-3)
        sub.add_argument("--seed", type=int, default=0)

    demo_parser = commands.add_parser("demo", help="train with accumulation")
    model_options(demo_parser)
    demo_parser.add_argument("--steps", type=int, default=100)
    demo_parser.add_argument(
        "--num-microbatches",
        type=int,
        default=None,
        help="override the planner's choice",
    )
    demo_parser.add_argument(
        "--repeats", type=int, default=5, help="timed repeats for the comparison table"
    )
    demo_parser.add_argument("--out", default="jaxaccum-demo")
    demo_parser.add_argument("--quiet", action="store_true", help="no progress bar")

    plan_parser = commands.add_parser(
        "plan",
        help="choose N for a memory budget",
        description=_plan_command.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model_options(plan_parser)
    _plan_command.add_arguments(plan_parser)

    bench_parser = commands.add_parser("bench", help="compare with optax and JAX")
    bench_parser.add_argument(
        "--quick", action="store_true", help="MLP only, fewer N (a few minutes)"
    )
    bench_parser.add_argument(
        "--models",
        nargs="+",
        default=["mlp", "transformer", "cnn"],
        choices=["mlp", "transformer", "cnn"],
    )
    bench_parser.add_argument(
        "--batch-size", type=int, default=8192, help="MLP batch size"
    )
    bench_parser.add_argument("--sequence-batch-size", type=int, default=512)
    bench_parser.add_argument("--image-batch-size", type=int, default=1024)
    bench_parser.add_argument("--num-microbatches", type=int, nargs="+", default=None)
    bench_parser.add_argument(
        "--compile-num-microbatches", type=int, nargs="+", default=None
    )
    bench_parser.add_argument("--repeats", type=int, default=None)
    bench_parser.add_argument("--out", default="jaxaccum-bench")
    bench_parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxaccum`` console script."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        _demo.demo(args)
    elif args.command == "plan":
        _plan_command.plan_command(args)
    else:
        args.num_microbatches = args.num_microbatches or (
            [8, 16] if args.quick else [1, 2, 4, 8, 16, 32]
        )
        args.compile_num_microbatches = args.compile_num_microbatches or (
            [2, 64] if args.quick else [2, 8, 32, 64]
        )
        args.repeats = args.repeats or (3 if args.quick else 5)
        _bench_command.bench_command(args)
    return 0
