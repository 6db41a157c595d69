"""Who may ask a peer for anything: the handshake, bounded before it is authenticated.

Issue 45: every accepted connection used to take one of a server's stream threads
for up to 5 s before it proved anything, so silent sockets from a client without
the job key starved the holders of it: with 40 of them an authenticated ``get`` of
1 MiB took 10 s, with 200 58 s, with 300 it failed, replication ended in a warning
(no second copy) and recover fell back to the controller's relay. Now:

* one thread (:class:`Gate`) accepts every connection and runs all handshakes at
  once without blocking: it sends each its nonce, reads the header and proof as
  they come, and hands a connection to the stream pool only once its proof holds;
  a stream thread never waits on a stranger;
* a handshake has HANDSHAKE_S all told, from its nonce, however its bytes dribble;
* at most PER_SOURCE unproven connections per source address (UNPROVEN in all); one
  more closes the oldest of its source (of the source holding the most, when the
  gate is full) at once. Handshakes cost the gate no thread, so a key holder's
  connection gets its nonce at once whatever else is open, and proves itself within
  a round trip, while what has sat silent longest is what goes;
* the socket listens on the host's cluster address and nothing else
  (:func:`listen_on`): never on 0.0.0.0, which would offer the gate to every
  network the host is on.

Why hand-written sockets: torch.distributed's store has no keyed request for a file
and is absent where recover runs (hosts with only a Python, this source sent as
``python -c``); paramiko is SSH, ~30 MB/s through its cipher; asyncio's loop would
own the sockets the streams then move with ``sendfile`` and ``splice`` in threads.
A selector over non-blocking sockets is the one thing needed, standard library only.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

if "receive_into" not in globals():  # one script on the hosts: see peer.stream
    from autohet_cli.peer.landing import PeerError as PeerError

DOMAIN = b"autohet-peer\0"
NONCE_BYTES = 32
MAX_HEADER = 64 << 10
REFUSED = b"\x00"
HANDSHAKE_S = 2.0  # nonce to proof, all told: one round trip for a key holder
# Handshakes at once from one source address, and all told. A partner opens a stream
# per rank and file at once (4 per rank: 32 from an 8-GPU host, 64 from a 16-GPU one),
# and each of those must get through without a wait.
PER_SOURCE = 64
UNPROVEN = 256
_ACCEPTS_PER_WAKE = 256

# The gate's answer for a proven connection: the connection (blocking again), the
# client's "address:port", and its header.
Admit = Callable[[socket.socket, str, dict[str, Any]], None]


def proof(key: bytes, nonce: bytes, header: bytes) -> bytes:
    return hmac.new(key, DOMAIN + nonce + header, hashlib.sha256).digest()


def refusal(reason: str) -> bytes:
    raw = reason.encode("utf-8", "replace")[:4096]
    return REFUSED + struct.pack("!H", len(raw)) + raw


def listen_on(addr: str, route_to: Sequence[str] = ()) -> socket.socket:
    """A socket listening on ``addr`` (the host's cluster address; port: any).

    An address of no interface here (a cloud VM's public address, NAT'd to its
    private one) is not met by listening on all of them: the socket goes on the
    local address that routes to ``route_to`` (its peers; where the NAT delivers),
    and without one PeerError says what to change."""
    try:
        return _listen(addr)
    except OSError as exc:
        first = exc
    loopback = _is_loopback(addr)
    for peer in route_to:
        local = _route_from(peer)
        # A non-loopback address answered by a loopback one would serve nobody remote.
        if local is None or local == addr or (_is_loopback(local) and not loopback):
            continue
        try:
            return _listen(local)
        except OSError:
            continue
    why = first.strerror or str(first) or type(first).__name__
    peers = ", ".join(route_to) or "none known"
    raise PeerError(
        f"cannot listen on {addr}: {why}. It is no address of this machine, and no "
        f"route to the peers ({peers}) names one; autohet does not listen on 0.0.0.0 "
        "instead. Give this host the address of one of its interfaces in the cluster file."
    )


def _listen(addr: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, 0))
        sock.listen(UNPROVEN)
    except BaseException:
        sock.close()
        raise
    return sock


def _route_from(peer: str) -> str | None:
    """This machine's address on the way to ``peer``: a UDP socket's ``connect``
    sends nothing, only makes the kernel choose the route and its source address."""
    try:
        with socket.socket(
            socket.AF_INET6 if ":" in peer else socket.AF_INET, socket.SOCK_DGRAM
        ) as s:
            s.connect((peer, 9))
            local = str(s.getsockname()[0])
    except OSError:
        return None
    return None if local in ("0.0.0.0", "::") else local


def _is_loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr in ("::1", "localhost")


@dataclass(frozen=True)
class _Shake:
    sock: socket.socket
    source: str
    peer: str
    nonce: bytes
    deadline: float  # monotonic: closed unless proven by then
    got: bytearray  # header length, header, proof, as they arrive

    def wants(self) -> int:
        """Bytes still missing; -1: the header length is over MAX_HEADER."""
        if len(self.got) < 4:
            return 4 - len(self.got)
        (n,) = struct.unpack("!I", self.got[:4])
        return -1 if n > MAX_HEADER else 4 + n + NONCE_BYTES - len(self.got)


class Gate:
    """Runs every handshake of ``listener`` in one thread (see the module doc) and
    hands each proven connection to ``admit``; a wrong proof is refused and reported
    to ``on_refused(peer)``. This thread alone touches the handshakes' state."""

    def __init__(
        self,
        listener: socket.socket,
        key: bytes,
        admit: Admit,
        on_refused: Callable[[str], None],
    ) -> None:
        self.key, self.admit, self.on_refused = key, admit, on_refused
        self._listener = listener
        listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._closed = threading.Event()
        self._shaking: dict[int, _Shake] = {}  # by file descriptor
        self._by_source: dict[str, deque[int]] = {}  # oldest first
        self._thread = threading.Thread(target=self._run, name="autohet-peer-gate", daemon=True)
        self._thread.start()

    def held(self) -> int:
        """Connections not yet proven, now (for tests and logs)."""
        return len(self._shaking)

    def close(self) -> None:
        self._closed.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(5)

    # ------------------------------------------------------------- the loop

    def _run(self) -> None:
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._closed.is_set():
                for k, _ev in self._sel.select(self._timeout()):
                    if k.fileobj is self._listener:
                        self._accept()
                    elif k.fileobj is self._wake_r:
                        self._drain_wake()
                    else:
                        self._read(k.fd)
                self._expire()
        finally:
            for fd in list(self._shaking):
                self._drop(fd)
            self._sel.close()
            for s in (self._listener, self._wake_r, self._wake_w):
                s.close()

    def _timeout(self) -> float:
        first = min((s.deadline for s in self._shaking.values()), default=None)
        return 1.0 if first is None else max(0.0, min(1.0, first - time.monotonic()))

    def _drain_wake(self) -> None:
        try:
            self._wake_r.recv(64)
        except OSError:
            pass

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_WAKE):  # more queued: the listener reads ready again
            try:
                conn, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    time.sleep(0.05)  # out of descriptors: let handshakes end first
                return  # ECONNABORTED and the like: the next wake tries again
            self._make_room(str(addr[0]))
            self._greet(conn, str(addr[0]), f"{addr[0]}:{addr[1]}")

    def _make_room(self, source: str) -> None:
        """Its source at PER_SOURCE, or the gate at UNPROVEN: the oldest handshake of
        the source (else of the source holding the most) is closed. A key holder
        proves itself within a round trip of its nonce, so the oldest is the one
        least likely to be one; closing the newest instead would let a flood that
        came first lock every later client out."""
        mine = self._by_source.get(source)
        if mine is not None and len(mine) >= PER_SOURCE:
            self._drop(mine[0])
        elif len(self._shaking) >= UNPROVEN:
            heavy = max(self._by_source.values(), key=len)
            self._drop(heavy[0])

    def _greet(self, conn: socket.socket, source: str, peer: str) -> None:
        nonce = os.urandom(NONCE_BYTES)
        try:
            conn.setblocking(False)
            sent = conn.send(nonce)  # an empty send buffer takes 32 bytes at once
        except OSError:
            sent = 0
        if sent != NONCE_BYTES:
            conn.close()
            return
        fd = conn.fileno()
        deadline = time.monotonic() + HANDSHAKE_S
        self._shaking[fd] = _Shake(conn, source, peer, nonce, deadline, bytearray())
        self._by_source.setdefault(source, deque()).append(fd)
        self._sel.register(conn, selectors.EVENT_READ)

    def _read(self, fd: int) -> None:
        shake = self._shaking.get(fd)
        if shake is None:
            return
        while (want := shake.wants()) > 0:
            try:
                chunk = shake.sock.recv(want)  # never past the proof: what follows is the stream's
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                chunk = b""
            if not chunk:
                self._drop(fd)
                return
            shake.got.extend(chunk)
        if want < 0:
            self._drop(fd)
            return
        self._release(fd)
        self._decide(shake)

    def _decide(self, shake: _Shake) -> None:
        raw = bytes(shake.got[4:-NONCE_BYTES])
        sock = shake.sock
        if not hmac.compare_digest(
            bytes(shake.got[-NONCE_BYTES:]), proof(self.key, shake.nonce, raw)
        ):
            try:
                self.on_refused(shake.peer)
            except Exception:  # a report that cannot be made (stdout gone) stops no gate
                pass
            try:
                sock.send(refusal("the job key differs (wrong job, or not one of its hosts)"))
            except OSError:
                pass
            sock.close()
            return
        try:
            header = json.loads(raw)
        except ValueError:
            header = None
        if not isinstance(header, dict):
            sock.close()
            return
        sock.setblocking(True)
        try:
            self.admit(sock, shake.peer, header)
        except Exception:  # a server closing meanwhile: this connection only
            sock.close()

    def _expire(self) -> None:
        now = time.monotonic()
        for fd in [fd for fd, s in self._shaking.items() if s.deadline <= now]:
            self._drop(fd)

    def _release(self, fd: int) -> _Shake:
        shake = self._shaking.pop(fd)
        mine = self._by_source[shake.source]
        mine.remove(fd)
        if not mine:
            del self._by_source[shake.source]
        self._sel.unregister(shake.sock)
        return shake

    def _drop(self, fd: int) -> None:
        self._release(fd).sock.close()
