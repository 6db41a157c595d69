"""``pids.process_gone``: one answer for run records and checkpoint pins."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from autohet_cli.pids import process_gone


def test_a_process_that_ended_here_is_gone_and_a_living_one_is_not() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process now
    here = socket.gethostname()
    assert process_gone(child.pid, here)
    assert not process_gone(os.getpid(), here)


def test_nothing_is_known_of_another_machine_or_of_no_pid() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not process_gone(child.pid, "another-machine")
    assert not process_gone(child.pid, None)
    assert not process_gone(0, socket.gethostname())
    assert not process_gone(None, socket.gethostname())
    assert process_gone(child.pid, "box", here="box")  # the caller names this machine
