"""VerifyingReader checks and reads a rank's files in parallel threads: the state it
loads is what plain DCP loads, and a missing or corrupt file fails as before."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from autohet_cli.ckpt.files import (
    CheckpointError,
    VerifyingReader,
    default_read_threads,
    read_runs,
    run_in_threads,
    sha256_file,
)
from autohet_cli.ckpt.format import Manifest, ManifestFile
from autohet_cli.ckpt.state import checkpoint_failure

pytestmark = [
    pytest.mark.usefixtures("alone"),
    pytest.mark.filterwarnings("ignore:torch.distributed is"),
]


def _state(seed: int | None) -> dict[str, Any]:
    """Nested like a trainer's state: tensors of several sizes, and non-tensor entries
    (DCP stores those as pickled bytes). ``seed`` None: zeroed targets, and no values."""
    g = torch.Generator().manual_seed(seed or 0)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g) if seed is not None else torch.zeros(shape)

    layers = {f"layers.{i}.{n}": t(64, 32) for i in range(6) for n in ("wq", "wo", "w1")}
    return {
        "model": {"embed.weight": t(200, 32), **layers, "norm.weight": t(32)},
        "optimizer": {"state": {f"exp_avg.{i}": t(128, 16) for i in range(5)}},
        "run": {"step": 7 if seed is not None else 0, "tokens": [1, 2] if seed is not None else []},
    }


def _save(directory: Path, *, num_files: int) -> Manifest:
    dcp.save(_state(1), storage_writer=FileSystemWriter(directory, thread_count=num_files))
    files = tuple(
        ManifestFile(
            path=p.name, sha256=sha256_file(p), num_bytes=p.stat().st_size, host="h0", rank=0
        )
        for p in sorted(directory.iterdir())
    )
    return Manifest(step=7, plan="p.v1", plan_sha256="0" * 64, world_size=1, files=files)


def _reader(directory: Path, manifest: Manifest, **kwargs: Any) -> VerifyingReader:
    metadata = FileSystemReader(directory).read_metadata()
    return VerifyingReader(directory, metadata=metadata, manifest=manifest, rank=0, **kwargs)


def _load(reader: VerifyingReader) -> dict[str, Any]:
    state = _state(None)
    try:
        dcp.load(state, storage_reader=reader)
    except CheckpointException as exc:
        raise checkpoint_failure(exc) from None
    return state


def _assert_same(got: Any, want: Any) -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            _assert_same(got[k], want[k])
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want)
    else:
        assert got == want


def _plain(directory: Path) -> dict[str, Any]:
    state = _state(None)
    dcp.load(state, storage_reader=FileSystemReader(directory))
    return state


@pytest.mark.parametrize(
    ("num_files", "num_threads", "read_threads"),
    [(1, 4, 4), (4, 2, 2), (4, 8, 8), (4, 1, 1), (4, 1, 3)],
)
def test_parallel_load_gives_what_plain_dcp_gives(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    num_files: int,
    num_threads: int,
    read_threads: int,
) -> None:
    manifest = _save(tmp_path, num_files=num_files)
    data = sorted(p.name for p in tmp_path.glob("*.distcp"))
    assert data == [f"__0_{i}.distcp" for i in range(num_files)]
    readers = set()
    dcp_read = FileSystemReader.read_data

    def spy(self: FileSystemReader, plan: Any, planner: Any) -> Any:
        readers.add(threading.get_ident())
        time.sleep(0.05)  # so that no one thread reads every part
        return dcp_read(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", spy)

    got = _load(_reader(tmp_path, manifest, num_threads=num_threads, read_threads=read_threads))

    assert (len(readers) > 1) == (read_threads > 1)  # DCP's reads ran in parallel threads
    monkeypatch.undo()
    _assert_same(got, _plain(tmp_path))
    _assert_same(got, _state(1))


def test_parallel_load_of_a_dtensor(tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    full = torch.arange(96.0).reshape(12, 8)
    saved = {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.ones(8)}
    dcp.save(saved, storage_writer=FileSystemWriter(tmp_path / "c", thread_count=2))
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    manifest = Manifest(
        step=1,
        plan="p.v1",
        plan_sha256="0" * 64,
        world_size=1,
        files=tuple(
            ManifestFile(
                path=n,
                sha256=sha256_file(tmp_path / "c" / n),
                num_bytes=(tmp_path / "c" / n).stat().st_size,  # the hash reads this much
                host="h0",
                rank=0,
            )
            for n in names
        ),
    )
    target = {"w": distribute_tensor(torch.zeros(12, 8), mesh, [Shard(0)]), "b": torch.zeros(8)}
    reader = _reader(tmp_path / "c", manifest, num_threads=4, read_threads=4)
    dcp.load(target, storage_reader=reader)
    assert torch.equal(target["w"].full_tensor(), full) and torch.equal(target["b"], torch.ones(8))


def test_on_cpu_files_are_checked_in_parallel_and_read_in_one_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = _save(tmp_path, num_files=4)
    checkers, readers = set(), set()
    dcp_read, check = FileSystemReader.read_data, VerifyingReader._check

    def spy_read(self: FileSystemReader, plan: Any, planner: Any) -> Any:
        readers.add(threading.get_ident())
        return dcp_read(self, plan, planner)

    def spy_check(self: VerifyingReader, name: str) -> bool:
        checkers.add(threading.get_ident())
        time.sleep(0.05)  # so that no one thread checks every file
        return check(self, name)

    monkeypatch.setattr(FileSystemReader, "read_data", spy_read)
    monkeypatch.setattr(VerifyingReader, "_check", spy_check)

    got = _load(_reader(tmp_path, manifest, num_threads=4))

    assert len(checkers) > 1 and readers == {threading.get_ident()}
    _assert_same(got, _state(1))


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupt_file_is_named_and_nothing_is_read(tmp_path: Path) -> None:
    manifest = _save(tmp_path, num_files=4)
    _flip_a_byte(tmp_path / "__0_3.distcp")
    _flip_a_byte(tmp_path / "__0_1.distcp")
    state = _state(None)

    with pytest.raises(CheckpointError, match=r"__0_1\.distcp is corrupt: its sha256 is") as info:
        try:
            dcp.load(
                state, storage_reader=_reader(tmp_path, manifest, num_threads=4, read_threads=4)
            )
        except CheckpointException as exc:
            raise checkpoint_failure(exc) from None
    assert str(tmp_path / "__0_1.distcp") in str(info.value)
    # Every file is checked before any is read: the intact ones were not loaded either.
    assert all(not t.any() for t in state["model"].values())


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    manifest = _save(tmp_path, num_files=4)
    (tmp_path / "__0_2.distcp").unlink()

    with pytest.raises(CheckpointError, match=r"__0_2\.distcp is missing: rank 0 reads it"):
        _load(_reader(tmp_path, manifest, num_threads=4, read_threads=4))


def test_missing_files_are_fetched_and_checked(tmp_path: Path) -> None:
    here, remote = tmp_path / "here", tmp_path / "remote"
    manifest = _save(here, num_files=4)
    shutil.copytree(here, remote)
    for name in ("__0_2.distcp", "__0_0.distcp"):
        (here / name).unlink()
    calls = []

    def fetch(name: str, dest: Path) -> bool:
        calls.append(name)
        shutil.copyfile(remote / name, dest)
        return True

    reader = _reader(here, manifest, fetch=fetch, num_threads=4, read_threads=4)
    _assert_same(_load(reader), _state(1))
    assert sorted(calls) == reader.fetched == ["__0_0.distcp", "__0_2.distcp"]

    _flip_a_byte(remote / "__0_0.distcp")  # what arrives is checked like the rest
    (here / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is corrupt"):
        _load(_reader(here, manifest, fetch=fetch, num_threads=4, read_threads=4))


def test_read_runs_cut_by_bytes_in_file_order() -> None:
    storage = {
        i: SimpleNamespace(relative_path=f"__0_{i // 4}.distcp", offset=(i % 4) * 10, length=10)
        for i in range(8)
    }
    items = [SimpleNamespace(storage_index=i) for i in (5, 0, 7, 2, 1, 6, 3, 4)]

    runs = read_runs(items, storage, 3)

    assert [[it.storage_index for it in run] for run in runs] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert read_runs(items, storage, 1) == [sorted(items, key=lambda it: it.storage_index)]
    assert len(read_runs(items, storage, 20)) == 8
    assert read_runs([], storage, 4) == []


def test_run_in_threads_raises_the_first_failure_in_order() -> None:
    def fail(i: int) -> None:
        if i in (2, 5):
            raise ValueError(f"bad {i}")

    with pytest.raises(ValueError, match="bad 2"):
        run_in_threads(fail, range(8), 4)


def test_default_read_threads_share_the_cores_among_the_hosts_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert default_read_threads(cpus=16, ranks_on_host=8) == 2
    assert default_read_threads(cpus=64, ranks_on_host=1) == 8
    assert default_read_threads(cpus=2, ranks_on_host=4) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_read_threads(cpus=16) == 4
