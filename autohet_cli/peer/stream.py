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
Answers are one byte: OK, HAVE (push: already here), or REFUSED
followed by a two-byte length and the reason.

Why not TLS or SSH: TLS needs certificates on every host, and SSH moves ~30 MB/s
through its cipher in Python (paramiko); integrity comes from the authenticated
manifest's sha256 either way, and the key keeps strangers from reading or
planting shards. Standard library only: recover runs this very module on hosts
(``python -c`` with its source), where autohet may not be importable.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# One script on the hosts: recover sends landing's source, then this one's
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

DOMAIN = b"autohet-peer\0"
OK, HAVE, REFUSED = b"\x01", b"\x02", b"\x00"
MAX_HEADER = 64 << 10
SOCK_BUF = 8 << 20
HANDSHAKE_S = 5.0  # a client that will not prove itself holds a server this long, all told
QUEUE_WAIT_S = 900.0  # a client waits this long for a free stream on a busy server
MAX_WAITING = 256  # connections waiting for a stream beyond this are closed at once


def _tune(sock: socket.socket) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        except OSError:
            pass  # capped by the kernel: the default serves


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes; with ``deadline`` (monotonic), all of them by then (a client
    sending one byte every few seconds cannot hold a server)."""
    out = bytearray()
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError("too slow")
            sock.settimeout(left)
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise PeerError("the peer closed the connection")
        out += chunk
    return bytes(out)


def _proof(key: bytes, nonce: bytes, header: bytes) -> bytes:
    return hmac.new(key, DOMAIN + nonce + header, hashlib.sha256).digest()


def refuse(sock: socket.socket, reason: str) -> None:
    raw = reason.encode("utf-8", "replace")[:4096]
    sock.sendall(REFUSED + struct.pack("!H", len(raw)) + raw)


def read_answer(sock: socket.socket) -> bytes:
    """OK or HAVE; REFUSED raises with the peer's reason."""
    got = _recv_exact(sock, 1)
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
    """Connect, prove the key with ``header``; the caller reads the first answer."""
    sock = socket.create_connection((addr, port), timeout=io_timeout_s)
    try:
        _tune(sock)
        # The server sends its nonce when a stream is free: a push queued behind other
        # big files waits its turn, not an I/O timeout.
        sock.settimeout(QUEUE_WAIT_S)
        nonce = _recv_exact(sock, 32)
        sock.settimeout(io_timeout_s)
        raw = json.dumps(header, sort_keys=True).encode()
        sock.sendall(struct.pack("!I", len(raw)) + raw + _proof(key, nonce, raw))
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
        read_answer(sock)
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
        if read_answer(sock) == HAVE:
            return False
        nbytes = int(header["bytes"])
        with open(src, "rb") as f:
            sent = sock.sendfile(f, 0, nbytes) if nbytes else 0  # sendfile refuses 0
        if sent != nbytes:
            raise PeerError(f"{src} shrank while it was sent ({sent} bytes)")
        read_answer(sock)  # the receiver's verdict after hashing
        return True


# ----------------------------------------------------------------- serving side

Handler = Callable[[socket.socket, dict[str, Any]], None]


class PeerServer:
    """Accepts authenticated requests on ``addr`` (port 0: any) and hands each to
    ``handler`` in a thread of its own; a wrong proof is refused and reported to
    ``on_refused(peer)``, and the server keeps serving."""

    def __init__(
        self,
        addr: str,
        key: bytes,
        handler: Handler,
        *,
        on_refused: Callable[[str], None] = lambda _p: None,
        io_timeout_s: float = IO_TIMEOUT_S,
        max_streams: int = 16,
    ) -> None:
        self.key, self.handler, self.on_refused = key, handler, on_refused
        self.io_timeout_s = io_timeout_s
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((addr, 0))
        self.sock.listen(64)
        self.port = int(self.sock.getsockname()[1])
        self._pool = ThreadPoolExecutor(max_streams, thread_name_prefix="autohet-peer")
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._waiting = 0
        self._thread = threading.Thread(
            target=self._accept, name="autohet-peer-accept", daemon=True
        )
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self.sock.accept()
            except OSError:
                if self._closed.is_set():
                    return
                time.sleep(0.05)  # EMFILE, ECONNABORTED: keep serving
                continue
            with self._lock:
                crowded = self._waiting >= MAX_WAITING
                if not crowded:
                    self._waiting += 1
            if crowded:  # a flood of connections cannot pile up file descriptors
                conn.close()
                continue
            self._pool.submit(self._serve, conn, f"{peer[0]}:{peer[1]}")

    def _serve(self, conn: socket.socket, peer: str) -> None:
        with self._lock:
            self._waiting -= 1
        with conn:
            try:
                deadline = time.monotonic() + HANDSHAKE_S
                conn.settimeout(HANDSHAKE_S)
                _tune(conn)
                nonce = os.urandom(32)
                conn.sendall(nonce)
                (n,) = struct.unpack("!I", _recv_exact(conn, 4, deadline))
                if n > MAX_HEADER:
                    raise PeerError("header too long")
                raw = _recv_exact(conn, n, deadline)
                proof = _recv_exact(conn, 32, deadline)
                if not hmac.compare_digest(proof, _proof(self.key, nonce, raw)):
                    self.on_refused(peer)
                    refuse(conn, "the job key differs (wrong job, or not one of its hosts)")
                    return
                header = json.loads(raw)
                if not isinstance(header, dict):
                    raise PeerError("header is not an object")
                conn.settimeout(self.io_timeout_s)
                self.handler(conn, header)
            except (OSError, PeerError, ValueError):
                return  # the client sees the cut and falls back

    def close(self) -> None:
        self._closed.set()
        try:
            self.sock.close()
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
    with open(keyfile, "rb") as fh:
        key = fh.read()
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        sys.exit(f"not here: {', '.join(missing[:5])}")

    def refused(peer: str) -> None:
        print(f"REFUSED {peer}", flush=True)

    try:
        server = PeerServer(addr, key, serve_files(set(paths)), on_refused=refused)
    except OSError:  # a NAT'd address on no interface: listen on all (the key still gates)
        server = PeerServer("0.0.0.0", key, serve_files(set(paths)), on_refused=refused)
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
    this one's without its ``__future__`` line (legal only at a file's top)."""
    import inspect

    from autohet_cli.peer import landing

    own = inspect.getsource(sys.modules[__name__])
    return inspect.getsource(landing) + own.replace("from __future__ import annotations\n", "", 1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        _serve_main(*sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "fetch":
        _fetch_main(*sys.argv[2:])
    else:
        sys.exit("usage: serve ADDR KEYFILE TIMEOUT PATH... | fetch KEYFILE STREAMS ITEMS_JSON")
