"""Issue 46.5, Slurm: a launch finds what this machine lacks before it writes anything
(Slurm's commands, a run folder the nodes share), sets ``--cpus-per-task`` without a
``slurm:`` section, has the master node check the rendezvous port, and leaves no
"failed" run behind when sbatch refuses the job."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from autohet_cli.cluster import load_cluster
from autohet_cli.launch import session
from autohet_cli.launch.session import LaunchRequest, dry_run
from autohet_cli.runfiles.listing import find_runs
from autohet_cli.slurm import ctl, nodeport, precheck
from autohet_cli.slurm.ctl import SlurmError
from autohet_cli.slurm.script import Component, cpus_per_task
from tests.unit.test_slurm_script import _cluster, _plan


def _tools(where: Path) -> Path:
    """Slurm's client commands on PATH, as files only: a unit test runs none of them."""
    where.mkdir()
    for name in precheck.TOOLS:
        (where / name).write_text("#!/bin/sh\nexit 1\n")
        (where / name).chmod(0o755)
    return where


def _loopback(tmp: Path, slurm: dict[str, object] | None = None) -> Path:
    """test_slurm_script's cluster with nodes that are this machine (127.0.0.x)."""
    path = _cluster(tmp, slurm)
    doc = yaml.safe_load(path.read_text())
    for i, host in enumerate(doc["hosts"]):
        host["address"] = f"127.0.0.{i + 2}"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_missing_sbatch_is_refused_before_anything_is_written_or_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _plan(tmp_path, _cluster(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    said: list[str] = []
    req = LaunchRequest(plan_file=plan, run_id="r1", runs_root=tmp_path / "runs")
    with pytest.raises(SlurmError) as exc:
        session.launch(req, said.append)
    assert str(exc.value).startswith("sbatch, scontrol, sinfo, scancel are not on PATH: ")
    assert "run autohet on a Slurm login node" in str(exc.value)
    assert said == [] and not (tmp_path / "runs").exists()  # no rendezvous, no run folder
    with pytest.raises(SlurmError, match="sbatch, scontrol, sinfo, scancel are not on PATH"):
        session.dry_check(req)


def test_a_node_local_run_folder_is_refused_unless_the_nodes_are_this_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(_tools(tmp_path / "bin")))
    # Node-local by its file system alone, wherever pytest's tmp_path is.
    monkeypatch.setattr(precheck, "NODE_LOCAL_PREFIXES", ())
    monkeypatch.setattr(precheck, "_mounts", lambda: [("/", "ext4"), (str(tmp_path), "tmpfs")])
    plan = _plan(tmp_path, _cluster(tmp_path))
    req = LaunchRequest(plan_file=plan, run_id="r1", runs_root=tmp_path / "runs")
    with pytest.raises(SlurmError) as exc:
        session.launch(req, lambda _line: None)
    assert str(exc.value).startswith(
        f"run folder {tmp_path.resolve()}/runs: it is on a tmpfs (memory) file system mounted "
        f"at {tmp_path}, which is node-local (each Slurm node has its own)"
    )
    assert "a file system the nodes share" in str(exc.value)
    assert not (tmp_path / "runs").exists()
    with pytest.raises(SlurmError, match="node-local"):
        session.dry_check(req)
    (tmp_path / "here").mkdir()
    here = load_cluster(_loopback(tmp_path / "here"))
    assert precheck.problems(here, ["a100-0", "v100-0"], tmp_path / "runs") == []


@pytest.mark.parametrize(
    ("path", "mounts", "why"),
    [
        ("/tmp/me/proj/runs", [], "it is under /tmp"),
        ("/var/tmp/runs", [], "it is under /var/tmp"),
        ("/dev/shm/runs", [], "it is under /dev/shm"),
        ("/scratch/runs", [("/", "ext4"), ("/scratch", "tmpfs")], "it is on a tmpfs"),
        ("/home/me/runs", [("/", "ext4"), ("/home", "nfs4")], None),
        ("/tmpfiles/runs", [("/", "xfs")], None),
    ],
)
def test_node_local_paths(path: str, mounts: list[tuple[str, str]], why: str | None) -> None:
    got = precheck.node_local(Path(path), mounts)
    assert got == why if why is None else (got or "").startswith(why)


def test_mountinfo_is_parsed_with_its_escapes() -> None:
    text = (
        "22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        "40 22 0:35 / /my\\040runs rw - tmpfs tmpfs rw,size=1024k\n"
    )
    assert precheck.parse_mountinfo(text) == [("/", "ext4"), ("/my runs", "tmpfs")]


def test_cpus_per_task_is_set_without_a_slurm_section(tmp_path: Path) -> None:
    plan = _plan(tmp_path, _cluster(tmp_path, slurm={}))
    script = dry_run(LaunchRequest(plan_file=plan, run_id="r1", runs_root=tmp_path / "runs"))
    # 4 GPUs per node in both components, 4 CPUs per GPU: never Slurm's one CPU per task.
    assert [ln for ln in script.splitlines() if "cpus-per-task" in ln] == [
        "#SBATCH --cpus-per-task=16"
    ] * 2
    cl = load_cluster(tmp_path / "cluster.yaml")
    cpu = Component(index=0, gpu_type="cpu", gpus_per_node=2, hosts=("n",))
    assert cpus_per_task(cpu, cl) == 2  # one per CPU device (worker process)


def _run_port_lines(
    tmp: Path, node: str, port: int, *, fixed: bool
) -> subprocess.CompletedProcess[str]:
    (tmp / "exit").mkdir(exist_ok=True)
    body = "\n".join(nodeport.lines("m", "python3", port, fixed=fixed))
    script = f'set -u\nrun={tmp}\nnode={node}\n{body}\necho "port=$port"\n'
    return subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": os.environ["PATH"], "AUTOHET_LAUNCH_TIME": "7"},
        check=False,
    )


