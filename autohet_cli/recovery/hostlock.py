"""One `autohet recover` of a job at a time, wherever it runs from (effects: a lock on the hosts).

Two recovers of one job from two controller directories both copied shards into
the same step directories and relaunched on the same hosts; one renamed a shard
into place while the other was verifying it, and a COMPLETE step ended with a
file its manifest does not sign. The controller's flock (``lock.py``) cannot see
a recover started from another directory or machine, so this lock lives where
two recovers meet: in the job's directory on the hosts,
``<checkpoint dir>/<plan>/<job>/.autohet-recover.lock``.

Taking it
    On every host the recover reads or writes, before it copies a byte: the
    survivors once the job is known, then any new host of the new plan. Hosts are
    taken in the plan's order, the first one alone: two recovers started together
    meet there first (it is the coordinator) and exactly one goes on. The record
    appears whole or not at all: it is written to a temp name and hard-linked to
    the lock's name (``ln`` fails when the name exists, on local disks and NFS
    alike). A lock someone else holds stops the recover, naming the holder, and
    the locks already taken are given back.
Giving it back
    When the recover ends, also on an error or Ctrl-C; only a lock whose record
    is still ours is removed.
Stale locks
    A recover killed outright (SIGKILL, power loss) leaves its lock. When the
    holder ran on this machine (same boot, same pid namespace) whether it still
    lives is known, by its pid and that pid's start time: a dead holder's lock is
    broken with a note, a live one's never. A holder on another machine cannot be
    checked from here: the lock is reported with who holds it and since when, and
    only ``--break-lock`` breaks it, and only once it is older than
    ``BREAK_AFTER_S`` (a recover that started a moment ago is still taking its
    locks, and its controller may well be up).
"""

from __future__ import annotations

import getpass
import json
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Literal, Self

from autohet_cli.cluster import Host
from autohet_cli.errors import AutohetError
from autohet_cli.recovery.errors import RecoverLockHeld, RecoveryError
from autohet_cli.transport.fanout import fan_out
from autohet_cli.transport.pool import HostPool

Say = Callable[[str], None]
State = Literal["alive", "dead", "unknown"]

LOCK_FILE = ".autohet-recover.lock"
SCHEMA = "autohet.recover-lock/v1"
# A recover takes its locks within seconds of starting; five minutes leaves room for
# slow hosts and still lets a user whose controller died go on the same hour.
BREAK_AFTER_S = 300.0
_TRIES = 3

# $1 job dir, $2 temp suffix, $3 our record. Exit 0: taken; 3: held (prints the host's
# clock, the lock's mtime, then its record); 4: cannot write there (stderr says why).
_TAKE = (
    'umask 077; mkdir -p -- "$1" || exit 4; l="$1/' + LOCK_FILE + '"; t="$l.$2.tmp"; '
    'printf "%s\\n" "$3" > "$t" || exit 4; '
    'if ln -- "$t" "$l" 2>/dev/null; then rm -f -- "$t"; exit 0; fi; rm -f -- "$t"; '
    'echo "$(date +%s) $(stat -c %Y -- "$l" 2>/dev/null || echo -)"; cat -- "$l" 2>/dev/null; '
    "exit 3"
)
# $1 job dir, $2 temp suffix, $3 the record judged stale: moved aside, removed if it is
# still that record, else put back (someone took the lock meanwhile).
_BREAK = (
    'l="$1/' + LOCK_FILE + '"; s="$l.$2.stale"; mv -f -- "$l" "$s" 2>/dev/null || exit 0; '
    'if [ "$(cat -- "$s")" = "$3" ]; then rm -f -- "$s"; exit 0; fi; '
    'ln -- "$s" "$l" 2>/dev/null; rm -f -- "$s"; exit 5'
)
# $1 job dir, $2 our record: removed only while it is ours.
_RELEASE = (
    'l="$1/' + LOCK_FILE + '"; [ "$(cat -- "$l" 2>/dev/null)" = "$2" ] && rm -f -- "$l"; true'
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Holder:
    """Who holds a lock: enough for a person to find the process, and for this machine
    to tell whether it still lives."""

    token: str
    job: str  # the job's namespace, <plan>/<job>
    machine: str  # the controller's host name
    machine_id: str  # boot id and pid namespace: where ``pid`` means this process
    pid: int
    pid_start: str  # the pid's start time (/proc): a reused pid is another process
    user: str
    cwd: str
    since_unix: float

    def to_text(self) -> str:
        return json.dumps({"schema": SCHEMA, **asdict(self)}, sort_keys=True)

    @classmethod
    def from_text(cls, text: str) -> Holder | None:
        """The record, or None when it is not one of ours (garbage, another version)."""
        try:
            d = json.loads(text)
            if not isinstance(d, dict) or d.pop("schema", None) != SCHEMA:
                return None
            holder = cls(**d)
        except (ValueError, TypeError):
            return None
        ok = isinstance(holder.pid, int) and isinstance(holder.since_unix, int | float)
        return holder if ok else None

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since_unix))
        return (
            f"autohet recover pid {self.pid} on {self.machine} (user {self.user}, "
            f"run in {self.cwd}, since {since})"
        )


def this_process(job: str, *, now_unix: float | None = None) -> Holder:
    pid = os.getpid()
    return Holder(
        token=secrets.token_hex(8),
        job=job,
        machine=socket.gethostname(),
        machine_id=machine_id(),
        pid=pid,
        pid_start=start_time(pid) or "",
        user=_user(),
        cwd=_cwd(),
        since_unix=time.time() if now_unix is None else now_unix,
    )


