"""One recover per plan at a time (issue 11, item 4), and run ids that stay in their directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from autohet_cli.errors import ConfigError
from autohet_cli.launch.attempt import run_id_of as _run_id
from autohet_cli.recovery.errors import RecoveryError
from autohet_cli.recovery.lock import recover_lock

ROOT = Path(__file__).resolve().parents[2]


def test_a_second_recover_of_the_same_plan_stops_at_once(tmp_path: Path) -> None:
    with recover_lock(tmp_path, "lab"):
        with pytest.raises(RecoveryError, match=r"another autohet recover of lab is running \(pid"):
            with recover_lock(tmp_path, "lab"):
                pass
        with recover_lock(tmp_path, "other"):  # other plans are not blocked
            pass
    with recover_lock(tmp_path, "lab"):  # released when the holder is done
        pass


def test_the_lock_holds_across_processes_and_dies_with_its_holder(tmp_path: Path) -> None:
    code = (
        "import sys, time; from pathlib import Path; "
        "from autohet_cli.recovery.lock import recover_lock\n"
        f"with recover_lock(Path({str(tmp_path)!r}), 'lab'):\n"
        "    print('held', flush=True); time.sleep(60)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RecoveryError, match=f"pid {holder.pid}"):
            with recover_lock(tmp_path, "lab"):
                pass
    finally:
        holder.kill()
        holder.wait()
    with recover_lock(tmp_path, "lab"):  # a killed holder leaves no stale lock
        pass


@pytest.mark.parametrize("bad", ["../..", "a/b", ".hidden", "-rf", "x" * 101, ""])
def test_run_ids_that_leave_the_runs_directory_are_refused(bad: str) -> None:
    """Issue 11, item 5: `--run-id ../..` was accepted."""
    with pytest.raises(ConfigError, match="--run-id"):
        _run_id(bad)
    assert _run_id("2026-11-23_try.2") == "2026-11-23_try.2"
