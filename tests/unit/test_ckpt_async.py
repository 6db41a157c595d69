"""Asynchronous checkpoints (issue 28): snapshot, background write hashed on its way
out, COMPLETE only when durable, synchronous where host memory is short, records."""

from __future__ import annotations

import hashlib
import inspect
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save

from autohet_cli.ckpt import checkpointer as checkpointer_module
from autohet_cli.ckpt import finish
from autohet_cli.ckpt.checkpointer import Checkpointer
from autohet_cli.ckpt.files import incomplete_reason
from autohet_cli.ckpt.memory import memory_verdict
from autohet_cli.ckpt.persist import SaveRecord, _HashingStream, hashing_writer, writer_threads
from autohet_cli.ckpt.snapshot import Snapshotter
from autohet_cli.errors import ConfigError
from autohet_cli.recovery.manifest import load_manifest
from autohet_cli.runtime.trainer import Trainer
from tests.unit.test_runtime_checkpoint import CONFIG, PLAN

pytestmark = pytest.mark.usefixtures("alone")

JOB = Path("ckpt") / "one" / "j1"
# torch 2.5's save and load have no no_dist: without a process group they run alone.
ONE_PROCESS = {"no_dist": True} if "no_dist" in inspect.signature(dcp_save).parameters else {}


def _fresh(tmp: Path, steps: int, **kwargs: object) -> tuple[Trainer, Checkpointer]:
    if dist.is_initialized():
        dist.destroy_process_group()
    trainer = Trainer(PLAN, CONFIG)
    trainer.fit(steps)
    ckpt = Checkpointer(
        trainer, root=tmp / "ckpt", plan_ref="one.v3", plan_sha256="a" * 64, job="j1", **kwargs
    )
    return trainer, ckpt


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.stage.state_dict().items()}


# --------------------------------------------------------------------- pure parts


