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
