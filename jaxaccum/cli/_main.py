"""The ``jaxaccum`` command line: one parser, three commands.

Every error, a bad flag or one raised while a command runs (by jaxaccum, JAX
or the user's loss), prints as one line, ``jaxaccum <command>: error: ...``,
with exit status 2; ``--debug`` prints the traceback too. Flags are checked
before any work: each as it is parsed, with the library's own checks
(``_flags``), then together, by the command's ``check_flags``.
"""

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

from jaxaccum.cli import _bench_command, _demo, _flags, _plan_command


def _usage_line(prog: str, message: str) -> str:
    return f"{prog}: error: {message} (see {prog} --help)\n"


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line, like the rest."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, _usage_line(self.prog, message))


def _model_options(sub: argparse.ArgumentParser) -> None:
    """The demo model's options, shared by ``demo`` and ``plan``."""
    sub.add_argument(
        "--batch-size",
        type=_flags.count("the batch size"),
        default=8192,
        help="effective batch size (default 8192)",
    )
    sub.add_argument(
        "--features",
        type=_flags.count("the number of input features"),
        default=784,
        help="input features (default 784)",
    )
    sub.add_argument(
        "--width",
        type=_flags.count("the hidden width"),
        default=512,
        help="hidden width (default 512)",
    )
    sub.add_argument(
        "--memory-budget",
        type=_flags.memory_budget,
        default="48MiB",
        help="bytes or e.g. 48MiB, 1GB, 'device' (default 48MiB)",
    )
    sub.add_argument(
        "--learning-rate",
        type=_flags.scalar("the learning rate", integer=False, low=0, open_low=True),
        default=1e-3,
        help="the optimizer's learning rate (default 1e-3)",
    )
    sub.add_argument(
        "--seed",
        type=_flags.scalar("the seed", integer=True, low=0),
        default=0,
        help="seed of the model's initialisation and data (default 0)",
    )


def _quick_default_help(flag: str) -> str:
    full, quick = _bench_command.QUICK_DEFAULTS[flag[2:].replace("-", "_")]
    return f"(default {full}; {quick} with --quick)"


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
    for flag, model, default in (
        ("--batch-size", "MLP", 8192),
        ("--sequence-batch-size", "transformer", 512),
        ("--image-batch-size", "CNN", 1024),
    ):
        bench_parser.add_argument(
            flag,
            type=_flags.count(f"the {model} batch size"),
            default=default,
            help=f"{model} batch size (default {default})",
        )
    for flag in ("--num-microbatches", "--compile-num-microbatches"):
        bench_parser.add_argument(
            flag,
            type=_flags.count("each number of micro-batches"),
            nargs="+",
            default=None,
            help="numbers of micro-batches, each dividing the batch size they "
            f"split {_quick_default_help(flag)}",
        )
    bench_parser.add_argument(
        "--repeats",
        type=_flags.count("the number of timed repeats"),
        default=None,
        help=f"timed repeats of each window {_quick_default_help('--repeats')}",
    )
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
    demo_parser.add_argument(
        "--steps",
        type=_flags.count("the number of training steps"),
        default=100,
        help="optimizer steps to train (default 100)",
    )
    demo_parser.add_argument(
        "--num-microbatches",
        type=_flags.count("the number of micro-batches"),
        default=None,
        help="override the planner's choice; must divide --batch-size",
    )
    demo_parser.add_argument(
        "--repeats",
        type=_flags.count("the number of timed repeats"),
        default=5,
        help="timed repeats for the comparison table (default 5)",
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


# Each command's checks of its flags together (after their defaults are set).
_FLAG_CHECKS: dict[str, Callable[[argparse.Namespace], None]] = {
    "demo": _demo.check_flags,
    "plan": _plan_command.check_flags,
    "bench": _bench_command.check_flags,
}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command's flags, each checked as it is parsed, then together: any
    refusal is a usage error (exit status 2) before the command does any work."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        _bench_command.fill_defaults(args)
    try:
        _FLAG_CHECKS[args.command](args)
    except ValueError as error:
        parser.exit(2, _usage_line(f"{parser.prog} {args.command}", str(error)))
    return args


def _run(args: argparse.Namespace) -> None:
    if args.command == "demo":
        _demo.demo(args)
    elif args.command == "plan":
        _plan_command.plan_command(args)
    else:
        _bench_command.bench_command(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxaccum`` console script; returns the exit status
    (2 after an error, which is printed as one line on stderr)."""
    try:
        args = _parse(argv)
    except SystemExit as exit_:  # --help, or a usage error already printed
        return int(exit_.code or 0)
    try:
        _run(args)
    except Exception as error:
        _report(args.command, error, args.debug)
        return 2
    return 0
