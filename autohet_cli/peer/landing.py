"""Where a peer stream's bytes land: under a temporary name, hashed as they arrive,
renamed into place only when their sha256 is the one asked for.

On Linux (``os.splice``, Python 3.10+) the bytes go socket -> pipe -> file inside
the kernel, no copy through this process on the way in, while a second thread
hashes them as they land, read back from the page cache through one small buffer;
elsewhere, or where the socket refuses splice, three threads pass large buffers
along (receive, hash, write). Standard
library only, and no import of autohet: recover runs this source, then
``peer.stream``'s, as one script on hosts where autohet may not be installed.
"""

from __future__ import annotations

import errno
import hashlib
import os
import queue
import secrets
import socket
import threading
from collections.abc import Callable

BUF_BYTES = 8 << 20  # per receive buffer; also the hasher's read-back buffer
BUFFERS = 6  # in flight per stream (buffered way): receiving, hashing, writing, and slack
PIPE_BYTES = 1 << 20  # the spliced way's pipe
IO_TIMEOUT_S = 10.0  # no byte moved for this long: the copy fails (and falls back)
PART = ".autohet-part"
_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, named there from Python 3.10 on
_splice = getattr(os, "splice", None)


class PeerError(Exception):
    """A copy that did not happen: refused, cut, or bytes that fail their sha256."""


class HashMismatch(PeerError):
    def __init__(self, got: str) -> None:
        super().__init__(f"sha256 mismatch: got {got[:16]}...")
        self.got = got


def receive_into(
    sock: socket.socket,
    dest: str,
    nbytes: int,
    sha256: str,
    *,
    make_dirs: bool = True,
    durable: bool = False,
) -> None:
    """``nbytes`` from ``sock`` into ``dest``: under a temporary name in its
    directory, hashed as they land, renamed into place only when the sha256 is
    ``sha256`` (HashMismatch else). ``durable``: flushed to the disk before the rename
    (a file that replaces another, so a crash cannot leave a torn one in its place)."""
    if make_dirs:  # a replica receiver never recreates a step directory being removed
        os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    tmp = f"{dest}.{secrets.token_hex(4)}{PART}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    ok = False
    try:
        got = None
        if _splice is not None and nbytes > 0:
            got = _land_spliced(sock, fd, nbytes, _splice)
        if got is None:  # no splice here (not Linux, Python < 3.10, a socket that refuses it)
            got = _land_buffered(sock, fd, nbytes)
        if got != sha256:
            raise HashMismatch(got)
        if durable:
            os.fsync(fd)
        os.replace(tmp, dest)
        ok = True
    finally:
        os.close(fd)
        if not ok:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _land_spliced(
    sock: socket.socket, fd: int, nbytes: int, splice: Callable[..., int]
) -> str | None:
    """The bytes go socket -> pipe -> file inside the kernel (``splice``), and a second
    thread hashes them as they land, read back from the page cache. Against receiving
    into buffers and writing them out this skips a pass over every byte through this
    process, which on two cores shared by both ends of a loopback copy took a 1.6 GB
    shard from 0.4-0.56 to 0.8-1.0 GB/s. None (nothing read yet): the socket or the
    file refuses this, use the buffered way."""
    import fcntl
    import select

    try:
        os.ftruncate(fd, nbytes)
    except OSError:
        return None
    timeout_ms = int(1000 * (sock.gettimeout() or IO_TIMEOUT_S))
    landed = [0]
    cond = threading.Condition()
    stop: list[BaseException] = []
    broke: list[BaseException] = []  # the hasher's own failure, if any
    digest = hashlib.sha256()

    def hasher() -> None:
        # Read back from the page cache into one reused buffer: a map of the file held
        # every hashed page in this process (its RSS grew by the shard) unless each range
        # was released again, and that cost as much as this copy (0.89-0.94 GB/s either
        # way here, medians of 5), with more ways to fail.
        buf = bytearray(min(BUF_BYTES, nbytes))
        view, done = memoryview(buf), 0
        try:
            while done < nbytes and not stop:
                with cond:
                    while landed[0] <= done and not stop:
                        cond.wait()
                    upto = landed[0]
                while done < upto and not stop:  # preadv and hashlib release the GIL
                    got = os.preadv(fd, [view[: min(len(buf), upto - done)]], done)
                    if got <= 0:
                        raise OSError(f"read {got} bytes at {done} of the file landing")
                    digest.update(view[:got])
                    done += got
        except BaseException as exc:
            broke.append(exc)
        finally:
            view.release()

    thread = threading.Thread(target=hasher, name="autohet-peer-hash", daemon=True)
    rd = wr = -1
    copying = False  # the file system refused splice: bytes from the pipe written by hand
    pos = 0
    try:
        rd, wr = os.pipe()
        try:
            fcntl.fcntl(wr, _F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass  # the default 64 KiB pipe: more calls, the same bytes
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        thread.start()
        while pos < nbytes:
            try:
                got = splice(sock.fileno(), wr, min(PIPE_BYTES, nbytes - pos))
            except BlockingIOError:  # the socket has a timeout, hence is non-blocking
                if not poller.poll(timeout_ms):
                    raise PeerError(f"no byte for {timeout_ms / 1000:g} s") from None
                continue
            except OSError as exc:
                if pos == 0 and exc.errno in _NO_SPLICE:  # nothing read yet: buffered
                    os.ftruncate(fd, 0)
                    return None
                raise
            if not got:
                raise PeerError(f"the peer closed the stream {nbytes - pos} bytes short")
            put = 0
            while put < got:
                if not copying:
                    try:
                        put += splice(rd, fd, got - put, offset_dst=pos + put)
                        continue
                    except OSError as exc:
                        if exc.errno not in _NO_SPLICE:
                            raise  # a full disk, an I/O error
                        copying = True
                chunk = os.read(rd, got - put)
                view = memoryview(chunk)
                while view:
                    view = view[os.pwrite(fd, view, pos + put + len(chunk) - len(view)) :]
                put += len(chunk)
            pos += got
            with cond:
                landed[0] = pos
                cond.notify()
        thread.join()
        if broke:
            raise PeerError(f"hashing failed: {broke[0]}")
        return digest.hexdigest()
    finally:
        if thread.is_alive():
            with cond:
                stop.append(PeerError("stopped"))
                cond.notify()
            thread.join(5)
        for end in (rd, wr):
            if end >= 0:
                os.close(end)


_NO_SPLICE = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM)


