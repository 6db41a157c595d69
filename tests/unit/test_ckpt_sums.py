"""Issue 30: recover reads a step's recorded sha256 instead of every file again, and
hashes again whatever changed since it was recorded."""

from __future__ import annotations

import hashlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

from autohet_cli.ckpt import sums


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_recorded_digests_are_used_while_the_file_is_unchanged(tmp_path: Path) -> None:
    f = tmp_path / "__0_0.distcp"
    f.write_bytes(b"a" * 1000)
    planted = "f" * 64  # a record the bytes do not match: used only while unchanged
    sums.record(str(tmp_path), {f.name: planted})
    assert sums.present(str(tmp_path)) == {f.name: planted}
    f.write_bytes(b"b" * 1000)  # same size, new mtime: read again
    os.utime(f, ns=(1, 1))
    assert sums.present(str(tmp_path)) == {f.name: _sha(b"b" * 1000)}
    f.write_bytes(b"b" * 999)  # truncated
    os.utime(f, ns=(1, 1))  # even with the recorded mtime back, the size differs
    assert sums.present(str(tmp_path)) == {f.name: _sha(b"b" * 999)}


def test_unrecorded_files_are_read_and_then_remembered(tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / f"__{i}_0.distcp").write_bytes(bytes([i]) * 5000)
    (tmp_path / ".metadata").write_bytes(b"meta")
    (tmp_path / "__9_0.distcp.ab12cd34.autohet-part").write_bytes(b"half")
    (tmp_path / "COMPLETE").write_bytes(b"")
    got = sums.present(str(tmp_path))
    assert got == {
        **{f"__{i}_0.distcp": _sha(bytes([i]) * 5000) for i in range(3)},
        ".metadata": _sha(b"meta"),
        "COMPLETE": _sha(b""),
    }
    recorded = (tmp_path / sums.SUMS).read_text().splitlines()
    assert len(recorded) == 5 and all(len(line.split(" ", 3)[0]) == 64 for line in recorded)


def test_the_script_prints_what_sha256sum_would(tmp_path: Path) -> None:
    (tmp_path / "__0_0.distcp").write_bytes(b"x" * 10)
    (tmp_path / ".metadata").write_bytes(b"m")
    out = subprocess.run(
        [sys.executable, "-c", inspect.getsource(sums), str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.splitlines() == sorted(
        [f"{_sha(b'm')}  .metadata", f"{_sha(b'x' * 10)}  __0_0.distcp"],
        key=lambda line: line.split("  ")[1],
    )
    missing = subprocess.run(
        [sys.executable, "-c", inspect.getsource(sums), str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert missing.stdout == ""


def test_the_manifest_and_complete_are_listed_too(tmp_path: Path) -> None:
    """Recover finalizes only hosts lacking them; unlisted, every host was rewritten."""
    (tmp_path / "manifest.json").write_text("{}")
    (tmp_path / "COMPLETE").write_bytes(b"")
    assert set(sums.present(str(tmp_path))) == {"manifest.json", "COMPLETE"}
