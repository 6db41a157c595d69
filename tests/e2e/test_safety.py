"""Safe by default, on real sshd hosts (issue 11): planted checkpoints never load, completed
checkpoints are never lost, runs never mix, recover checks and locks, names stay inside."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import uuid
from pathlib import Path

import pytest
import yaml

from tests.e2e.sshd import SshdFarm
from tests.e2e.test_launch import _cluster_file, _launch, _plan, _workers_gone
from tests.e2e.test_recover import _recover
from tests.planting import plant_step

pytestmark = pytest.mark.e2e


def _jobs(root: Path) -> list[Path]:
    return sorted(d for d in (root / "e2e").iterdir() if d.is_dir())


def _other_heads(plan_file: Path, out: Path) -> Path:
    """The same plan with gpt-tiny's weights read as 8 heads of 8 (the same shapes)."""
    import dataclasses

    from autohet_cli.models import get_model
    from autohet_cli.plan import load_plan, write_plan

    plan = load_plan(plan_file)
    spec = dataclasses.replace(get_model("gpt-tiny"), num_heads=8, num_kv_heads=8)
    _, path = write_plan(dataclasses.replace(plan, architecture=spec, version=0), out)
    return path


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow(
    "one 3-host launch that saves, then five recovers against it, the last one resuming"
)
def test_planted_steps_never_load_and_recover_checks_locks_and_cleans_up(
    sshd_farm: SshdFarm, tmp_path: Path
) -> None:
    sshd_farm.start(3)
    remote = tmp_path / "remote"
    plan = _plan(tmp_path, _cluster_file(sshd_farm, tmp_path / "cluster.yaml", str(remote)))
    proc = _launch(plan, tmp_path, "--steps", "60", "--checkpoint-every", "2")
    assert proc.stdout is not None
    for line in proc.stdout:
        if "step 5 " in line:
            break
    # Item 4: --lost no longer skips the check for workers still running.
    busy = _recover(tmp_path, plan, "--lost", "fake-4", "--dry-run")
    assert busy.returncode == 1 and "still running" in busy.stderr, busy.stderr
    # The run ends (its uploads finish), then fake-4 is lost: the remote copy is whole.
    proc.communicate(timeout=300)
    assert proc.returncode == 0
    sshd_farm.hosts[2].stop()

    (job,) = _jobs(remote)
    steps = sorted(d for d in job.glob("step-*") if (d / "COMPLETE").exists())
    newest = steps[-1]
    assert newest.name == "step-00000060"
    # Item 1: a "newer" step in remote storage whose .metadata runs a command when
    # unpickled, with a manifest whose sha256 and step were edited to match.
    marker = tmp_path / "pwned"
    plant_step(newest, 99, marker)

    # Item 10: an older step on request, and a step that does not exist.
    older = int(steps[-2].name.split("-")[1])
    res = _recover(tmp_path, plan, "--lost", "fake-4", "--dry-run", "--json", "--step", str(older))
    assert res.returncode == 0 and json.loads(res.stdout)["step"] == older, res.stderr
    res = _recover(tmp_path, plan, "--lost", "fake-4", "--dry-run", "--step", "77")
    assert res.returncode == 1 and "--step 77: no usable checkpoint" in res.stderr

    # Item 10: a recover whose transfer fails writes no plan version. fake-4's shard
    # lives in remote storage and on its partner (replicas): corrupt every copy for a
    # moment.
    lost_shard = next(
        f["path"]
        for f in json.loads((newest / "manifest.json").read_text())["files"]
        if f["host"] == "fake-4"
    )
    good = (newest / lost_shard).read_bytes()
    copies = [newest / lost_shard] + [
        c
        for h in sshd_farm.hosts[:2]
        for c in (_jobs(h.checkpoint_dir)[0] / newest.name / lost_shard,)
        if c.exists()
    ]
    assert len(copies) == 2  # remote storage and fake-4's partner
    for c in copies:
        c.write_bytes(b"x" + good[1:])
    # With no older step allowed (--step), the step is lost; by default recover falls
    # back to the older step (tests/unit/test_recovery_session_local.py).
    step_now = newest.name.split("-")[1].lstrip("0")
    res = _recover(tmp_path, plan, "--lost", "fake-4", "--no-resume", "--step", step_now)
    assert res.returncode == 1 and f"--step {step_now}: " in res.stderr, res.stderr
    assert "every source failed" in res.stderr, res.stderr
    assert not (tmp_path / "plans" / "e2e.v2.yaml").exists()
    for c in copies:
        c.write_bytes(good)

    # Temp files of an interrupted copy are removed.
    survivor = _jobs(sshd_farm.hosts[0].checkpoint_dir)[0] / newest.name
    (survivor / "__9_0.distcp.autohet-part").write_bytes(b"partial")
    (survivor / ".__9_0.distcp.1234abcd.tmp").write_bytes(b"partial")

    res = _recover(tmp_path, plan, "--lost", "fake-4", "--steps", "64")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert re.search(r"skipped step-00000099: .*does not verify", out), out
    assert f"resuming job {job.name} from {newest.name}" in out
    assert not marker.exists()  # nothing planted was ever unpickled
    assert (tmp_path / "plans" / "e2e.v2.yaml").exists()
    assert not list(survivor.glob("*.autohet-part")) and not list(survivor.glob(".*.tmp"))
    assert not _workers_gone(sshd_farm)


