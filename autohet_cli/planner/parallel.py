"""Planner work in a second process, on the user's other core (effects at the edge).

SCIP solves one model on one thread, and the planner's searches are pure Python
besides; so on a machine with two or more cores, independent work (the baselines'
searches beside the plan's own search) runs in a forked child while this process
goes on. Forked, not spawned: the child starts with the parent's inputs, cost
tables and deadline (``costmodel.budget``) without pickling them, in milliseconds;
only its result comes back, pickled through a pipe, with the child's planner phases
(``planner.phases``).

Without ``fork`` (not Linux), on one core, or with ``AUTOHET_PLANNER_PROCESSES=1``,
the work runs here when its result is asked for: the same result, later.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from autohet_cli.errors import AutohetError, TimeLimitReached
from autohet_cli.planner import phases

T = TypeVar("T")
PROCESSES_ENV = "AUTOHET_PLANNER_PROCESSES"
_IN_CHILD = False  # set in a forked planner process: it forks no more (cores are taken)
_STARTED: weakref.WeakSet[Pending[Any]] = weakref.WeakSet()  # forked by this process


def spare_core(*, crowd: int = 0) -> bool:
    """Whether work may fork now: this is not a planner child, the machine has
    two cores or more, and one is free of this process and the children it has
    still working (a child that has sent every result has exited), or would be
    with ``crowd`` more cores."""
    if _IN_CHILD or not _can_fork():
        return False
    working = sum(1 for p in list(_STARTED) if p.working)
    return cores() + crowd > 1 + working


def ahead(fn: Callable[[], T], *, crowd: int = 0) -> Pending[T] | None:
    """``fn`` started in a child now where a core is free (``spare_core``), for a
    result that may or may not be wanted; else None (nothing is run)."""
    return Pending(fn) if spare_core(crowd=crowd) else None


def _can_fork() -> bool:
    """Two cores or more, and ``fork`` (Linux): a child is worth starting."""
    return cores() >= 2 and "fork" in multiprocessing.get_all_start_methods()


def cores() -> int:
    """Processes the planner may use: the cores this process may run on, or
    ``AUTOHET_PLANNER_PROCESSES`` (an integer >= 1) when set."""
    raw = os.environ.get(PROCESSES_ENV, "").strip()
    if raw:
        try:
            return max(1, int(raw))
        except ValueError:
            return 1
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Pending(Generic[T]):
    """``fns`` run one after the other, started now in a forked child where that
    helps (each result sent back as soon as it is done), else each run here when
    its result is asked for."""

    def __init__(self, *fns: Callable[[], T]) -> None:
        self._fns = fns
        self._got: dict[int, tuple[str, Any]] = {}
        self._proc: Any = None
        self._dropped: set[int] = set()  # indices the child was told to skip (drop)
        self._conn: Any = None
        if not _can_fork():
            return
        ctx = multiprocessing.get_context("fork")
        here, there = ctx.Pipe(duplex=False)
        orders, self._orders = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, args=(fns, there, orders), daemon=True)
        self._proc.start()
        _STARTED.add(self)
        there.close()
        orders.close()
        self._conn = here

    def drop(self, index: int) -> None:
        """``fns[index]`` is not wanted: the child skips it if it has not started it
        (so that it does not take a core from work that is wanted); asked for after
        all, it runs here then, as without a child."""
        self._dropped.add(index)
        if self._proc is not None:
            try:
                self._orders.send(index)
            except OSError:  # the child is gone: nothing left to skip
                pass

    @property
    def working(self) -> bool:
        """Whether its child is still running (not every result sent yet)."""
        return self._proc is not None and self._proc.is_alive()

    @property
    def forked(self) -> bool:
        return self._proc is not None

    def result(self, index: int = 0, *, timeout_s: float | None = None) -> T:
        """``fns[index]()``, or the exception it raised (a domain error as itself);
        TimeLimitReached if the child has not sent it within ``timeout_s`` (None or
        infinite: no limit, as ``costmodel.budget.seconds_left`` says without a
        deadline; run here, without a child, the call is not cut short: its own
        deadline holds)."""
        if self._proc is None or (index in self._dropped and index not in self._got):
            return self._fns[index]()
        until = None
        if timeout_s is not None and timeout_s != float("inf"):
            until = time.monotonic() + max(0.0, timeout_s)
        while index not in self._got:
            if until is not None and not self._conn.poll(max(0.0, until - time.monotonic())):
                raise TimeLimitReached("the planner's second process did not answer in time")
            try:
                i, kind, payload, spent = pickle.loads(self._conn.recv_bytes())
            except EOFError:  # the child died without a word (killed, out of memory)
                self._proc.join()
                raise AutohetError(
                    f"a planner process ended with exit code {self._proc.exitcode} before "
                    f"answering; rerun with {PROCESSES_ENV}=1 to plan in one process"
                ) from None
            phases.add(spent)
            self._got[i] = (kind, payload)
        kind, payload = self._got[index]
        if kind == "error":
            raise payload
        if kind == "crash":
            raise RuntimeError(f"a planner process failed:\n{payload}")
        return payload  # type: ignore[no-any-return]

    def cancel(self) -> None:
        """Stop the child (its remaining results are not wanted)."""
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join()
            self._orders.close()
        if self._conn is not None:
            self._conn.close()


def _child(fns: tuple[Callable[[], Any], ...], conn: Any, orders: Any) -> None:
    global _IN_CHILD
    _IN_CHILD = True
    dropped: set[int] = set()
    for i, fn in enumerate(fns):
        while orders.poll():  # what the parent no longer wants (Pending.drop)
            try:
                dropped.add(orders.recv())
            except EOFError:
                break
        if i in dropped:
            continue
        before = phases.snapshot()
        try:
            out: tuple[str, Any] = ("ok", fn())
        except AutohetError as exc:  # the domain's errors travel as themselves
            out = ("error", exc)
        except BaseException:  # anything else: its traceback, for the parent to raise
            out = ("crash", traceback.format_exc())
        try:
            data = pickle.dumps((i, *out, phases.since(before)))
        except Exception:  # an unpicklable result or error
            data = pickle.dumps((i, "crash", traceback.format_exc(), phases.since(before)))
        conn.send_bytes(data)
    conn.close()
