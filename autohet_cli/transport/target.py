"""Where and as whom to connect: a cluster Host merged with ~/.ssh/config.

Precedence, per field: explicit cluster fields (host entry or cluster defaults),
then the ssh config entry for the host's address (``HostName``, ``User``, ``Port``,
``IdentityFile``, ``ProxyJump``), then OpenSSH's defaults (local user, port 22,
keys from ssh-agent and ~/.ssh/id_*). ``Host.port`` has no "unset" value, so a
cluster port of 22 lets an ssh config ``Port`` apply; any other port wins.
"""

from __future__ import annotations

import getpass
import os
from dataclasses import dataclass, field
from pathlib import Path

import paramiko

from autohet_cli.cluster import Host
from autohet_cli.errors import ConfigError

DEFAULT_SSH_CONFIG = Path("~/.ssh/config")
DEFAULT_KNOWN_HOSTS = Path("~/.ssh/known_hosts")
SYSTEM_KNOWN_HOSTS = Path("/etc/ssh/ssh_known_hosts")
MAX_JUMPS = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class SshOptions:
    """How to connect; the CLI fills these from its flags."""

    known_hosts: Path | None = None  # None: ~/.ssh/known_hosts (+ /etc/ssh/ssh_known_hosts)
    accept_new_host_keys: bool = False  # like StrictHostKeyChecking=accept-new
    connect_timeout_s: float = 10.0  # TCP connect, SSH banner, auth, channel open
    keepalive_s: float = 15.0  # 0 disables keep-alive packets
    ssh_config: Path | None = None  # None: ~/.ssh/config if it exists
    allow_agent: bool = True
    look_for_keys: bool = True  # ~/.ssh/id_* as OpenSSH does

    def __post_init__(self) -> None:
        if self.connect_timeout_s <= 0:
            raise ConfigError(f"connect timeout must be positive, got {self.connect_timeout_s} s")
        if self.keepalive_s < 0:
            raise ConfigError(f"keep-alive interval must be >= 0, got {self.keepalive_s} s")

    def known_hosts_path(self) -> Path:
        return (self.known_hosts or DEFAULT_KNOWN_HOSTS).expanduser()


@dataclass(frozen=True, slots=True, kw_only=True)
class SshTarget:
    """One SSH hop, fully resolved."""

    name: str  # the cluster host name (or the jump spec) for messages
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...] = ()
    jumps: tuple[SshTarget, ...] = field(default=())

    @property
    def label(self) -> str:
        where = f"{self.user}@{self.hostname}:{self.port}"
        return self.name if self.name == where else f"{self.name} ({where})"

    @property
    def known_hosts_name(self) -> str:
        """The name OpenSSH files the key under: ``host`` on port 22, else ``[host]:port``."""
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"


def where(hop: SshTarget, of: SshTarget) -> str:
    """How messages name a hop: the host itself, or ``host: jump host J (user@addr:port)``."""
    return of.label if hop is of else f"{of.name}: {hop.label}"


def load_ssh_config(path: Path | None) -> paramiko.SSHConfig:
    p = (path or DEFAULT_SSH_CONFIG).expanduser()
    if not p.is_file():
        if path is not None:
            raise ConfigError(f"ssh config {p}: file not found")
        return paramiko.SSHConfig()
    try:
        return paramiko.SSHConfig.from_path(str(p))
    except (OSError, ValueError, paramiko.SSHException) as exc:
        raise ConfigError(f"ssh config {p}: cannot read it: {exc}") from exc


def resolve(host: Host, config: paramiko.SSHConfig) -> SshTarget:
    """The connection for a cluster host, jumps included (see the module doc for precedence)."""
    entry = _lookup(config, host.address, host.name)
    port = host.port if host.port != 22 else _port(entry.get("port", "22"), host.name)
    if host.identity_file:
        identities: tuple[str, ...] = (os.path.expanduser(host.identity_file),)
    else:
        identities = _existing(entry.get("identityfile", []))
    return SshTarget(
        name=host.name,
        hostname=str(entry.get("hostname", host.address)),
        port=port,
        user=host.user or str(entry.get("user") or getpass.getuser()),
        identity_files=identities,
        jumps=_jumps(str(entry.get("proxyjump") or ""), config, host.name),
    )


def _lookup(config: paramiko.SSHConfig, alias: str, name: str) -> dict[str, object]:
    try:
        return dict(config.lookup(alias))
    except Exception as exc:  # paramiko raises assorted errors for Match/exec/tokens
        raise ConfigError(f"host {name}: ssh config entry for {alias!r}: {exc}") from exc


def _jumps(spec: str, config: paramiko.SSHConfig, name: str) -> tuple[SshTarget, ...]:
    """``ProxyJump [user@]host[:port][,...]``; each jump's own ssh config entry applies."""
    if not spec or spec.lower() == "none":
        return ()
    hops = [h.strip() for h in spec.split(",") if h.strip()]
    if len(hops) > MAX_JUMPS:
        raise ConfigError(f"host {name}: ProxyJump lists {len(hops)} hops; at most {MAX_JUMPS}")
    out = []
    for hop in hops:
        user, alias, port = _parse_hop(hop.removeprefix("ssh://"), name)
        entry = _lookup(config, alias, name)
        out.append(
            SshTarget(
                name=f"jump host {hop}",
                hostname=str(entry.get("hostname", alias)),
                port=port or _port(entry.get("port", "22"), name),
                user=user or str(entry.get("user") or getpass.getuser()),
                identity_files=_existing(entry.get("identityfile", [])),
            )
        )
    return tuple(out)


def _parse_hop(hop: str, name: str) -> tuple[str | None, str, int | None]:
    user, _, rest = hop.rpartition("@")
    if rest.startswith("["):  # [v6addr]:port
        addr, _, tail = rest[1:].partition("]")
        port = tail.removeprefix(":") or None
    else:
        addr, _, port_s = rest.partition(":")
        port = port_s or None
    if not addr:
        raise ConfigError(f"host {name}: cannot read ProxyJump hop {hop!r}")
    return user or None, addr, _port(port, name) if port else None


def _port(raw: object, name: str) -> int:
    try:
        port = int(str(raw))
    except ValueError:
        raise ConfigError(f"host {name}: ssh port {raw!r} is not a number") from None
    if not 0 < port < 65536:
        raise ConfigError(f"host {name}: ssh port {port} is out of range")
    return port


def _existing(paths: object) -> tuple[str, ...]:
    """ssh config IdentityFile entries that exist (OpenSSH skips missing ones silently)."""
    items = paths if isinstance(paths, list) else [paths] if paths else []
    expanded = (os.path.expanduser(str(p)) for p in items)
    return tuple(p for p in expanded if os.path.isfile(p))
