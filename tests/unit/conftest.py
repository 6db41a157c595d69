"""Fixtures shared by the unit tests (``alone``, ``sailor_root``, ``receiver``), and the
rule that keeps this tier fast.

The unit tier checks logic in this process (a CLI in a fresh interpreter is fine):
it never starts worker processes, sshd or Slurm. Those live in ``tests/dist`` and
``tests/e2e``, which say so by their folder and marker. :func:`_refuse_other_tiers`
(on ``subprocess`` and ``torch.multiprocessing``'s process starter) makes a unit test
that starts one fail, naming the command and where it belongs (issue 44: 28 of the
suite's minutes were process start-ups).
"""

from __future__ import annotations

import importlib
import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from autohet_cli.peer.replicate import Replicator

# Sailor's measured data, copied into the repository (see tests/data/sailor/README.md).
SAILOR = Path(__file__).resolve().parents[1] / "data" / "sailor"

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "AUTOHET_HOST")

# Programs (argv[0]) and modules (``-m``) that belong to the dist or e2e tiers.
_PROGRAMS = dict.fromkeys(("sshd", "slurmctld", "slurmd", "munged", "sbatch", "srun"), "e2e")
_PROGRAMS["torchrun"] = "dist"
_MODULES = {
    "torch.distributed.run": "dist",
    "autohet_cli.runtime.agent": "dist",
    "autohet_cli.runtime.train": "dist",
}


def other_tier(argv: Sequence[str]) -> str | None:
    """The tier a command belongs to when it starts workers, sshd or Slurm; else None.
    ``python -m autohet_cli.runtime.train --help`` only prints, so ``--help`` is fine."""
    if not argv or "--help" in argv:
        return None
    tier = _PROGRAMS.get(PurePath(argv[0]).name)
    for flag, module in zip(argv, argv[1:], strict=False):
        if flag == "-m":
            tier = tier or _MODULES.get(module)
            break  # what follows is the module's own arguments
    return tier


@pytest.fixture(autouse=True)
def _refuse_other_tiers(monkeypatch: pytest.MonkeyPatch) -> None:
    real_init = subprocess.Popen.__init__

    def guarded(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        argv = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)
        words = [os.fsdecode(a) for a in argv]
        if kwargs.get("shell") and words:
            words = words[0].split()
        tier = other_tier(words)
        if tier is not None:
            raise AssertionError(
                f"a unit test started {' '.join(words)[:200]!r}: worker processes, sshd and "
                f"Slurm belong in tests/{tier} (tests/unit/conftest.py)"
            )
        real_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)

    def no_workers(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(
            "a unit test started gloo worker processes (torch.multiprocessing): they "
            "belong in tests/dist (tests/unit/conftest.py)"
        )

    # The module, not torch.multiprocessing's function of the same name.
    starter = importlib.import_module("torch.multiprocessing.spawn")
    monkeypatch.setattr(starter, "start_processes", no_workers)


@pytest.fixture(autouse=True)
def _denormals_as_found() -> Iterator[None]:
    """The probe flushes denormals to zero for its timings (a process-wide CPU flag);
    run in this process by a test, it left later tests in the same worker unable to
    draw subnormal floats (hypothesis refuses). torch has no getter: the default is off."""
    yield
    torch.set_flush_denormal(False)


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A worker in this process runs alone (no torchrun variables); its process group
    is torn down afterwards, so the next test can start its own."""
    for name in _TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sailor_root() -> Path:
    """Sailor's measured profiles (``tests/data/sailor``), failing where they are gone."""
    if not (SAILOR / "llm_info.json").is_file():
        pytest.fail(
            f"Sailor's measured profiles are missing at {SAILOR}; they ship with the "
            "repository (tests/data/sailor): restore them from git",
            pytrace=False,
        )
    return SAILOR


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Replicator]:
    """Host b's replica receiver on loopback (``tests.peering``), its job folder holding
    an empty step 2."""
    from tests import peering

    job = tmp_path / "b" / "plan" / "default"
    (job / peering.STEP).mkdir(parents=True)
    r = peering.receiver(job)
    yield r
    r.close()
