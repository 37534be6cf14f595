"""The ``jaxaccum`` command line: one parser, three commands.

Every error, a bad flag or one raised while a command runs (by jaxaccum, JAX
or the user's loss), prints as one line, ``jaxaccum <command>: error: ...``,
with exit status 2; ``--debug`` prints the traceback too.
"""

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from jaxaccum.cli import _bench_command, _demo, _plan_command


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line, like the rest."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _model_options(sub: argparse.ArgumentParser) -> None:
    """The demo model's options, shared by ``demo`` and ``plan``."""
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


def _bench_arguments(bench_parser: argparse.ArgumentParser) -> None:
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


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="jaxaccum", description="Exact, compiled gradient accumulation for JAX."
    )
    # Subparsers are built by the parent's class: _Parser too.
    commands = parser.add_subparsers(dest="command", required=True)
    common = _Parser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", help="print the traceback of an error"
    )

    demo_parser = commands.add_parser(
        "demo", help="train with accumulation", parents=[common]
    )
    _model_options(demo_parser)
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
        parents=[common],
        description=_plan_command.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _model_options(plan_parser)
    _plan_command.add_arguments(plan_parser)

    _bench_arguments(
        commands.add_parser(
            "bench", help="compare with optax and JAX", parents=[common]
        )
    )
    return parser


def _report(command: str, error: Exception, debug: bool) -> None:
    """Prints ``error`` on stderr as one line (after its traceback if ``debug``).

    ValueError and TypeError messages (jaxaccum's, the command's, most of
    JAX's) are sentences that stand alone; other errors lead with their type
    (``KeyError: 'mask'``). Only a message's first line is printed.
    """
    if debug:
        traceback.print_exception(error)
    lines = str(error).strip().splitlines()
    if not lines:  # a bare raise: say what and where, not nothing
        message = f"{type(error).__name__} with no message{_raised_at(error)}"
    elif type(error) in (ValueError, TypeError):
        message = lines[0]
    else:
        message = f"{type(error).__name__}: {lines[0]}"
    if not debug and len(lines) > 1:
        message += " (--debug for the full message)"
    elif not debug and message != "".join(lines[:1]):
        message += " (--debug for the traceback)"
    print(f"jaxaccum {command}: error: {message}", file=sys.stderr)


def _raised_at(error: Exception) -> str:
    """`` raised in NAME (FILE:LINE)``: the frame that raised ``error``."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    frame = frames[-1]
    return (
        f", raised in {frame.name} ({os.path.basename(frame.filename)}:{frame.lineno})"
    )


def _run(args: argparse.Namespace) -> None:
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxaccum`` console script; returns the exit status
    (2 after an error, which is printed as one line on stderr)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error already printed
        return int(exit_.code or 0)
    try:
        _run(args)
    except Exception as error:
        _report(args.command, error, args.debug)
        return 2
    return 0
