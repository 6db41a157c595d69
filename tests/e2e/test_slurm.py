"""The Slurm backend against a real Slurm on loopback (tests/e2e/slurm.py): slurmctld,
two slurmd (nodes sn1 and sn2, one UTS namespace each) and munged, all local.

A plan over both nodes runs as a two-component heterogeneous job and trains; Ctrl-C
saves the step and stops it with nothing left behind; Slurm's SIGTERM to the steps
(``scancel --signal=TERM``, the time limit's ``--signal``) is a preemption notice that
saves the step; a node whose processes vanish is reported as a lost host; the cluster
file is imported from the same Slurm.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.cli import start_autohet
from tests.e2e.slurm import SlurmCluster, SlurmNode, slurm_problem
from tests.e2e.sshd import SshdFarm
from tests.e2e.test_launch import _plan
from tests.e2e.test_recover import EVERY, STEPS, _losses, _reference

ROOT = Path(__file__).resolve().parents[2]
# Pipeline 0 crosses the nodes (sn1 then sn2); pipeline 1 is sn1's second device.
# sn1 runs 2 workers and sn2 one: two host groups, so two components.
TWO_NODES = ((5, ((0, 3, "sn1"), (3, 6, "sn2"))), (3, ((0, 6, "sn1"),)))


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    problem = slurm_problem()
    if problem is not None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true but the Slurm tests cannot run: {problem}", pytrace=False)
        pytest.skip(f"real Slurm tests skipped: {problem}")
    cluster = SlurmCluster(
        tmp_path_factory.mktemp("slurm"),
        [
            SlurmNode(name="sn1", address="127.0.0.2", cpus=2, memory_mb=4000),
            SlurmNode(
                name="sn2",
                address="127.0.0.3",
                cpus=2,
                memory_mb=4000,
                gres="gpu:v100:1",
                features=("v100",),
            ),
        ],
    )
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _cluster_file(
    tmp: Path,
    farm: SshdFarm | None = None,
    remote_storage: str | None = None,
    slurm: dict[str, object] | None = None,
) -> Path:
    """sn1 (2 CPU devices) and sn2 (1); with ``farm``, also reachable over its sshd;
    ``slurm``: settings over the default ones (partition, a 15 minutes time limit)."""
    hosts: list[dict[str, object]] = [
        {
            "name": name,
            "address": address,
            "python": sys.executable,
            "workdir": str(tmp / f"work-{name}"),
            "checkpoint_dir": str(tmp / f"ckpt-{name}"),
            "gpus": {"type": "cpu", "count": count},
        }
        for name, address, count in (("sn1", "127.0.0.2", 2), ("sn2", "127.0.0.3", 1))
    ]
    if farm is not None:
        for host, fake in zip(hosts, farm.hosts, strict=True):
            assert fake.address == host["address"]
            host.update(
                port=fake.port,
                user=fake.user,
                identity_file=str(fake.client_key.private_path),
                workdir=str(fake.root / "work"),
                checkpoint_dir=str(fake.checkpoint_dir),
            )
    doc = {
        "schema": "autohet.cluster/v1",
        "name": "slurm-loopback",
        "backend": "slurm",
        "slurm": {"partition": "debug", "time_limit": "15:00", **(slurm or {})},
        "hosts": hosts,
    }
    if remote_storage:
        doc["remote_storage"] = remote_storage
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _autohet(slurm: SlurmCluster, cwd: Path, *args: str) -> subprocess.Popen[str]:
    return start_autohet(*args, cwd=cwd, env=slurm.env)


def _left_behind(tmp: Path) -> list[str]:
    """Processes of this test's run (their command lines point into ``tmp``)."""
    out = subprocess.run(
        ["ps", "-ww", "-eo", "pid,stat,args"], capture_output=True, text=True, check=True
    ).stdout
    return [
        ln
        for ln in out.splitlines()
        if str(tmp) in ln and " Z" not in ln and "sbin/sshd" not in ln and "sshd:" not in ln
    ]


