"""Run the real ``autohet`` command in a fresh interpreter, as a user's shell would: to
its end (``autohet``) or in the background (``start_autohet``)."""

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


def start_autohet(
    *args: str, cwd: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[str]:
    """``autohet ARGS`` started in ``cwd`` with this checkout on the path (``env``
    added), in a session of its own; stdout and stderr come as one text pipe."""
    return subprocess.Popen(
        [sys.executable, "-m", "autohet_cli", *args],
        cwd=cwd,
        env={**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
