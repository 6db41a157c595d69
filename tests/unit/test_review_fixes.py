"""Fixes from the review of the launch/recover/checkpoint rewrite: uploads never block
training, private directories under a umask of 002, the key race, per-rank probes,
and jobs ordered by when they began."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import time
from pathlib import Path

from autohet_cli.ckpt.files import ensure_private_dir, read_key, write_key
from autohet_cli.ckpt.format import Manifest, ManifestFile
from autohet_cli.ckpt.remote import RemoteCopy, Uploader, UploadJob
from autohet_cli.cluster import Cluster
from autohet_cli.launch.hostcmds import PROBE as _PROBE
from autohet_cli.launch.jobs import list_jobs
from autohet_cli.transport.pool import ConnectOptions, HostPool
from tests.planting import cpu_host

SHA = "0" * 64


def test_a_slow_remote_never_blocks_the_next_save(tmp_path: Path) -> None:
    """Rank 0 waits for a file another rank never sends; the next save returns at once,
    ends that wait, and the newer step reaches the remote copy instead."""
    local = tmp_path / "local"
    local.mkdir()
    (local / "manifest.json").write_bytes(b"{}")
    (local / "__0_0.distcp").write_bytes(b"data")
    lost = ManifestFile(path="__1_0.distcp", sha256=SHA, num_bytes=4, host="h", rank=1)
    manifest = Manifest(step=1, plan="p.v1", plan_sha256=SHA, world_size=2, files=(lost,))
    uploader = Uploader(RemoteCopy(str(tmp_path / "remote"), "p", "j"), timeout_s=30)
    uploader.start(UploadJob(step=1, local_dir=local, names=(), manifest=manifest))
    time.sleep(0.5)  # rank 0 is now waiting for rank 1's file of step 1
    started = time.monotonic()
    uploader.start(UploadJob(step=2, local_dir=local, names=("__0_0.distcp",)))
    assert time.monotonic() - started < 1.0
    began = time.monotonic()
    uploader.join(timeout_s=10)  # the end of training: a bounded wait, here a short one
    assert time.monotonic() - began < 5
    assert any(
        "step 1 is not marked COMPLETE in" in e and e.endswith("superseded by 2")
        for e in uploader.errors
    )
    step2 = tmp_path / "remote" / "p" / "j" / "step-00000002" / "__0_0.distcp"
    assert step2.read_bytes() == b"data"
    assert not (tmp_path / "remote" / "p" / "j" / "step-00000001" / "COMPLETE").exists()


def test_private_dirs_are_made_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o002)  # Ubuntu's default for users with a private group
    try:
        ensure_private_dir(tmp_path / "a" / "b" / "job", tmp_path / "a")
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "job"):
        assert d.stat().st_mode & 0o777 == 0o700, d


def _race(job_dir: str, seed: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    try:
        out.put(write_key(Path(job_dir), bytes([seed]) * 32))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out.put(repr(exc))


def test_ranks_of_one_host_racing_to_write_the_key_all_get_the_same_whole_key(
    tmp_path: Path,
) -> None:
    for attempt in range(5):
        job = tmp_path / f"job{attempt}"
        job.mkdir(mode=0o700)
        ctx = multiprocessing.get_context("fork")
        out: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
        procs = [ctx.Process(target=_race, args=(str(job), i, out)) for i in range(8)]
        for p in procs:
            p.start()
        got = [out.get(timeout=30) for _ in procs]
        for p in procs:
            p.join()
        assert all(isinstance(g, bytes) and len(g) == 32 for g in got), got
        assert len(set(got)) == 1 and read_key(job) == got[0]
        assert sorted(p.name for p in job.iterdir()) == [".autohet-key"]  # no temp left


def test_the_probe_reads_only_this_hosts_running_ranks_on_the_hosts_clock(
    tmp_path: Path,
) -> None:
    for d in ("heartbeat", "boot", "errors"):
        (tmp_path / d).mkdir()
    now = time.time()
    beat = {"state": "running", "time": round(now - 30, 3)}
    (tmp_path / "heartbeat" / "rank0").write_text(json.dumps(beat))
    os.utime(tmp_path / "heartbeat" / "rank0", (now, now))  # a server clock would lie
    done = {"state": "done", "time": round(now - 100, 3)}
    (tmp_path / "heartbeat" / "rank1").write_text(json.dumps(done))
    (tmp_path / "heartbeat" / "rank7").write_text(json.dumps(beat | {"time": now - 999}))
    (tmp_path / "boot" / "rank2").write_text("x")
    (tmp_path / "errors" / "rank1.json").write_text('{"message": "boom"}')
    res = subprocess.run(
        ["sh", "-c", _PROBE, "sh", str(tmp_path), "0 1 2 3"],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = res.stdout.split("\n")
    ages = [int(x.split()[1]) for x in lines if x.startswith("hb ")]
    assert len(ages) == 1 and 29 <= ages[0] <= 32  # rank 0 only: rank 1 is done, 7 elsewhere
    assert 'err {"message": "boom"}' in lines
    assert "boot 3" in lines  # ranks 0 and 1 beat, rank 2 marked its start, rank 3 nothing


def test_jobs_are_ordered_by_when_they_began_not_by_name(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    plan_dir = ck / "lab"
    for name, age_s in (("default", 10), ("20991231T000000Z-ffff", 500), ("mine", 100)):
        job = plan_dir / name
        job.mkdir(parents=True)
        key = job / ".autohet-key"
        key.write_bytes(b"k" * 32)
        when = time.time() - age_s
        os.utime(key, (when, when))
    (plan_dir / "step-00000004").mkdir()  # an old-layout step: not a job
    host = cpu_host("localhost", checkpoint_dir=str(ck))
    with HostPool(Cluster(name="c", hosts=(host,), inter_node_gbps=10.0), ConnectOptions()) as pool:
        jobs = list_jobs(pool, ["localhost"], "lab")
    assert list(jobs) == ["20991231T000000Z-ffff", "mine", "default"]
    assert all(j.key_hosts == ("localhost",) for j in jobs.values())
