"""The preflight asks each host once per pool: a relaunch (recover's) reuses what an
earlier check of the same hosts found, and only the rendezvous port is looked up fresh."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from autohet_cli.cluster import Cluster
from autohet_cli.launch.preflight import PreflightError, preflight, preflight_ahead
from autohet_cli.transport.pool import ConnectOptions, HostPool
from tests.planting import cpu_host


def _counting_python(tmp: Path, name: str) -> str:
    """An interpreter that notes each start in ``<name>.runs`` (a real process, not a mock)."""
    path = tmp / f"python-{name}"
    runs = tmp / f"{name}.runs"
    path.write_text(f'#!/bin/sh\necho run >> "{runs}"\nexec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return str(path)


def _runs(tmp: Path, name: str) -> int:
    f = tmp / f"{name}.runs"
    return len(f.read_text().splitlines()) if f.exists() else 0


def _cluster(tmp: Path) -> Cluster:
    hosts = tuple(
        cpu_host(n, python=_counting_python(tmp, n), workdir=str(tmp / f"work-{n}"))
        for n in ("a", "b")
    )
    return Cluster(name="c", hosts=hosts, inter_node_gbps=10.0)


def test_a_second_preflight_on_the_same_pool_asks_only_for_the_port(tmp_path: Path) -> None:
    cluster = _cluster(tmp_path)
    with HostPool(cluster, ConnectOptions()) as pool:
        first = preflight(pool, ["a", "b"], needs_autohet=True, port_host="a")
        assert (_runs(tmp_path, "a"), _runs(tmp_path, "b")) == (1, 1)
        again = preflight(pool, ["a", "b"], needs_autohet=True, port_host="a")
        # b is not asked again; a only for a port free now (never a stale one).
        assert (_runs(tmp_path, "a"), _runs(tmp_path, "b")) == (2, 1)
        assert again["b"] == first["b"] and again["a"].home == first["a"].home
        assert again["a"].free_port is not None and again["a"].free_port > 0
        preflight(pool, ["a", "b"], needs_autohet=False, port_host=None)  # covered: asked more
        assert (_runs(tmp_path, "a"), _runs(tmp_path, "b")) == (2, 1)
    with HostPool(cluster, ConnectOptions()) as pool:  # another pool asks again
        preflight(pool, ["b"], needs_autohet=True, port_host=None)
        assert _runs(tmp_path, "b") == 2


def test_a_check_started_ahead_is_awaited_not_repeated(tmp_path: Path) -> None:
    cluster = _cluster(tmp_path)
    with HostPool(cluster, ConnectOptions()) as pool:
        preflight_ahead(pool, ["a", "b"], needs_autohet=True)
        reports = preflight(pool, ["a", "b"], needs_autohet=True, port_host=None)
        assert set(reports) == {"a", "b"} and reports["a"].free_port is None
        assert (_runs(tmp_path, "a"), _runs(tmp_path, "b")) == (1, 1)
    with HostPool(cluster, ConnectOptions()) as pool:
        # Facts found without looking for autohet do not stand for a check that needs it.
        preflight_ahead(pool, ["b"], needs_autohet=False)
        preflight(pool, ["b"], needs_autohet=True, port_host=None)
        assert _runs(tmp_path, "b") == 3


def test_a_failed_check_ahead_is_asked_again_and_named_then(tmp_path: Path) -> None:
    cluster = _cluster(tmp_path)
    broken = tmp_path / "python-a"
    good = broken.read_text()
    marker = tmp_path / "broken-ran"
    broken.write_text(f"#!/bin/sh\ntouch {marker}\nexit 7\n")
    with HostPool(cluster, ConnectOptions()) as pool:
        preflight_ahead(pool, ["a"], needs_autohet=True)
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        broken.write_text(good)  # fixed in between: the failure is not kept
        assert preflight(pool, ["a"], needs_autohet=True, port_host=None)["a"].python


def test_a_hung_check_ahead_is_named_within_the_preflight_s_own_timeout(tmp_path: Path) -> None:
    cluster = _cluster(tmp_path)
    (tmp_path / "python-a").write_text("#!/bin/sh\nexec sleep 5\n")
    with HostPool(cluster, ConnectOptions()) as pool:
        preflight_ahead(pool, ["a"], needs_autohet=True)  # its own timeout: 90 s
        started = time.monotonic()
        with pytest.raises(PreflightError, match="a: .* did not answer within 1 s"):
            preflight(pool, ["a"], needs_autohet=True, port_host=None, timeout_s=1.0)
        assert time.monotonic() - started < 3.0


def test_a_workdir_others_can_write_is_refused_by_the_private_directory_rule(
    tmp_path: Path,
) -> None:
    """Issue 45: the workers import code from the host's workdir (--sync-dir, a
    --data-fn module), so it follows the rule checkpoint and cache directories do."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # no sticky bit: anyone may rename what we put here
    host = cpu_host("a", python=sys.executable, workdir=str(shared / "work"))
    cluster = Cluster(name="c", hosts=(host,), inter_node_gbps=10.0)
    with HostPool(cluster, ConnectOptions()) as pool, pytest.raises(PreflightError) as err:
        preflight(pool, ["a"], needs_autohet=False, port_host=None)
    text = str(err.value)
    assert text.startswith(
        f"a: refusing the workdir {shared / 'work'}: {shared} is writable by others"
    )
    assert "someone else could plant code" in text
    (shared / "work").chmod(0o777)
    shared.chmod(0o1777)  # sticky as /tmp: then the workdir itself is what matters
    with HostPool(cluster, ConnectOptions()) as pool, pytest.raises(PreflightError) as err:
        preflight(pool, ["a"], needs_autohet=False, port_host=None)
    assert f"{shared / 'work'} is writable by others (mode 0777)" in str(err.value)
    (shared / "work").chmod(0o700)
    with HostPool(cluster, ConnectOptions()) as pool:
        assert preflight(pool, ["a"], needs_autohet=False, port_host=None)["a"].home
