"""After a real launch, the run is in one folder and `autohet runs` finds its loss curve.

Localhost: rank 0 runs on this machine and writes the folder's metrics.jsonl and
TensorBoard events itself. Over real sshd: rank 0's host is another machine, and the
launcher collects the lines it streams; both copies must match the host's own file.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.cli import autohet
from tests.e2e.sshd import SshdFarm
from tests.e2e.test_launch import _cluster_file, _launch, _plan

pytestmark = pytest.mark.e2e
STEPS = 4
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _autohet(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # HOME: the localhost workdir (~/autohet) lands in the test's folder.
    return autohet(*args, cwd=cwd, timeout=240, env={"HOME": str(cwd), "OMP_NUM_THREADS": "1"})


def _losses(path: Path) -> list[float]:
    lines = [json.loads(ln) for ln in path.read_text().splitlines()]
    return [m["loss"] for m in lines if "loss" in m]


@pytest.mark.timeout(300)
def test_a_localhost_launch_is_one_folder_that_runs_lists_and_plots(tmp_path: Path) -> None:
    cluster = tmp_path / "localhost.yaml"
    cluster.write_text(
        "schema: autohet.cluster/v1\nname: localhost\nhosts:\n"
        "  - {name: localhost, address: localhost, gpus: {type: cpu, count: 2}, "
        f"checkpoint_dir: {tmp_path / 'ckpt'}}}\n"
    )
    planned = _autohet(
        *("plan", "--cluster", str(cluster), "--model", "gpt-tiny", "--global-batch-size", "4"),
        *("--precision", "fp32", "--seq-len", "64", "--time-limit", "5", "--json"),
        *("--out-dir", "plans"),
        cwd=tmp_path,
    )
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)["plan_path"]
    run = _autohet("launch", plan, "--steps", str(STEPS), cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    (folder,) = (tmp_path / "runs").glob("*/*")
    said = [ln for ln in run.stdout.splitlines() if ln.startswith("run folder: runs/")]
    assert len(said) == 2, run.stdout  # at the start and at the end
    assert {"localhost.log", "events.json", "metrics.jsonl", "run.json"} <= {
        p.name for p in folder.iterdir()
    }
    assert (folder / "prediction-check.json").is_file()
    assert any((folder / "tensorboard").glob("events.out.tfevents.*"))
    losses = _losses(folder / "metrics.jsonl")
    assert len(losses) == STEPS
    (on_host,) = (tmp_path / "autohet" / "runs").glob("*/*/metrics.jsonl")  # kept there too
    assert _losses(on_host) == losses
    record = json.loads((folder / "run.json").read_text())
    assert (record["status"], record["last_step"], record["last_loss"]) == (
        "finished",
        STEPS - 1,
        losses[-1],
    )
    assert record["checkpoints"]["localhost"].startswith(str(tmp_path / "ckpt"))

    listed = _autohet("runs", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    (row,) = [ln for ln in listed.stdout.splitlines() if ln.startswith(folder.name)]
    assert row.split()[2:5] == ["finished", str(STEPS - 1), f"{losses[-1]:.4f}"]
    shown = _autohet("runs", "show", "latest", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert f"finished at step {STEPS - 1}, loss {losses[-1]:.4f}" in shown.stdout
    assert "loss (* train)" in shown.stdout
    assert (folder / "loss.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.timeout(300)
def test_a_remote_rank_0_streams_its_metrics_into_the_run_folder(
    sshd_farm: SshdFarm, tmp_path: Path
) -> None:
    sshd_farm.start(1)
    cluster = _cluster_file(sshd_farm, tmp_path / "cluster.yaml")
    plan = _plan(tmp_path, cluster, ((2, ((0, 6, "fake-2"),)),))
    proc = _launch(plan, tmp_path, "--steps", str(STEPS), "--checkpoint-every", "0")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    (folder,) = (tmp_path / "runs").glob("e2e.v1/*")
    assert "streamed from fake-2" in out
    (on_host,) = (sshd_farm.hosts[0].root / "work" / "runs").glob("e2e.v1/*/metrics.jsonl")
    assert (folder / "metrics.jsonl").read_text() == on_host.read_text()
    assert len(_losses(on_host)) == STEPS
    assert any((folder / "tensorboard").glob("events.out.tfevents.*"))
    assert "autohet-metric" not in (folder / "fake-2.log").read_text()
    record = json.loads((folder / "run.json").read_text())
    assert (record["status"], record["last_step"]) == ("finished", STEPS - 1)