def _gone(tmp: Path, within_s: float = 20.0) -> list[str]:
    """What of the run is still alive ``within_s`` after Slurm said the job ended:
    slurmstepd sends SIGKILL KillWait (5 s here) after TERM, and a process that
    escaped its step (proctrack/linuxproc follows the process tree) would stay."""
    deadline = time.monotonic() + within_s
    while (left := _left_behind(tmp)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _job_states(slurm: SlurmCluster, run_dir: Path) -> set[str]:
    job_id = re.search(r"Slurm job (\d+)", (run_dir.parent.parent.parent / "out.txt").read_text())
    assert job_id
    res = slurm.run("scontrol", "show", "job", "-o", job_id.group(1))
    return set(re.findall(r"JobState=(\w+)", res.stdout))


def _parent(pid: int) -> tuple[int, str]:
    """(parent pid, parent command line) of ``pid``; (0, "") once it is gone."""
    try:
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
        args = Path(f"/proc/{ppid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, ValueError):
        return 0, ""
    return ppid, args.strip()


def _step_ancestor(pid: int) -> str:
    """The ``slurmstepd: [...]`` command line above ``pid`` (the step it runs in), or ""."""
    while pid > 1:
        pid, args = _parent(pid)
        if args.startswith("slurmstepd:"):
            return args
    return ""


def _rest(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The rest of ``proc``'s output, once it exits (killed after ``timeout_s``). Not
    ``communicate(timeout=...)``: that reads the pipe's descriptor and loses the lines
    that iterating ``proc.stdout`` had already buffered."""
    assert proc.stdout is not None
    timer = threading.Timer(timeout_s, os.killpg, (proc.pid, signal.SIGKILL))
    timer.start()
    try:
        rest = proc.stdout.read()
        proc.wait()
    finally:
        timer.cancel()
    return rest


@pytest.mark.slow("a Slurm heterogeneous job of two components starts and trains")
def test_a_plan_trains_as_a_two_component_heterogeneous_job(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    plan = _plan(tmp_path, _cluster_file(tmp_path), TWO_NODES)
    proc = _autohet(slurm, tmp_path, "launch", str(plan), "--steps", "20", "--train-arg=--lr=0.003")
    out, _ = proc.communicate(timeout=300)
    (tmp_path / "out.txt").write_text(out)
    assert proc.returncode == 0, out
    losses = [float(m.group(1)) for m in re.finditer(r"step \d+ loss ([0-9.]+)", out)]
    assert len(losses) >= 20, out
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.02, losses
    run_dir = next((tmp_path / "runs").glob("e2e.v1/*"))
    script = (run_dir / "job.sbatch").read_text()
    assert script.count("#SBATCH hetjob") == 1 and "--nodelist=sn1" in script
    assert "--nodelist=sn2" in script
    # No cpus_per_gpu in the cluster file: still one CPU per CPU device, never Slurm's
    # one CPU for a node's every worker (issue 46).
    assert "#SBATCH --cpus-per-task=2" in script and "#SBATCH --cpus-per-task=1" in script
    # sn1 checked the printed port before the rendezvous and told sn2 through the folder.
    (port_file,) = run_dir.glob("master-port.*")
    port = port_file.read_text().strip()
    assert f"rendezvous: 127.0.0.2:{port} (if free on sn1 when the job starts" in out, out
    # Both components ran torchrun on their own node and exited 0.
    assert {p.name: p.read_text().strip() for p in (run_dir / "exit").iterdir()} == {
        "sn1": "0",
        "sn2": "0",
    }
    events = json.loads((run_dir / "events.json").read_text())
    assert events["status"] == "finished", events
    assert _job_states(slurm, run_dir) == {"COMPLETED"}
    assert not (run_dir / ".job-key").exists()  # the key is not left in the run directory
    key = next(tmp_path.glob("ckpt-sn2/e2e/*/.autohet-key"))
    assert key.stat().st_mode & 0o077 == 0
    assert not _gone(tmp_path)


def test_ctrl_c_saves_the_step_and_leaves_no_process(slurm: SlurmCluster, tmp_path: Path) -> None:
    """The first Ctrl-C is a notice (``scancel --signal=TERM`` to the steps): every rank
    saves its step, the job ends on its own; nothing is left running."""
    plan = _plan(tmp_path, _cluster_file(tmp_path), TWO_NODES)
    proc = _autohet(slurm, tmp_path, "launch", str(plan), "--steps", "100000")
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + 180
    for line in proc.stdout:
        seen.append(line)
        if "step 1 " in line or time.monotonic() > deadline:
            break
    assert len(_left_behind(tmp_path)) >= 3, "".join(seen)
    os.killpg(proc.pid, signal.SIGINT)
    out = "".join(seen) + _rest(proc, 180)
    (tmp_path / "out.txt").write_text(out)
    assert proc.returncode == 130, out
    assert re.search(r"interrupted: stopped on request; every rank saved step \d+", out), out
    run_dir = next((tmp_path / "runs").glob("e2e.v1/*"))
    assert _job_states(slurm, run_dir) == {"COMPLETED"}
    assert not _gone(tmp_path), out


# Before the time limit's signal: far from 15 minutes, within 3 (see the test).
SIGNAL_BEFORE_END_S = 180


@pytest.mark.parametrize("sender", ["scancel", "time_limit"])
@pytest.mark.slow("waits for Slurm's own time limit (or scancel) to signal a running job's steps")
def test_slurm_s_term_to_every_process_of_the_steps_is_one_notice_that_saves_the_step(
    slurm: SlurmCluster, tmp_path: Path, sender: str
) -> None:
    """Slurm sends a step's signal to every process of the step (proctrack/linuxproc
    walks the process tree) and leaves the batch shell alone: each node's wrapper
    shell, torchrun agent and workers get one SIGTERM each, at once, as at a spot
    shutdown. Two senders, one delivery: ``scancel --signal=TERM`` (no ``--full`` or
    ``-b``), and the time limit's ``--signal=TERM@N``, which slurmctld's periodic
    time-limit pass (every 30 s) sends through the same ``job_signal``, steps only,
    to every component. The pass sends it once the end is within N + 30 s: the job
    starts with 15 minutes, and after a few steps its limit drops to 3 minutes, so
    the next pass (within 30 s) signals it long before the limit itself."""
    cluster = _cluster_file(tmp_path, slurm={"signal_before_end_s": SIGNAL_BEFORE_END_S})
    plan = _plan(tmp_path, cluster, TWO_NODES)
    args = ["--steps", "100000", "--checkpoint-every", "0"]  # only the notice saves
    proc = _autohet(slurm, tmp_path, "launch", str(plan), *args)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "step 1 " in line:
            break
    job = re.search(r"submitted: Slurm job (\d+)", "".join(seen))
    assert job, "".join(seen)
    # Every agent and worker runs inside a job step (what the signal reaches), not the
    # batch step, and each agent is its node wrapper's own child: a subshell between
    # them would die on the TERM and take the wrapper with it (exit 143, step killed).
    agents, workers = [], []
    for ln in _left_behind(tmp_path):
        pid = int(ln.split()[0])
        if "autohet_cli.runtime.agent" in ln:
            agents.append(_step_ancestor(pid))
            assert "job.sbatch node" in _parent(pid)[1], ln
        elif "autohet_cli.runtime.train" in ln:
            workers.append(_step_ancestor(pid))
    assert len(agents) == 2 and len(workers) == 3, (agents, workers)
    assert all(w and "batch" not in w for w in agents + workers), (agents, workers)
    if sender == "scancel":
        res = slurm.run("scancel", "--signal=TERM", job.group(1))
    else:
        res = slurm.run("scontrol", "update", f"JobId={job.group(1)}", "TimeLimit=3")
    assert res.returncode == 0, res.stderr
    out = "".join(seen) + _rest(proc, 180)
    (tmp_path / "out.txt").write_text(out)
    assert proc.returncode == 3, out[-6000:]  # preempted
    # One notice per node: each agent took it (the wrapper's forwarded TERM is a repeat
    # of it, not a second notice), and the workers of both nodes gave it.
    for node, n in (("sn1", 2), ("sn2", 1)):
        assert f"[{node}] [autohet agent] SIGTERM: a preemption notice; forwarded to {n}" in out
    assert "SIGTERM again" not in out and "SignalException" not in out, out[-6000:]
    # The first step end that saw a notice names the nodes whose TERM had come by then
    # (slurmd signals each node's step on its own, milliseconds apart, and seconds apart
    # on a loaded machine); the verdict names both, a late one from its agent's line,
    # so the recover line lets both go.
    assert re.search(r"^host preempting: sn[12] \(SIGTERM\)", out, re.M), out[-6000:]
    final = re.search(r"^preempted: host preempting \((.*)\); every rank saved step", out, re.M)
    assert final and sorted(final.group(1).split("; ")) == ["sn1: SIGTERM", "sn2: SIGTERM"], out
    saved = re.search(r"emergency checkpoint: step (\d+) saved on every rank", out)
    assert saved, out[-6000:]
    step = int(saved.group(1))
    assert max(_losses(out)) == step - 1  # the last printed step is in the checkpoint
    (d,) = tmp_path.glob(f"ckpt-sn1/e2e/*/step-{step:08d}")  # rank 0's node
    assert (d / "COMPLETE").is_file() and list(d.glob("*.distcp"))
    run_dir = next((tmp_path / "runs").glob("e2e.v1/*"))
    script = (run_dir / "job.sbatch").read_text()
    assert script.count(f"#SBATCH --signal=TERM@{SIGNAL_BEFORE_END_S}") == 2  # each component
    events = json.loads((run_dir / "events.json").read_text())
    assert events["status"] == "preempted", events
    assert {p.name: p.read_text().strip() for p in (run_dir / "exit").iterdir()} == {
        "sn1": "0",
        "sn2": "0",
    }
    assert _job_states(slurm, run_dir) == {"COMPLETED"}  # it ended on its own, in time
    assert not _gone(tmp_path), out


def test_cluster_import_reads_gres_types_and_counts(slurm: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "imported.yaml"
    args = ["cluster", "import", "--slurm", "--partition", "debug", "--out", str(out)]
    proc = _autohet(slurm, tmp_path, *args, "--cpu-devices", "2", "--name", "lab")
    text, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, text
    doc = yaml.safe_load(out.read_text())
    assert doc["backend"] == "slurm" and doc["name"] == "lab"
    assert doc["slurm"] == {"partition": "debug", "gpu_types": {"V100-16": {"gres": "v100"}}}
    assert doc["hosts"] == [
        {"name": "sn1", "address": "127.0.0.2", "gpus": {"type": "cpu", "count": 2}},
        {"name": "sn2", "address": "127.0.0.3", "gpus": {"type": "V100-16", "count": 1}},
    ]
    assert "v100 taken as V100-16" in text
    # Never overwritten; without --cpu-devices the CPU-only node is left out, said so.
    again = _autohet(slurm, tmp_path, *args)
    text, _ = again.communicate(timeout=60)
    assert again.returncode == 1 and "already exists" in text and "Traceback" not in text
    other = tmp_path / "gpu-only.yaml"
    proc = _autohet(slurm, tmp_path, "cluster", "import", "--slurm", "--out", str(other))
    text, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, text
    assert [h["name"] for h in yaml.safe_load(other.read_text())["hosts"]] == ["sn2"]
    assert "sn1: no GPU GRES; left out" in text


@pytest.mark.slow(
    "a Slurm job, a node's daemons killed, recover's new job on the survivor: three real job starts"
)
def test_a_vanished_node_is_a_lost_host_and_recover_resumes_on_slurm(
    slurm: SlurmCluster, sshd_farm: SshdFarm, tmp_path: Path
) -> None:
    """Last in this file: sn2's slurmd stays dead (the cluster is the module's).

    sn1 and sn2 also run sshd (the same loopback addresses): recover lists and copies
    the shards over SSH and relaunches on sn1 as a new Slurm job."""
    sshd_farm.start(2)  # 127.0.0.2 and 127.0.0.3, as the Slurm nodes
    remote = tmp_path / "remote"
    cluster = _cluster_file(tmp_path, farm=sshd_farm, remote_storage=str(remote))
    plan = _plan(tmp_path, cluster, TWO_NODES)
    train = ["--train-arg=--lr=0.003", "--train-arg=--lr-schedule=constant"]
    every = [f"--train-arg=--checkpoint-every={EVERY}"]
    proc = _autohet(slurm, tmp_path, "launch", str(plan), "--steps", "1000", *train, *every)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "step 8 " in line:
            break
    killed_at = time.monotonic()
    slurm.kill_node("sn2")
    rest, _ = proc.communicate(timeout=240)
    detected_s = time.monotonic() - killed_at
    out = "".join(seen) + rest
    (tmp_path / "out.txt").write_text(out)
    assert proc.returncode != 0, out
    events = json.loads(next((tmp_path / "runs").glob("e2e.v1/*/events.json")).read_text())
    assert events["status"] == "host_lost" and events["lost_hosts"] == ["sn2"], out
    assert "autohet recover" in out and "--lost sn2" in out, out
    assert detected_s < 60, out
    assert not _gone(tmp_path), out

    rec = _autohet(
        slurm,
        tmp_path,
        "recover",
        str(plan),
        "--lost",
        "sn2",
        "--known-hosts",
        str(tmp_path / "sshd" / "known_hosts"),
        "--steps",
        str(STEPS),
        "--checkpoint-every",
        str(EVERY),
        *train,
        "--json",
    )
    text, _ = rec.communicate(timeout=300)
    assert rec.returncode == 0, text
    report = json.loads(text.strip().splitlines()[-1])
    # The newest complete step (saves are asynchronous: step 6 may not be durable by step 8).
    # sn2's shards are on sn1 already when sn1 is its partner (replicas) and the copy was
    # made; otherwise they come from remote storage. Either way the run goes on (below).
    assert report["resumed_step"] in (3, 6, 9), report
    assert report["bytes_from_peers"] == 0, report  # sn1 is the only survivor
    run_dir = next((tmp_path / "runs").glob("e2e.v2/*"))
    assert "--nodelist=sn1" in (run_dir / "job.sbatch").read_text()  # a Slurm job again
    assert "hetjob" not in (run_dir / "job.sbatch").read_text()  # one node: one component
    after = _losses((run_dir / "sn1.log").read_text())
    ref = _reference(tmp_path)
    resumed = [s for s in after if s >= report["resumed_step"]]
    assert resumed and max(resumed) == STEPS - 1, after
    for step in resumed:
        assert after[step] == pytest.approx(ref[step], abs=1e-4), (step, after[step], ref[step])
    assert not _gone(tmp_path)
