"""The save in flight: at most one, its second half running in a thread of its own
while training goes on, and its outcome learned by every rank together.

Together, because the second half of a save (``ckpt.finish``) runs collectives with
every rank: a rank that alone saw its save fail and stopped would leave the others
training on into a collective nobody joins. So while a save is unconfirmed the
checkpointer asks at every step end whether it is still running anywhere and whether
it failed anywhere (one small all-reduce, ``Checkpointer.poll``), and every rank acts
on the answer at once. This module keeps the books for that; what a failure means
(reported and outlived, or raised as a bug) is ``ckpt.failures``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from autohet_cli.ckpt.finish import SaveJob

__all__ = ["SaveInFlight"]


class SaveInFlight:
    """The latest save every rank started: its thread (None: none running, or it was
    written inline), this rank's failure of it (kept here for the training thread,
    never raised in the save's own), and whether every rank has confirmed it yet."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self.pending = False  # a save every rank started and not all have confirmed
        self.step = 0  # the pending save's step

    def start(self, job: SaveJob, persist: Callable[[SaveJob], None], *, inline: bool) -> None:
        """Run ``persist(job)`` here (``inline``) or in a thread of its own; either way
        the save stays pending until ``settle`` finds it done on every rank.
        ``persist`` keeps its failure in ``failure`` rather than raising it."""
        self.pending, self.step = True, job.step  # every rank: settle() agrees on it
        if inline:
            persist(job)
            return
        thread = threading.Thread(
            target=persist, args=(job,), name=f"autohet-save-{job.step}", daemon=True
        )
        self.thread = thread
        thread.start()

    def wait(self) -> None:
        """Return when the save in flight (if any) is durable; raise its failure."""
        thread, self.thread = self.thread, None
        if thread is not None:
            thread.join()
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure

    def settle(
        self, agree_max: Callable[[Sequence[float]], list[float]], *, block: bool
    ) -> tuple[int, BaseException | None] | None:
        """Collective while a save is pending (``agree_max``: the element-wise maximum
        over every rank): whether it is done everywhere and whether it failed
        anywhere. ``block``: wait for this rank's part first. Returns None while it
        runs somewhere, when it succeeded, or when none is pending; else the failed
        save's step and this rank's failure of it (None: it failed on another rank)."""
        if not self.pending:
            return None
        thread = self.thread
        if block and thread is not None:
            thread.join()
        done = thread is None or not thread.is_alive()
        running, failed = agree_max(
            [0.0 if done else 1.0, 1.0 if done and self.failure is not None else 0.0]
        )
        if running:
            return None
        self.pending = False
        thread, self.thread = self.thread, None
        if thread is not None:
            thread.join()
        failure, self.failure = self.failure, None
        if not failed:
            return None
        return self.step, failure
