"""--sync-dir: rsync semantics over a real (local) runner."""

from __future__ import annotations

from pathlib import Path

import pytest

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


def test_links_never_lead_out_of_the_directory(tmp_path: Path) -> None:
    """Issue 11 item 13: a link to /etc/hostname was uploaded. Links inside the
    directory are sent as the files they point to; others are skipped, named."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "real.txt").write_text("inside\n")
    secret = tmp_path / "secret.txt"
    secret.write_text("secret\n")
    (src / "to_secret").symlink_to(secret)
    (src / "hostname").symlink_to("/etc/hostname")
    (src / "escape").symlink_to("../secret.txt")
    (src / "abs_inside").symlink_to(src / "pkg" / "real.txt")
    (src / "pkg" / "rel_inside").symlink_to("real.txt")
    (src / "outside_dir").symlink_to(tmp_path)  # a folder holding src itself
    (src / "inside_dir").symlink_to(src / "pkg")
    (src / "dangling").symlink_to(src / "nowhere")
    warnings: list[str] = []
    with LocalRunner("localhost") as runner:
        sent = sync_dir(runner, src, str(dst), warn=warnings.append)
    assert sent == ["abs_inside", "pkg/real.txt", "pkg/rel_inside"]
    for name in ("abs_inside", "pkg/rel_inside"):
        assert (dst / name).read_text() == "inside\n" and not (dst / name).is_symlink()
    sent_files = [p for p in dst.rglob("*") if p.is_file()]
    assert len(sent_files) == 3 and all("secret" not in p.read_text() for p in sent_files)
    skipped = {w.split("skipped ")[1].split(":")[0] for w in warnings}
    assert skipped == {"to_secret", "hostname", "escape", "outside_dir", "inside_dir", "dangling"}
    assert any("escape" in w and "outside" in w and str(secret) in w for w in warnings)


def test_skipped_links_are_printed_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "hostname").symlink_to("/etc/hostname")
    with LocalRunner("localhost") as runner:
        assert sync_dir(runner, src, str(tmp_path / "dst")) == []
    assert "warning:" in capsys.readouterr().err
