"""How long this process has run, from its start, not from when our code began.

``autohet plan --time-limit`` bounds the command's wall time (issue 32), and a
user's clock starts when they press enter: the interpreter and the imports
(pyscipopt, yaml, typer: about half a second on a small machine) count. Linux
keeps each process's start time in ``/proc/self/stat`` (field 22, clock ticks
since boot) beside the time since boot in ``/proc/uptime``; elsewhere the clock
starts at the first call here, which undercounts only the imports. The kernel's
start time is the fork's, not the exec's: a wrapper that runs a while and then
execs autohet is charged its own time too.
"""

from __future__ import annotations

import os
import time

_FIRST = time.monotonic()


def process_age_s() -> float:
    """Seconds since this process started (best effort, never negative)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            stat = f.read()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime_s = float(f.read().split()[0])
        # the command name (field 2) may hold spaces and parentheses: count after it
        started_ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
        age = uptime_s - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        age = time.monotonic() - _FIRST
    return max(0.0, age)
