"""Open an authenticated SSH connection, through ProxyJump hops, with clear errors.

Each hop is a paramiko client; the next hop's socket is a ``direct-tcpip`` channel
opened on the previous hop. Every failure becomes one of our TransportError
subclasses naming the host and the cause: DNS, refused, timeout, host key, auth.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from dataclasses import dataclass

import paramiko

from autohet_cli.errors import (
    AuthError,
    ConnectTimeout,
    HostUnreachable,
    TransportError,
)
from autohet_cli.transport.hostkeys import (
    KnownHostsPolicy,
    changed_key_error,
    load_known_hosts,
)
from autohet_cli.transport.target import SshOptions, SshTarget, where

# paramiko logs handshake failures with tracebacks at ERROR level from its own thread;
# we raise a clear error instead, so keep Python's last-resort handler from printing them.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


@dataclass(slots=True)
class Connection:
    """The target's client and the jump clients it rides on (closed with it)."""

    client: paramiko.SSHClient
    transport: paramiko.Transport
    jumps: list[paramiko.SSHClient]

    def close(self) -> None:
        for c in [self.client, *reversed(self.jumps)]:
            c.close()


def open_connection(target: SshTarget, options: SshOptions) -> Connection:
    hops = [*target.jumps, target]
    opened: list[paramiko.SSHClient] = []
    sock: paramiko.Channel | None = None
    try:
        for i, hop in enumerate(hops):
            client = _connect_hop(hop, options, sock, via=hops[i - 1] if i else None, of=target)
            opened.append(client)
            if hop is not target:
                sock = _open_tunnel(client, hops[i + 1], options, via=hop, of=target)
    except BaseException:
        for c in reversed(opened):
            c.close()
        raise
    transport = opened[-1].get_transport()
    assert transport is not None
    if options.keepalive_s > 0:
        transport.set_keepalive(max(1, round(options.keepalive_s)))
    return Connection(client=opened[-1], transport=transport, jumps=opened[:-1])


def _connect_hop(
    hop: SshTarget,
    options: SshOptions,
    sock: paramiko.Channel | None,
    *,
    via: SshTarget | None,
    of: SshTarget,
) -> paramiko.SSHClient:
    missing = [p for p in hop.identity_files if not _is_file(p)]
    if missing:
        raise AuthError(
            f"host {where(hop, of)}: identity file {missing[0]} not found "
            "(check identity_file in the cluster file or IdentityFile in ~/.ssh/config)",
            host=of.name,
        )
    client = paramiko.SSHClient()
    load_known_hosts(client, options)
    client.set_missing_host_key_policy(KnownHostsPolicy(hop, options, of=of))
    t = options.connect_timeout_s
    try:
        client.connect(
            hop.hostname,
            port=hop.port,
            username=hop.user,
            # paramiko takes a list here; its stubs say str only.
            key_filename=list(hop.identity_files) or None,  # type: ignore[arg-type]
            timeout=t,
            banner_timeout=t,
            auth_timeout=t,
            channel_timeout=t,
            allow_agent=options.allow_agent,
            look_for_keys=options.look_for_keys,
            sock=sock,
        )
    except Exception as exc:
        client.close()
        raise classify(exc, hop, options, of=of, via=via) from exc
    return client


def _open_tunnel(
    client: paramiko.SSHClient,
    nxt: SshTarget,
    options: SshOptions,
    *,
    via: SshTarget,
    of: SshTarget,
) -> paramiko.Channel:
    transport = client.get_transport()
    assert transport is not None
    try:
        return transport.open_channel(
            "direct-tcpip",
            (nxt.hostname, nxt.port),
            ("127.0.0.1", 0),
            timeout=options.connect_timeout_s,
        )
    except (paramiko.SSHException, OSError, EOFError) as exc:
        raise HostUnreachable(
            f"host {where(nxt, of)}: {via.label} could not open a connection to "
            f"{nxt.hostname}:{nxt.port} for us ({reason(exc)}); is sshd running there, and "
            "does the jump host allow TCP forwarding?",
            host=of.name,
        ) from exc


