"""Run the real ``autohet`` command in a fresh interpreter, as a user's shell would: to
its end (``autohet``) or in the background (``start_autohet``, whose output
``read_until`` follows); and any command to its end with its output as text (``run``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(
    argv: Sequence[str], *, cwd: Path, timeout: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``argv`` to its end in ``cwd`` (``env``: its whole environment, else this
    one's), stdout and stderr captured as text; its exit status is the caller's to judge."""
    return subprocess.run(
        list(argv), cwd=cwd, env=env, timeout=timeout, capture_output=True, text=True, check=False
    )


def autohet(
    *args: str, cwd: Path, timeout: float = 300, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``autohet ARGS`` in ``cwd`` with this checkout on the path; wide columns so that
    output assertions do not depend on the terminal; ``env`` adds variables."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", **(env or {})}
    return run([sys.executable, "-m", "autohet_cli", *args], cwd=cwd, env=full, timeout=timeout)


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


def read_until(proc: subprocess.Popen[str], marker: str, seen: list[str]) -> list[str]:
    """Add ``proc``'s output lines to ``seen`` up to the first that holds ``marker``
    (or to the end of its output), and return ``seen``."""
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            break
    return seen
