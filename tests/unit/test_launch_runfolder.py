"""The launcher's side of the run folder: who writes the metrics, the collector, run.json."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from autohet_cli.cluster import Cluster, cluster_from_dict
from autohet_cli.launch import runfolder
from autohet_cli.launch.collect import MetricsCollector
from autohet_cli.launch.executor import Job, LaunchError
from autohet_cli.launch.session import Prepared
from autohet_cli.launch.specs import LaunchOptions, LaunchSpec, build_launch_specs
from autohet_cli.runfiles.metricsfile import (
    FOLDER_ENV,
    METRIC_PREFIX,
    STREAM_ENV,
    tb_scalars,
)
from autohet_cli.runfiles.record import read_record
from autohet_cli.transport.pool import ConnectOptions, HostPool
from tests.planting import plan_of, stage


def _cluster(first_address: str) -> Cluster:
    return cluster_from_dict(
        {
            "schema": "autohet.cluster/v1",
            "name": "lab",
            "remote_storage": "s3://bucket/ck",
            "hosts": [
                {"name": "a", "address": first_address, "gpus": {"type": "cpu", "count": 1}},
                {
                    "name": "b",
                    "address": "127.0.0.3",
                    "gpus": {"type": "cpu", "count": 1},
                    "checkpoint_dir": "/data/ck",
                },
            ],
        },
        "test",
    )


PLAN = plan_of([stage(0, 3, "a"), stage(3, 6, "b")], version=2)


def _specs(first_address: str, **kw: object) -> list[LaunchSpec]:
    options = LaunchOptions(run_id="R", job="J", run_folder="/home/me/runs/lab.v2/R", **kw)
    return build_launch_specs(PLAN, _cluster(first_address), options)


def test_rank_0_on_this_machine_writes_into_the_run_folder_itself() -> None:
    first, second = _specs("localhost")
    assert first.env[FOLDER_ENV] == "/home/me/runs/lab.v2/R"
    assert STREAM_ENV not in first.env
    assert FOLDER_ENV not in second.env and STREAM_ENV not in second.env  # rank 0 only


def test_rank_0_on_another_machine_streams_its_metrics_to_the_launcher() -> None:
    first, second = _specs("127.0.0.2")
    assert first.env[STREAM_ENV] == "1" and FOLDER_ENV not in first.env
    assert STREAM_ENV not in second.env
    assert f"{STREAM_ENV}=1" in first.command_line()  # what --dry-run shows


def test_a_user_script_or_no_run_folder_asks_for_nothing() -> None:
    for spec in _specs("localhost", script=("train.py",)):
        assert FOLDER_ENV not in spec.env and STREAM_ENV not in spec.env
    plain = build_launch_specs(PLAN, _cluster("localhost"), LaunchOptions(run_id="R"))
    assert all(FOLDER_ENV not in s.env for s in plain)


def _job(tmp_path: Path, first_address: str = "127.0.0.2") -> Job:
    cluster = _cluster(first_address)
    specs = _specs(first_address)
    pool = HostPool(cluster, ConnectOptions())
    return Job(specs, pool, tmp_path / "lab.v2.yaml", tmp_path, printer=lambda _l: None)


def test_streamed_metric_lines_go_to_the_run_folder_not_the_log(tmp_path: Path) -> None:
    job = _job(tmp_path)
    job._collector = MetricsCollector(tmp_path)  # what start() makes for a streaming host
    job._logs["a"] = (tmp_path / "a.log").open("a", encoding="utf-8")
    job._tails["a"] = collections.deque()
    on_line = job._on_line("a")
    step = {"step": 0, "loss": 7.25, "lr": 0.001, "tokens_per_s": 10.0, "peak_mem_bytes": [1]}
    on_line("stdout", METRIC_PREFIX + json.dumps(step))
    on_line("stdout", "step 0 loss 7.250000 tokens/s 10 lr 0.001")
    on_line("stdout", METRIC_PREFIX + json.dumps({"step": 0, "eval_loss": 7.5}))
    job.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(ln) for ln in lines] == [step, {"step": 0, "eval_loss": 7.5}]
    assert METRIC_PREFIX not in (tmp_path / "a.log").read_text()
    assert job.status.loss == 7.25  # the human line still drives the status


def test_the_collector_writes_tensorboard_events_with_the_workers_tags(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    collector = MetricsCollector(tmp_path)
    records = [
        {"step": s, "loss": 7.0 - s, "lr": 0.1, "tokens_per_s": 5.0, "grad_norm": 1.0}
        for s in range(3)
    ]
    for r in records:
        collector.add(json.dumps(r))
    collector.add("not json")
    collector.add(json.dumps({"no": "step"}))
    collector.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {t for t, _ in tb_scalars(records[0])}
    assert [e.value for e in events.Scalars("train/loss")] == [7.0, 6.0, 5.0]


def _prepared(tmp_path: Path, first_address: str) -> Prepared:
    return Prepared(
        plan=PLAN,
        plan_file=tmp_path / "lab.v2.yaml",
        cluster=_cluster(first_address),
        cluster_path=str(tmp_path / "lab.yaml"),
        remote_storage="s3://bucket/ck",
    )


def test_run_json_is_written_at_the_start_and_says_how_an_error_ended_the_run(
    tmp_path: Path,
) -> None:
    job = _job(tmp_path)
    said: list[str] = []
    with (
        pytest.raises(LaunchError),
        runfolder.recorded(job, _prepared(tmp_path, "127.0.0.2"), tmp_path, said.append),
    ):
        started = read_record(tmp_path)
        assert started is not None and started.status == "running"
        raise LaunchError("b: cannot create the run directory")
    assert said[0].startswith(f"run folder: {tmp_path}/")
    ended = read_record(tmp_path)
    assert ended is not None
    assert (ended.status, ended.detail) == (
        "failed",
        "LaunchError: b: cannot create the run directory",
    )
    assert ended.plan == "lab.v2" and ended.job == "J" and ended.trainer == "built-in"
    assert ended.checkpoints == {"a": "~/autohet/checkpoints/lab/J/", "b": "/data/ck/lab/J/"}
    assert ended.remote_checkpoints == "s3://bucket/ck/lab/J/"
    assert ended.ended_at is not None and ended.last_step is None


def test_launches_in_the_same_second_each_get_their_own_folder(tmp_path: Path) -> None:
    """The default run id is the UTC second: concurrent launches of one plan race for
    it; each must get a folder of its own (a suffix), never a FileExistsError."""
    from concurrent.futures import ThreadPoolExecutor

    from autohet_cli.launch.attempt import local_run_dir as _local_run_dir
    from autohet_cli.launch.executor import LaunchError
    from tests.unit.test_recovery_transfer import plan as make_plan

    p = make_plan("lab", 1, [[("a", 0, 8)]])
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: _local_run_dir(tmp_path, p, None), range(16)))
    folders = [f for f, _ in got]
    assert len(set(folders)) == 16 and all(f.is_dir() for f in folders)
    # a run id given by the user is used once
    _local_run_dir(tmp_path, p, "mine")
    with pytest.raises(LaunchError, match="already exists: a run id is used once"):
        _local_run_dir(tmp_path, p, "mine")


def test_a_host_sharing_the_run_directory_waits_for_the_makers_token(tmp_path: Path) -> None:
    """Hosts on one NFS home: the one that made the directory may not have written the
    launch's token yet when another looks; that one waits for it instead of refusing
    its own launch's directory. Another launch's directory is refused at once."""
    import subprocess
    import threading
    import time

    from autohet_cli.launch import hostcmds

    work, run = tmp_path / "work", tmp_path / "work" / "runs" / "p.v1" / "r1"

    def mkrun(token: str) -> int:
        argv = ["sh", "-c", hostcmds.MKRUN, "sh", str(work), str(run.parent), str(run), token]
        return subprocess.run(argv, check=False).returncode

    run.mkdir(parents=True)  # the maker's mkdir, its token not written yet
    late = threading.Timer(0.5, lambda: (run / ".launch").write_text("T1"))
    late.start()
    started = time.monotonic()
    assert mkrun("T1") == 0  # waited for the token rather than refusing
    assert 0.4 < time.monotonic() - started < 4
    late.join()
    started = time.monotonic()
    assert mkrun("T2") != 0  # another launch: refused at once
    assert time.monotonic() - started < 1
    fresh = tmp_path / "work" / "runs" / "p.v1" / "r2"
    argv = ["sh", "-c", hostcmds.MKRUN, "sh", str(work), str(fresh.parent), str(fresh), "T3"]
    assert subprocess.run(argv, check=False).returncode == 0
    assert (fresh / ".launch").read_text() == "T3" and not list(fresh.glob(".launch.*"))
