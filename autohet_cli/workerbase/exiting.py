"""A worker's or agent's exit without the interpreter's final garbage collections.

Why: a process that imported torch (DTensor, DCP, dynamo and its sympy) tracks millions
of objects, and at exit CPython collects them all, before and while it clears every
module: 1-2 s of CPU per process on a small machine, in ``gc_collect_main`` (py-spy).
A launch ends only when every host's workers and then its agent have exited, so a
3-host launch on a 2-core machine ended 5 s after its last line; with this, 1.5 s.

``gc.freeze()`` as an exit hook moves every tracked object to the permanent
generation, which those collections skip. Everything else a normal exit does still
happens: every other exit hook runs, stdout and stderr are flushed, modules are torn
down and objects outside reference cycles freed (their files closed). What it gives
up: finalisers of objects in reference cycles at exit, which CPython does not promise
to run; a worker's records are written and closed before it returns.
"""

from __future__ import annotations

import atexit
import gc


def skip_final_collection() -> None:
    """Freeze the heap when the interpreter exits (an ``atexit`` hook)."""
    atexit.register(gc.freeze)
