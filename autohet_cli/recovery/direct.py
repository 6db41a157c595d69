"""Peer → peer copies that do not pass through the controller, open to nobody else.

The source host serves one file on a port of its cluster address (``SERVE``,
standard library only); the destination host connects and writes it to a temp
file that is renamed into place (``FETCH``). Both hold the job key
(``<job dir>/.autohet-key``, 0600; see ``autohet_cli.ckpt.format``), and the
stream is opened only to a peer that proves it: the server sends a random nonce,
the client answers HMAC-SHA256(key, "autohet-direct" | nonce | path) and gets
one byte of acceptance before the file; a wrong answer is refused (and reported)
and the server waits for the next connection until its deadline. Integrity is
the caller's sha256 check against the authenticated manifest, as for every other
source. Every socket has an
``IO_TIMEOUT_S`` inactivity timeout, so a peer that connects and stops reading
fails the copy in seconds and the caller falls back to the next source.

Why not TLS or the SSH connections: TLS needs certificates on every host, and
streaming through SSH would send every byte through the controller, which is
exactly what a peer-to-peer copy avoids; the relay through the controller stays
the fallback when the hosts cannot reach each other.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from autohet_cli.cluster import Host, python_for
from autohet_cli.errors import AutohetError
from autohet_cli.transport.base import Runner

TIMEOUT_S = 120  # the server waits this long for its authenticated client
IO_TIMEOUT_S = 10  # no byte moved for this long: the copy fails (and falls back)

SERVE = r"""
import hashlib, hmac, os, socket, sys, time
path, addr, timeout, io_timeout, keyfile = (
    sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
key = open(keyfile, "rb").read()
src = open(path, "rb")  # fail before offering a port if the file is not there
srv = socket.socket()
srv.bind((addr, 0))
srv.listen(8)
print("PORT", srv.getsockname()[1], flush=True)
deadline = time.monotonic() + timeout
want_prefix = b"autohet-direct\0"
while True:
    left = deadline - time.monotonic()
    if left <= 0:
        sys.exit("no authenticated client within %.0f s" % timeout)
    srv.settimeout(left)
    try:
        conn, peer = srv.accept()
    except socket.timeout:
        continue
    conn.settimeout(2.0)  # a peer that will not answer holds the server this long at most
    nonce = os.urandom(32)
    try:
        conn.sendall(nonce)
        proof = b""
        while len(proof) < 32:
            chunk = conn.recv(32 - len(proof))
            if not chunk:
                break
            proof += chunk
    except OSError:
        conn.close()
        continue
    want = hmac.new(key, want_prefix + nonce + path.encode(), hashlib.sha256).digest()
    if not hmac.compare_digest(proof, want):
        print("REFUSED", "%s:%s" % peer[:2], flush=True)
        conn.close()
        continue
    conn.settimeout(io_timeout)
    with conn, src:
        conn.sendall(b"\x01")  # accepted: the file follows
        while chunk := src.read(1 << 20):
            conn.sendall(chunk)
    break
"""

FETCH = r"""
import hashlib, hmac, os, socket, sys
addr, port, src_path, dest, io_timeout, keyfile = (
    sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5]), sys.argv[6])
key = open(keyfile, "rb").read()
os.umask(0o077)
os.makedirs(os.path.dirname(dest), exist_ok=True)
tmp = dest + ".autohet-part"
with socket.create_connection((addr, port), timeout=io_timeout) as s:
    nonce = b""
    while len(nonce) < 32:
        chunk = s.recv(32 - len(nonce))
        if not chunk:
            sys.exit("the source closed the connection before the handshake")
        nonce += chunk
    s.sendall(hmac.new(key, b"autohet-direct\0" + nonce + src_path.encode(),
                       hashlib.sha256).digest())
    if s.recv(1) != b"\x01":
        sys.exit("the source refused us: this host's job key differs from the source's")
    with open(tmp, "wb") as f:
        while chunk := s.recv(1 << 20):
            f.write(chunk)
os.replace(tmp, dest)
"""


def direct_copy(
    src: Runner,
    src_host: Host,
    path: str,
    dest: Runner,
    dest_host: Host,
    dest_path: str,
    *,
    src_key: str,
    dest_key: str,
    warn: Callable[[str], None] = lambda _m: None,
) -> None:
    """Copy ``path`` on ``src_host`` to ``dest_path`` on ``dest_host`` over one TCP stream.

    Both hosts must be remote: the controller's own files reach a remote host
    straight over SFTP, which is already direct (and a remote host could not
    reach the controller's ``localhost``)."""
    if src_host.is_local or dest_host.is_local:
        raise AutohetError("direct copy needs two remote hosts; SFTP is direct here")
    port: list[int] = []

    def on_line(_stream: str, line: str) -> None:
        if line.startswith("PORT "):
            port.append(int(line.split()[1]))
        elif line.startswith("REFUSED "):
            warn(
                f"warning: {src_host.name} refused a connection from {line.split()[1]} that "
                f"could not prove the job key while serving {path}"
            )

    args = [path, src_host.address, str(TIMEOUT_S), str(IO_TIMEOUT_S), src_key]
    server = src.start([python_for(src_host), "-c", SERVE, *args], on_line=on_line)
    try:
        deadline = time.monotonic() + 20
        while not port and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if not port:
            raise AutohetError(f"{src_host.name}: could not serve {path} (no port)")
        fetch = [src_host.address, str(port[0]), path, dest_path, str(IO_TIMEOUT_S), dest_key]
        # No limit on the whole copy (a big shard takes long): the sockets' inactivity
        # timeout ends a stalled one.
        res = dest.run([python_for(dest_host), "-c", FETCH, *fetch], timeout_s=None)
        if res.exit_code != 0:
            tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
            raise AutohetError(f"{dest_host.name}: fetching {path} failed: {tail}")
        code = server.wait(30)
        if code != 0:
            why = (server.stderr.strip().splitlines() or [f"exit code {code}, no output"])[-1]
            raise AutohetError(f"{src_host.name}: serving {path} failed: {why}")
    finally:
        if server.poll() is None:
            server.kill(1.0)
