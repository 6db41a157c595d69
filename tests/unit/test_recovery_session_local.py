"""`autohet recover` end to end on hosts of this machine (local runners), no training:
two recovers of one job at once (issue 29, high 5), and a shard whose only copy is
corrupt (issue 29, medium 8)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from autohet_cli.recovery import session
from autohet_cli.recovery.errors import RecoverLockHeld, RecoveryError
from tests.recovery_site import HOSTS, Site, make_site


def _request(plan_file: Path, **kw: object) -> session.RecoverRequest:
    return session.RecoverRequest(
        plan_file=plan_file, lost=("c",), resume=False, time_limit_s=5.0, **kw
    )  # type: ignore[arg-type]


def _intact(site: Site, host: str, step: int) -> dict[str, bool]:
    """Each manifest file in ``host``'s step directory: does it match its sha256?"""
    d = site.step_dir(host, step)
    manifest = json.loads((d / "manifest.json").read_text())
    return {
        f["path"]: hashlib.sha256((d / f["path"]).read_bytes()).hexdigest() == f["sha256"]
        for f in manifest["files"]
        if (d / f["path"]).exists()
    }


def test_two_recovers_of_one_job_from_two_plans_directories_cannot_both_go_on(
    tmp_path: Path,
) -> None:
    site = make_site(tmp_path)
    copy = tmp_path / "copy" / "plans"
    shutil.copytree(site.plan_file.parent, copy)  # `cp -r plans copy/`
    locked, go = threading.Event(), threading.Event()
    first_said: list[str] = []

    def first_say(line: str) -> None:
        first_said.append(line)
        if line.startswith("lost: "):  # the job is chosen and locked on the hosts
            locked.set()
            go.wait(30)

    results: list[session.RecoverResult] = []
    first = threading.Thread(
        target=lambda: results.append(session.recover(_request(site.plan_file), first_say))
    )
    first.start()
    try:
        assert locked.wait(30), first_said
        second_said: list[str] = []
        with pytest.raises(RecoverLockHeld) as info:
            session.recover(_request(copy / "lab.v1.yaml"), second_said.append)
        assert f"autohet recover pid {os.getpid()} on " in str(info.value)
        assert "holds its lock on a" in str(info.value)
        assert not any(line.endswith(" ok") for line in second_said)  # it copied nothing
        assert not (copy / "lab.v2.yaml").exists()
    finally:
        go.set()
        first.join(60)
    assert results and results[0].exit_code == 0 and results[0].report["resumed_step"] == 6
    assert (site.plan_file.parent / "lab.v2.yaml").exists()
    # Given back at the end: the second one now goes through, with nothing left to move.
    again = session.recover(_request(copy / "lab.v1.yaml"), lambda _line: None)
    assert again.report["bytes_from_peers"] == again.report["bytes_from_remote"] == 0


def test_a_shard_whose_only_copy_is_corrupt_never_lands_and_an_older_step_is_used(
    tmp_path: Path,
) -> None:
    site = make_site(tmp_path)
    bad = site.remote_dir(6) / "__2_0.distcp"  # c's shard of step 6: c is lost
    bad.write_bytes(b"\0" * bad.stat().st_size)
    said: list[str] = []

    with pytest.raises(
        RecoveryError, match=r"--step 6: .*step-00000006: no intact copy of __2_0\.distcp is left"
    ):
        session.recover(_request(site.plan_file, step=6), said.append)
    result = session.recover(_request(site.plan_file), said.append)

    assert result.exit_code == 0 and result.report["resumed_step"] == 3
    assert any("step-00000006: no intact copy" in s and "an older checkpoint" in s for s in said)
    for host in ("a", "b"):
        names = {p.name for p in site.step_dir(host, 6).iterdir()}
        assert "__2_0.distcp" not in names  # never under its name in that COMPLETE step
        assert not [n for n in names if "autohet-part" in n or n.endswith(".tmp")]
        assert all(_intact(site, host, 6).values())
        got = _intact(site, host, 3)
        assert set(got) == {".metadata", *(f"__{r}_0.distcp" for r in range(len(HOSTS)))}
        assert all(got.values())


