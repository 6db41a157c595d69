"""The remote command line: hostile argv, env values and cwd come out of a real
shell (bash and POSIX sh, as sshd would run them) exactly as given, and nothing
in them runs."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autohet_cli.transport.quoting import (
    PID_MARKER,
    parse_pid_line,
    quote_path,
    remote_command,
    sftp_path,
)
from autohet_cli.transport.ssh import _PidFilter
from tests.cli import run

SHELLS = [s for s in ("bash", "sh") if shutil.which(s)]
REPORT = (
    "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], "
    "'env': os.environ.get('HOSTILE'), 'cwd': os.getcwd()}))"
)


def _hostile(marker: Path) -> list[str]:
    m = str(marker)
    return [
        f"$(touch {m})",
        f"`touch {m}`",
        f";touch {m}",
        f"&& touch {m}",
        f"| touch {m}",
        f"'; touch {m}; '",
        f'"; touch {m}; "',
        f"\ntouch {m}\n",
        f"$'\\x41'{{a,b}} ~ * ? [x] !! ${{HOME}} $HOME \\ > {m}",
        "-n",
        "--",
        "",
        " leading and trailing ",
        "tab\there",
        "ünïcødé ✓",
    ]


def _run_shell(shell: str, command: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = run([shell, "-c", command], cwd=cwd, env=env, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_exact_text_for_a_plain_command() -> None:
    cmd = remote_command(["echo", "a b"], env={"K": "v w"}, cwd="/w d")
    assert cmd == "cd -- '/w d' && exec env -- 'K=v w' echo 'a b'"
    assert remote_command(["true"]) == "exec env -- true"
    assert remote_command(["sleep", "1"], announce_pid=True) == (
        f"echo {PID_MARKER} $$ && exec env -- sleep 1"
    )
    # The pid file is written before anything runs (and nothing runs if it cannot be).
    assert remote_command(["sleep", "1"], announce_pid=True, pid_file="~/r d/t.pid") == (
        f"echo {PID_MARKER} $$ && printf '%s\\n' $$ > ~/'r d/t.pid' && exec env -- sleep 1"
    )


@pytest.mark.parametrize("shell", SHELLS)
def test_hostile_argv_env_and_cwd_round_trip_and_run_nothing(shell: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    hostile = _hostile(marker)
    # Relative: a slash would make nested directories. It would land in tmp_path (the shell's
    # cwd) or in workdir; neither may appear.
    workdir = tmp_path / "dir $(touch pwned) `touch pwned` ;touch pwned 'q\" \n z"
    workdir.mkdir()
    for value in hostile:
        cmd = remote_command(
            [sys.executable, "-c", REPORT, *hostile], env={"HOSTILE": value}, cwd=str(workdir)
        )
        got = json.loads(_run_shell(shell, cmd, cwd=tmp_path))
        assert got == {"argv": hostile, "env": value, "cwd": str(workdir)}
    assert not marker.exists(), "a hostile value executed shell code"
    assert not (workdir / "pwned").exists(), "a hostile cwd executed shell code"


@pytest.mark.parametrize("shell", SHELLS)
def test_program_names_that_look_like_options(shell: str, tmp_path: Path) -> None:
    prog = tmp_path / "-weird prog"
    prog.write_text('#!/bin/sh\necho ran "$@"\n')
    prog.chmod(0o755)
    cmd = remote_command(["./-weird prog", "x"], cwd=str(tmp_path))
    assert _run_shell(shell, cmd, cwd=tmp_path) == "ran x\n"


@pytest.mark.parametrize("shell", SHELLS)
def test_tilde_workdir_expands_to_home_only_at_the_front(shell: str, tmp_path: Path) -> None:
    (tmp_path / "a b" / "~c").mkdir(parents=True)
    env = {**os.environ, "HOME": str(tmp_path)}
    cmd = remote_command(["pwd"], cwd="~/a b/~c")
    assert _run_shell(shell, cmd, cwd=Path("/"), env=env) == f"{tmp_path}/a b/~c\n"
    assert _run_shell(shell, remote_command(["pwd"], cwd="~"), cwd=Path("/"), env=env) == (
        f"{tmp_path}\n"
    )
    assert quote_path("~user/x") == "'~user/x'"
    assert quote_path("~/") == "~/"


@settings(max_examples=40, deadline=None)
@given(
    argv=st.lists(st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\0"))),
    value=st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\0")),
)
def test_any_text_round_trips_through_bash(argv: list[str], value: str) -> None:
    cmd = remote_command([sys.executable, "-c", REPORT, *argv], env={"HOSTILE": value}, cwd="/")
    done = subprocess.run(["bash", "-c", cmd], capture_output=True, timeout=30, check=True)
    assert json.loads(done.stdout) == {"argv": argv, "env": value, "cwd": "/"}


def test_what_no_command_line_can_carry_is_rejected() -> None:
    with pytest.raises(ValueError, match="NUL"):
        remote_command(["echo", "a\0b"])
    with pytest.raises(ValueError, match="NUL"):
        remote_command(["echo"], env={"K": "a\0"})
    with pytest.raises(ValueError, match="NUL"):
        remote_command(["echo"], cwd="/a\0")
    with pytest.raises(ValueError, match="not a valid identifier"):
        remote_command(["echo"], env={"K=1; touch x; K": "v"})
    with pytest.raises(ValueError, match="contains '='"):
        remote_command(["A=B", "echo"])
    with pytest.raises(ValueError, match="list of strings"):
        remote_command("echo hi")
    with pytest.raises(ValueError, match="cwd is empty"):
        remote_command(["echo"], cwd="")


def test_pid_line_and_sftp_paths() -> None:
    assert parse_pid_line(f"{PID_MARKER} 4242") == 4242
    assert parse_pid_line(f"{PID_MARKER} 42 x") is None
    assert parse_pid_line("hello 4242") is None
    assert parse_pid_line(f"{PID_MARKER} 1") is None and parse_pid_line(f"{PID_MARKER} 0") is None
    assert sftp_path("~/ckpt/a") == "ckpt/a"
    assert sftp_path("~") == "."
    assert sftp_path("/abs/$(x)") == "/abs/$(x)"


def test_pid_announcement_is_taken_out_of_stdout_even_after_login_chatter() -> None:
    pids: list[int | None] = []
    source = io.BytesIO(b"motd from bashrc\n" + f"{PID_MARKER} 4242\n".encode() + b"out\n")
    stdout = _PidFilter(source, pids.append)
    assert [stdout.readline() for _ in range(4)] == [b"motd from bashrc\n", b"out\n", b"", b""]
    assert pids == [4242]
    nothing = _PidFilter(io.BytesIO(b""), pids.append)
    assert nothing.readline() == b"" and pids == [4242, None]