def classify(
    exc: Exception,
    hop: SshTarget,
    options: SshOptions,
    *,
    of: SshTarget,
    via: SshTarget | None = None,
) -> TransportError:
    """Turn whatever paramiko or the socket layer raised into one clear TransportError."""
    here = f"host {where(hop, of)}" + (f" (via {via.label})" if via else "")
    addr = f"{hop.hostname}:{hop.port}"
    t = options.connect_timeout_s
    name = of.name
    if isinstance(exc, TransportError):  # our own, e.g. the host key policy's refusal
        return exc
    if isinstance(exc, paramiko.BadHostKeyException):
        return changed_key_error(hop, exc.key, exc.expected_key, options.known_hosts_path(), of=of)
    if isinstance(exc, paramiko.PasswordRequiredException):
        return AuthError(
            f"{here}: the private key is encrypted; add it to ssh-agent (ssh-add) first",
            host=name,
        )
    if isinstance(exc, paramiko.AuthenticationException):
        keys = ", ".join(hop.identity_files) or "default keys (~/.ssh/id_*)"
        agent = " and ssh-agent keys" if options.allow_agent else ""
        return AuthError(
            f"{here}: authentication failed for user {hop.user!r}: the server refused "
            f"{keys}{agent} ({reason(exc)}). Check the user and that the public key is in "
            "the host's ~/.ssh/authorized_keys",
            host=name,
        )
    if isinstance(exc, socket.gaierror):
        return HostUnreachable(
            f"{here}: cannot resolve host name {hop.hostname!r} (DNS: {exc.strerror or exc})",
            host=name,
        )
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        codes = {getattr(e, "errno", None) for e in exc.errors.values()}
        if codes == {errno.ECONNREFUSED}:
            return HostUnreachable(
                f"{here}: connection refused at {addr}: no sshd listening there "
                "(host down or restarted, wrong port?)",
                host=name,
            )
        return HostUnreachable(f"{here}: cannot reach {addr}: {reason(exc)}", host=name)
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return ConnectTimeout(f"{here}: connection to {addr} timed out after {t:g} s", host=name)
    if isinstance(exc, paramiko.SSHException) and _handshake_stalled(str(exc)):
        if "reset" in str(exc).lower():
            return HostUnreachable(
                f"{here}: {addr} closed the connection before the SSH greeting", host=name
            )
        return ConnectTimeout(
            f"{here}: timed out after {t:g} s waiting for the SSH greeting from {addr} "
            "(TCP connected; not an SSH server, or it is overloaded)",
            host=name,
        )
    if isinstance(exc, (EOFError, ConnectionError)):
        return HostUnreachable(
            f"{here}: {addr} closed the connection during the SSH handshake ({reason(exc)})",
            host=name,
        )
    if isinstance(exc, OSError):
        return HostUnreachable(f"{here}: cannot connect to {addr}: {reason(exc)}", host=name)
    if isinstance(exc, paramiko.SSHException):
        return TransportError(f"{here}: SSH error: {reason(exc)}", host=name)
    return TransportError(f"{here}: {type(exc).__name__}: {reason(exc)}", host=name)


def _handshake_stalled(message: str) -> bool:
    """paramiko's words for "no banner/key exchange in time": the banner read timed out,
    or ``connect``'s own handshake timeout ran out first (then: no session)."""
    return "protocol banner" in message or message in (
        "No existing session",
        "Negotiation timed out.",
    )


def reason(exc: BaseException) -> str:
    """The cause in words, never empty: paramiko raises a bare ``EOFError()`` when the
    server closes the connection, and some ``SSHException``s carry no text."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    if str(exc):
        return str(exc)
    if isinstance(exc, EOFError):
        return "EOFError: the connection was closed (sshd stopped, or the host went down?)"
    return f"{type(exc).__name__} (no message)"


def _is_file(path: str) -> bool:
    return os.path.isfile(path)