def test_a_host_lost_during_the_copy_is_recovered_from_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 46: a wave goes on while recover copies. c is lost; during the copy b stops
    answering: recover replans on a alone and copies again, instead of failing."""
    from autohet_cli.errors import HostUnreachable
    from autohet_cli.plan import load_plan
    from autohet_cli.recovery import copies
    from autohet_cli.transport.pool import HostPool

    site = make_site(tmp_path)
    real_runner, real_copy = HostPool.runner, copies.execute_transfers
    down: set[str] = set()

    class Gone:
        def run(self, *_a: object, **_k: object) -> object:
            raise HostUnreachable("connection refused (test)", host="b")

    def runner(self: HostPool, name: str) -> object:
        return Gone() if name in down else real_runner(self, name)

    def copy_once(*args: object, **kw: object) -> object:
        if not down:
            down.add("b")  # b vanishes mid-copy
            raise RecoveryError("transfer failed: b: connection refused (test)")
        return real_copy(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(HostPool, "runner", runner)
    monkeypatch.setattr(copies, "execute_transfers", copy_once)
    said: list[str] = []
    result = session.recover(_request(site.plan_file), said.append)
    assert result.exit_code == 0, said
    assert any(s.startswith("b: lost during the copy (transfer failed") for s in said), said
    new = load_plan(result.report["new_plan_path"])
    assert new.hosts() == ["a"]
    assert any(s == "plan: recovered from the loss of b, c" for s in said), said


def test_auto_recover_follows_a_wave_into_the_next_recover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 46: the run a recover resumed loses a host too; with --auto-recover, recover
    goes on from the plan it just wrote, with the newly lost hosts, on the same job."""
    from typer.testing import CliRunner

    from autohet_cli.cli import app as app_module

    if not app_module.app.registered_commands:
        app_module._register()
    app = app_module.app
    site = make_site(tmp_path)
    calls: list[session.RecoverRequest] = []

    def fake(req: session.RecoverRequest, say: object) -> session.RecoverResult:
        calls.append(req)
        wave = {
            "new_plan_path": str(site.plan_file.with_name(f"lab.v{len(calls) + 1}.yaml")),
            "job": "J",
            "phases": {"detect": 0.1},
            "relaunch": {
                "status": "host_lost",
                "lost_hosts": ["b"],
                "recoverable": len(calls) == 1,  # the second relaunch finishes
            },
        }
        return session.RecoverResult(exit_code=0 if len(calls) == 2 else 3, report=wave)

    monkeypatch.setattr(session, "recover", fake)
    args = ["recover", str(site.plan_file), "--lost", "c", "--auto-recover"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert [r.lost for r in calls] == [("c",), ("b",)]
    assert calls[1].plan_file.name == "lab.v2.yaml" and calls[1].job == "J"
    assert calls[1].step is None
    assert "auto-recover: the resumed run lost b too; recovering again from" in res.output
    # Without the flag: one recover, its exit code.
    calls.clear()
    res = CliRunner().invoke(app, args[:-1])
    assert res.exit_code == 3 and len(calls) == 1


def _vanishing_hosts(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The hosts added to the returned set answer nothing from then on: every command
    their pool runner is asked for refuses, as a reclaimed spot host's sshd does."""
    from autohet_cli.errors import HostUnreachable
    from autohet_cli.transport.pool import HostPool

    real_runner = HostPool.runner
    down: set[str] = set()

    class Gone:
        def __init__(self, host: str) -> None:
            self.host = host

        def __getattr__(self, name: str) -> object:
            def refuse(*_a: object, **_k: object) -> object:
                raise HostUnreachable("connection refused (test)", host=self.host)

            return refuse

    def runner(self: HostPool, name: str) -> object:
        return Gone(name) if name in down else real_runner(self, name)

    monkeypatch.setattr(HostPool, "runner", runner)
    return down


def test_a_host_that_vanishes_mid_copy_fails_the_real_copy_and_is_recovered_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test above makes the copy raise; here the copy is recover's own and only the
    host goes: once the copy has begun, b answers nothing (as a reclaimed spot host's
    sshd), and what the real copy code makes of that must bring recover to replan
    without b, copy again and land on a alone."""
    from autohet_cli.plan import load_plan
    from autohet_cli.recovery import copies

    site = make_site(tmp_path)
    real_copy = copies.execute_transfers
    down = _vanishing_hosts(monkeypatch)
    copying: list[list[str]] = []

    def copy(tp: object, *args: object, **kw: object) -> object:
        copying.append(sorted({i.dest_host for i in tp.items}))  # type: ignore[attr-defined]
        down.add("b")  # b is reclaimed as the copy starts
        return real_copy(tp, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(copies, "execute_transfers", copy)
    said: list[str] = []
    result = session.recover(_request(site.plan_file), said.append)
    assert result.exit_code == 0, said
    assert "b" in copying[0], (copying, said)  # b was a destination of the first copy
    lost = [s for s in said if s.startswith("b: lost during the copy (")]
    assert lost and "connection refused (test)" in lost[0], said
    assert load_plan(result.report["new_plan_path"]).hosts() == ["a"]
    assert "plan: recovered from the loss of b, c" in said, said
    assert set(_intact(site, "a", 6).values()) == {True}  # a holds every file, verified
    # The checkpoint's step named as the log's, as every message names it (issue 46.7).
    assert "lost: c; resuming job 20260101T000000Z-abcd from step-00000006 (after step 5)" in said


def test_a_host_lost_after_the_copy_before_the_run_starts_is_a_wave_auto_recover_follows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 46: b stops answering between the copy and the resumed run's start (its
    preflight): recover said only the transport's error and stopped. Now the relaunch
    counts as one that lost b, which next_wave (--auto-recover) recovers from."""
    from autohet_cli.errors import HostUnreachable

    site = make_site(tmp_path)
    down = _vanishing_hosts(monkeypatch)

    def run_job(*_a: object, **_k: object) -> object:
        down.add("b")
        raise HostUnreachable("host b: connection refused (test)", host="b")

    monkeypatch.setattr(session, "run_job", run_job)
    monkeypatch.setattr(session, "preflight_ahead", lambda *_a, **_k: None)
    said: list[str] = []
    req = dataclasses.replace(_request(site.plan_file), resume=True)
    result = session.recover(req, said.append)
    assert result.exit_code == 3, said
    relaunch = result.report["relaunch"]
    assert relaunch == {"status": "host_lost", "lost_hosts": ["b"], "recoverable": True}
    v2 = result.report["new_plan_path"]
    assert f"the checkpoint is in place on a: autohet recover {v2}" in said[-1], said
    nxt = session.next_wave(req, result)
    assert nxt is not None and nxt.lost == ("b",) and str(nxt.plan_file) == v2
