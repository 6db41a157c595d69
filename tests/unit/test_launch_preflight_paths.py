"""The preflight checks, in its one round trip per host, that every path the workers
will read is there and of the right kind, and names host, flag and path if not."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from autohet_cli.launch import pathargs
from autohet_cli.launch.preflight import PreflightError, preflight, preflight_ahead
from autohet_cli.transport.pool import ConnectOptions, HostPool
from tests.unit.test_launch_preflight import _cluster, _runs


def _paths(tmp: Path, *args: str) -> dict[str, tuple[pathargs.PathArg, ...]]:
    """Per host of ``_cluster`` (both this machine), ``args``' paths read from ``tmp``."""
    caller = pathargs.Caller(cwd=str(tmp), home=os.path.expanduser("~"))
    cluster = _cluster(tmp)
    return {h.name: pathargs.resolve(args, h, caller).paths for h in cluster.hosts}


def _problem(tmp: Path, *args: str) -> str:
    with HostPool(_cluster(tmp), ConnectOptions()) as pool:
        with pytest.raises(PreflightError) as info:
            preflight(pool, ["a"], needs_autohet=False, port_host=None, paths=_paths(tmp, *args))
    return str(info.value)


def test_every_kind_of_path_that_is_there_passes(tmp_path: Path) -> None:
    (tmp_path / "tokens.bin").write_bytes(b"\0\0")  # a flat token file
    (tmp_path / "mega.bin").write_bytes(b"")  # a Megatron prefix: mega.bin + mega.idx
    (tmp_path / "mega.idx").write_bytes(b"")
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "meta.json").write_text("{}")
    hf = tmp_path / "my-llama"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (tmp_path / "run.yaml").write_text("steps: 1\n")
    (tmp_path / "mine.py").write_text("")
    with HostPool(_cluster(tmp_path), ConnectOptions()) as pool:
        # With a data function, --data need only exist: here a folder without meta.json.
        paths = _paths(tmp_path, "--data=my-llama", "--data-fn=pkg.mine:build")
        preflight(pool, ["a"], needs_autohet=False, port_host=None, paths=paths)
        for data in ("tokens.bin", "mega", "prepared"):
            paths = _paths(
                tmp_path,
                f"--data={data}",
                "--init-from=my-llama",
                "--config=run.yaml",
                "--model-fn=mine.py:build",
                "--dump-state=not/there/yet",  # written, not read: never checked
            )
            preflight(pool, ["a", "b"], needs_autohet=False, port_host=None, paths=paths)


def test_a_missing_relative_path_names_host_flag_path_and_how_it_was_read(
    tmp_path: Path,
) -> None:
    message = _problem(tmp_path, "--data=build/x")
    assert message == (
        f"host a (localhost): --data build/x: no such file or directory (read as "
        f"{tmp_path}/build/x: relative paths on this machine are read from the current "
        "directory)"
    )


@pytest.mark.parametrize(
    ("make", "args", "expected"),
    [
        ({}, ("--init-from=/nowhere/llama",), "--init-from /nowhere/llama: no such directory"),
        ({"f": ""}, ("--init-from=f",), "--init-from f: not a directory"),
        ({"d/": ""}, ("--init-from=d",), "--init-from d: no config.json in it"),
        ({"d/": ""}, ("--data=d",), "--data d: a directory without meta.json"),
        ({"d/": ""}, ("--config=d",), "--config d: is a directory, not a file"),
        ({}, ("--data=d", "--data-fn=m:build"), "--data d: no such file or directory"),
        ({"m.bin": ""}, ("--data=m.idx",), "--data m.idx: a Megatron dataset needs both"),
        ({}, ("--model-fn=lib/mine.py:build",), "--model-fn lib/mine.py: no such file"),
        ({}, ("--config", "run.toml"), "--config run.toml: no such file"),
    ],
)
def test_each_kind_is_checked_for_what_the_worker_needs(
    tmp_path: Path, make: dict[str, str], args: tuple[str, ...], expected: str
) -> None:
    for name, text in make.items():
        if name.endswith("/"):
            (tmp_path / name).mkdir()
        else:
            (tmp_path / name).write_text(text)
    message = _problem(tmp_path, *args)
    assert message.startswith(f"host a (localhost): {expected}"), message
    assert "\n" not in message


def test_problems_on_several_hosts_and_paths_come_in_one_line(tmp_path: Path) -> None:
    with HostPool(_cluster(tmp_path), ConnectOptions()) as pool:
        with pytest.raises(PreflightError) as info:
            preflight(
                pool,
                ["a", "b"],
                needs_autohet=False,
                port_host=None,
                paths=_paths(tmp_path, "--data=x", "--init-from=y"),
            )
    message = str(info.value)
    assert "\n" not in message
    for host in ("a", "b"):
        for flag in ("--data x", "--init-from y"):
            assert f"host {host} (localhost): {flag}: no such" in message


def test_paths_ride_on_the_host_check_and_a_check_ahead_covers_them(tmp_path: Path) -> None:
    (tmp_path / "tokens.bin").write_bytes(b"\0\0")
    paths = _paths(tmp_path, "--data=tokens.bin")
    with HostPool(_cluster(tmp_path), ConnectOptions()) as pool:
        preflight_ahead(pool, ["a", "b"], needs_autohet=False, paths=paths)
        preflight(pool, ["a", "b"], needs_autohet=False, port_host=None, paths=paths)
        assert (_runs(tmp_path, "a"), _runs(tmp_path, "b")) == (1, 1)  # one round trip each
        # Another path was not covered by that check: asked again (still one trip).
        other = _paths(tmp_path, "--data=missing")
        with pytest.raises(PreflightError, match="--data missing: no such file"):
            preflight(pool, ["a"], needs_autohet=False, port_host=None, paths=other)
        assert _runs(tmp_path, "a") == 2
