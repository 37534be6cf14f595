"""The command line's flag types, checked with the library's own checks.

Every numeric flag is checked as it is parsed, before any work: its argparse
``type=`` reads the number and hands it to
:func:`jaxaccum._checks.check_scalar`, the check behind the library's numeric
arguments, so ``--steps 0`` is refused as ``steps=0`` would be, with the flag,
the value and the allowed range in one line. What only flags together decide (a
batch size a micro-batch count does not divide) each command checks in its
``check_flags``, also before any work, with :func:`check_divides`.
"""

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import jaxaccum
from jaxaccum._checks import check_scalar


def _number(text: str) -> Any:
    """The int or float that ``text`` writes, else ``text`` itself: the check
    then refuses it by type, with its own message."""
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return text


def scalar(
    noun: str,
    *,
    integer: bool,
    low: float | None = None,
    open_low: bool = False,
    hint: str = "",
) -> Callable[[str], Any]:
    """An argparse type: the number a flag's text writes, checked by
    :func:`check_scalar` (``noun`` names it in the message, after argparse's
    ``argument --flag:``); an ``int`` if ``integer``, else a ``float``."""

    def parse(text: str) -> Any:
        value = _number(text)
        try:
            check_scalar(
                noun, value, integer=integer, low=low, open_low=open_low, hint=hint
            )
        except (TypeError, ValueError) as error:
            raise argparse.ArgumentTypeError(str(error)) from error
        return int(value) if integer else float(value)

    return parse


def count(noun: str, hint: str = "") -> Callable[[str], int]:
    """An argparse type: an integer from 1 to 2**31 - 1 (a size, a count)."""
    return scalar(noun, integer=True, low=1, hint=hint)


def memory_budget(text: str) -> str:
    """An argparse type: a budget :func:`jaxaccum.parse_memory_budget` reads,
    kept as written for the commands to print and pass on."""
    try:
        jaxaccum.parse_memory_budget(text)
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return text


def check_divides(
    flag: str, nums: Sequence[int], batch_flag: str, batch_size: int
) -> None:
    """Checks that each of ``nums`` (given by ``flag``) divides ``batch_size``
    (given by ``batch_flag``): micro-batches are whole and equal.

    Raises:
      ValueError: naming both flags and the values that do not divide.

    Examples:
      >>> check_divides("--num-microbatches", [2, 4], "--batch-size", 256)
      >>> check_divides("--candidates", [3, 4], "--batch-size", 6)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: argument --candidates: 4 does not divide --batch-size 6: ...
    """
    bad = [num for num in nums if batch_size % num]
    if bad:
        values = " ".join(map(str, bad))
        raise ValueError(
            f"argument {flag}: {values} {'do' if len(bad) > 1 else 'does'} not "
            f"divide {batch_flag} {batch_size}: micro-batches are whole and equal. "
            f"Pass {flag} values that divide {batch_size}, or another {batch_flag}."
        )


def loss_flags_given(args: argparse.Namespace) -> list[str]:
    """The flags describing the user's ``LOSS`` that were given (each is
    None or False when not)."""
    flags = (
        ("--params", args.params),
        ("--batch", args.batch),
        ("--has-aux", args.has_aux),
        ("--reduction", args.reduction),
        ("--aux-reduction", args.aux_reduction),
        ("--batch-argnums", args.batch_argnums),
        ("--key-argnums", args.key_argnums),
    )
    return [flag for flag, value in flags if value not in (None, False)]
