"""Real sshd hosts on this machine for the benchmarks that go over SSH (the e2e tests'
``SshdFarm``)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.e2e.sshd import SshdFarm, make_client_key, sshd_problem


def sshd_missing() -> bool:
    """True, having printed why, where this machine cannot run sshd (skip the benchmark)."""
    problem = sshd_problem()
    if problem is not None:
        print(f"skipped: {problem}")
    return problem is not None


@contextmanager
def sshd_farm() -> Iterator[tuple[Path, SshdFarm]]:
    """A fresh temp folder and a farm of no hosts yet under it; every host stopped after."""
    with tempfile.TemporaryDirectory(prefix="autohet-bench-") as tmp:
        root = Path(tmp)
        farm = SshdFarm(root=root / "sshd", client_key=make_client_key(root / "key"))
        farm.root.mkdir()
        try:
            yield root, farm
        finally:
            farm.stop_all()
