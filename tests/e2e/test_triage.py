"""Failures that say what failed, on real sshd hosts: a crash is not a lost host, workers that
never start are named, a hung interpreter is caught before the job starts, and a default run
checkpoints so that a lost host can be healed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.e2e.sshd import SshdFarm
from tests.e2e.test_launch import ROOT, _cluster_file, _launch, _plan, _workers_gone
from tests.e2e.test_recover import _job

pytestmark = pytest.mark.e2e


def _set_python(cluster: Path, host: str, python: str) -> None:
    doc = yaml.safe_load(cluster.read_text())
    for h in doc["hosts"]:
        if h["name"] == host:
            h["python"] = python
    cluster.write_text(yaml.safe_dump(doc))


def _wrapper(path: Path, body: str) -> str:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def _run(plan: Path, tmp: Path, *extra: str, timeout: float = 240) -> tuple[int, str]:
    proc = _launch(plan, tmp, *extra)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _events(tmp: Path) -> dict[str, object]:
    path = max((tmp / "runs").glob("e2e.v*/*/events.json"), key=lambda p: p.stat().st_mtime)
    return dict(json.loads(path.read_text()))


def test_a_crash_on_one_host_is_failed_workers_with_its_root_cause_not_a_lost_host(
    sshd_farm: SshdFarm, tmp_path: Path
) -> None:
    sshd_farm.start(3)
    code = tmp_path / "code"
    code.mkdir()
    (code / "crashy.py").write_text(
        "import os\n"
        "from autohet_cli.runtime.gpt import build as gpt_build\n"
        "def build(request):\n"
        "    if os.environ.get('AUTOHET_HOST') == 'fake-3':\n"
        "        raise RuntimeError('bad learning schedule in user code')\n"
        "    return gpt_build(request)\n"
    )
    plan = _plan(tmp_path, _cluster_file(sshd_farm, tmp_path / "cluster.yaml"))
    rc, out = _run(
        plan,
        tmp_path,
        "--steps",
        "5",
        "--sync-dir",
        str(code),
        "--train-arg=--model-fn=crashy:build",
        "--auto-recover",
    )
    assert rc != 0, out
    assert re.search(r"^failed: .*root cause: rank \d on fake-3", out, re.M), out
    assert "RuntimeError: bad learning schedule in user code" in out
    assert "run folder: runs/e2e.v1/" in out
    # Nothing suggests recovering, and --auto-recover did not act.
    assert "autohet recover" not in out and "auto-recover:" not in out, out
    events = _events(tmp_path)
    assert events["status"] == "failed" and events["lost_hosts"] == []
    assert "fake-3" in events["failed_hosts"]
    assert not _workers_gone(sshd_farm)


@pytest.mark.slow("waits out the 20 s start deadline it tests")
def test_workers_that_never_start_are_named_after_the_start_deadline(
    sshd_farm: SshdFarm, tmp_path: Path
) -> None:
    """fake-3's python answers the preflight but hangs when asked to start torchrun."""
    sshd_farm.start(3)
    cluster = _cluster_file(sshd_farm, tmp_path / "cluster.yaml")
    hang = _wrapper(
        tmp_path / "hangpy",
        f'case "$*" in *runtime.agent*) exec sleep 600;; esac\nexec {sys.executable} "$@"',
    )
    _set_python(cluster, "fake-3", hang)
    plan = _plan(tmp_path, cluster)
    started = time.monotonic()
    rc, out = _run(plan, tmp_path, "--steps", "5", "--start-timeout", "20", "--force")
    assert time.monotonic() - started < 120, out
    assert rc != 0, out
    assert re.search(r"^not_started: torchrun on fake-3 never reached the rendezvous", out, re.M), (
        out
    )
    assert "autohet recover" not in out
    events = _events(tmp_path)
    assert events["not_started_hosts"] == ["fake-3"] and events["lost_hosts"] == []
    assert not _workers_gone(sshd_farm, keep="sleep 600")


