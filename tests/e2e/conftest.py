"""Fixtures for the end-to-end tests: real sshd processes on loopback (see sshd.py).

Without /usr/sbin/sshd these tests skip with the reason, except under CI=true,
where .ci/run installs openssh-server and a missing sshd must fail loudly.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.sshd import ClientKey, SshdFarm, make_client_key, sshd_problem


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def sshd_ready() -> None:
    problem = sshd_problem()
    if problem is None:
        return
    if _in_ci():
        pytest.fail(f"CI=true but real sshd tests cannot run: {problem}", pytrace=False)
    pytest.skip(f"real sshd tests skipped: {problem}")


@pytest.fixture(scope="session")
def client_key(sshd_ready: None, tmp_path_factory: pytest.TempPathFactory) -> ClientKey:
    """One ed25519 client key for the whole session (authorized on every fake host)."""
    return make_client_key(tmp_path_factory.mktemp("client-key"))


@pytest.fixture
def sshd_farm(client_key: ClientKey, tmp_path: Path) -> Iterator[SshdFarm]:
    """Factory: ``sshd_farm.start(n)`` starts n fake hosts on 127.0.0.2, 127.0.0.3, ...;
    all are stopped when the test ends."""
    farm = SshdFarm(root=tmp_path / "sshd", client_key=client_key)
    farm.root.mkdir()
    try:
        yield farm
    finally:
        farm.stop_all()
