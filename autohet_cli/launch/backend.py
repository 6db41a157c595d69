"""The seam between a launch and the place that runs its hosts: one interface, a registry.

In the spirit of torchx's ``Scheduler`` and SkyPilot's backends, a backend is
what ``autohet launch``, ``--dry-run`` and recover's relaunch need from a place
that runs hosts:

- ``dry_run_text``: what would run, with no I/O (each host's command, or the
  batch script), exactly as it would be started;
- ``check``: the checks the launch runs before anything starts, read only (the
  lines to show; the launch's own error where it would refuse);
- ``run``: prepare and submit one attempt, stream its logs, watch it, signal and
  cancel it on a stop, and judge how it ended (a ``JobOutcome``); the common part
  (announcing, watching, stopping, the run folder) is ``launch.supervise``;
- ``checkpoint_pool``: where the job's files are read from this machine (over
  SSH from each host, or locally from a file system the nodes share).

Two implementations: ``ssh`` (every host reached over SSH; localhost runs here;
``launch.ssh_backend``) and ``slurm`` (one heterogeneous batch job;
``slurm.backend``). ``launch.session`` and ``recovery.session`` drive a backend
through ``backend_for`` and never import one by name. A third backend
(Kubernetes, SkyPilot) is one module with a ``BACKEND`` object and one line in
``MODULES`` (or a ``register`` call); the cluster file's ``backend:`` names it.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from autohet_cli.errors import ConfigError
from autohet_cli.slurmconf import BACKENDS

if TYPE_CHECKING:  # types only: the backends import this module, not the reverse
    from autohet_cli.cluster import Cluster
    from autohet_cli.launch.attempt import Attempt, Prepared
    from autohet_cli.launch.executor import JobOutcome
    from autohet_cli.launch.pathargs import Caller
    from autohet_cli.transport.pool import ConnectOptions, HostPool


class Backend(Protocol):
    name: str

    def dry_run_text(self, p: Prepared, attempt: Attempt, job: str | None, who: Caller) -> str:
        """What ``run`` would start for ``attempt``, with no I/O (``--dry-run`` prints it)."""
        ...

    def check(
        self, p: Prepared, attempt: Attempt, connect: ConnectOptions, who: Caller
    ) -> list[str]:
        """The launch's checks, read only: lines to show; raises where it would refuse."""
        ...

    def run(self, p: Prepared, pool: HostPool, attempt: Attempt) -> JobOutcome:
        """One attempt of the plan, from start to its end (or its failure)."""
        ...

    def checkpoint_pool(self, cluster: Cluster, connect: ConnectOptions) -> HostPool:
        """How this machine reads the hosts' checkpoint directories."""
        ...


# Backend name -> the module that defines its ``BACKEND`` (imported on first use, so
# a launch on SSH never imports Slurm's code, and this module imports no backend).
MODULES: dict[str, str] = {
    "ssh": "autohet_cli.launch.ssh_backend",
    "slurm": "autohet_cli.slurm.backend",
}
_LOADED: dict[str, Backend] = {}


def register(name: str, module: str) -> None:
    """Make ``backend: NAME`` in a cluster file run through ``module``'s ``BACKEND``."""
    MODULES[name] = module
    _LOADED.pop(name, None)
    if name not in BACKENDS:
        BACKENDS.append(name)  # what a cluster file's backend: accepts


def names() -> Sequence[str]:
    return tuple(MODULES)


def backend_for(name: str) -> Backend:
    """The backend a cluster file (or ``--backend``) names."""
    if name not in _LOADED:
        module = MODULES.get(name)
        if module is None:
            raise ConfigError(
                f"backend {name!r}: not one of {', '.join(sorted(MODULES))} (the cluster "
                "file's backend: or --backend)"
            )
        _LOADED[name] = importlib.import_module(module).BACKEND
    return _LOADED[name]