def test_the_master_node_checks_the_port_and_tells_the_others(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        moved = _run_port_lines(tmp_path, "m", port, fixed=False)
        assert moved.returncode == 0, moved.stderr
        got = int(moved.stdout.split("port=")[1])
        assert got != port and f"port {port} is taken on m" in moved.stderr
        assert (tmp_path / "master-port.7").read_text().strip() == str(got)
        other = _run_port_lines(tmp_path, "w", port, fixed=False)  # reads it from the folder
        assert other.stdout.strip() == f"port={got}"
        (tmp_path / "master-port.7").unlink()
        fixed = _run_port_lines(tmp_path, "m", port, fixed=True)
        assert fixed.returncode == 1 and (tmp_path / "exit" / "m").read_text().strip() == "1"
        assert f"autohet runtime: error: --master-port {port} is taken on m" in fixed.stderr
        assert not (tmp_path / "master-port.7").exists()
    free = _run_port_lines(tmp_path, "m", port, fixed=True)
    assert free.stdout.strip() == f"port={port}"


def test_a_job_sbatch_refuses_leaves_no_failed_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(script: str) -> str:
        raise SlurmError(f"sbatch --parsable {script}: invalid partition specified: gpu")

    monkeypatch.setenv("PATH", str(_tools(tmp_path / "bin")))
    monkeypatch.setattr(ctl, "submit", refuse)
    monkeypatch.setenv("HOME", str(tmp_path))
    plan = _plan(tmp_path, _loopback(tmp_path))
    said: list[str] = []
    req = LaunchRequest(plan_file=plan, run_id="r1", runs_root=tmp_path / "runs")
    with pytest.raises(SlurmError, match="invalid partition specified"):
        session.launch(req, said.append)
    run = (tmp_path / "runs" / "lab.v1" / "r1").resolve()
    assert said[-1] == f"nothing was started: run folder {run} removed", said
    assert not run.exists() and find_runs(tmp_path / "runs") == []
