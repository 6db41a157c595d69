"""Authenticated peer streams: a file moved host to host at line rate, verified as it lands.

Both ends hold the job key (``<job dir>/.autohet-key``, 0600; see
``autohet_cli.ckpt.format``). The serving end sends a random 32-byte nonce; the
client sends a length-prefixed JSON header and HMAC-SHA256(key, DOMAIN | nonce |
header), so only a holder of the key can ask for anything, and the header it asks
with (which file, how many bytes, which sha256) cannot be altered on the way. Two
requests exist:

``get``  ``{"op": "get", "path": P}``: the server sends the file with
         ``sendfile`` (no copy through user space), only a path it was started
         with (recover's copies from a surviving peer).
``push`` ``{"op": "push", "step": N, "name": F, "bytes": B, "sha256": H}``: the
         receiver decides (a step directory it has, a budget, a file it has),
         answers, and the client streams B bytes (the runtime's replicas).

Either way the receiving end hashes the bytes as they land, under a temporary
name, and renames into place only when the sha256 is the one asked for
(``peer.landing``): a copy that fails its hash is never seen under its name.
Answers are one byte: OK, HAVE (push: the very bytes are here already), or
REFUSED followed by a two-byte length and the reason.

The handshake runs in the server's gate (``peer.gate``), bounded before it is
authenticated: outside the stream pool, a short deadline, limits per source, the
cluster address only. A proven request then waits for a free stream (a push queued
behind other big files waits its turn, not an I/O timeout), so a client allows
QUEUE_WAIT_S for the first answer and IO_TIMEOUT_S of silence after it.

Why not TLS or SSH: TLS needs certificates on every host, and SSH moves ~30 MB/s
through its cipher in Python (paramiko); integrity comes from the authenticated
manifest's sha256 either way, and the key keeps strangers from reading or
planting shards. Standard library only: recover runs this very module on hosts
(``python -c`` with its source), where autohet may not be importable.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# One script on the hosts: recover sends landing's source, the gate's, then this one's
# (``script_source``), where the names below are defined already and must stay the
# shipped ones (an autohet installed there may be another version).
if "receive_into" not in globals():
    from autohet_cli.peer.landing import BUF_BYTES as BUF_BYTES
    from autohet_cli.peer.landing import IO_TIMEOUT_S as IO_TIMEOUT_S
    from autohet_cli.peer.landing import PART as PART
    from autohet_cli.peer.landing import PIPE_BYTES as PIPE_BYTES
    from autohet_cli.peer.landing import HashMismatch as HashMismatch
    from autohet_cli.peer.landing import PeerError as PeerError
    from autohet_cli.peer.landing import receive_into as receive_into
if "Gate" not in globals():
    from autohet_cli.peer.gate import HANDSHAKE_S as HANDSHAKE_S
    from autohet_cli.peer.gate import REFUSED as REFUSED
    from autohet_cli.peer.gate import Gate as Gate
    from autohet_cli.peer.gate import listen_on as listen_on
    from autohet_cli.peer.gate import proof as proof
    from autohet_cli.peer.gate import refusal as refusal

OK, HAVE = b"\x01", b"\x02"
SOCK_BUF = 8 << 20
QUEUE_WAIT_S = 900.0  # a client waits this long for a free stream on a busy server
MAX_WAITING = 256  # proven connections waiting for a stream beyond this are closed at once
# A push's verdict comes once the receiver has hashed the bytes and, replacing a file,
# flushed them: a client allows for a disk this slow before it gives up.
FLUSH_BYTES_PER_S = 100 << 20


def _tune(sock: socket.socket) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        except OSError:
            pass  # capped by the kernel: the default serves


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise PeerError("the peer closed the connection")
        out += chunk
    return bytes(out)


def refuse(sock: socket.socket, reason: str) -> None:
    sock.sendall(refusal(reason))


def read_answer(sock: socket.socket, then_timeout_s: float | None = None) -> bytes:
    """OK or HAVE; REFUSED raises with the peer's reason. ``then_timeout_s``: the
    socket's timeout once the answer's first byte is in (see :func:`open_request`)."""
    got = _recv_exact(sock, 1)
    if then_timeout_s is not None:
        sock.settimeout(then_timeout_s)
    if got == REFUSED:
        (n,) = struct.unpack("!H", _recv_exact(sock, 2))
        raise PeerError(_recv_exact(sock, n).decode("utf-8", "replace"))
    if got not in (OK, HAVE):
        raise PeerError(f"unexpected answer {got!r}")
    return got


# ----------------------------------------------------------------- client side


def open_request(
    addr: str, port: int, key: bytes, header: dict[str, Any], io_timeout_s: float = IO_TIMEOUT_S
) -> socket.socket:
    """Connect, prove the key with ``header``; the caller reads the first answer with
    ``read_answer(sock, io_timeout_s)``: the socket waits QUEUE_WAIT_S for it, since
    the server answers when a stream is free (a push queued behind other big files
    waits its turn, not an I/O timeout)."""
    sock = socket.create_connection((addr, port), timeout=io_timeout_s)
    try:
        _tune(sock)
        nonce = _recv_exact(sock, 32)  # the gate greets every connection at once
        raw = json.dumps(header, sort_keys=True).encode()
        sock.sendall(struct.pack("!I", len(raw)) + raw + proof(key, nonce, raw))
        sock.settimeout(QUEUE_WAIT_S)
    except BaseException:
        sock.close()
        raise
    return sock


def get_file(
    addr: str,
    port: int,
    key: bytes,
    path: str,
    dest: str,
    nbytes: int,
    sha256: str,
    io_timeout_s: float = IO_TIMEOUT_S,
) -> None:
    """Fetch ``path`` from a serving peer into ``dest`` (verified; see receive_into)."""
    with open_request(addr, port, key, {"op": "get", "path": path}, io_timeout_s) as sock:
        read_answer(sock, io_timeout_s)
        size = struct.unpack("!Q", _recv_exact(sock, 8))[0]
        if size != nbytes:
            raise PeerError(f"{path} is {size} bytes there, the manifest says {nbytes}")
        receive_into(sock, dest, nbytes, sha256)


def push_file(
    addr: str,
    port: int,
    key: bytes,
    src: str,
    header: dict[str, Any],
    io_timeout_s: float = IO_TIMEOUT_S,
) -> bool:
    """Send ``src`` to a receiver (``header``: op push, step, name, bytes, sha256).
    True: sent and verified there; False: the receiver had it already."""
    with open_request(addr, port, key, header, io_timeout_s) as sock:
        if read_answer(sock, io_timeout_s) == HAVE:
            return False
        nbytes = int(header["bytes"])
        with open(src, "rb") as f:
            sent = sock.sendfile(f, 0, nbytes) if nbytes else 0  # sendfile refuses 0
        if sent != nbytes:
            raise PeerError(f"{src} shrank while it was sent ({sent} bytes)")
        sock.settimeout(io_timeout_s + nbytes / FLUSH_BYTES_PER_S)
        read_answer(sock)  # the receiver's verdict after hashing (and flushing)
        return True


# ----------------------------------------------------------------- serving side

Handler = Callable[[socket.socket, dict[str, Any]], None]


class PeerServer:
    """Accepts authenticated requests on ``addr`` (port 0: any) and hands each to
    ``handler`` in a stream thread of its own. The handshake runs in the gate
    (``peer.gate``), so only proven connections take a stream; a wrong proof is
    refused and reported to ``on_refused(peer)``, and the server keeps serving.
    ``addr`` is the host's cluster address; one of no interface here is met by the
    local address routing to ``route_to`` or a PeerError, never by 0.0.0.0."""

    def __init__(
        self,
        addr: str,
        key: bytes,
        handler: Handler,
        *,
        on_refused: Callable[[str], None] = lambda _p: None,
        io_timeout_s: float = IO_TIMEOUT_S,
        max_streams: int = 16,
        route_to: Sequence[str] = (),
    ) -> None:
        self.handler, self.io_timeout_s = handler, io_timeout_s
        self.sock = listen_on(addr, route_to)
        self.addr = str(self.sock.getsockname()[0])
        self.port = int(self.sock.getsockname()[1])
        self._pool = ThreadPoolExecutor(max_streams, thread_name_prefix="autohet-peer")
        self._lock = threading.Lock()
        self._waiting = 0
        self.gate = Gate(self.sock, key, self._admit, on_refused)

    def _admit(self, conn: socket.socket, peer: str, header: dict[str, Any]) -> None:
        """In the gate's thread: a proven connection waits for a stream."""
        with self._lock:
            crowded = self._waiting >= MAX_WAITING
            if not crowded:
                self._waiting += 1
        if crowded:  # a flood of requests cannot pile up file descriptors
            conn.close()
            return
        try:
            self._pool.submit(self._serve, conn, header)
        except RuntimeError:  # closing: the pool takes no more (the client falls back)
            with self._lock:
                self._waiting -= 1
            conn.close()

    def _serve(self, conn: socket.socket, header: dict[str, Any]) -> None:
        with self._lock:
            self._waiting -= 1
        with conn:
            try:
                conn.settimeout(self.io_timeout_s)
                _tune(conn)
                self.handler(conn, header)
            except (OSError, PeerError, ValueError):
                return  # the client sees the cut and falls back

    def close(self) -> None:
        try:
            self.gate.close()  # stops accepting; closes the listening socket
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)


