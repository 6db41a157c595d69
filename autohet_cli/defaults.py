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


EMBEDDED_CLUSTER = "localhost"


def resolve_cluster_path(ref: str | Path | None) -> Path:
    """Where a ``--cluster`` value (or a plan's recorded cluster path) points.

    Nothing, or the name ``localhost``, is the embedded cluster, as every
    command's help says; a file of that name in the working directory still wins,
    so nobody's hostfile called ``localhost`` changes meaning. Anything else is
    a path, checked later by the loader (whose errors name the file).
    """
    if ref is None or str(ref) == "":
        return default_cluster_path()
    path = Path(ref)
    if str(ref) == EMBEDDED_CLUSTER and not path.exists():
        return default_cluster_path()
    return path
