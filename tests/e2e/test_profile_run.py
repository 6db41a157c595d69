"""`autohet profile run` against real sshd "hosts" on loopback."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.models import get_model
from autohet_cli.profiling.run import ProfileRunRequest, run_profiling, select_hosts
from autohet_cli.settings import TrainingSettings
from tests.e2e.sshd import SshdFarm
from tests.planning import plan_tables

pytestmark = pytest.mark.e2e
TINY = get_model("gpt-tiny")


def _cluster(farm: SshdFarm, **host_overrides: object) -> Cluster:
    hosts = tuple(h.as_host(python=sys.executable, **host_overrides) for h in farm.hosts)
    return Cluster(name="fake", hosts=hosts, inter_node_gbps=10.0)


def _request(cluster: Cluster, farm: SshdFarm, **kw: object) -> ProfileRunRequest:
    base = ProfileRunRequest(
        cluster=cluster,
        model=TINY,
        seq_len=64,
        tps=(1,),
        micro_batch_sizes=(1, 2),
        all_hosts=True,
        timeout_s=120,
        connect_timeout_s=5,
        known_hosts=farm.known_hosts,
        time_budget_s=2.0,
        measure_network=False,
        runtime_runs=False,  # test_cli_profile_run runs the runtime phase
    )
    return replace(base, **kw)  # type: ignore[arg-type]


@pytest.mark.slow("profiles three sshd hosts: probes, links and the runtime on each")
def test_three_hosts_are_profiled_in_parallel_and_plannable(sshd_farm: SshdFarm) -> None:
    sshd_farm.start(3)
    cluster = _cluster(sshd_farm)
    result = run_profiling(_request(cluster, sshd_farm, measure_network=True))
    assert not result.failed, [o.error for o in result.failed]
    assert result.profile is not None
    assert result.profile.meta["hosts"] == ["fake-2", "fake-3", "fake-4"]
    links = result.profile.meta["network"]
    assert [link["hosts"] for link in links] == [
        ["fake-2", "fake-3"],
        ["fake-2", "fake-4"],
        ["fake-3", "fake-4"],
    ]
    assert all(link.get("gbps", 0) > 0 for link in links), links
    entries = [e for k, e in result.profile.entries.items() if k.gpu_type == "cpu"]
    assert {e.key.micro_batch_size for e in entries} == {1, 2}
    assert all(e.source == "measured" and len(e.layers) == TINY.num_layers for e in entries)
    # the probe cleaned up after itself on every host
    for h in sshd_farm.hosts:
        assert not list((h.root / "work").glob("profile-*"))
    training = TrainingSettings(
        global_batch_size=6, micro_batch_size=1, seq_len=64, precision="fp32"
    )
    tables = CostTables(TINY, result.profile, training)
    outcome = plan_tables(cluster, tables, name="fake", time_limit_s=5, with_baselines=False)
    assert outcome.plan.pipelines
    assert tables.is_measured(
        "cpu", outcome.plan.tensor_parallel, outcome.plan.training.micro_batch_size
    )


def test_unknown_host_key_is_refused_and_others_still_profiled(sshd_farm: SshdFarm) -> None:
    sshd_farm.start(2)
    sshd_farm.start(1, trusted=False)
    result = run_profiling(_request(_cluster(sshd_farm), sshd_farm))
    failed = {o.host: o.error or "" for o in result.failed}
    assert list(failed) == ["fake-4"]
    assert "--accept-new-host-keys" in failed["fake-4"]
    assert result.profile is not None and result.profile.meta["hosts"] == ["fake-2", "fake-3"]
    assert "fake-4" in result.profile.meta["unreachable"]


def test_stopped_host_is_reported_with_the_cause(sshd_farm: SshdFarm) -> None:
    hosts = sshd_farm.start(3)
    hosts[1].stop()
    result = run_profiling(_request(_cluster(sshd_farm), sshd_farm))
    failed = {o.host: o.error or "" for o in result.failed}
    assert list(failed) == ["fake-3"]
    assert "refused" in failed["fake-3"].lower() and "fake-3" in failed["fake-3"]
    assert result.profile is not None and result.profile.meta["hosts"] == ["fake-2", "fake-4"]


def test_shell_metacharacters_in_names_and_paths_run_nothing(
    sshd_farm: SshdFarm, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    (host,) = sshd_farm.start(1)
    evil = host.as_host(
        name=f"x$(touch {marker});touch {marker}",
        python=sys.executable,
        workdir=str(host.root / f"w;touch {marker}" / "$(touch x)"),
    )
    cluster = Cluster(name="evil", hosts=(evil,), inter_node_gbps=10.0)
    result = run_profiling(_request(cluster, sshd_farm))
    assert not result.failed, [o.error for o in result.failed]
    assert not marker.exists()
    assert (host.root / f"w;touch {marker}" / "$(touch x)").is_dir()


def test_one_host_per_gpu_type_unless_all_hosts(sshd_farm: SshdFarm) -> None:
    sshd_farm.start(3)
    hosts = list(_cluster(sshd_farm).hosts)
    hosts[1] = replace(hosts[1], num_gpus=2)
    cluster = Cluster(name="fake", hosts=tuple(hosts), inter_node_gbps=10.0)
    assert [h.name for h in select_hosts(cluster, (), False)] == ["fake-3"]
    assert len(select_hosts(cluster, (), True)) == 3
    assert [h.name for h in select_hosts(cluster, ("fake-4",), False)] == ["fake-4"]