def serve_files(paths: set[str]) -> Handler:
    """A ``get`` handler for exactly ``paths`` (anything else is refused)."""

    def handler(conn: socket.socket, header: dict[str, Any]) -> None:
        path = header.get("path")
        if header.get("op") != "get" or path not in paths:
            refuse(conn, f"not served here: {str(path)[:200]}")
            return
        try:
            f = open(str(path), "rb")
        except OSError as exc:
            refuse(conn, f"cannot read {path}: {exc.strerror or exc}")
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            conn.sendall(OK + struct.pack("!Q", size))
            conn.sendfile(f, 0, size)

    return handler


# ----------------------------------------------------------------- as a script

# recover runs this module's source on a host: ``serve`` offers files until killed
# or ``timeout`` passes; ``fetch`` copies a list of files, several at a time, and
# prints one JSON line per file (seconds, verdict) for the report.


def _serve_main(addr: str, keyfile: str, timeout_s: str, *paths: str) -> None:
    """``addr``: the host's cluster address, then, comma-separated, the addresses of
    the peers that will fetch (to find the local address routing to them where the
    cluster address is on no interface here, as behind a NAT)."""
    own, *route_to = addr.split(",")
    with open(keyfile, "rb") as fh:
        key = fh.read()
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        sys.exit(f"not here: {', '.join(missing[:5])}")

    def refused(peer: str) -> None:
        print(f"REFUSED {peer}", flush=True)

    try:
        server = PeerServer(
            own, key, serve_files(set(paths)), on_refused=refused, route_to=route_to
        )
    except (OSError, PeerError) as exc:
        sys.exit(str(exc))
    print(f"PORT {server.port}", flush=True)
    time.sleep(float(timeout_s))
    server.close()


