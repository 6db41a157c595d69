"""Where a worker's start-up goes: from the launcher's start to the first finished step.

A recovery is only as fast as its restart, so every worker measures its own, and
rank 0 reports it (``autohet runtime: startup: ...`` for people, one
``autohet-startup:`` JSON line for the launcher and the recovery benchmark):

launch          the launcher's start command to this interpreter importing autohet:
                SSH, torchrun's own start (it imports torch), its rendezvous of all
                hosts, the worker's spawn (``AUTOHET_LAUNCH_TIME``, set by the
                launcher, on its clock: hosts' clocks must agree to the tenth of a
                second for this one figure to be exact)
imports         autohet and torch in the worker
process_group   ``init_process_group`` (all ranks meet)
build           the trainer: model, optimizer, data, sync buckets; the model is built
                on the meta device and initialised on this rank's device, or left
                uninitialised when ``--resume`` will load it (``runtime.stage``)
load            the checkpoint: listing, verification, DCP load (0 with no resume);
                when ``--resume`` finds none, the initialisation the build skipped
first_step      the first step, warm-up included; with ``--compile`` the seconds
                torch.compile spent in it are reported beside it (``compile_s``)

The phases are wall-clock times of this rank; every rank waits for the slowest at
the process group and at the load, so rank 0's view is the job's.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from autohet_cli.runtime import IMPORT_START_UNIX
from autohet_cli.runtime.hooks import Hook
from autohet_cli.runtime.metrics import StepResult
from autohet_cli.workerbase.records import LAUNCH_TIME_ENV, STARTUP_PREFIX

PHASES = ("launch", "imports", "process_group", "build", "load", "first_step")


class StartupClock(Hook):
    """Marks the phases above; reports them at the end of the first step (rank 0)."""

    def __init__(self, say: Callable[[str], None], emit: Callable[[str], None] | None = None):
        self.say = say
        self.emit = emit or (lambda line: print(line, flush=True))
        self.marks: list[tuple[str, float]] = [("imports", IMPORT_START_UNIX)]
        self.rank = 0
        self.done = False
        try:
            launched: float | None = float(os.environ.get(LAUNCH_TIME_ENV, ""))
        except ValueError:
            launched = None
        self.launched = launched

    def mark(self, phase: str) -> None:
        """``phase`` ended now (the next one starts)."""
        self.marks.append((phase, time.time()))

    def phases_s(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.launched is not None:
            out["launch"] = max(0.0, IMPORT_START_UNIX - self.launched)
        for (_, start), (phase, end) in zip(self.marks, self.marks[1:], strict=False):
            out[phase] = end - start
        return out

    def on_train_start(self, trainer: object) -> None:
        self.rank = getattr(getattr(trainer, "runtime", None), "global_rank", 0)
        self.mark("load")  # the checkpoint (if any) was loaded before fit()

    def on_step_end(self, trainer: object, result: StepResult) -> None:
        if self.done:
            return
        self.done = True
        self.mark("first_step")
        if self.rank != 0:
            return
        phases = self.phases_s()
        clock = getattr(trainer, "compile_clock", None)
        compile_s = clock.total_s() if clock is not None else None
        record: dict[str, object] = {
            "phases_s": {k: round(v, 3) for k, v in phases.items()},
            "step": result.step,
            "compiled": clock is not None,
        }
        if compile_s is not None:
            record["compile_s"] = round(compile_s, 3)
        self.emit(STARTUP_PREFIX + json.dumps(record))
        total = sum(phases.values())
        parts = [f"{k.replace('_', ' ')} {v:.2f} s" for k, v in phases.items()]
        if clock is not None:
            parts.append(
                "torch.compile on" + (f": {compile_s:.2f} s of the first step" if compile_s else "")
            )
        self.say(f"startup: {total:.1f} s to the first step (" + ", ".join(parts) + ")")