@pytest.mark.slow("four 3-host launches in a row: the refusal between runs is the behaviour")
def test_runs_never_mix_never_delete_checkpoints_and_tilde_means_the_hosts_home(
    sshd_farm: SshdFarm, tmp_path: Path
) -> None:
    sshd_farm.start(3)
    # A remote copy lets a plain --resume fill in the shards other hosts wrote.
    cluster = _cluster_file(sshd_farm, tmp_path / "cluster.yaml", str(tmp_path / "remote"))
    home_dir = f"autohet-e2e-{uuid.uuid4().hex[:8]}"
    doc = yaml.safe_load(cluster.read_text())
    for i, h in enumerate(doc["hosts"]):
        h["checkpoint_dir"] = f"~/{home_dir}/ck{i}"  # item 8: was passed quoted
    cluster.write_text(yaml.safe_dump(doc))
    plan = _plan(tmp_path, cluster)
    ck = Path.home() / home_dir
    try:
        first = _launch(plan, tmp_path, "--steps", "3", "--run-id", "r1")
        out, _ = first.communicate(timeout=300)
        assert first.returncode == 0, out
        assert not list((tmp_path / "sshd").rglob("~")), "a directory literally named ~"
        (job1,) = _jobs(ck / "ck0")
        before = _digests(ck)

        # Item 9: a reused run directory is refused, never judged by old heartbeats.
        again = _launch(plan, tmp_path, "--steps", "3", "--run-id", "r1")
        out, _ = again.communicate(timeout=120)
        assert again.returncode == 1 and "already exists" in out, out
        assert "started" not in out

        # Item 3: a fresh launch starts a new job beside the old one, which stays intact.
        second = _launch(plan, tmp_path, "--steps", "3")
        out, _ = second.communicate(timeout=300)
        assert second.returncode == 0, out
        assert re.search(r"^job: \S+ \(new; earlier checkpoints of e2e are kept", out, re.M)
        jobs = _jobs(ck / "ck0")
        assert len(jobs) == 2 and job1 in jobs
        after = _digests(ck)
        assert {k: v for k, v in after.items() if k in before} == before

        # Issue 45: a plan of the same name and shapes but another model (8 heads of 8,
        # not 4 of 16) is refused before any tensor loads, both sides named.
        other = _other_heads(plan, tmp_path / "plans-other")
        refused = _launch(other, tmp_path, "--steps", "5", "--resume")
        out, _ = refused.communicate(timeout=300)
        assert refused.returncode == 1, out
        assert "another model than this plan's" in out and "num_heads 4 then, 8 now" in out, out
        assert re.search(r"^failed: .*root cause: .*another model than this plan's", out, re.M)
        assert "Size mismatch" not in out and "autohet_cli/ckpt" not in out, out
        assert len(_jobs(ck / "ck0")) == 2  # no new job

        resumed = _launch(plan, tmp_path, "--steps", "5", "--resume")
        out, _ = resumed.communicate(timeout=300)
        assert resumed.returncode == 0, out
        newest = max(jobs).name
        assert f"job: resuming {newest}" in out and "at step 3" in out, out
    finally:
        shutil.rmtree(ck, ignore_errors=True)


@pytest.mark.slow("two 3-host launches over one shared home: save, then resume")
def test_hosts_sharing_a_home_share_run_and_checkpoint_directories_safely(
    sshd_farm: SshdFarm, tmp_path: Path
) -> None:
    """An NFS home: every host sees the same workdir and checkpoint dir. The run directory
    is made once per launch (not refused as reused), pid files and heartbeats stay per
    host, and checkpoints are written and resumed whole."""
    sshd_farm.start(3)
    cluster = _cluster_file(sshd_farm, tmp_path / "cluster.yaml")
    doc = yaml.safe_load(cluster.read_text())
    for h in doc["hosts"]:
        h["workdir"] = str(tmp_path / "home" / "work")
        h["checkpoint_dir"] = str(tmp_path / "home" / "ck")
    cluster.write_text(yaml.safe_dump(doc))
    plan = _plan(tmp_path, cluster)
    first = _launch(plan, tmp_path, "--steps", "4", "--checkpoint-every", "2")
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out
    (run,) = (tmp_path / "home" / "work" / "runs" / "e2e.v1").iterdir()
    assert sorted(p.name for p in run.glob("torchrun-*.pid")) == [
        "torchrun-fake-2.pid",
        "torchrun-fake-3.pid",
        "torchrun-fake-4.pid",
    ]
    (job,) = _jobs(tmp_path / "home" / "ck")
    assert (job / "step-00000004" / "COMPLETE").exists()
    assert len(list((job / "step-00000004").glob("*.distcp"))) == 3
    again = _launch(plan, tmp_path, "--steps", "6", "--resume")
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0 and "at step 4" in out, out
