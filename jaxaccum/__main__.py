"""``python -m jaxaccum``: the same as the ``jaxaccum`` command."""

import sys

from jaxaccum.cli import main

sys.exit(main())
