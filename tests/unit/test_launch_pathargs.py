"""Paths given to launch/recover, as each host reads them (``launch.pathargs``).

This machine's hosts read a relative path from where autohet runs (the workers
start in the workdir, so it is made absolute); other hosts read it from their
workdir, written out so the command line shows it; ``~`` is each host's home.
"""

from __future__ import annotations

import pytest

from autohet_cli.cluster import Host
from autohet_cli.errors import ConfigError
from autohet_cli.launch import pathargs
from autohet_cli.launch.pathargs import CALLER_DIR, HOME, WORKDIR, Caller, resolve
from autohet_cli.paths import shell_word
from tests.planting import cpu_host

CALLER = Caller(cwd="/home/me/proj", home="/home/me")


def _host(name: str, address: str, workdir: str = "~/autohet") -> Host:
    return cpu_host(name, address, workdir=workdir)


LOCAL = _host("localhost", "localhost")
REMOTE = _host("a", "127.0.0.2")


def test_this_machine_reads_relative_paths_from_the_callers_directory() -> None:
    args = (
        "--steps=5",
        "--data=build/sample-tokens",
        "--init-from",
        "my-llama",
        "--config=./run.yaml",
        "--model-fn=models/mine.py:build",
        "--data-fn=mypkg.data:build",  # a module name: no path
        "--dump-state=out",
        "--lr=0.1",
    )
    hp = resolve(args, LOCAL, CALLER)
    assert hp.args == (
        "--steps=5",
        "--data=/home/me/proj/build/sample-tokens",
        "--init-from",
        "/home/me/proj/my-llama",
        "--config=/home/me/proj/run.yaml",
        "--model-fn=/home/me/proj/models/mine.py:build",
        "--data-fn=mypkg.data:build",
        "--dump-state=/home/me/proj/out",
        "--lr=0.1",
    )
    assert [(a.flag, a.given, a.kind, a.how) for a in hp.paths] == [
        ("--data", "build/sample-tokens", "exists", CALLER_DIR),  # read by --data-fn
        ("--init-from", "my-llama", "hf_dir", CALLER_DIR),
        ("--config", "./run.yaml", "file", CALLER_DIR),
        ("--model-fn", "models/mine.py", "fn", CALLER_DIR),
        ("--dump-state", "out", "out", CALLER_DIR),
    ]
    assert [a.checked for a in hp.paths] == [True, True, True, True, False]


def test_home_and_absolute_paths_on_this_machine() -> None:
    hp = resolve(["--data=~/tokens", "--init-from=/models/llama", "--data", "~"], LOCAL, CALLER)
    assert hp.args == ("--data=/home/me/tokens", "--init-from=/models/llama", "--data", "/home/me")
    # Only the last --data counts (argparse keeps it): the first is never checked.
    assert [(a.flag, a.path, a.how) for a in hp.paths] == [
        ("--init-from", "/models/llama", "absolute"),
        ("--data", "/home/me", HOME),
    ]


def test_a_remote_host_reads_relative_paths_from_its_workdir() -> None:
    args = ["--data=build/x", "--init-from=~/models/llama", "--config=/etc/run.yaml"]
    before = resolve(args, REMOTE, CALLER)  # the host's home is not known yet
    assert before.args == (
        "--data=~/autohet/build/x",
        "--init-from=~/models/llama",
        "--config=/etc/run.yaml",
    )
    after = resolve(args, REMOTE, CALLER, home="/home/u")
    assert after.args == (
        "--data=/home/u/autohet/build/x",
        "--init-from=/home/u/models/llama",
        "--config=/etc/run.yaml",
    )
    assert [a.how for a in after.paths] == [WORKDIR, HOME, "absolute"]
    absolute = resolve(["--data=x"], _host("b", "10.0.0.9", "/scratch/w/"), CALLER)
    assert absolute.args == ("--data=/scratch/w/x",)


