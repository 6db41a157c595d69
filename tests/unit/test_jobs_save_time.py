"""The job listing reads each host's last save time (written by the workers' save), which
launch compares with a spot host's preemption notice."""

from __future__ import annotations

from pathlib import Path

from autohet_cli.ckpt.notice import LAST_SAVE_FILE
from autohet_cli.cluster import cluster_from_dict
from autohet_cli.launch import jobs
from autohet_cli.transport.pool import ConnectOptions, HostPool


def _pool(ckpt: Path) -> HostPool:
    cluster = cluster_from_dict(
        {
            "schema": "autohet.cluster/v1",
            "name": "one",
            "hosts": [
                {
                    "name": "localhost",
                    "address": "localhost",
                    "gpus": {"type": "cpu", "count": 1},
                    "checkpoint_dir": str(ckpt),
                }
            ],
        },
        "test",
    )
    return HostPool(cluster, ConnectOptions())


def test_the_last_save_time_of_each_host_comes_with_the_job(tmp_path: Path) -> None:
    measured = tmp_path / "p" / "20261125T000000Z-aaaa"
    (measured / "step-00000004").mkdir(parents=True)
    (measured / "step-00000004" / "COMPLETE").touch()
    (measured / LAST_SAVE_FILE).write_text("41.250\n")
    garbled = tmp_path / "p" / "20261125T000001Z-bbbb"
    garbled.mkdir()
    (garbled / LAST_SAVE_FILE).write_text("x y\nz")  # not a number: ignored, job still listed
    with _pool(tmp_path) as pool:
        found = jobs.list_jobs(pool, ["localhost"], "p")
    assert found[measured.name].save_s == {"localhost": 41.25}
    assert found[measured.name].newest_step == 4
    assert found[garbled.name].save_s == {}
