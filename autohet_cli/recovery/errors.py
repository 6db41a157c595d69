"""The recovery errors (``AutohetError``s; the CLI prints the message and exits 1)."""

from __future__ import annotations

from autohet_cli.errors import AutohetError


class RecoveryError(AutohetError):
    """Recovery cannot proceed: no usable checkpoint, files lost everywhere, bad inputs."""


class RecoverLockHeld(RecoveryError):
    """Another recover of the same job holds its lock on a host (the message names it)."""

    def __init__(self, message: str, *, host: str, holder: str) -> None:
        super().__init__(message)
        self.host = host
        self.holder = holder


class StepLost(RecoveryError):
    """A checkpoint step cannot be rebuilt: some file it needs has no intact copy left
    (every copy missing or failing its sha256). An older step may still be whole."""

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step