def test_notes_say_how_each_relative_path_is_read() -> None:
    hosts = {"localhost": LOCAL, "a": REMOTE}
    args = ["--data=build/x", "--init-from=/m"]
    lines = pathargs.notes([resolve(args, LOCAL, CALLER), resolve(args, REMOTE, CALLER)], hosts)
    assert lines == [
        "paths: localhost (localhost) reads --data build/x as /home/me/proj/build/x "
        "(relative paths on this machine are read from the current directory)",
        "paths: a (127.0.0.2) reads --data build/x as ~/autohet/build/x "
        "(relative paths on remote hosts are relative to the workdir)",
    ]
    listing = pathargs.listing(resolve(args, REMOTE, CALLER), REMOTE)
    assert listing == [
        "# a: --data build/x -> ~/autohet/build/x (relative paths on remote hosts are "
        "relative to the workdir)",
        "# a: --init-from /m -> /m",
    ]


def test_the_error_names_host_flag_and_path() -> None:
    (arg,) = resolve(["--data=build/x"], REMOTE, CALLER).paths
    line = pathargs.problem(arg, REMOTE, "no such file or directory", "/home/u/autohet/build/x")
    assert line == (
        "host a (127.0.0.2): --data build/x: no such file or directory (read as "
        "/home/u/autohet/build/x: relative paths on remote hosts are relative to the workdir)"
    )
    (absolute,) = resolve(["--init-from=/m"], REMOTE, CALLER).paths
    assert pathargs.problem(absolute, REMOTE, "no such directory", "/m") == (
        "host a (127.0.0.2): --init-from /m: no such directory"
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--trace"], ("--trace",)),  # no value: the worker's default file
        (["--trace", "--lr=1"], ("--trace", "--lr=1")),
        (["--trace", "t.json"], ("--trace", "/home/me/proj/t.json")),
        (["--data"], ("--data",)),  # no value: left for the worker's own error
        (["--data-dtype=uint16", "--datas=x"], ("--data-dtype=uint16", "--datas=x")),
        (["--model-fn=m.py:build"], ("--model-fn=/home/me/proj/m.py:build",)),
    ],
)
def test_what_is_and_is_not_a_path(args: list[str], expected: tuple[str, ...]) -> None:
    assert resolve(args, LOCAL, CALLER).args == expected


def test_urls_and_empty_values_are_not_paths() -> None:
    args = ("--data=s3://bucket/tokens", "--init-from=")
    hp = resolve(args, LOCAL, CALLER)
    assert hp.args == args and hp.paths == ()


def test_with_a_data_function_data_need_only_exist() -> None:
    """Your function reads --data as it likes (a folder of parquet files, say)."""
    hp = resolve(["--data=corpus", "--data-fn=pkg.mine:build"], LOCAL, CALLER)
    assert [(a.flag, a.path, a.kind) for a in hp.paths] == [
        ("--data", "/home/me/proj/corpus", "exists")
    ]


def test_a_later_module_name_replaces_an_earlier_file() -> None:
    hp = resolve(["--model-fn=m.py:build", "--model-fn=pkg.m:build"], LOCAL, CALLER)
    assert hp.paths == ()


def test_a_home_path_after_an_option_runs_as_printed_in_a_shell() -> None:
    assert shell_word("--data=~/autohet/x y") == "--data=\"$HOME\"/'autohet/x y'"
    assert shell_word("--data=~") == '--data="$HOME"'
    assert shell_word("--data=~user/x") == "'--data=~user/x'"
    assert shell_word("~/x") == '"$HOME"/x'


@pytest.mark.parametrize("host", [LOCAL, REMOTE], ids=["local", "remote"])
def test_a_tilde_user_path_is_refused_naming_the_flag(host: Host) -> None:
    """``~root/x`` passed the preflight (expanduser) while the worker, given it quoted,
    read ``WORKDIR/~root/x``."""
    with pytest.raises(
        ConfigError, match=r"--data ~root/tokens: ~user/\.\.\. paths are not expanded"
    ):
        resolve(["--data=~root/tokens"], host, CALLER)
