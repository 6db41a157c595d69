"""The console script's quick exit (``app.console_main``, issue 32): ``autohet plan``
leaves without the interpreter's teardown, but with everything a normal exit gives a
user: the plan written, every line of output, the exit hooks run, the exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.cli import ROOT, run

CLUSTER = str(ROOT / "profiles" / "clusters" / "paper-mix.yaml")
PLAN = ["plan", "--cluster", CLUSTER, "--model", "gpt-tiny", "--global-batch-size", "8"]
PLAN += ["--seq-len", "64", "--precision", "fp32", "--time-limit", "10"]

# A hook registered as a library would (atexit), then the console script as installed.
# An object whose finaliser runs only in the interpreter's teardown tells which exit
# was taken.
SCRIPT = """
import atexit, pathlib, sys, threading, time
atexit.register(lambda: print("exit hook ran", file=sys.stderr, flush=True))
atexit.register(lambda: print("hook output"))  # block-buffered stdout, not flushed

class Torn:
    def __del__(self):
        print("torn down", file=sys.stderr, flush=True)

torn = Torn()
if sys.argv[1] == "thread":  # a non-daemon thread still working at the end
    sys.argv.pop(1)
    def work():
        time.sleep(1.0)
        pathlib.Path("thread-done").write_text("yes")
    threading.Thread(target=work).start()
sys.argv = sys.argv[1:]
from autohet_cli.cli.app import console_main
console_main()
"""


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    env.pop("PYTHONUNBUFFERED", None)  # stdout to a pipe block-buffered, as users get it
    return run([sys.executable, "-c", SCRIPT, *args], cwd=cwd, env=env, timeout=300)


def test_a_plan_exits_quickly_with_its_output_hooks_and_code(tmp_path: Path) -> None:
    args = PLAN
    out = _run("autohet", *args, "--explain", "--out-dir", "plans", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    [written] = (tmp_path / "plans").glob("*.v1.yaml")
    # every line, the last included, reached the pipe (flushed before os._exit), and
    # what an exit hook printed after them
    *_, last, hooked = out.stdout.rstrip().splitlines()
    assert last.startswith(f"wrote plans/{written.name}") and hooked == "hook output"
    assert "Plan " in out.stdout and "baseline" in out.stdout
    assert "exit hook ran" in out.stderr and "torn down" not in out.stderr
    again = _run("autohet", *args, "--json", "--out-dir", "plans", cwd=tmp_path)
    assert again.returncode == 0
    summary = json.loads(again.stdout.splitlines()[0])
    # The same plan again keeps its version (issue 46); a solve that came out otherwise
    # under load is the next one.
    assert summary["version"] in (1, 2) and summary["unchanged"] == (summary["version"] == 1)


def test_a_failed_plan_keeps_its_code_and_message(tmp_path: Path) -> None:
    args = [a if a != CLUSTER else str(tmp_path / "missing.yaml") for a in PLAN]
    out = _run("autohet", *args, cwd=tmp_path)
    assert out.returncode == 1
    assert "error:" in out.stderr and "missing.yaml" in out.stderr
    assert "Traceback" not in out.stderr and "exit hook ran" in out.stderr


def test_a_running_thread_gets_the_normal_exit(tmp_path: Path) -> None:
    args = PLAN
    out = _run("thread", "autohet", *args, "--out-dir", "plans", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "thread-done").read_text() == "yes"  # it finished its work
    assert "exit hook ran" in out.stderr  # (a thread left running: the interpreter
    # skips the finaliser at teardown, so "torn down" tells nothing here)
    assert out.stdout.rstrip().splitlines()[-2].startswith("wrote plans/")


def test_other_commands_exit_as_usual(tmp_path: Path) -> None:
    out = _run("autohet", "models", "list", cwd=tmp_path)
    assert out.returncode == 0 and "gpt-tiny" in out.stdout
    assert "exit hook ran" in out.stderr and "torn down" in out.stderr
