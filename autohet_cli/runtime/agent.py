"""The host agent: torchrun, except that a shutdown's SIGTERM waits for the emergency save.

``python -m autohet_cli.runtime.agent ARGS`` takes torchrun's arguments and runs
torchrun's own ``main`` (rendezvous, worker start, exit codes, logs: all torchrun's).
One thing differs: what the agent does on SIGTERM.

Why: a spot VM's shutdown sends SIGTERM to every process at once. torchrun's agent
turns its SIGTERM into ``SignalException``, sends the workers a second SIGTERM and
SIGKILLs them 30 s later, and exits non-zero; the workers, busy agreeing on a step
to save, are killed mid-save (a 1.2B llama's save took 50 s) and the launcher sees
a failure instead of a preemption. torchrun has no option for this (the
``TORCHELASTIC_SIGNALS_TO_HANDLE`` of newer releases only drops the handler, which
leaves SIGTERM killing the agent and orphaning its workers), so we supervise with
torchrun and replace only its signal handler: ``PContext.start`` installs the module
function ``torch.distributed.elastic.multiprocessing.api._terminate_process_handler``
by name when the workers start (every release from 2.5 to 2.13 does; checked at
start, and a torch without it runs torchrun unchanged with a warning).

The rule (the workers' side is ``runtime.preempt``):

* The first SIGTERM is a notice. The agent forwards one SIGTERM to each worker (a
  signal to the agent alone, e.g. the launcher's graceful stop, must reach them;
  where the shutdown signalled them too, the worker counts both as one notice),
  and keeps supervising: the workers save the step they agree on and exit 0, and
  torchrun exits 0 as for any finished run.
* More SIGTERMs within ``REPEAT_WINDOW_S`` of the first are the same notice (a
  shutdown may signal a process group and every process, in any order).
* A later SIGTERM, SIGINT, SIGHUP or SIGQUIT gets torchrun's own handling: the
  workers are stopped at once (they too end on a SIGTERM past the window). A
  host's hard deadline is SIGKILL, which nothing can delay.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from autohet_cli import oom
from autohet_cli.workerbase.exiting import skip_final_collection
from autohet_cli.workerbase.records import AGENT_NOTICE, AGENT_PREFIX

# A shutdown's repeats come within milliseconds (systemd signals the unit's processes
# in one pass, a Slurm step's processes get one signal each); 10 s absorbs a slow
# second pass while a person's deliberate "stop now" a little later still acts.
REPEAT_WINDOW_S = 10.0


class NoticeClock:
    """First SIGTERM time; whether another one is the same notice (pure: time given)."""

    def __init__(self, window_s: float = REPEAT_WINDOW_S) -> None:
        self.window_s = window_s
        self.first_at: float | None = None

    def absorb(self, now: float) -> bool | None:
        """None: this is the first (a new notice); True: a repeat of it; False: not
        the same notice any more (act on it)."""
        if self.first_at is None:
            self.first_at = now
            return None
        return now - self.first_at <= self.window_s


def child_pids(pid: int) -> list[int]:
    """The direct children of ``pid`` (Linux ``/proc``): the agent's workers."""
    kids: set[int] = set()
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    kids.update(int(x) for x in f.read().split())
            except OSError:
                continue
    except OSError:
        pass
    if kids:
        return sorted(kids)
    # Kernels without CONFIG_PROC_CHILDREN: every process's parent from its stat line.
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 1 and fields[1] == str(pid):
            kids.add(int(entry))
    return sorted(kids)


def _say(text: str) -> None:
    # os.write, not print: this runs inside a signal handler, and a buffered stream
    # the main thread is writing to would raise a reentrant-call error.
    try:
        os.write(2, f"{AGENT_PREFIX}{text}\n".encode())
    except OSError:
        pass


def patched_handler(
    original: Callable[[int, FrameType | None], Any],
    clock: NoticeClock,
    *,
    now: Callable[[], float] = time.monotonic,
    children: Callable[[], Sequence[int]] = lambda: child_pids(os.getpid()),
) -> Callable[[int, FrameType | None], Any]:
    """torchrun's handler with the rule above in front of it."""

    def handler(signum: int, frame: FrameType | None) -> Any:
        if signum != signal.SIGTERM:
            return original(signum, frame)
        seen = clock.absorb(now())
        if seen is None:
            kids = list(children())
            for pid in kids:
                try:
                    os.kill(pid, signal.SIGTERM)
                except OSError:
                    pass  # gone already
            _say(
                f"{AGENT_NOTICE.removeprefix(AGENT_PREFIX)}; forwarded to {len(kids)} "
                "worker(s), which "
                "save their step and exit (another SIGTERM after "
                f"{clock.window_s:g} s stops them at once)"
            )
            return None
        if seen:
            return None  # the same notice again
        _say("SIGTERM again: stopping the workers now")
        return original(signum, frame)

    return handler


def install() -> bool:
    """Put the rule in front of torchrun's handler; False when this torch lacks it."""
    try:
        from torch.distributed.elastic.multiprocessing import api
    except ImportError:
        return False
    original = getattr(api, "_terminate_process_handler", None)
    if original is None or not callable(original):
        return False
    setattr(api, "_terminate_process_handler", patched_handler(original, NoticeClock()))  # noqa: B010
    return True


def main(argv: Sequence[str] | None = None) -> None:
    if not install():
        import torch

        _say(
            f"warning: torch {torch.__version__}'s torchrun has no termination handler to "
            "extend: a SIGTERM to this agent stops the workers within 30 s, saved or not"
        )
    from torch.distributed.run import main as torchrun_main

    # The kernel's OOM kills are counted from here: a worker's SIGKILL is called out of
    # memory only if a counter rose (autohet_cli.oom, read by launch.triage).
    before = oom.kill_counts()
    try:
        # torchrun's main reads sys.argv[1:] when given None; its exit code is its own.
        torchrun_main(list(sys.argv[1:] if argv is None else argv))
    finally:
        if line := oom.evidence_line(before):
            try:
                os.write(2, f"{line}\n".encode())
            except OSError:
                pass


if __name__ == "__main__":
    # Default SIGTERM until torchrun starts the workers (nothing to save before then).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    skip_final_collection()  # torchrun imported torch: its exit, 1-2 s less
    main()
