"""The command printed after a job stops must be one that can work (issue 29, medium 9):
a one-host run whose host froze was told `recover --lost localhost`, which refuses
(recover needs a surviving host of the plan: the job's key and checkpoints are there)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autohet_cli.cluster import Cluster, Host
from autohet_cli.errors import AutohetError
from autohet_cli.launch.executor import JobOutcome
from autohet_cli.launch.session import LaunchRequest, next_commands
from autohet_cli.plan import Plan
from autohet_cli.recovery import executor as rx
from autohet_cli.transport.pool import ConnectOptions, HostPool
from tests.planting import cpu_host, plan_of, stage


def _plan(*hosts: str) -> Plan:
    n = len(hosts)
    return plan_of([stage(i * 6 // n, (i + 1) * 6 // n, h) for i, h in enumerate(hosts)])


def _lost(*hosts: str) -> JobOutcome:
    return JobOutcome(status="host_lost", exit_code=1, lost_hosts=list(hosts))


REQ = LaunchRequest(plan_file=Path("plans/lab.v1.yaml"), steps=50)


def test_a_lost_host_with_none_of_the_plan_left_gets_launch_resume_not_recover() -> None:
    # The cluster may have more hosts: those are not where the job's key and steps are.
    recover, resume = next_commands(REQ, _plan("localhost"), _lost("localhost"))
    assert recover is None
    assert resume is not None and resume.startswith("autohet launch plans/lab.v1.yaml --resume")
    assert "--steps 50" in resume


def test_a_lost_host_with_a_survivor_of_the_plan_gets_recover() -> None:
    recover, resume = next_commands(REQ, _plan("a", "b"), _lost("b"))
    assert recover is not None and resume is None
    assert recover.startswith("autohet recover plans/lab.v1.yaml --lost b")
    job = LaunchRequest(plan_file=REQ.plan_file, job="20260101T000000Z-abcd")
    recover, _ = next_commands(job, _plan("a", "b"), _lost("b"))
    _, resume = next_commands(job, _plan("a"), _lost("a"))
    assert recover is not None and "--job 20260101T000000Z-abcd" in recover
    assert resume is not None and "--job 20260101T000000Z-abcd" in resume


def test_failed_workers_get_neither() -> None:
    failed = JobOutcome(status="failed", exit_code=1, failed_hosts=["a"])
    assert next_commands(REQ, _plan("a", "b"), failed) == (None, None)


def test_recover_with_no_host_of_the_plan_left_says_what_to_run_instead(tmp_path: Path) -> None:
    host = cpu_host("localhost", checkpoint_dir=str(tmp_path))
    other = cpu_host("spare", checkpoint_dir=str(tmp_path / "spare"))
    cluster = Cluster(name="c", hosts=(host, other), inter_node_gbps=10.0)
    with HostPool(cluster, ConnectOptions()) as pool:
        with pytest.raises(AutohetError) as info:
            rx.probe_survivors(_plan("localhost"), pool, ["localhost"], print)
    message = str(info.value)
    assert "no host of plan lab.v1 survives" in message
    assert "autohet launch PLAN --resume" in message and "add new hosts" not in message


def _free_closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed): connecting is refused."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_host_lost_in_an_earlier_wave_is_never_added_back(tmp_path: Path) -> None:
    """Issue 46: after a recovery moved away from 'gone', the cluster file still lists
    it; the next recovery probes it (refused: not added) instead of planning on it, and
    --lost may name it although the plan no longer has it."""
    from autohet_cli.recovery.errors import RecoveryError

    def host(name: str, address: str, port: int = 22) -> Host:
        return cpu_host(name, address, port=port, checkpoint_dir=str(tmp_path / name))

    hosts = (
        host("localhost", "localhost"),
        host("spare", "local"),  # answers: may join
        host("gone", "127.0.0.1", _free_closed_port()),  # an earlier wave's loss
    )
    cluster = Cluster(name="c", hosts=hosts, inter_node_gbps=10.0)
    plan = _plan("localhost")
    said: list[str] = []
    with HostPool(cluster, ConnectOptions(connect_timeout_s=5)) as pool:
        assert rx.probe_additions(plan, cluster, pool, [], said.append) == ["gone"]
        assert any(s.startswith("gone: in the cluster file but does not answer") for s in said)
        said.clear()
        # Named lost: not probed, said, and never a candidate.
        assert rx.probe_additions(plan, cluster, pool, ["gone"], said.append) == []
        assert said == ["gone: named lost (not in plan lab.v1); not added back"]
    rx.check_lost_names(plan, cluster, ["gone"])  # named against the job: accepted
    # A host of an earlier version, since dropped from the cluster file: accepted too.
    rx.check_lost_names(plan, cluster, ["old-host"], {"old-host"})
    from autohet_cli.plan import write_plan

    write_plan(_plan("localhost", "old-host"), tmp_path / "plans")
    assert "old-host" in rx.earlier_hosts(tmp_path / "plans", "lab")
    with pytest.raises(
        RecoveryError, match="--lost nosuch: not a host of plan lab.v1 .* nor of cluster 'c'"
    ):
        rx.check_lost_names(plan, cluster, ["nosuch"])
