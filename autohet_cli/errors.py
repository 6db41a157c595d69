"""The one exception tree of autohet.

Domain code raises these and never exits the process; the CLI catches
``AutohetError`` once, prints its message and exits 1. The message is what a
user needs: which file, which field, what to do.
"""

from __future__ import annotations


class AutohetError(Exception):
    """Base of every error a user can cause or fix."""


class ConfigError(AutohetError):
    """An input file or option is malformed (names the file and the field)."""


class UnknownNameError(AutohetError):
    """A GPU type, model or host name that we do not know."""


class ProfileError(AutohetError):
    """A profile lacks what a computation needs or is inconsistent."""


class PlanError(AutohetError):
    """A plan artifact is invalid, or cannot be written."""


class InfeasibleError(AutohetError):
    """No plan satisfies the constraints; the message names the shortfall."""


class NoBetterPlan(InfeasibleError):
    """A search told what to beat (``SearchRequest.must_beat_ms``) solved no plan:
    every grouping's lower bound said it could not get under the target, or those
    whose bound could gave no plan that fits."""


class TimeLimitReached(InfeasibleError):
    """The planner's time limit passed before it had a plan (or a baseline) to give.

    An InfeasibleError, so callers that fall back when no plan is found (recovery
    keeps the surviving pipelines) do so too when none was found in time."""


class TransportError(AutohetError):
    """Running a command or moving a file on a host failed (names the host)."""

    def __init__(self, message: str, *, host: str | None = None) -> None:
        super().__init__(message)
        self.host = host


class HostUnreachable(TransportError):
    """No SSH session could be opened: DNS failure, connection refused, no route."""


class ConnectTimeout(HostUnreachable):
    """The host did not answer (TCP connect or SSH banner) within the connect timeout."""


class HostKeyError(TransportError):
    """The host's key is unknown (and not accepted) or has changed since it was recorded."""


class AuthError(TransportError):
    """The host refused our keys (or a key file is missing or encrypted)."""


class CommandTimeout(TransportError):
    """A command ran past its timeout; it was killed (with its process group)."""

    def __init__(
        self,
        message: str,
        *,
        host: str | None = None,
        timeout_s: float = 0.0,
        stdout: str = "",
        stderr: str = "",
    ) -> None:
        super().__init__(message, host=host)
        self.timeout_s = timeout_s
        self.stdout = stdout
        self.stderr = stderr


class CommandFailed(TransportError):
    """A command exited non-zero where success was required."""

    def __init__(
        self, message: str, *, host: str | None = None, exit_code: int, stderr: str = ""
    ) -> None:
        super().__init__(message, host=host)
        self.exit_code = exit_code
        self.stderr = stderr


class SessionsExhausted(TransportError):
    """An SSH connection already has as many sessions open as sshd allows (MaxSessions)."""
