"""The runtime's replicas: after each save, every host's shards also on a partner host.

Why: a host that vanishes takes its shards with it, and without a second copy the
only other one is remote storage, which a VM reads at a few hundred MB/s. With a
copy on a partner (``peer.placement``), ``autohet recover`` takes the lost host's
shards from the partner and reads nothing from remote storage.

How (in the checkpointer's persist thread, after the step is COMPLETE, so
training goes on meanwhile):

* each host's directory owner runs a receiver (``peer.stream.PeerServer``) on the
  host's cluster address only (``AUTOHET_HOST_ADDR``, set by the launcher), started
  with the checkpointer; its port travels with the save's gathered entries, along
  with the host's failure domain and its room, so every rank computes the same
  placement and rank 0 records it in the manifest (``replicas``);
* each rank pushes its own files of the step to its host's partners, several
  streams at a time; rank 0 also pushes ``.metadata`` and ``manifest.json``, and
  ``COMPLETE`` last, so a partner of rank 0's host holds a usable step when that
  host is lost;
* the receiver writes each file into ITS step directory of the job (where recover
  and the loader look), hashed as it lands and renamed into place only when its
  sha256 is the one the sender's authenticated header names; a file it holds with
  that sha256 is skipped (``peer.held``), another in its way replaced; a file beyond
  its budget or its disk's room is refused, named, and not written;
* the ranks then agree on what moved; rank 0 prints one line, and a failure is a
  warning (the step is saved; only its second copy is missing), never a stop.

The receiver does not fsync a new file: a replica only matters when its origin is
gone, and a partner that crashed meanwhile leaves a file whose sha256 recover checks
anyway. One that replaces a file is flushed before the rename, so a crash cannot
leave a torn file where one whole, if stale, was.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from autohet_cli.peer import stream
from autohet_cli.peer.held import HeldFiles
from autohet_cli.peer.placement import (
    ADDR_ENV,
    DOMAIN_ENV,
    PeerHost,
    Placement,
    place_replicas,
    shard_bytes_by_host,
)
from autohet_cli.peer.tally import Tally
from autohet_cli.workerbase.stepfiles import COMPLETE, MANIFEST, METADATA, step_dir_name
from autohet_cli.yamlio import sha256_file

STREAMS = 4  # files in flight per rank
# Files received at once per host. Each lands through a 1 MiB pipe (Linux: splice, its
# hashed pages released from this process as it goes) or, elsewhere, through
# landing.BUFFERS x BUF_BYTES (48 MiB) of buffers, so a receiver's memory stays under
# 8 x 48 MiB whatever the size of the shards.
RECEIVE_STREAMS = 8
_NAME = re.compile(r"^(__\d+_\d+\.distcp|\.metadata|manifest\.json|COMPLETE)$")
_MAX_BYTES = 1 << 50
_UNREACHABLE = "unreachable: "
_EMPTY_SHA = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def reserve_bytes(total_bytes: int) -> int:
    """What replicas leave free on a checkpoint file system besides the host's own next
    save (counted apart, see ``_room_locked``): 5% of the disk, at least 256 MiB and
    at most 2 GiB. A percentage alone starved replication on big, busy disks (12.6 GB
    held back on a 252 GB disk with 10 GB free) for no gain: the own save is already
    reserved."""
    return min(2 << 30, max(256 << 20, total_bytes // 20))


class Replicator:
    """One rank's part in replication (see the module doc)."""

    def __init__(
        self,
        *,
        host: str,
        plan_dir: Path,
        key: bytes,
        replicas: int,
        budget_bytes: int | None,
        owner: bool,
        env: Mapping[str, str] = os.environ,
    ) -> None:
        self.host, self.plan_dir, self.key = host, plan_dir, key
        self.replicas, self.budget_bytes = replicas, budget_bytes
        self.addr = env.get(ADDR_ENV) or _own_address()
        self.domain = env.get(DOMAIN_ENV) or "unknown"
        self._lock = threading.Lock()
        self._received: dict[int, int] = {}  # step -> bytes received for it
        self.refused: list[str] = []  # pushes this receiver refused (for tests, logs)
        self.saves = 0  # steps replicated by this run
        self.server: stream.PeerServer | None = None
        self.problem: str | None = None
        self.owner = owner
        self.own_bytes = 0  # this host's shards in the latest save: its next one needs as much
        self._in_flight = 0  # bytes being received now (not on the disk's books yet)
        self._held = HeldFiles()
        if owner and replicas > 0:
            # The cluster address only; one on no interface here (a NAT'd public one, still
            # advertised): the local address on the way to the rendezvous host instead.
            route_to = [a for a in (env.get("MASTER_ADDR"),) if a]
            try:
                self.server = stream.PeerServer(
                    self.addr, key, self._receive, max_streams=RECEIVE_STREAMS, route_to=route_to
                )
            except stream.PeerError as exc:  # says which address, and what to change
                self.problem = str(exc)
            except OSError as exc:
                self.problem = f"cannot listen on {self.addr}: {exc.strerror or exc}"

    # ------------------------------------------------------------- facts

    def info(self) -> dict[str, Any] | None:
        """This rank's facts for the save's gather: its host's, from the directory's
        owner (port None: no receiver here, so it keeps no copies); None elsewhere."""
        if not self.owner:
            return None
        return {
            "host": self.host,
            "addr": self.addr,
            "port": None if self.server is None else self.server.port,
            "domain": self.domain,
            "room": self.room_bytes() if self.server is not None else 0,
        }

    def room_bytes(self) -> int:
        """What this host may still take for others: the disk's free space less the
        reserve, less the host's own next save (written before pruning frees an old
        step), less what is landing now; within the budget."""
        with self._lock:
            return self._room_locked()

    def placement(
        self, infos: Sequence[dict[str, Any] | None], files: Sequence[Mapping[str, Any]]
    ) -> tuple[Placement, dict[str, dict[str, Any]]]:
        """The same placement on every rank, from the save's gathered facts; and each
        receiving host's address and port."""
        hosts_seen = {i["host"]: i for i in infos if i is not None}
        receivers = {h: i for h, i in hosts_seen.items() if i["port"] is not None}
        sizes = shard_bytes_by_host(files)
        with self._lock:
            self.own_bytes = sizes.get(self.host, 0)
        hosts = [
            PeerHost(
                name=h,
                machine=str(i["addr"]),
                domain=str(i["domain"]),
                shard_bytes=sizes.get(h, 0),
                # its own next save comes first (reported before this save's size)
                room_bytes=max(0, int(i["room"]) - sizes.get(h, 0)),
            )
            for h, i in sorted(hosts_seen.items())
        ]
        return place_replicas(hosts, self.replicas), receivers

    # ------------------------------------------------------------- sending

    def send(
        self,
        step: int,
        step_dir: Path,
        files: Sequence[Mapping[str, Any]],
        placement: Placement,
        receivers: Mapping[str, Mapping[str, Any]],
        *,
        rank: int,
        deadline_s: float = 120.0,
    ) -> Tally:
        """Push this rank's files of ``step`` to its host's partners (rank 0: also
        ``.metadata`` and the manifest; COMPLETE follows, see :meth:`complete`)."""
        tally = Tally(host=self.host)
        partners = [p for p in placement.partners.get(self.host, ()) if p in receivers]
        mine = [f for f in files if f["rank"] == rank and f["path"] != METADATA]
        todo = [(str(f["path"]), int(f["bytes"]), str(f["sha256"])) for f in mine]
        if rank == 0:
            meta = next((f for f in files if f["path"] == METADATA), None)
            if meta is not None:
                todo.append((METADATA, int(meta["bytes"]), str(meta["sha256"])))
            man = step_dir / MANIFEST
            if man.is_file():
                todo.append((MANIFEST, man.stat().st_size, sha256_file(man)))
        if not partners or not todo:
            return tally
        t0 = time.monotonic()
        jobs = [(p, t) for p in partners for t in todo]
        # A partner that cannot be reached is given up on at its first failure, and
        # nothing starts after the deadline: a dead or slow partner must not hold the
        # next save (or a preemption's) for long, since that save waits for this one.
        dead: set[str] = set()
        stop_at = t0 + deadline_s

        def push(job: tuple[str, tuple[str, int, str]]) -> str | None:
            partner, item = job
            if partner in dead:
                return f"skipped: {partner} could not be reached"
            if time.monotonic() > stop_at:
                return f"skipped: replication ran past {deadline_s:.0f} s"
            outcome = self._push(step, step_dir, partner, item, receivers)
            if outcome is not None and outcome.startswith(_UNREACHABLE):
                dead.add(partner)
            return outcome

        with ThreadPoolExecutor(min(STREAMS, len(jobs))) as pool:
            done = list(pool.map(push, jobs))
        for (partner, (name, nbytes, _sha)), outcome in zip(jobs, done, strict=True):
            if outcome is None:
                tally.sent_bytes += nbytes
            elif outcome == "have":
                tally.skipped += 1
            else:
                tally.errors.append(f"{name} to {partner}: {outcome}")
        tally.reached = [p for p in partners if p not in _failed(jobs, done)]
        tally.seconds = time.monotonic() - t0
        return tally

    def complete(
        self,
        step: int,
        step_dir: Path,
        tallies: Sequence[Tally],
        receivers: Mapping[str, Mapping[str, Any]],
    ) -> list[str]:
        """Rank 0, once every rank's pushes are done: COMPLETE to each partner of its
        host that EVERY rank of the host reached, so a partner holds a whole step."""
        if not (step_dir / COMPLETE).is_file():
            return []
        mine = [t for t in tallies if t.host == self.host]
        whole = set.intersection(*(set(t.reached) for t in mine)) if mine else set()
        errors = []
        for partner in sorted(whole):
            outcome = self._push(step, step_dir, partner, (COMPLETE, 0, _EMPTY_SHA), receivers)
            if outcome not in (None, "have"):
                errors.append(f"{COMPLETE} to {partner}: {outcome}")
        return errors

    def _push(
        self,
        step: int,
        step_dir: Path,
        partner: str,
        item: tuple[str, int, str],
        receivers: Mapping[str, Mapping[str, Any]],
    ) -> str | None:
        """None: sent and verified; "have": the partner had it; else why not."""
        name, nbytes, sha = item
        to = receivers[partner]
        header = {"op": "push", "step": step, "name": name, "bytes": nbytes, "sha256": sha}
        try:
            sent = stream.push_file(
                str(to["addr"]), int(to["port"]), self.key, str(step_dir / name), header
            )
        except stream.PeerError as exc:
            return str(exc)
        except OSError as exc:  # refused, timed out, reset: the partner is not there
            return f"{_UNREACHABLE}{exc.strerror or exc or type(exc).__name__}"
        return None if sent else "have"

    # ------------------------------------------------------------- receiving

    def _receive(self, conn: socket.socket, header: dict[str, Any]) -> None:
        why = self._contract(header)
        if why is None:
            step, nbytes, sha = int(header["step"]), int(header["bytes"]), str(header["sha256"])
            dest = self.plan_dir / step_dir_name(step) / str(header["name"])
            # HAVE only for the very bytes (hashed outside the lock: a shard takes seconds)
            if self._held.holds(dest, nbytes, sha):
                why = "have"
        with self._lock:  # checked and reserved at once: concurrent pushes cannot overshoot
            if why is None:
                why = self._over_locked(step, nbytes)
            if why is None:
                self._received[step] = self._received.get(step, 0) + nbytes
                self._in_flight += nbytes
            else:
                self.refused.append(why)
        if why == "have":
            conn.sendall(stream.HAVE)
            return
        if why is not None:
            stream.refuse(conn, why)
            return
        ok = False
        try:
            conn.sendall(stream.OK)
            # No record in ckpt.sums: a new copy is not fsynced (see the module doc), so
            # recover hashes it rather than trust a record a crash could leave wrong.
            stream.receive_into(
                conn, str(dest), nbytes, sha, make_dirs=False, durable=os.path.lexists(dest)
            )
            ok = True
        except stream.HashMismatch as exc:
            stream.refuse(conn, str(exc))
            return
        finally:
            with self._lock:
                self._in_flight -= nbytes
                if not ok:  # what never landed does not count against the budget
                    self._received[step] -= nbytes
        conn.sendall(stream.OK)

    def _contract(self, h: Mapping[str, Any]) -> str | None:
        """Why this push is refused whatever this host holds (None: it may come)."""
        name, step, nbytes, sha = h.get("name"), h.get("step"), h.get("bytes"), h.get("sha256")
        if h.get("op") != "push" or not isinstance(name, str) or not _NAME.fullmatch(name):
            return f"not a checkpoint file name: {str(name)[:100]!r}"
        if not isinstance(step, int) or step < 0 or not isinstance(nbytes, int):
            return "bad step or size"
        if not 0 <= nbytes < _MAX_BYTES or not isinstance(sha, str) or len(sha) != 64:
            return "bad size or sha256"
        d = self.plan_dir / step_dir_name(step)
        if d.is_symlink() or not d.is_dir():
            return f"{self.host} has no step {step} (pruned, or its save failed)"
        return None

    def _over_locked(self, step: int, nbytes: int) -> str | None:
        """Why ``nbytes`` more for ``step`` do not fit (None: they do). Under the lock."""
        taken = self._received.get(step, 0)
        if self.budget_bytes is not None and taken + nbytes > self.budget_bytes:
            return (
                f"over {self.host}'s replica budget ({taken + nbytes} > "
                f"{self.budget_bytes} bytes for step {step})"
            )
        room = self._room_locked()
        if nbytes > room:
            return f"{self.host}'s disk has room for {room} bytes of replicas, not {nbytes}"
        return None

    def _room_locked(self) -> int:
        try:
            du = shutil.disk_usage(self.plan_dir)
        except OSError:
            return 0
        room = max(0, du.free - reserve_bytes(du.total) - self.own_bytes - self._in_flight)
        return room if self.budget_bytes is None else min(room, self.budget_bytes)

    def forget(self, before_step: int) -> None:
        with self._lock:
            for s in [s for s in self._received if s < before_step]:
                del self._received[s]

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


def _failed(jobs: Sequence[tuple[str, Any]], done: Sequence[str | None]) -> set[str]:
    return {p for (p, _t), outcome in zip(jobs, done, strict=True) if outcome not in (None, "have")}


def _own_address() -> str:
    """Without the launcher's address: what this machine's name resolves to."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
