"""What one launch attempt ends with (``JobOutcome``) or is refused with (``LaunchError``).

The types every part of a running job shares: the executor's helpers (``hostlines``,
``hostprocs``, ``verdict``) sit below ``launch.executor`` and build or raise these, so
they live here, below them all; ``launch.executor`` names them too, for its callers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from autohet_cli.errors import AutohetError
from autohet_cli.launch import triage

Printer = Callable[[str], None]


class LaunchError(AutohetError):
    """The job could not be started as asked (names the host and what to do)."""


@dataclass(slots=True, kw_only=True)
class JobOutcome:
    status: str  # finished | failed | host_lost | not_started | interrupted
    exit_code: int
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    lost_hosts: list[str] = field(default_factory=list)
    failed_hosts: list[str] = field(default_factory=list)
    not_started_hosts: list[str] = field(default_factory=list)
    root_cause: dict[str, object] | None = None
    detail: str = ""
    local_run_dir: str = ""
    last_status: str = ""
    last_step: int | None = None

    @property
    def recoverable(self) -> bool:
        return self.status in triage.RECOVERABLE

    def to_dict(self) -> dict[str, object]:
        return asdict(self)
