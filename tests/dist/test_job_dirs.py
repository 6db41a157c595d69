"""Issue 29: every launch left a job directory and key behind, even with
``--checkpoint-every 0`` (49 empty ones after one session). The launcher makes the
job (key on every host) before the workers start; a worker that saves nothing
(``--checkpoint-every 0 --no-emergency-save``) removes it again. Issue 46:
``--checkpoint-every 0`` alone still saves the last step, so that job stays."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from realdata import byte_tokens
from test_guards import run_alone
from test_runtime_exact import make_plan

from autohet_cli.ckpt.format import COMPLETE, KEY_FILE, new_key
from autohet_cli.plan import write_plan

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("emergency", [True, False])
def test_a_run_that_saves_nothing_leaves_no_job_and_every_0_saves_the_last_step(
    tmp_path: Path, emergency: bool
) -> None:
    plan = make_plan("nojob", [(2, [(0, 6)])])
    _, path = write_plan(plan, tmp_path)
    job = tmp_path / "ckpt" / "nojob" / "j7"
    job.mkdir(parents=True, mode=0o700)
    fd = os.open(job / KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, new_key())
    os.close(fd)
    other = tmp_path / "ckpt" / "nojob" / "j8"  # another job, with something in it
    other.mkdir(mode=0o700)
    (other / "step-00000003").mkdir()
    cmd = [
        sys.executable,
        *("-m", "autohet_cli.runtime.train", "--plan", str(path), "--device", "cpu"),
        *("--steps", "2", "--data", str(byte_tokens()), "--checkpoint-every", "0"),
        *("--checkpoint-dir", str(tmp_path / "ckpt"), "--job", "j7"),
        *(("--remote-storage", "none") if emergency else ("--no-emergency-save",)),
    ]
    proc = run_alone(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if emergency:  # checkpoints on: no periodic saves, the last step saved all the same
        assert (job / "step-00000002" / COMPLETE).is_file(), proc.stderr[-3000:]
        assert "no periodic saves (--checkpoint-every 0" in proc.stderr
        assert "the last step is saved" in proc.stderr
    else:
        assert not job.exists()
    assert (other / "step-00000003").is_dir()
