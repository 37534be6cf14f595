"""What the top-level names of 0.1 that moved or went do when called the
0.1 way: keep the old meaning, or refuse the old call with the conversion;
never reinterpret it. And the reason a removed name went, on the ``from``
path too (Python's ``from jaxaccum import x`` turns a module's
``AttributeError`` into a bare "cannot import name")."""

import dis
import math
import sys
from typing import Any

from jaxaccum._types import PyTree
from jaxaccum.growth import NoiseScaleEMA as _NoiseScaleEMA

_IMPORT_FROM = dis.opmap.get("IMPORT_FROM")


class NoiseScaleEMA(_NoiseScaleEMA):
    """``jaxaccum.NoiseScaleEMA``, 0.1's path: ``half_life=`` builds a
    :class:`jaxaccum.growth.NoiseScaleEMA` (that class, not this one); 0.1's
    per-window ``decay`` is refused with the half-life that gives the same
    average."""

    def __new__(cls, *args: PyTree, **kwargs: PyTree) -> Any:
        if args or "decay" in kwargs:
            decay = (args or (kwargs.get("decay"),))[0]
            raise TypeError(
                f"NoiseScaleEMA({decay!r}) is jaxaccum 0.1's call, a decay per "
                "window; jaxaccum.growth.NoiseScaleEMA takes half_life= in "
                "examples (tokens with reduction='weighted'), so that windows "
                "of different sizes weigh by their examples. For windows of B "
                "examples the same average is half_life = B * ln 2 / -ln(decay)"
                f"{_example(decay)}: pass NoiseScaleEMA(half_life=...)."
            )
        return _NoiseScaleEMA(**kwargs)


def _example(decay: Any) -> str:
    try:
        factor = math.log(2) / -math.log(float(decay))
    except (TypeError, ValueError, ZeroDivisionError):
        return ""
    return f" ({factor:.3g} B for decay={decay!r})" if factor > 0 else ""


def removed_error(name: str, reason: str) -> Exception:
    """The error for the removed name ``name``: an ``ImportError`` saying why
    when ``from jaxaccum import name`` asks for it (so Python shows the
    reason), else the ``AttributeError`` a module's ``__getattr__`` raises."""
    message = f"jaxaccum.{name} was removed: {reason}"
    frame = sys._getframe(2)  # the code that asked jaxaccum.__getattr__
    code = frame.f_code.co_code
    asked = code[frame.f_lasti] if 0 <= frame.f_lasti < len(code) else None
    if _IMPORT_FROM is not None and asked == _IMPORT_FROM:
        return ImportError(message, name="jaxaccum")
    return AttributeError(message)
