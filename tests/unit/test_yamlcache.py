"""Large YAML inputs are parsed once per content (``autohet_cli.yamlcache``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from autohet_cli import yamlcache
from autohet_cli.errors import ConfigError
from autohet_cli.yamlio import load_yaml


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(yamlcache.ENV, raising=False)
    return tmp_path / "cache" / "autohet" / "yaml"


def _big(path: Path, value: int = 1) -> Path:
    rows = "\n".join(f"  k{i}: {{a: {i}, b: [1.5, true, null, 'x{value}']}}" for i in range(3000))
    path.write_text(f"schema: test\nrows:\n{rows}\n")
    assert path.stat().st_size >= yamlcache.MIN_BYTES
    return path


def test_a_large_file_is_parsed_once_and_served_equal(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = _big(tmp_path / "p.yaml")
    first = load_yaml(f)
    assert len(list(cache.iterdir())) == 1
    assert oct(cache.stat().st_mode & 0o777) == oct(0o700)
    calls = []
    real = yamlcache.cached_parse

    def spy(data: bytes, parse: object, salt: bytes = b"") -> object:
        calls.append(1)
        return real(data, lambda: pytest.fail("parsed again"), salt)

    monkeypatch.setattr("autohet_cli.yamlio.cached_parse", spy)
    assert load_yaml(f) == first and calls


def test_an_edited_file_is_parsed_afresh(cache: Path, tmp_path: Path) -> None:
    f = _big(tmp_path / "p.yaml")
    assert load_yaml(f)["rows"]["k0"]["b"][3] == "x1"
    _big(f, value=2)
    assert load_yaml(f)["rows"]["k0"]["b"][3] == "x2"
    assert len(list(cache.iterdir())) == 2


def test_a_damaged_entry_is_parsed_over(cache: Path, tmp_path: Path) -> None:
    f = _big(tmp_path / "p.yaml")
    want = load_yaml(f)
    (entry,) = cache.iterdir()
    entry.write_bytes(b"\x00garbage")
    assert load_yaml(f) == want


def test_a_cache_that_cannot_be_written_changes_nothing(cache: Path, tmp_path: Path) -> None:
    """A file where the cache directory would be (root can write anywhere, but not
    make a directory inside a file): the file is parsed, nothing raised."""
    cache.parent.parent.mkdir(parents=True)
    cache.parent.write_text("not a directory")
    f = _big(tmp_path / "p.yaml")
    assert load_yaml(f)["schema"] == "test"
    assert load_yaml(f)["rows"]["k2999"]["a"] == 2999


def test_a_bad_file_is_refused_every_time_and_never_cached(cache: Path, tmp_path: Path) -> None:
    f = _big(tmp_path / "p.yaml")
    f.write_text(f.read_text() + "bad: [unclosed\n")
    for _ in range(2):
        with pytest.raises(ConfigError, match="not valid YAML"):
            load_yaml(f)
    assert not cache.exists() or not list(cache.iterdir())


def test_timestamps_are_parsed_but_not_cached(cache: Path, tmp_path: Path) -> None:
    f = _big(tmp_path / "p.yaml")
    f.write_text(f.read_text() + "when: 2026-11-26 10:00:00\n")
    assert str(load_yaml(f)["when"]).startswith("2026-11-26")
    assert not cache.exists() or not list(cache.iterdir())


def test_small_files_and_the_switch_bypass_it(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = tmp_path / "s.yaml"
    small.write_text("a: 1\n")
    assert load_yaml(small) == {"a": 1}
    monkeypatch.setenv(yamlcache.ENV, "0")
    assert load_yaml(_big(tmp_path / "p.yaml"))["schema"] == "test"
    assert not cache.exists()


def _entry(cache: Path) -> Path:
    (entry,) = (p for p in cache.iterdir() if p.suffix == ".marshal")
    return entry


def test_a_cache_others_may_write_is_not_used(cache: Path, tmp_path: Path) -> None:
    """Review: an entry planted by another user (a shared XDG_CACHE_HOME such as /tmp)
    would be served for a known profile's bytes; a group- or world-writable cache is
    neither read nor written."""
    f = _big(tmp_path / "p.yaml")
    want = load_yaml(f)
    entry = _entry(cache)
    import marshal

    entry.write_bytes(marshal.dumps({"schema": "planted"}))
    cache.chmod(0o777)
    assert load_yaml(f) == want  # the planted entry is not read
    cache.chmod(0o700)
    assert load_yaml(f) == {"schema": "planted"}  # (the same entry, from a private cache)


def test_links_and_fifos_in_the_cache_are_not_followed(cache: Path, tmp_path: Path) -> None:
    f = _big(tmp_path / "p.yaml")
    want = load_yaml(f)
    entry = _entry(cache)
    elsewhere = tmp_path / "elsewhere"
    import marshal

    elsewhere.write_bytes(marshal.dumps({"schema": "via a link"}))
    entry.unlink()
    entry.symlink_to(elsewhere)
    assert load_yaml(f) == want
    entry.unlink()
    os.mkfifo(entry)  # a read would wait for a writer forever
    assert load_yaml(f) == want


def test_the_parsers_rules_are_part_of_the_key(cache: Path, tmp_path: Path) -> None:
    data = b"x" * yamlcache.MIN_BYTES
    assert yamlcache.cached_parse(data, lambda: 1, b"rules-a") == 1
    assert yamlcache.cached_parse(data, lambda: 2, b"rules-b") == 2
    assert yamlcache.cached_parse(data, lambda: 3, b"rules-a") == 1
