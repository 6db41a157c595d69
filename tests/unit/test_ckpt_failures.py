"""Issue 29's checkpoint findings, reproduced in one process: a failed periodic save
no longer ends the run, a deleted job key stops it, a step of an abandoned run is
replaced (not kept) when a resumed run reaches it, interrupted saves' leftovers and
unused job directories do not pile up."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch.distributed as dist

from autohet_cli.ckpt import failures, finish
from autohet_cli.ckpt.checkpointer import Checkpointer
from autohet_cli.ckpt.files import CheckpointError, list_steps, read_key
from autohet_cli.ckpt.format import KEY_FILE
from autohet_cli.ckpt.remote import RemoteCopy
from autohet_cli.runtime.trainer import Trainer
from tests.unit.test_ckpt_async import CONFIG, JOB, PLAN, _fresh, _params

pytestmark = pytest.mark.usefixtures("alone")


def _complete(tmp: Path, key: bytes) -> list[int]:
    return sorted(s for s, why in list_steps(tmp / JOB, key).items() if why is None)


# ------------------------------------------------------------ a failed save


def test_a_failed_periodic_save_is_named_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer, ckpt = _fresh(tmp_path, 1)
    ckpt.save()
    ckpt.poll(block=True)
    real = finish.dcp_save

    def full(*_a: object, **_k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.distcp"))

    monkeypatch.setattr(finish, "dcp_save", full)
    trainer.fit(1)
    ckpt.save()  # the write fails in the background
    assert ckpt.poll(block=True) == 2  # reported, not raised
    err = capsys.readouterr().err
    assert "warning: step 2 was not saved: No space left on device [ENOSPC]" in err
    assert "training goes on" in err and "newest complete step on this host: step 1" in err
    assert not [p for p in (tmp_path / JOB).iterdir() if p.name.startswith(".tmp-")]
    monkeypatch.setattr(finish, "dcp_save", real)
    trainer.fit(1)
    ckpt.save()
    ckpt.close()
    assert _complete(tmp_path, ckpt.key) == [1, 3]
    assert ckpt.failed_steps == [2]


def test_a_failed_last_save_fails_the_run_with_its_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, ckpt = _fresh(tmp_path, 1)

    def readonly(*_a: object, **_k: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(finish, "dcp_save", readonly)
    ckpt.save(last=True)
    with pytest.raises(CheckpointError, match=r"step 1 was not saved: Read-only file system"):
        ckpt.close()
    assert not [p for p in (tmp_path / JOB).iterdir() if "step-" in p.name]  # no leftovers


def test_a_bug_inside_a_save_is_raised_not_warned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the storage's errors let training go on; a TypeError inside DCP's save
    (wrapped in its CheckpointException) is a bug and stops the run."""
    from torch.distributed.checkpoint.api import CheckpointException

    _, ckpt = _fresh(tmp_path, 1)

    def bug(*_a: object, **_k: object) -> None:
        raise CheckpointException("save failed", {0: (TypeError("cannot pickle 'x'"), None)})

    monkeypatch.setattr(finish, "dcp_save", bug)
    ckpt.save()
    with pytest.raises(CheckpointException):
        ckpt.poll(block=True)


def test_torchs_words_for_a_full_disk_come_with_the_disk_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Usage:
        total, used, free = 10 << 30, 10 << 30, 4096

    monkeypatch.setattr(failures.shutil, "disk_usage", lambda _p: Usage())
    got = failures.save_failure(7, RuntimeError("unexpected pos 704 vs 598"), tmp_path / "a/b")
    text = str(got)
    assert text.startswith("step 7 was not saved: RuntimeError: unexpected pos 704 vs 598")
    assert f"the file system of {tmp_path} is full: 4.0 KB free of 10.0 GB" in text


def test_a_healthy_disk_is_not_blamed(tmp_path: Path) -> None:
    assert failures.disk_diagnosis(tmp_path) == ""


# ------------------------------------------------------------ the job key


def test_a_key_deleted_during_the_run_stops_it_before_anything_is_written(
    tmp_path: Path,
) -> None:
    trainer, ckpt = _fresh(tmp_path, 1)
    ckpt.save()
    ckpt.poll(block=True)
    (tmp_path / JOB / KEY_FILE).unlink()  # a scratch purge
    trainer.fit(1)
    with pytest.raises(CheckpointError, match=r"the job key .*\.autohet-key on .* is gone"):
        ckpt.save()
    assert read_key(tmp_path / JOB) is None  # never silently made again
    steps = sorted(p.name for p in (tmp_path / JOB).iterdir() if "step-" in p.name)
    assert steps == ["step-00000001"]  # no step 2, not even a temporary one


def test_a_key_replaced_during_the_run_stops_it(tmp_path: Path) -> None:
    trainer, ckpt = _fresh(tmp_path, 1)
    key = tmp_path / JOB / KEY_FILE
    key.unlink()
    fd = os.open(key, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"k" * 32)
    os.close(fd)
    with pytest.raises(CheckpointError, match="was replaced during the run"):
        ckpt.save()


def _save_step_one(tmp_path: Path) -> None:
    """A fresh run that saves step 1 and closes its checkpointer."""
    _, ckpt = _fresh(tmp_path, 1)
    ckpt.save()
    ckpt.close()