def test_a_hung_interpreter_is_named_before_anything_starts(
    sshd_farm: SshdFarm, tmp_path: Path
) -> None:
    sshd_farm.start(2)
    cluster = _cluster_file(sshd_farm, tmp_path / "cluster.yaml")
    _set_python(cluster, "fake-3", _wrapper(tmp_path / "hung", "exec sleep 600"))
    plan = _plan(tmp_path, cluster, ((2, ((0, 6, "fake-2"),)), (2, ((0, 6, "fake-3"),))))
    rc, out = _run(plan, tmp_path, "--start-timeout", "5", "--force", timeout=120)
    assert rc == 1, out
    assert "error: fake-3:" in out and "did not answer within 5 s" in out, out
    assert "started" not in out  # no worker was started anywhere


def _recover(tmp: Path, plan: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "autohet_cli", "recover", str(plan)]
        + ["--known-hosts", str(tmp / "sshd" / "known_hosts"), *args],
        cwd=tmp,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_default_run_checkpoints_and_says_where_so_a_lost_host_can_be_healed(
    sshd_farm: SshdFarm, tmp_path: Path
) -> None:
    sshd_farm.start(3)
    remote = str(tmp_path / "remote")
    plan = _plan(tmp_path, _cluster_file(sshd_farm, tmp_path / "cluster.yaml", remote))
    rc, out = _run(plan, tmp_path, "--steps", "4")
    assert rc == 0, out
    assert re.search(r"^checkpoints: auto .*fake-2:\S+/ckpt/e2e/", out, re.M), out
    for step in (1, 4):  # the first step and the last are saved (COMPLETE on rank 0's host)
        assert (_job(sshd_farm.hosts[0].checkpoint_dir) / f"step-{step:08d}" / "COMPLETE").exists()
        for h in sshd_farm.hosts:
            assert list((_job(h.checkpoint_dir) / f"step-{step:08d}").glob("*.distcp"))
    res = _recover(tmp_path, plan, "--lost", "fake-4", "--dry-run", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout)["step"] == 4


def test_recover_names_the_real_cause_and_json_gets_an_error_object(
    sshd_farm: SshdFarm, tmp_path: Path
) -> None:
    sshd_farm.start(3)
    cluster = _cluster_file(sshd_farm, tmp_path / "cluster.yaml", str(tmp_path / "remote"))
    plan = _plan(tmp_path, cluster)
    # No save at all (a run that ends normally saves its last step unless told not to).
    rc, out = _run(plan, tmp_path, "--steps", "2", "--checkpoint-every", "0", "--no-emergency-save")
    assert rc == 0 and "checkpoints: none (--checkpoint-every 0 with --no-emergency-save)" in out

    res = _recover(tmp_path, plan, "--lost", "v100-9", "--dry-run", "--json")
    assert res.returncode == 1
    error = json.loads(res.stdout)
    assert error["ok"] is False and "v100-9: not a host of plan e2e.v1" in error["error"]
    assert "fake-2, fake-3, fake-4" in error["error"] and "Traceback" not in res.stderr

    res = _recover(tmp_path, plan, "--lost", "fake-4", "--dry-run")
    assert res.returncode == 1
    assert "the run never checkpointed" in res.stderr, res.stderr

    # The survivors refuse our key: that is not a lost host, and not "no checkpoint".
    doc = yaml.safe_load(cluster.read_text())
    for h in doc["hosts"]:
        h["identity_file"] = str(tmp_path / "no-such-key")
    cluster.write_text(yaml.safe_dump(doc))
    res = _recover(
        tmp_path, plan, "--lost", "fake-4", "--dry-run", "--json", "--cluster", str(cluster)
    )
    assert res.returncode == 1
    error = json.loads(res.stdout)
    assert "cannot check every survivor" in error["error"], error
    assert "fake-2" in error["error"] and "no-such-key" in error["error"], error
    assert "checkpoint" not in error["error"].split("cannot check")[0]
