"""Run the real ``autohet`` command in a fresh interpreter, as a user's shell would."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def autohet(
    *args: str, cwd: Path, timeout: float = 300, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``autohet ARGS`` in ``cwd`` with this checkout on the path; wide columns so that
    output assertions do not depend on the terminal; ``env`` adds variables."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "autohet_cli", *args],
        cwd=cwd,
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