def test_no_key_is_made_for_a_job_that_holds_steps(tmp_path: Path) -> None:
    _save_step_one(tmp_path)
    (tmp_path / JOB / KEY_FILE).unlink()
    dist.destroy_process_group()
    with pytest.raises(CheckpointError, match="its key .* is on no host"):
        Checkpointer(
            Trainer(PLAN, CONFIG), root=tmp_path / "ckpt", plan_ref="one.v3",
            plan_sha256="a" * 64, job="j1",
        )  # fmt: skip
    assert read_key(tmp_path / JOB) is None


# ------------------------------------------------------------ an earlier run's step


def test_a_resumed_run_sets_the_later_steps_of_the_run_it_left_aside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--resume=1`` with step 2 damaged: the resumed run's step 2 used to be
    skipped ("already saved and complete") and the good state thrown away."""
    trainer, ckpt = _fresh(tmp_path, 1, remote=RemoteCopy(str(tmp_path / "r"), "one", "j1"))
    for _ in range(2):
        ckpt.save()
        ckpt.poll(block=True)
        trainer.fit(1)
    ckpt.close()
    assert ckpt.remote is not None and ckpt.remote.is_complete(2)
    step2 = tmp_path / JOB / "step-00000002"
    shard = next(step2.glob("__0_*.distcp"))
    shard.write_bytes(b"\0" * shard.stat().st_size)  # damaged: its sha256 no longer matches
    dist.destroy_process_group()
    again = Trainer(PLAN, CONFIG, defer_init=True)
    ckpt = Checkpointer(
        again, root=tmp_path / "ckpt", plan_ref="one.v3", plan_sha256="a" * 64, job="j1",
        remote=RemoteCopy(str(tmp_path / "r"), "one", "j1"),
    )  # fmt: skip
    assert ckpt.resume(1) == 1
    err = capsys.readouterr().err
    assert "steps 2 of job j1 come after the resumed step 1" in err
    assert "steps 2 in the remote copy" in err and "no longer COMPLETE there" in err
    aside = [p.name for p in (tmp_path / JOB).iterdir() if p.name.startswith(".abandoned-")]
    assert len(aside) == 1 and aside[0].startswith(".abandoned-step-00000002-")  # kept
    again.fit(1)
    assert ckpt.save() is not None  # its own step 2, not "already saved"
    ckpt.close()
    # Kept until this run had a complete step of its own, then removed by retention.
    assert not [p for p in (tmp_path / JOB).iterdir() if p.name.startswith(".abandoned-")]
    assert ckpt.remote.is_complete(2)  # this run's, uploaded again
    want = _params(again)
    dist.destroy_process_group()
    third = Trainer(PLAN, CONFIG, defer_init=True)
    ckpt = Checkpointer(
        third, root=tmp_path / "ckpt", plan_ref="one.v3", plan_sha256="a" * 64, job="j1"
    )
    assert ckpt.resume() == 2  # loads: every file verifies
    got = _params(third)
    assert all((got[k] == want[k]).all() for k in want)


def test_a_fresh_run_in_a_job_with_steps_keeps_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save_step_one(tmp_path)
    before = (tmp_path / JOB / "step-00000001" / "manifest.json").read_bytes()
    dist.destroy_process_group()
    _, ckpt = _fresh(tmp_path, 1)  # not resumed: step 0 -> 1 again
    assert ckpt.save() is None
    ckpt.close()
    assert (tmp_path / JOB / "step-00000001" / "manifest.json").read_bytes() == before
    assert "already saved and complete; kept" in capsys.readouterr().err


def test_a_failure_after_complete_keeps_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer, ckpt = _fresh(tmp_path, 1)

    def broken(*_a: object, **_k: object) -> None:
        raise CheckpointError("cannot remove an old step: Permission denied")

    monkeypatch.setattr(ckpt.retention, "after_save", broken)
    ckpt.save()
    assert ckpt.poll(block=True) == 1
    assert "step 1 is saved, but what follows a save failed" in capsys.readouterr().err
    assert _complete(tmp_path, ckpt.key) == [1]
    assert ckpt.failed_steps == []


def test_the_step_resumed_from_is_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _save_step_one(tmp_path)
    dist.destroy_process_group()
    again = Trainer(PLAN, CONFIG, defer_init=True)
    ckpt = Checkpointer(
        again, root=tmp_path / "ckpt", plan_ref="one.v3", plan_sha256="a" * 64, job="j1"
    )
    ckpt.resume()
    assert ckpt.save() is None
    assert "step 1 of job j1 is already saved and complete; kept" in capsys.readouterr().err


# ------------------------------------------------------------ leftovers


def test_an_interrupted_saves_leftovers_go_at_the_next_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save_step_one(tmp_path)
    left = tmp_path / JOB / ".tmp-step-00000005"
    left.mkdir()
    (left / "__0_0.distcp").write_bytes(b"half")
    dist.destroy_process_group()
    _fresh(tmp_path, 0)
    assert not left.exists()
    assert "removed the leftovers of interrupted saves" in capsys.readouterr().err


def test_a_run_that_saved_nothing_leaves_no_job_behind(tmp_path: Path) -> None:
    _, ckpt = _fresh(tmp_path, 1)
    assert (tmp_path / JOB / KEY_FILE).is_file()
    ckpt.close()
    assert not (tmp_path / JOB).exists()


def test_a_job_with_anything_else_in_it_stays(tmp_path: Path) -> None:
    _, ckpt = _fresh(tmp_path, 1)
    (tmp_path / JOB / "notes.txt").write_text("mine")
    ckpt.close()
    assert (tmp_path / JOB / KEY_FILE).is_file()