def machine_id() -> str:
    """This kernel's boot and our pid namespace ("" where /proc cannot say): two
    processes with the same id see the same pids."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        return f"{boot} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot), or None when no such process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def holder_state(holder: Holder | None, here: str) -> State:
    """Alive or dead when the holder ran on this machine; else unknown."""
    if holder is None or not here or holder.machine_id != here:
        return "unknown"
    started = start_time(holder.pid)
    return "alive" if started is not None and started == holder.pid_start else "dead"


def refusal(state: State, age_s: float | None, *, break_lock: bool) -> str | None:
    """Why a lock found held may not be broken (None: break it)."""
    if state == "dead":
        return None
    if state == "alive":
        return "it is still running here: wait for it to finish, or stop it first"
    if not break_lock:
        return (
            "it cannot be checked from this machine; if it is no longer running (its "
            "controller is down, or it was killed), run again with --break-lock (which "
            f"breaks a lock older than {BREAK_AFTER_S / 60:.0f} min)"
        )
    if age_s is None or age_s < BREAK_AFTER_S:
        taken = "when is unknown" if age_s is None else f"taken {age_s:.0f} s ago"
        return (
            f"{taken}: --break-lock breaks only a lock older than {BREAK_AFTER_S / 60:.0f} "
            "min (a recover that just started is still taking its locks); wait, then retry"
        )
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class _Found:
    raw: str  # the record as read ("" when it vanished before we read it)
    age_s: float | None  # by the host's own clock


def _parse_found(stdout: str) -> _Found:
    head, _, raw = stdout.partition("\n")
    parts = head.split()
    age = None
    if len(parts) == 2 and all(p.isdigit() for p in parts):
        age = float(int(parts[0]) - int(parts[1]))
    return _Found(raw=raw.rstrip("\n"), age_s=age)


class HostLock:
    """The recover lock of job ``ns`` on the hosts it is taken on; a context manager
    that gives every one back on exit."""

    def __init__(self, pool: HostPool, ns: str, *, break_lock: bool = False, say: Say) -> None:
        self._pool = pool
        self._ns = ns
        self._break_lock = break_lock
        self._say = say
        self._me = this_process(ns)
        self._text = self._me.to_text()
        self._held: list[str] = []

    @property
    def held(self) -> tuple[str, ...]:
        return tuple(self._held)

    def take(self, hosts: Sequence[str]) -> None:
        """Take the lock on ``hosts`` (those not held yet): the first alone, then the
        rest in parallel. Any refusal gives back every lock this object holds."""
        todo = [h for h in dict.fromkeys(hosts) if h not in self._held]
        if not todo:
            return
        errors: dict[str, Exception] = {}
        try:
            self._take_one(todo[0])
            self._held.append(todo[0])
        except AutohetError as exc:
            errors[todo[0]] = exc
        if not errors and len(todo) > 1:
            rest = fan_out([self._pool.host(h) for h in todo[1:]], self._take_one_host)
            for host, result in rest.items():
                if isinstance(result, Exception):
                    errors[host] = result
                else:
                    self._held.append(host)
        if errors:
            self.release()
            held = [e for e in errors.values() if isinstance(e, RecoverLockHeld)]
            raise held[0] if held else next(iter(errors.values()))

    def release(self) -> None:
        """Give back every lock taken (best effort: a host gone now keeps it, and
        the next recover on this machine sees its holder dead)."""
        mine, self._held = self._held, []
        fan_out([self._pool.host(h) for h in mine], self._release_host)

    def _dir(self, host: str) -> str:
        return f"{self._pool.checkpoint_dir(host).rstrip('/')}/{self._ns}"

    def _take_one_host(self, host: Host) -> None:
        self._take_one(host.name)

    def _take_one(self, host: str) -> None:
        runner = self._pool.runner(host)
        path = f"{self._dir(host)}/{LOCK_FILE}"
        for _ in range(_TRIES):
            suffix = secrets.token_hex(4)
            res = runner.run(
                ["sh", "-c", _TAKE, "sh", self._dir(host), suffix, self._text], timeout_s=60
            )
            if res.exit_code == 0:
                return
            if res.exit_code != 3:
                cause = res.stderr.strip() or f"exit code {res.exit_code}"
                raise RecoveryError(f"{host}: cannot take the recover lock {path}: {cause}")
            found = _parse_found(res.stdout)
            if not found.raw:
                continue  # given back between our try and our read: try again
            holder = Holder.from_text(found.raw)
            state = holder_state(holder, self._me.machine_id)
            who = holder.describe() if holder else f"an unreadable record {found.raw[:120]!r}"
            why = refusal(state, found.age_s, break_lock=self._break_lock)
            if why is not None:
                raise RecoverLockHeld(
                    f"another autohet recover of job {self._ns} holds its lock on {host} "
                    f"({path}): {who}; {why}",
                    host=host,
                    holder=who,
                )
            reason = "no longer running" if state == "dead" else "--break-lock"
            self._say(f"note: {host}: breaking the recover lock of {who} ({reason})")
            runner.run(["sh", "-c", _BREAK, "sh", self._dir(host), suffix, found.raw], timeout_s=60)
        raise RecoveryError(
            f"{host}: the recover lock {path} kept changing hands ({_TRIES} tries); "
            "another recover is starting: run again once it is done"
        )

    def _release_host(self, host: Host) -> None:
        self._pool.runner(host.name).run(
            ["sh", "-c", _RELEASE, "sh", self._dir(host.name), self._text], timeout_s=60
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError:  # removed under us: the record still names the process
        return "?"


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())
