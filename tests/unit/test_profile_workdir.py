"""``autohet profile`` sends its probe into the host's workdir and runs it there as the
user: the workdir follows the private-directory rule (issue 45), as the launch's does."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from autohet_cli.errors import ProfileError
from autohet_cli.profiling.run import private_workdir
from autohet_cli.transport.local import LocalRunner
from tests.planting import cpu_host


def test_the_probe_directory_is_made_private_and_a_shared_workdir_refused(
    tmp_path: Path,
) -> None:
    host = cpu_host("a", python=sys.executable)
    runner = LocalRunner("a")
    work = tmp_path / "work"
    probe = work / "profile-1"
    private_workdir(runner, host, str(probe), str(work))
    assert stat.S_IMODE(probe.stat().st_mode) == 0o700

    work.chmod(0o777)  # anyone could rename a probe directory away and put theirs there
    with pytest.raises(ProfileError) as err:
        private_workdir(runner, host, str(work / "profile-2"), str(work))
    text = str(err.value)
    assert text.startswith(f"host a: refusing the workdir {work}: {work} is writable by others")
    assert "someone else could swap it" in text
