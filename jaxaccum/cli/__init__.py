"""The ``jaxaccum`` command: ``demo``, ``bench`` and ``plan``.

Imported only by the console script (and ``python -m jaxaccum``), never by
``import jaxaccum``: it needs the ``cli`` extra (``pip install "jaxaccum[cli]"``:
Flax for its models, rich, matplotlib). Its demo models
(``jaxaccum.cli.models``) and benchmark harness (``jaxaccum.cli.harness``)
live here, off the library's import path, public for ``benchmarks/``.
"""

try:
    import flax  # noqa: F401
    import matplotlib  # noqa: F401
    import rich  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised in a core-only venv
    raise ImportError(
        f'The jaxaccum command needs {error.name}: pip install "jaxaccum[cli]"'
    ) from error

from jaxaccum.cli._main import main as main

__all__ = ["main"]