def _land_buffered(sock: socket.socket, fd: int, nbytes: int) -> str:
    """Where splice is not there: three threads pass a few large buffers along: this
    one receives, one hashes, one writes (socket reads, hashlib and file writes all
    release the GIL), so the three overlap on the cores there are."""
    free: queue.Queue[bytearray] = queue.Queue()
    size = min(BUF_BYTES, max(nbytes, 1))
    for _ in range(max(1, min(BUFFERS, -(-nbytes // size)))):  # no more than the file fills
        free.put(bytearray(size))
    Item = tuple[bytearray, int] | None
    to_hash: queue.Queue[Item] = queue.Queue()
    to_write: queue.Queue[Item] = queue.Queue()
    digest = hashlib.sha256()
    failed: list[BaseException] = []

    def hasher() -> None:
        while (item := to_hash.get()) is not None:
            if not failed:
                digest.update(memoryview(item[0])[: item[1]])
            to_write.put(item)
        to_write.put(None)

    def writer() -> None:
        while (item := to_write.get()) is not None:
            buf, n = item
            try:
                view = memoryview(buf)[:n]
                while view and not failed:
                    view = view[os.write(fd, view) :]
            except BaseException as exc:  # a full disk: the receiver stops at once
                failed.append(exc)
            free.put(buf)

    threads = [
        threading.Thread(target=hasher, name="autohet-peer-hash", daemon=True),
        threading.Thread(target=writer, name="autohet-peer-write", daemon=True),
    ]
    for t in threads:
        t.start()
    try:
        left = nbytes
        while left and not failed:
            buf = free.get()
            view, fill = memoryview(buf), 0
            want = min(len(buf), left)
            while fill < want:
                n = sock.recv_into(view[fill:want])
                if not n:
                    raise PeerError(f"the peer closed the stream {left - fill} bytes short")
                fill += n
            to_hash.put((buf, fill))
            left -= fill
        to_hash.put(None)
        for t in threads:
            t.join()
        if failed:
            raise failed[0]
        return digest.hexdigest()
    finally:
        if any(t.is_alive() for t in threads):
            failed.append(PeerError("stopped"))
            to_hash.put(None)
            for t in threads:
                t.join(5)