def _fetch_main(keyfile: str, streams: str, items_json: str) -> None:
    with open(keyfile, "rb") as fh:
        key = fh.read()
    os.umask(0o077)
    items = json.loads(items_json)

    def one(i: int) -> None:
        it = items[i]
        t0 = time.monotonic()
        verdict: dict[str, Any] = {"i": i, "ok": False}
        try:
            get_file(it["addr"], it["port"], key, it["path"], it["dest"], it["bytes"], it["sha256"])
            verdict["ok"] = True
        except HashMismatch as exc:
            verdict.update(why="sha256", got=exc.got)
        except (OSError, PeerError) as exc:
            verdict.update(why=str(exc) or type(exc).__name__)
        verdict["s"] = round(time.monotonic() - t0, 6)
        print(json.dumps(verdict), flush=True)

    with ThreadPoolExecutor(max(1, int(streams))) as pool:
        list(pool.map(one, range(len(items))))


def script_source() -> str:
    """This module as one standalone script (``python -c``): landing's source, then
    the gate's and this one's without their ``__future__`` lines (legal only at a
    file's top)."""
    import inspect

    from autohet_cli.peer import gate, landing

    future = "from __future__ import annotations\n"
    rest = [inspect.getsource(m) for m in (gate, sys.modules[__name__])]
    return inspect.getsource(landing) + "".join(r.replace(future, "", 1) for r in rest)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        _serve_main(*sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "fetch":
        _fetch_main(*sys.argv[2:])
    else:
        sys.exit(
            "usage: serve ADDR[,PEER...] KEYFILE TIMEOUT PATH... | fetch KEYFILE STREAMS ITEMS_JSON"
        )
