"""Files shipped inside the package (pure: no I/O until a caller opens a path).

``autohet_cli/data`` is plain package data, not a package, so it is reached
through ``importlib.resources.files("autohet_cli")``.
"""

from __future__ import annotations

import atexit
from contextlib import ExitStack
from importlib import resources
from pathlib import Path

# Keeps extracted copies alive for the process when the package is imported from a zip.
_EXTRACTED = ExitStack()
atexit.register(_EXTRACTED.close)


def _data_path(*parts: str) -> Path:
    ref = resources.files("autohet_cli").joinpath("data")
    for part in parts:
        ref = ref.joinpath(part)
    if isinstance(ref, Path):
        return ref
    return _EXTRACTED.enter_context(resources.as_file(ref))


def default_cluster_path() -> Path:
    """The embedded ``localhost`` cluster: this machine, two CPU devices."""
    return _data_path("clusters", "localhost.yaml")
