"""The names in a checkpoint step directory, ``step-<N:08d>/`` (pure).

Part of the checkpoint format (``ckpt.format``, which re-exports them), kept below the
packages that share them: the checkpointer writes and reads these files (``ckpt``),
peer copies push them to partner hosts (``peer.replicate``).
"""

from __future__ import annotations

import re

MANIFEST = "manifest.json"
COMPLETE = "COMPLETE"
METADATA = ".metadata"

_STEP_DIR = re.compile(r"^step-(?P<step>\d{8,})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step-<N:08d>`` directory name; None for anything else."""
    m = _STEP_DIR.match(name)
    return int(m.group("step")) if m else None
