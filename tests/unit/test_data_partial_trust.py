"""``OUT.partial/`` is reused only when it is ours and its parts read back whole (issue 45,
item 4): a planted world-writable directory with matching ``settings.json`` and a part of
5,000 copies of one id once became ``tokens.bin`` ("1 reused"), because the directory's
owner and mode went unchecked and a part was trusted by its size alone."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from autohet_cli.cli.data import register
from autohet_cli.dataset import DataError
from autohet_cli.dataset.prepare import PrepareOptions, file_sha256, partial_dir, prepare


def _jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def _tokens(out: Path) -> list[int]:
    return np.fromfile(out / "tokens.bin", dtype="<u2").tolist()


def _interrupted(tmp_path: Path) -> tuple[PrepareOptions, Path, Path]:
    """A run cut short after its first input finished: (options, first, its part)."""
    first = _jsonl(tmp_path / "first.jsonl", ["one two three", "four five"])
    second = _jsonl(tmp_path / "second.jsonl", ["six"])
    options = PrepareOptions(inputs=(first, second), tokenizer="sample", out_dir=tmp_path / "out")

    def stop_at_second(_fraction: float, detail: str) -> None:
        if detail.startswith("second.jsonl"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(options, stop_at_second)
    part = partial_dir(options.out_dir) / "parts" / f"{file_sha256(first)}.bin"
    assert part.exists() and part.with_suffix(".json").exists()
    return options, first, part


def _fresh(tmp_path: Path, options: PrepareOptions) -> list[int]:
    fresh = tmp_path / "fresh"
    prepare(PrepareOptions(inputs=options.inputs, tokenizer="sample", out_dir=fresh))
    return _tokens(fresh)


def _plant(part: Path, ids: list[int]) -> None:
    """A part of other tokens, with the old size-only marker that once sufficed."""
    np.array(ids, dtype="<u2").tofile(part)
    part.with_suffix(".json").write_text(json.dumps({"documents": 1, "tokens": len(ids)}))


def test_a_world_writable_partial_dir_is_refused_not_reused(tmp_path: Path) -> None:
    options, _first, part = _interrupted(tmp_path)
    root = partial_dir(options.out_dir)
    _plant(part, [7] * 5000)
    os.chmod(root, 0o777)
    with pytest.raises(DataError, match=r"out\.partial.*writable by others.*delete") as caught:
        prepare(options)
    assert "another --out" in str(caught.value)
    assert not options.out_dir.exists()
    assert part.exists()  # not ours to delete: left for the user to look at


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory away needs root")
def test_a_partial_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    options, _first, _part = _interrupted(tmp_path)
    os.chown(partial_dir(options.out_dir), 4242, -1)
    with pytest.raises(DataError, match=r"out\.partial belongs to uid 4242, not to you"):
        prepare(options)


def test_a_new_partial_dir_is_private_whatever_the_umask(tmp_path: Path) -> None:
    options, _first, _part = _interrupted(tmp_path)
    root = partial_dir(options.out_dir)
    assert (root.stat().st_mode & 0o777, (root / "parts").stat().st_mode & 0o777) == (
        0o700,
        0o700,
    )


def test_a_part_with_only_a_size_marker_is_reencoded(tmp_path: Path) -> None:
    options, first, part = _interrupted(tmp_path)
    _plant(part, [7] * 5000)
    result = prepare(options)
    assert result.num_inputs_reused == 0
    assert [str(first) in why for why in result.redone] == [True]
    assert _tokens(options.out_dir) == _fresh(tmp_path, options)


def test_a_part_whose_bytes_changed_is_reencoded(tmp_path: Path) -> None:
    options, first, part = _interrupted(tmp_path)
    size = part.stat().st_size
    part.write_bytes(b"\x07\x00" * (size // 2))  # same size, other tokens, marker kept
    result = prepare(options)
    assert (result.num_inputs_reused, len(result.redone)) == (0, 1)
    assert "hash" in result.redone[0] and str(first) in result.redone[0]
    assert _tokens(options.out_dir) == _fresh(tmp_path, options)


def test_a_part_recorded_for_another_input_range_is_reencoded(tmp_path: Path) -> None:
    options, _first, part = _interrupted(tmp_path)
    marker = part.with_suffix(".json")
    record = json.loads(marker.read_text())
    record["input"]["end"] += 1
    marker.write_text(json.dumps(record))
    result = prepare(options)
    assert (result.num_inputs_reused, len(result.redone)) == (0, 1)
    assert _tokens(options.out_dir) == _fresh(tmp_path, options)


def test_a_verified_part_is_reused(tmp_path: Path) -> None:
    options, _first, _part = _interrupted(tmp_path)
    result = prepare(options)
    assert (result.num_inputs_reused, result.redone) == (1, ())
    assert _tokens(options.out_dir) == _fresh(tmp_path, options)


def test_a_part_changed_after_its_check_is_not_published(tmp_path: Path) -> None:
    """The bytes copied into tokens.bin are hashed as they are copied, so a part changed
    between its check and the copy is refused, and its marker removed for the rerun."""
    options, _first, part = _interrupted(tmp_path)

    def change_it(_fraction: float, detail: str) -> None:
        if detail.startswith("second.jsonl"):
            part.write_bytes(b"\x07\x00" * (part.stat().st_size // 2))

    with pytest.raises(DataError, match=r"changed while preparing.*run the same command"):
        prepare(options, change_it)
    assert not options.out_dir.exists() and not part.with_suffix(".json").exists()
    assert prepare(options).redone == ()
    assert _tokens(options.out_dir) == _fresh(tmp_path, options)


def test_the_command_says_which_input_it_reencoded(tmp_path: Path) -> None:
    options, first, part = _interrupted(tmp_path)
    _plant(part, [7] * 5000)
    app = typer.Typer()
    register(app)
    args = [str(p) for p in options.inputs]
    res = CliRunner().invoke(
        app, ["data", "prepare", *args, "--tokenizer", "sample", "--out", str(options.out_dir)]
    )
    assert res.exit_code == 0, res.output
    assert f"re-encoding {first}" in res.output
    assert "1 re-encoded" in res.output and "reused" not in res.output
