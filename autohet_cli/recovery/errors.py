"""The recovery error (an ``AutohetError``; the CLI prints its message and exits 1)."""

from __future__ import annotations

from autohet_cli.errors import AutohetError


class RecoveryError(AutohetError):
    """Recovery cannot proceed: no usable checkpoint, files lost everywhere, bad inputs."""
