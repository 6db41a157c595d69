"""--keep-checkpoints in one process: prune after a save, never after a failed one, pins."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from autohet_cli.ckpt import finish
from autohet_cli.ckpt.checkpointer import Checkpointer, CheckpointError, RemoteCopy
from autohet_cli.ckpt.prune import pinned, reading_step, remove_steps
from autohet_cli.ckpt.retention import Pin, choose_prune, pin_name, pin_to_text
from autohet_cli.runtime.trainer import Trainer
from tests.planting import plant_step
from tests.unit.test_runtime_checkpoint import CONFIG, PLAN

pytestmark = pytest.mark.usefixtures("alone")

JOB_DIR = Path("ckpt") / "one" / "j1"
REMOTE_JOB = Path("remote") / "one" / "j1"


def _fresh(
    tmp: Path, steps: int, keep: int, *, remote: bool = False
) -> tuple[Trainer, Checkpointer]:
    if dist.is_initialized():
        dist.destroy_process_group()
    trainer = Trainer(PLAN, CONFIG)
    trainer.fit(steps)
    ckpt = Checkpointer(
        trainer,
        root=tmp / "ckpt",
        plan_ref="one.v3",
        plan_sha256="a" * 64,
        job="j1",
        keep=keep,
        remote=RemoteCopy(str(tmp / "remote"), "one", "j1") if remote else None,
    )
    return trainer, ckpt


def _save_steps(trainer: Trainer, ckpt: Checkpointer, n: int) -> None:
    """Train and save ``n`` more steps, each upload finished before the next save."""
    for _ in range(n):
        trainer.fit(1)
        assert ckpt.save() is not None
        ckpt.wait()  # durable: the files are written in the background
        if ckpt.uploader is not None:
            ckpt.uploader.join()


def _steps(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("step-"))


def test_each_save_keeps_the_newest_k_and_leaves_everything_else(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer, ckpt = _fresh(tmp_path, 0, keep=2, remote=True)
    job = tmp_path / JOB_DIR
    (job / ".tmp-step-00000099").mkdir()  # a save in flight (another attempt's)
    (job / "step-00000000").mkdir()  # no COMPLETE: recover may be filling it
    (job / "notes.txt").write_text("mine")
    _save_steps(trainer, ckpt, 4)
    ckpt.close()
    assert _steps(job) == ["step-00000000", "step-00000003", "step-00000004"]
    assert (job / ".tmp-step-00000099").is_dir() and (job / "notes.txt").read_text() == "mine"
    assert (job / ".autohet-key").is_file()
    assert not [p for p in job.iterdir() if p.name.startswith(".del-")]
    err = capsys.readouterr().err
    assert "checkpoints: removed step 1 of job j1 on h0 (keeping 2, 3; --keep-checkpoints 2)" in err
    assert "checkpoints: removed step 2 of job j1 on h0 (keeping 3, 4; --keep-checkpoints 2)" in err
    # The remote copy too, after each upload completed there.
    assert _steps(tmp_path / REMOTE_JOB) == ["step-00000003", "step-00000004"]
    assert f"of job j1 from the remote copy {tmp_path / 'remote'} (keeping 3, 4;" in err


def test_keep_zero_keeps_every_step(tmp_path: Path) -> None:
    trainer, ckpt = _fresh(tmp_path, 0, keep=0)
    _save_steps(trainer, ckpt, 4)
    assert _steps(tmp_path / JOB_DIR) == [f"step-0000000{s}" for s in (1, 2, 3, 4)]


def test_a_failed_save_removes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, ckpt = _fresh(tmp_path, 0, keep=1, remote=True)
    _save_steps(trainer, ckpt, 2)
    job = tmp_path / JOB_DIR
    assert _steps(job) == ["step-00000002"]

    def broken(*_args: object, **_kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(finish, "dcp_save", broken)
    trainer.fit(1)
    ckpt.save()  # the snapshot; the write fails in the background
    with pytest.raises(CheckpointError, match="step 3 was not saved: .*No space left"):
        ckpt.close()
    assert _steps(job) == ["step-00000002"]
    assert _steps(tmp_path / REMOTE_JOB) == ["step-00000002"]


def test_a_planted_complete_step_neither_counts_nor_goes(tmp_path: Path) -> None:
    """A step whose manifest does not authenticate is not one of the newest K: it can
    neither push real steps out nor be removed (it is someone else's)."""
    trainer, ckpt = _fresh(tmp_path, 0, keep=1)
    _save_steps(trainer, ckpt, 1)
    job = tmp_path / JOB_DIR
    plant_step(job / "step-00000001", 99, tmp_path / "pwned")
    _save_steps(trainer, ckpt, 1)
    assert _steps(job) == ["step-00000002", "step-00000099"]


def test_a_pin_keeps_its_step_until_released(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer, ckpt = _fresh(tmp_path, 0, keep=1)
    job = tmp_path / JOB_DIR
    _save_steps(trainer, ckpt, 1)
    with pinned(job, 1, holder="a test", ttl_s=600) as pin:
        _save_steps(trainer, ckpt, 2)
        assert _steps(job) == ["step-00000001", "step-00000003"]
        assert pin.is_file()
    assert "(keeping 1, 3; 1 pinned; --keep-checkpoints 1)" in capsys.readouterr().err
    _save_steps(trainer, ckpt, 1)
    assert _steps(job) == ["step-00000004"]


def test_a_pin_left_by_a_dead_process_or_expired_does_not_block(tmp_path: Path) -> None:
    trainer, ckpt = _fresh(tmp_path, 0, keep=1)
    job = tmp_path / JOB_DIR
    _save_steps(trainer, ckpt, 2)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    here = socket.gethostname()
    stale = {
        "dead": Pin(
            step=2, holder="t", machine=here, pid=int(dead.stdout), expires_unix=time.time() + 600
        ),
        "expired": Pin(
            step=2, holder="t", machine="elsewhere", pid=1, expires_unix=time.time() - 1
        ),
    }
    for token, pin in stale.items():
        (job / pin_name(2, token)).write_text(pin_to_text(pin))
    (job / pin_name(2, "junk")).write_text("{")
    _save_steps(trainer, ckpt, 1)
    assert _steps(job) == ["step-00000003"]
    assert not list(job.glob(".pin-*"))  # lapsed pins are cleared away


def test_the_step_a_run_resumed_from_stays_until_it_saved_k_newer(tmp_path: Path) -> None:
    trainer, ckpt = _fresh(tmp_path, 0, keep=2)
    _save_steps(trainer, ckpt, 3)
    job = tmp_path / JOB_DIR
    assert _steps(job) == ["step-00000002", "step-00000003"]
    resumed, ckpt = _fresh(tmp_path, 0, keep=2)
    assert ckpt.resume(2) == 2
    # Step 3 of the run left behind is replaced by this run's: one newer save, 2 held.
    _save_steps(resumed, ckpt, 1)
    assert _steps(job) == ["step-00000002", "step-00000003"]
    _save_steps(resumed, ckpt, 1)  # step 4: two newer saves, 2 released
    assert _steps(job) == ["step-00000003", "step-00000004"]


def test_a_remote_pin_keeps_the_step_in_the_remote_copy(tmp_path: Path) -> None:
    trainer, ckpt = _fresh(tmp_path, 0, keep=1, remote=True)
    _save_steps(trainer, ckpt, 1)
    remote = tmp_path / REMOTE_JOB
    pin = Pin(step=1, holder="recover", machine="elsewhere", pid=1, expires_unix=time.time() + 60)
    (remote / pin_name(1, "r")).write_text(pin_to_text(pin))
    _save_steps(trainer, ckpt, 1)
    assert _steps(remote) == ["step-00000001", "step-00000002"]
    assert _steps(tmp_path / JOB_DIR) == ["step-00000002"]  # local pins are the hosts' own
    (remote / pin_name(1, "r")).unlink()
    _save_steps(trainer, ckpt, 1)
    ckpt.close()
    assert _steps(remote) == ["step-00000003"]


def test_export_pins_the_step_it_reads_where_it_can(tmp_path: Path) -> None:
    trainer, ckpt = _fresh(tmp_path, 0, keep=1)
    job = tmp_path / JOB_DIR
    _save_steps(trainer, ckpt, 1)
    with reading_step(job / "step-00000001", holder="autohet export"):
        (pin,) = job.glob(".pin-step-00000001-*.json")
        _save_steps(trainer, ckpt, 1)
        assert _steps(job) == ["step-00000001", "step-00000002"]
    assert not pin.exists()
    # Where no pin can be written (here: no job directory at all) it reads anyway.
    with reading_step(tmp_path / "gone" / "step-00000001", holder="autohet export"):
        pass


def test_two_owners_of_a_shared_directory_both_prune_it_without_errors(tmp_path: Path) -> None:
    """Hosts sharing one directory (an NFS home) each have an owner rank; both remove
    the same steps, and the second finds the first one's work done."""
    job = tmp_path / "job"
    for step in (1, 2, 3):
        (job / f"step-0000000{step}").mkdir(parents=True)
        (job / f"step-0000000{step}" / "__0_0.distcp").write_bytes(b"x" * 10)
    (job / ".del-step-00000000-dead").mkdir()  # a removal cut short earlier
    prune = choose_prune([p.name for p in job.iterdir()], complete={1, 2, 3}, keep=1)
    assert remove_steps(job, prune) == ([1, 2], [])
    assert remove_steps(job, prune) == ([], [])  # the other owner, a moment later
    assert sorted(p.name for p in job.iterdir()) == ["step-00000003"]
