"""``python -m autohet_cli.profiling.probe`` where autohet is installed (the packed
probe has its own ``__main__``, written by ``probepack``)."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