def test_files_are_hashed_on_their_way_out_by_every_writer_thread(tmp_path: Path) -> None:
    """The digests DCP's writer threads took equal the files' own, .metadata included
    (written as .metadata.tmp and renamed)."""
    state = {f"t{i}": torch.randn(64 + i, 32) for i in range(7)} | {"step": 3, "run": "x"}
    writer, fs = hashing_writer(tmp_path, thread_count=3)
    dcp_save(state, storage_writer=writer, **ONE_PROCESS)
    written = fs.written()
    on_disk = sorted(p.name for p in tmp_path.iterdir())
    assert on_disk == [".metadata", "__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    for name in on_disk:
        data = (tmp_path / name).read_bytes()
        assert written[name].sha256 == hashlib.sha256(data).hexdigest(), name
        assert written[name].nbytes == len(data)
    back = {k: torch.empty_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    dcp_load(back, storage_reader=FileSystemReader(tmp_path), **ONE_PROCESS)
    assert all(torch.equal(back[k], state[k]) for k in back)


def test_a_stream_that_seeks_back_is_not_trusted(tmp_path: Path) -> None:
    with (tmp_path / "f").open("wb") as raw:
        s = _HashingStream(raw)
        s.write(b"abcd")
        s.seek(4)  # where it is: fine
        assert not s.broken
        s.seek(0)
        assert s.broken


def test_writer_threads_share_the_hosts_cores() -> None:
    assert writer_threads(1, cpus=2, env={}) == 2
    assert writer_threads(8, cpus=16, env={}) == 2
    assert writer_threads(1, cpus=64, env={}) == 8  # DCP's writer reached disk speed with 8
    assert writer_threads(4, cpus=2, env={}) == 1
    assert writer_threads(4, cpus=2, env={"AUTOHET_CHECKPOINT_WRITERS": "3"}) == 3
    with pytest.raises(ConfigError, match=r"AUTOHET_CHECKPOINT_WRITERS='0': expected a number"):
        writer_threads(1, env={"AUTOHET_CHECKPOINT_WRITERS": "0"})


def test_a_snapshot_is_a_copy_in_reused_buffers() -> None:
    source = {"model": {"w": torch.arange(6.0)}, "optimizer": {"m": torch.ones(3)}, "step": 2}
    snap = Snapshotter()
    assert snap.new_bytes(source) == 9 * 4
    first = snap.take(source)
    assert snap.new_bytes(source) == 0  # the buffers exist: a later save allocates nothing
    source["model"]["w"].add_(1)  # training goes on
    assert torch.equal(first["model"]["w"], torch.arange(6.0)) and first["step"] == 2
    second = snap.take(source)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()
    assert torch.equal(second["model"]["w"], torch.arange(6.0) + 1)
    source["model"]["w"] = torch.zeros(7)  # a new shape: a new buffer
    assert snap.new_bytes(source) == 7 * 4


def test_a_dtensor_is_snapshotted_into_its_own_host_shard(tmp_path: Path) -> None:
    """Tensor-parallel parameters: the buffer keeps the mesh and placements DCP plans
    with, and a later snapshot writes into the same shard storage."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    param = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    snap = Snapshotter()
    first = snap.take({"w": param})["w"]
    param.to_local().add_(10)
    assert torch.equal(first.to_local(), torch.arange(8.0).reshape(4, 2))
    assert first.placements == param.placements and first.device_mesh == mesh
    second = snap.take({"w": param})["w"]
    assert second is first and torch.equal(first.to_local(), torch.arange(8.0).reshape(4, 2) + 10)


def test_the_memory_check_counts_every_rank_of_the_host() -> None:
    gb = 10**9
    assert memory_verdict(2 * gb, ranks_on_host=1, available_bytes=10 * gb).fits
    short = memory_verdict(2 * gb, ranks_on_host=4, available_bytes=9 * gb)
    assert not short.fits and short.need_bytes == 8 * gb
    assert "needs 8.0 GB of host memory (4 rank(s) on this host) and 9.0 GB is available" in (
        short.reason
    )
    assert memory_verdict(2 * gb, ranks_on_host=1, available_bytes=None).fits  # unknown
    assert memory_verdict(0, ranks_on_host=8, available_bytes=0).fits  # buffers exist


# --------------------------------------------------------------------- the checkpointer


def test_training_goes_on_while_the_step_is_written_and_the_snapshot_is_saved(
    tmp_path: Path,
) -> None:
    trainer, ckpt = _fresh(tmp_path, 2)
    want = _params(trainer)
    records: list[SaveRecord] = []
    ckpt.listeners.append(records.append)
    final = ckpt.save()
    trainer.fit(2)  # in-place updates while the background thread writes step 2
    ckpt.close()
    assert final is not None and incomplete_reason(final, ckpt.key) is None
    manifest = load_manifest(final / "manifest.json")
    (record,) = records
    assert record.step == 2 and not record.synchronous
    assert record.nbytes == sum(f.num_bytes for f in manifest.files)
    assert 0 < record.blocked_s <= record.persist_s
    # For the next run's schedule: the blocked time less the buffers' one-time allocation.
    assert record.alloc_s > 0
    assert ckpt.previous_record() == {
        "ckpt_blocked_s": pytest.approx(record.blocked_s - record.alloc_s, abs=1e-3),
        "ckpt_persist_s": round(record.persist_s, 4),
    }
    resumed, ckpt2 = _fresh(tmp_path, 0)
    assert ckpt2.resume() == 2
    got = _params(resumed)
    assert all(torch.equal(got[k], want[k]) for k in want)  # step 2, not step 4


def test_one_save_in_flight_the_next_waits_for_it(tmp_path: Path) -> None:
    trainer, ckpt = _fresh(tmp_path, 1)
    gate_open = False
    real = finish.dcp_save

    def slow(*args: object, **kwargs: object) -> object:
        while not gate_open:
            time.sleep(0.01)
        return real(*args, **kwargs)

    finish.dcp_save = slow  # type: ignore[assignment]
    try:
        ckpt.save()
        trainer.fit(1)
        assert not (tmp_path / JOB / "step-00000001").exists()  # not durable: no step dir
        gate_open = True
        ckpt.save()  # waits for step 1, then snapshots step 2
        assert incomplete_reason(tmp_path / JOB / "step-00000001", ckpt.key) is None
        ckpt.close()
    finally:
        finish.dcp_save = real
    assert incomplete_reason(tmp_path / JOB / "step-00000002", ckpt.key) is None


def test_short_host_memory_writes_synchronously_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer, ckpt = _fresh(tmp_path, 1)
    monkeypatch.setattr(checkpointer_module, "available_memory_bytes", lambda: 1)
    records: list[SaveRecord] = []
    ckpt.listeners.append(records.append)
    final = ckpt.save()
    assert final is not None and incomplete_reason(final, ckpt.key) is None  # before wait()
    # training waited for the whole save, the rename, COMPLETE and manifest included
    assert records[0].synchronous and records[0].blocked_s == records[0].persist_s > 0
    err = capsys.readouterr().err
    assert "writes step 1 synchronously (training waits): a snapshot of the training state" in err
    ckpt.close()


_CRASH = """
import os, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from autohet_cli.ckpt import persist
from tests.unit.test_ckpt_async import _fresh

tmp = Path({tmp!r})
trainer, ckpt = _fresh(tmp, 1)
ckpt.save(); ckpt.wait()                     # step 1: whole
trainer.fit(1)
real = persist.HashingFileSystem.rename
def die(self, path, new_path):              # the data files are written: die before
    os._exit(9)                              # .metadata, the manifest and COMPLETE
persist.HashingFileSystem.rename = die
ckpt.save()
ckpt.wait()
"""


def test_a_crash_mid_save_never_leaves_a_complete_step(tmp_path: Path) -> None:
    root = str(Path(__file__).resolve().parents[2])
    script = _CRASH.format(root=root, tmp=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": root},
    )
    assert done.returncode == 9, done.stderr[-2000:]
    job = tmp_path / JOB
    assert sorted(p.name for p in job.iterdir() if "step-" in p.name) == [
        ".tmp-step-00000002",
        "step-00000001",
    ]
    assert not (job / ".tmp-step-00000002" / "COMPLETE").exists()
    assert list((job / ".tmp-step-00000002").glob("__0_*.distcp"))  # it was mid-write
    _, ckpt = _fresh(tmp_path, 0)
    assert ckpt.resume() == 1
