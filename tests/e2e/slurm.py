"""A real Slurm on loopback for the end-to-end tests: munged, slurmctld and slurmd.

Everything lives in one temporary directory: its own ``slurm.conf`` (clients find
it through ``SLURM_CONF``), its own munge key and socket, state, spool and logs, on
free ports. Each node daemon runs in a UTS namespace of its own whose hostname is
the node's name: that is how slurmd finds which node it is, so one machine hosts
several node daemons without Slurm's ``--enable-multiple-slurmd`` build (Debian's
is not). Node ``snK`` has ``NodeAddr=127.0.0.(K+1)`` and its own slurmd port.
Nodes are CPU-only; ``gres`` adds GPU GRES records without devices (``Count``
only), enough for ``sinfo``/``scontrol`` to report types for the import tests.
Nothing here talks to an address outside 127.0.0.0/8.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SBIN = Path("/usr/sbin")
START_TIMEOUT_S = 30.0


def slurm_problem() -> str | None:
    """Why a real Slurm cannot run here, or None."""
    for exe in ("slurmctld", "slurmd", "munged"):
        if not (SBIN / exe).exists():
            return f"{SBIN / exe} is missing (apt-get install slurmctld slurmd munge)"
    for exe in ("sbatch", "squeue", "scancel", "sacct", "sinfo", "scontrol", "unshare"):
        if shutil.which(exe) is None:
            return f"{exe} is not on PATH (apt-get install slurm-client)"
    if os.geteuid() != 0:
        return "the node daemons need root (UTS namespaces, job user switching)"
    probe = subprocess.run(
        ["unshare", "--uts", "true"], capture_output=True, text=True, check=False
    )
    if probe.returncode != 0:
        return f"unshare --uts fails: {probe.stderr.strip()}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True, kw_only=True)
class SlurmNode:
    name: str
    address: str
    cpus: int
    memory_mb: int
    gres: str = ""  # e.g. "gpu:a100:2" (records only: no device files)
    features: tuple[str, ...] = ()


@dataclass(slots=True)
class SlurmCluster:
    """``start()`` brings up munged, slurmctld and one slurmd per node; ``stop()`` ends them."""

    root: Path
    nodes: list[SlurmNode]
    partition: str = "debug"
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment Slurm's client commands need to find this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> SlurmCluster:
        r = self.root
        for d in ("state", "spool", "log", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "munge").chmod(0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = r / "munge" / "munge.socket"
        self._spawn(
            [
                str(SBIN / "munged"),
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={sock}",
                f"--pid-file={r / 'munge' / 'munged.pid'}",
                f"--log-file={r / 'log' / 'munged.log'}",
                f"--seed-file={r / 'munge' / 'munged.seed'}",
            ],
            "munged",
        )
        _wait(lambda: sock.exists(), "munged's socket")
        ctl_port = _free_port()
        lines = [
            "ClusterName=autohet-test",
            f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
            f"SlurmctldPort={ctl_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"AuthInfo=socket={sock}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'spool'}/slurmd-%n.pid",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log'}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "SchedulerType=sched/backfill",
            # Heterogeneous jobs are started by the backfill scheduler only: every second.
            "SchedulerParameters=bf_interval=1",
            "MinJobAge=600",
            "MailProg=/bin/true",
            "KillWait=5",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "GresTypes=gpu",
            "PrologFlags=Alloc",
            "LaunchParameters=use_interactive_step",
        ]
        gres_lines = []
        for n in self.nodes:
            port = _free_port()
            extra = f" Gres={n.gres}" if n.gres else ""
            if n.features:
                extra += f" Feature={','.join(n.features)}"
            lines.append(
                f"NodeName={n.name} NodeHostname={n.name} NodeAddr={n.address} Port={port} "
                f"CPUs={n.cpus} RealMemory={n.memory_mb} State=UNKNOWN{extra}"
            )
            if n.gres:
                _, gtype, count = n.gres.split(":")
                # slurmd counts a GPU per device file: empty files stand in for /dev/nvidiaN.
                dev = r / "dev" / n.name
                dev.mkdir(parents=True, exist_ok=True)
                for i in range(int(count)):
                    (dev / f"gpu{i}").touch()
                gres_lines.append(
                    f"NodeName={n.name} Name=gpu Type={gtype} File={dev}/gpu[0-{int(count) - 1}]"
                )
            (r / "spool" / n.name).mkdir(parents=True, exist_ok=True)
        names = ",".join(n.name for n in self.nodes)
        lines.append(
            f"PartitionName={self.partition} Nodes={names} Default=YES MaxTime=INFINITE State=UP"
        )
        self.conf.write_text("\n".join(lines) + "\n")
        (r / "gres.conf").write_text("AutoDetect=off\n" + "\n".join(gres_lines) + "\n")
        (r / "cgroup.conf").write_text("CgroupPlugin=autodetect\n")
        env = self.env
        self._spawn([str(SBIN / "slurmctld"), "-D", "-i"], "slurmctld", env=env)
        _wait(lambda: self._ok(["scontrol", "ping"], "UP"), "slurmctld")
        for n in self.nodes:
            self._spawn(
                ["unshare", "--uts", "sh", "-c", f"hostname {n.name} && exec {SBIN}/slurmd -D"],
                f"slurmd-{n.name}",
                env=env,
            )
        _wait(self._all_idle, "every node idle")
        return self

    def _spawn(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> None:
        out = (self.root / "log" / f"{name}.stdout").open("wb")
        self.procs.append(
            subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        )

    def _ok(self, argv: list[str], want: str) -> bool:
        res = subprocess.run(argv, capture_output=True, text=True, env=self.env, check=False)
        return res.returncode == 0 and want in res.stdout

    def _all_idle(self) -> bool:
        res = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"],
            capture_output=True,
            text=True,
            env=self.env,
            check=False,
        )
        states = dict(line.split() for line in res.stdout.splitlines() if line.strip())
        return all(states.get(n.name) == "idle" for n in self.nodes)

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), capture_output=True, text=True, env=self.env, check=False)

    def kill_node(self, name: str) -> None:
        """A node that vanishes: SIGKILL every process in its UTS namespace (its slurmd,
        the step daemons it started, and the job's processes on it)."""
        i = [n.name for n in self.nodes].index(name)
        anchor = self.procs[2 + i].pid  # unshare, which exec'd into sh and then slurmd
        ns = os.readlink(f"/proc/{anchor}/ns/uts")
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{pid}/ns/uts") == ns:
                    os.kill(int(pid), signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue

    def stop(self) -> None:
        subprocess.run(
            ["scancel", "--full", "-u", "root"], env=self.env, check=False, capture_output=True
        )
        for proc in reversed(self.procs):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in reversed(self.procs):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        self.procs.clear()


def _wait(ok: object, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if ok():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise RuntimeError(f"test Slurm: {what} did not come up in {START_TIMEOUT_S:.0f} s")
