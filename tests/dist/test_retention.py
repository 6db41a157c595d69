"""--keep-checkpoints through the real worker entry point, four gloo workers on two hosts.

The run saves every step (``--checkpoint-every 1 --keep-checkpoints 2``) under the
two-host plan of ``test_checkpoint`` (fake hosts ``a`` and ``b``, each with its own
checkpoint directory, as ``autohet launch`` starts them) and a remote copy. Every
host's directory and the remote copy must end with exactly the newest two complete
steps, and nothing half-removed; rank 0 says what went. Resuming from the oldest
kept step continues the saving run's loss curve, and that run keeps its source
step while it has saved fewer than K newer ones.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_checkpoint import _args, _losses, _run, _two_host_plan, _workers
from test_runtime_exact import NUM_LAYERS, make_plan

from autohet_cli.ckpt.files import list_steps, read_key
from autohet_cli.ckpt.notice import LAST_SAVE_FILE, LAST_SAVE_RECORD
from autohet_cli.plan import write_plan

pytestmark = pytest.mark.dist

SAVED_STEPS = 5
NS = Path("ckpt") / "default"  # plan name / the job of workers started without the launcher


def _names(d: Path) -> list[str]:
    """The job directory's entries but its key and the last save's figures."""
    skip = (".autohet-key", LAST_SAVE_FILE, LAST_SAVE_RECORD)
    return sorted(p.name for p in d.iterdir() if p.name not in skip)


@pytest.mark.timeout(400)
def test_only_the_newest_k_complete_steps_stay_on_every_host_and_remotely(
    tmp_path: Path,
) -> None:
    plans = tmp_path / "plans"
    plans.mkdir()
    _, path = write_plan(_two_host_plan(), plans)
    dirs = {h: tmp_path / f"disk-{h}" for h in "ab"}
    remote = tmp_path / "remote"
    errors = _workers(
        path,
        SAVED_STEPS,
        "aabb",
        lambda host: [
            *("--run-dir", str(tmp_path / f"run-{host}"), "--checkpoint-dir", str(dirs[host])),
            *("--checkpoint-every", "1", "--keep-checkpoints", "2"),
            *("--remote-storage", str(remote)),
        ],
    )
    kept = ["step-00000004", "step-00000005"]
    key = read_key(dirs["a"] / NS)
    assert key is not None
    # Host a holds rank 0's files with the manifest and COMPLETE; b only its ranks' files.
    assert _names(dirs["a"] / NS) == kept and _names(dirs["b"] / NS) == kept
    assert list_steps(dirs["a"] / NS, key) == {4: None, 5: None}
    for step in kept:
        ranks = {p.name.split("_")[2] for p in (dirs["b"] / NS / step).glob("*.distcp")}
        assert ranks == {"2", "3"}  # __2_<n>.distcp, __3_<n>.distcp: one per writer thread
    # The remote copy: pruned by rank 0's uploader after each step completed there.
    assert list_steps(remote / NS, key) == {4: None, 5: None}
    assert _names(remote / NS) == kept
    log = errors[0]
    for gone, left in ((1, "2, 3"), (2, "3, 4"), (3, "4, 5")):
        line = f"checkpoints: removed step {gone} of job default on a, b (keeping {left}; "
        assert line + "--keep-checkpoints 2)" in log, log[-3000:]
        assert f"removed step {gone} of job default from the remote copy {remote}" in log
    assert not any(e for e in errors[1:] if "removed step" in e)  # rank 0 alone says it

    # Resume from the oldest kept step, every host's files in one directory (what
    # recover assembles), on one device: the curve goes on where the run left it.
    root = tmp_path / "resume-disk"
    for h in "ab":
        shutil.copytree(dirs[h], root, dirs_exist_ok=True)
    one = make_plan("ckpt", [(8, [(0, NUM_LAYERS)])], optimizer="adam")
    _, one_path = write_plan(one, plans)
    metrics = tmp_path / "resumed.jsonl"
    proc = _run(
        _args(one_path, SAVED_STEPS + 1, "--resume", "4", "--checkpoint-dir", str(root))
        + ["--metrics", str(metrics), "--remote-storage", "none"]
        + ["--checkpoint-every", "1", "--keep-checkpoints", "2"]
    )
    assert f"resumed from {root / NS / 'step-00000004'} at step 4" in proc.stderr
    before, after = _losses(tmp_path / "run-a" / "metrics.jsonl"), _losses(metrics)
    assert sorted(after) == [4, 5]
    assert after[4] == pytest.approx(before[4], rel=1e-5)
    # Step 5 of the run it went back from is set aside at the resume (never loaded)
    # and goes once this run saved its own step 5; two newer saves release step 4.
    assert "steps 5 of job default come after the resumed step 4" in proc.stderr
    assert "removed 1 step(s) of the run this one went back from (.abandoned-step-" in (proc.stderr)
    assert not [p for p in (root / NS).iterdir() if p.name.startswith(".abandoned-")]
    assert list_steps(root / NS, key) == {5: None, 6: None}
    assert "checkpoints: removed step 4 of job default" in proc.stderr
