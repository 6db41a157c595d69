"""Real OpenSSH servers on loopback, one per fake host, for the end-to-end tests.

Each :class:`FakeSshHost` is its own ``/usr/sbin/sshd -D`` process listening on
``127.0.0.N`` (N = 2, 3, ...) on a free port, with its own ed25519 host key, its own
``sshd_config``, log file and ``checkpoint_dir``. The client key is shared and sits in
one ``authorized_keys`` file. Nothing here ever talks to an address outside 127.0.0.0/8.
"""

from __future__ import annotations

import ctypes
import getpass
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from autohet_cli.cluster import Host
from autohet_cli.transport import SshOptions

CHECKOUT = Path(__file__).resolve().parents[2]
SSHD = Path("/usr/sbin/sshd")
PRIVSEP_DIR = Path("/run/sshd")
START_TIMEOUT_S = 10.0
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientKey:
    """The test client's ed25519 key pair (OpenSSH formats)."""

    private_path: Path
    public_line: str


def write_ed25519_key(path: Path, comment: str) -> str:
    """Write a new unencrypted OpenSSH ed25519 private key (mode 600); return the public line."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    path.write_bytes(private)
    path.chmod(0o600)
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    line = f"{public.decode()} {comment}"
    path.with_name(path.name + ".pub").write_text(line + "\n")
    return line


def make_client_key(directory: Path) -> ClientKey:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "id_ed25519"
    return ClientKey(private_path=path, public_line=write_ed25519_key(path, "autohet-e2e-client"))


def free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child: SIGTERM this sshd if pytest dies, so no listener outlives a crashed run."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (by parent pid), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out: list[int] = []
    todo = [root]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def sshd_problem() -> str | None:
    """Why real sshd tests cannot run here, or None when they can."""
    if not SSHD.is_file():
        return f"{SSHD} is missing (apt-get install openssh-server)"
    if os.geteuid() != 0:
        return "sshd tests need root (sshd privilege separation and root login)"
    return None


def ensure_privsep_dir() -> None:
    """sshd refuses to start without its privilege separation directory."""
    PRIVSEP_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)


@dataclass(slots=True, kw_only=True)
class FakeSshHost:
    """One sshd on ``address:port``; ``stop()`` simulates the host vanishing."""

    name: str
    address: str
    port: int
    root: Path
    client_key: ClientKey
    authorized_keys: Path
    extra_config: str = ""
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def host_key_path(self) -> Path:
        return self.root / "ssh_host_ed25519_key"

    @property
    def config_path(self) -> Path:
        return self.root / "sshd_config"

    @property
    def log_path(self) -> Path:
        return self.root / "sshd.log"

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "ckpt"

    @property
    def user(self) -> str:
        return getpass.getuser()

    def as_host(self, **overrides: Any) -> Host:
        """This fake host as a cluster Host (cpu 'GPU', our client key, its own ckpt dir)."""
        fields: dict[str, Any] = {
            "name": self.name,
            "address": self.address,
            "gpu_type": "cpu",
            "num_gpus": 1,
            "gpu_mem_bytes": 4 << 30,
            "intra_node_gbps": 80.0,
            "user": self.user,
            "port": self.port,
            "identity_file": str(self.client_key.private_path),
            "checkpoint_dir": str(self.checkpoint_dir),
            "workdir": str(self.root / "work"),
        }
        fields.update(overrides)
        return Host(**fields)

    def cluster_entry(self, num_gpus: int = 1) -> dict[str, Any]:
        """This fake host as a cluster file lists it (``num_gpus`` cpu "GPUs")."""
        return {
            "name": self.name,
            "address": self.address,
            "port": self.port,
            "user": self.user,
            "identity_file": str(self.client_key.private_path),
            "python": sys.executable,
            "workdir": str(self.root / "work"),
            "checkpoint_dir": str(self.checkpoint_dir),
            "gpus": {"type": "cpu", "count": num_gpus},
        }

    def host_key_public(self) -> str:
        """``ssh-ed25519 AAAA...`` (type and base64, no comment)."""
        text = self.host_key_path.with_name(self.host_key_path.name + ".pub").read_text()
        return " ".join(text.split()[:2])

    def known_hosts_line(self) -> str:
        return f"[{self.address}]:{self.port} {self.host_key_public()}"

    def new_host_key(self) -> None:
        """Replace the host key (as a reinstalled host, or an impostor, would have)."""
        write_ed25519_key(self.host_key_path, f"{self.name}-host")

    def write_config(self) -> None:
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(
            "\n".join(
                [
                    f"ListenAddress {self.address}",
                    f"Port {self.port}",
                    f"HostKey {self.host_key_path}",
                    f"PidFile {self.root / 'sshd.pid'}",
                    f"AuthorizedKeysFile {self.authorized_keys}",
                    "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PubkeyAuthentication yes",
                    "UsePAM no",
                    "StrictModes no",
                    "AllowTcpForwarding yes",
                    "Subsystem sftp internal-sftp",
                    "LogLevel VERBOSE",
                    # bash sources ~/.bashrc for sshd's `bash -c` only at SHLVL < 2. This
                    # image's root ~/.bashrc runs `pyenv init` (0.5 s, a global rehash lock
                    # that a session killed mid-way leaves stale: then every later session
                    # waits 60 s). The machine's dotfiles are not under test: skip them.
                    # The hosts' Python imports this checkout's autohet, as the launcher
                    # does (tests/cli.py), not whichever one the venv's editable
                    # install points at (a second clone's workers ran the first's code).
                    f'SetEnv SHLVL=1 "PYTHONPATH={CHECKOUT}"',
                    "MaxStartups 50",
                    "LoginGraceTime 20",
                    self.extra_config,
                    "",
                ]
            )
        )

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        if not self.host_key_path.is_file():
            self.new_host_key()
        self.write_config()
        ensure_privsep_dir()
        # -D: stay in the foreground (a child we can kill); -E: log to our file.
        self.proc = subprocess.Popen(
            [str(SSHD), "-D", "-f", str(self.config_path), "-E", str(self.log_path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd for {self.name} exited at start:\n{self.log()}")
            try:
                with socket.create_connection((self.address, self.port), timeout=1.0) as s:
                    if s.recv(8).startswith(b"SSH-"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"sshd for {self.name} not ready in {START_TIMEOUT_S}s:\n{self.log()}")

    def stop(self) -> None:
        """The host vanishes: kill this sshd and every session and process under it."""
        if self.proc is None:
            return
        for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.proc = None

    def restart(self, *, new_host_key: bool = False) -> None:
        self.stop()
        if new_host_key:
            self.new_host_key()
        self.start()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no sshd log)"


@dataclass(slots=True, kw_only=True)
class SshdFarm:
    """Starts fake hosts on 127.0.0.2, 127.0.0.3, ... and keeps one known_hosts for them."""

    root: Path
    client_key: ClientKey
    hosts: list[FakeSshHost] = field(default_factory=list)

    @property
    def known_hosts(self) -> Path:
        return self.root / "known_hosts"

    @property
    def authorized_keys(self) -> Path:
        return self.root / "authorized_keys"

    @property
    def ssh_config(self) -> Path:
        """An ssh config of our own (empty unless a test writes it): ~/.ssh/config stays out."""
        path = self.root / "ssh_config"
        if not path.exists():
            path.write_text("")
        return path

    def options(self, **overrides: Any) -> SshOptions:
        """Options that use only our files: no agent, no ~/.ssh keys, no ~/.ssh/config."""
        fields: dict[str, Any] = {
            "known_hosts": self.known_hosts,
            "ssh_config": self.ssh_config,
            "connect_timeout_s": 5.0,
            "allow_agent": False,
            "look_for_keys": False,
        }
        fields.update(overrides)
        return SshOptions(**fields)

    def start(
        self,
        count: int = 1,
        *,
        trusted: bool = True,
        authorized: bool = True,
        extra_config: str = "",
    ) -> list[FakeSshHost]:
        """Start ``count`` new hosts; ``trusted`` puts their keys into ``known_hosts``;
        ``authorized=False`` gives them an empty authorized_keys (auth must fail)."""
        if not self.authorized_keys.exists():
            self.authorized_keys.write_text(self.client_key.public_line + "\n")
        empty = self.root / "authorized_keys.empty"
        empty.touch()
        started = []
        for _ in range(count):
            n = len(self.hosts) + 2
            address = f"127.0.0.{n}"
            host = FakeSshHost(
                name=f"fake-{n}",
                address=address,
                port=free_port(address),
                root=self.root / f"host-{n}",
                client_key=self.client_key,
                authorized_keys=self.authorized_keys if authorized else empty,
                extra_config=extra_config,
            )
            host.root.mkdir(parents=True)
            self.hosts.append(host)
            host.start()
            started.append(host)
            if trusted:
                with self.known_hosts.open("a") as f:
                    f.write(host.known_hosts_line() + "\n")
        self.known_hosts.touch()
        return started

    def stop_all(self) -> None:
        for host in self.hosts:
            host.stop()
