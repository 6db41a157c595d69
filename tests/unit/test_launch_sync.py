"""--sync-dir: rsync semantics over a real (local) runner."""

from __future__ import annotations

from pathlib import Path

from autohet_cli.launch.sync import sync_dir
from autohet_cli.transport.local import LocalRunner


def test_only_changed_files_move_and_nothing_is_deleted(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "pkg").mkdir(parents=True)
    (src / "train.py").write_text("print('hi')\n")
    (src / "pkg" / "data.txt").write_text("1\n")
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "x.pyc").write_bytes(b"\0")
    with LocalRunner("localhost") as runner:
        assert sorted(sync_dir(runner, src, str(dst))) == ["pkg/data.txt", "train.py"]
        assert (dst / "pkg" / "data.txt").read_text() == "1\n"
        assert sync_dir(runner, src, str(dst)) == []
        (src / "pkg" / "data.txt").write_text("2\n")
        (dst / "theirs.txt").write_text("keep\n")
        assert sync_dir(runner, src, str(dst)) == ["pkg/data.txt"]
    assert (dst / "pkg" / "data.txt").read_text() == "2\n"
    assert (dst / "theirs.txt").read_text() == "keep\n"
    assert not (dst / "__pycache__").exists()
