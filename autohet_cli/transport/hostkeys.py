"""Host key checking against known_hosts, as OpenSSH's StrictHostKeyChecking does.

Known key: accepted. Changed key: always refused (someone may be in the middle).
Unknown key: refused with the way to accept it, or, with ``accept_new``
(``--accept-new-host-keys``, OpenSSH's ``accept-new``), recorded in known_hosts
and accepted. Never a silent auto-add.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import os
import threading
from pathlib import Path

import paramiko

from autohet_cli.errors import ConfigError, HostKeyError
from autohet_cli.transport.target import SYSTEM_KNOWN_HOSTS, SshOptions, SshTarget, where

_append_lock = threading.Lock()


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's ``SHA256:...`` fingerprint of a public key."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def load_known_hosts(client: paramiko.SSHClient, options: SshOptions) -> None:
    """Load the chosen known_hosts (and the system file when none was chosen)."""
    path = options.known_hosts_path()
    paths = [path] if options.known_hosts else [path, SYSTEM_KNOWN_HOSTS]
    for p in paths:
        if not p.is_file():
            continue
        try:
            client.get_host_keys().load(str(p))
        except (OSError, paramiko.SSHException, ValueError) as exc:
            raise ConfigError(f"known_hosts {p}: cannot read it: {exc}") from exc


def append_known_host(path: Path, name: str, key: paramiko.PKey) -> None:
    """Append ``name keytype base64`` to known_hosts (locked; file created mode 600)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    line = f"{name} {key.get_name()} {key.get_base64()}\n"
    with _append_lock:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, line.encode())
        finally:
            os.close(fd)


class KnownHostsPolicy(paramiko.MissingHostKeyPolicy):
    """Decides on keys that known_hosts does not list (paramiko asks only about those)."""

    def __init__(self, target: SshTarget, options: SshOptions, *, of: SshTarget) -> None:
        self._target = target
        self._options = options
        self._of = of

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        path = self._options.known_hosts_path()
        if not self._options.accept_new_host_keys:
            raise unknown_key_error(self._target, key, path, of=self._of)
        append_known_host(path, hostname, key)
        client.get_host_keys().add(hostname, key.get_name(), key)


def unknown_key_error(
    target: SshTarget, key: paramiko.PKey, path: Path, *, of: SshTarget
) -> HostKeyError:
    port_opt = f"-p {target.port} " if target.port != 22 else ""
    return HostKeyError(
        f"host {where(target, of)}: unknown host key {key.get_name()} {fingerprint(key)}; "
        f"it is not in {path}. If you trust this host, rerun with --accept-new-host-keys "
        f"to record it (like ssh -o StrictHostKeyChecking=accept-new), or add it yourself: "
        f"ssh-keyscan {port_opt}{target.hostname} >> {path}",
        host=of.name,
    )


def changed_key_error(
    target: SshTarget,
    offered: paramiko.PKey,
    expected: paramiko.PKey,
    path: Path,
    *,
    of: SshTarget,
) -> HostKeyError:
    return HostKeyError(
        f"host {where(target, of)}: HOST KEY HAS CHANGED. It offered {offered.get_name()} "
        f"{fingerprint(offered)} but {path} records {expected.get_name()} "
        f"{fingerprint(expected)} for {target.known_hosts_name}. Someone could be "
        "intercepting the connection (man-in-the-middle), or the host was reinstalled. "
        "Refusing to connect; --accept-new-host-keys does not override this. If you have "
        f"verified the new key, remove the old one: "
        f"ssh-keygen -R '{target.known_hosts_name}' -f {path}",
        host=of.name,
    )
