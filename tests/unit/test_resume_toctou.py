"""Resume loads the bytes it hashed (issue 45, "bytes are verified where they are
used"): a data file swapped between its check and DCP's read does not reach the load,
a file someone else could write is refused, and the descriptors are closed after."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from autohet_cli.ckpt.files import CheckpointError, VerifyingReader, sha256_file
from autohet_cli.ckpt.format import Manifest, ManifestFile
from autohet_cli.ckpt.ownfiles import PreadStream
from autohet_cli.ckpt.state import checkpoint_failure

pytestmark = [
    pytest.mark.usefixtures("alone"),
    pytest.mark.filterwarnings("ignore:torch.distributed is"),
]


def _state(seed: int | None) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed or 0)
    t = (
        (lambda: torch.randn(64, 32, generator=g))
        if seed is not None
        else lambda: torch.zeros(64, 32)
    )
    return {
        "model": {f"w{i}": t() for i in range(4)},
        "run": {"step": seed if seed is not None else 0},
    }


def _save(directory: Path, seed: int) -> Manifest:
    dcp.save(_state(seed), storage_writer=FileSystemWriter(directory, thread_count=2))
    files = tuple(
        ManifestFile(
            path=p.name, sha256=sha256_file(p), num_bytes=p.stat().st_size, host="h", rank=0
        )
        for p in sorted(directory.iterdir())
    )
    return Manifest(step=1, plan="p.v1", plan_sha256="0" * 64, world_size=1, files=files)


def _load(directory: Path, manifest: Manifest, **kwargs: Any) -> tuple[dict[str, Any], int]:
    metadata = FileSystemReader(directory).read_metadata()
    state = _state(None)
    before = len(os.listdir("/proc/self/fd"))
    reader = VerifyingReader(directory, metadata=metadata, manifest=manifest, rank=0, **kwargs)
    try:
        dcp.load(state, storage_reader=reader)
    except CheckpointException as exc:
        raise checkpoint_failure(exc) from None
    finally:
        reader.close()
    return state, len(os.listdir("/proc/self/fd")) - before


@pytest.mark.parametrize("read_threads", [1, 2])
def test_a_file_swapped_after_its_check_does_not_reach_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read_threads: int
) -> None:
    here, evil = tmp_path / "here", tmp_path / "evil"
    manifest = _save(here, 1)
    _save(evil, 2)  # the same names and layout, other weights and another "run"
    check = VerifyingReader._check

    def check_then_swap(self: VerifyingReader, name: str) -> bool:
        got = check(self, name)
        os.replace(evil / name, here / name)  # the swap lands after the hash
        return got

    monkeypatch.setattr(VerifyingReader, "_check", check_then_swap)
    got, leaked = _load(here, manifest, num_threads=2, read_threads=read_threads)

    want = _state(1)
    assert got["run"] == want["run"]
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert leaked == 0  # every descriptor closed with the reader


def test_a_data_file_others_can_write_is_refused(tmp_path: Path) -> None:
    manifest = _save(tmp_path, 1)
    name = next(p for p in sorted(tmp_path.glob("*.distcp")))
    name.chmod(0o666)
    with pytest.raises(CheckpointError, match=r"writable by others.*chmod go-w"):
        _load(tmp_path, manifest)


def test_a_symlinked_data_file_is_refused(tmp_path: Path) -> None:
    here = tmp_path / "here"
    manifest = _save(here, 1)
    name = next(p for p in sorted(here.glob("*.distcp")))
    moved = tmp_path / name.name
    name.rename(moved)
    name.symlink_to(moved)
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        _load(here, manifest)


def test_pread_stream_seeks_and_reads_like_a_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(range(100)))
    fd = os.open(path, os.O_RDONLY)
    try:
        a, b = PreadStream(fd), PreadStream(fd)  # two positions on one descriptor
        assert a.read(3) == bytes([0, 1, 2]) and b.read(2) == bytes([0, 1])
        assert a.seek(-2, os.SEEK_END) == 98 and a.read() == bytes([98, 99])
        assert b.seek(5, os.SEEK_CUR) == 7 and b.read(1) == bytes([7])
        a.close()
        assert os.read(fd, 1) == b"\x00"  # closing a stream leaves the descriptor open
    finally:
        os.close(fd)


def test_a_metadata_link_is_refused_not_followed(tmp_path: Path) -> None:
    """Resume's .metadata is read once from the file itself (never through a link,
    never past the manifest's size), as its data files are."""
    from types import SimpleNamespace

    from autohet_cli.ckpt.format import signed_manifest_text, step_dir_name
    from autohet_cli.ckpt.loading import SourceData, _read_source

    step = tmp_path / step_dir_name(1)
    manifest = _save(step, 1)
    key = b"k" * 32
    (step / "manifest.json").write_text(signed_manifest_text(manifest, key))
    view = SimpleNamespace(
        plan_dir=tmp_path, key=key, trainer=SimpleNamespace(plan=SimpleNamespace(name="p"))
    )
    got = _read_source(view, 1)  # type: ignore[arg-type]
    assert isinstance(got, SourceData) and got.metadata == (step / ".metadata").read_bytes()
    moved = tmp_path / "elsewhere"
    (step / ".metadata").rename(moved)
    (step / ".metadata").symlink_to(moved)  # the same bytes, through a link
    why = _read_source(view, 1)  # type: ignore[arg-type]
    assert why == f"{step / '.metadata'} is a symbolic link; " + (
        "checkpoint files are read only as regular files of the step directory itself: "
        "copy the file there, not a link"
    )
