"""What a worker leaves in its run directory for the launcher: a boot mark and its failure.

``RUN_DIR/boot/rank<R>``
    Written the moment the worker process runs, i.e. after torchrun's rendezvous and
    the interpreter's start. The launcher's start-up deadline looks for these: a
    host with none has workers that never started (a hung interpreter, a rendezvous
    that never completed), which is neither a lost host nor a crash.

``RUN_DIR/errors/rank<R>.json``
    One JSON object on one line, written when the worker fails: ``kind`` is
    ``error`` (this rank's own failure: an exception, a bad config), ``peer_lost``
    (it stopped because another rank vanished) or ``stuck``; ``message`` is one
    line, ``detail`` the tail of the traceback, ``time`` the Unix time. The
    launcher reads every host's records and names the earliest ``error`` as the
    root cause, the way torchrun's error summary names the first failure, but
    across hosts.

Both are best effort: a full or vanished run directory must not turn one failure
into another.

``REPORT_PREFIX``
    The stdout line on which rank 0 prints the run report at the end
    (``runtime.report``); the launcher reads it from the host's log.
``PREEMPT_PREFIX``
    The stdout lines on which rank 0 announces a preemption notice and the
    emergency checkpoint (``runtime.preempt``); the launcher acts on them.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

REPORT_PREFIX = "autohet-report: "
# Rank 0's stdout lines about a preemption notice (``runtime.preempt``): JSON with
# ``event`` "notice" (the hosts and their notices, the step to save) then "saved".
PREEMPT_PREFIX = "autohet-preempt: "
# Rank 0's start-up phases (``runtime.startup``), measured from AUTOHET_LAUNCH_TIME.
STARTUP_PREFIX = "autohet-startup: "
# The agent's line when a SIGTERM reaches it first (runtime.agent): the launcher counts
# that host as leaving even when its workers' notice came after the emergency save.
AGENT_PREFIX = "[autohet agent] "
AGENT_NOTICE = AGENT_PREFIX + "SIGTERM: a preemption notice"
LAUNCH_TIME_ENV = "AUTOHET_LAUNCH_TIME"

BOOT_DIR = "boot"
ERRORS_DIR = "errors"
MAX_DETAIL_LINES = 15
MAX_DETAIL_CHARS = 3000


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def say(message: str) -> None:
    """A line for the launcher's log (``autohet runtime: ...``; errors are
    ``autohet runtime: error: ...``, which triage reads when no record exists).

    One write, newline included: workers run unbuffered (PYTHONUNBUFFERED) and share
    their host's stderr pipe, and ``print`` writes the text and its newline apart, so
    two ranks refusing at once came out as one line of both texts and an empty one."""
    sys.stderr.write(f"autohet runtime: {message}\n")
    sys.stderr.flush()


def write_boot(run_dir: Path | None, rank: int | None = None) -> None:
    """Mark this worker as started (the launcher's start-up deadline reads it)."""
    if run_dir is None:
        return
    r = _rank() if rank is None else rank
    try:
        (run_dir / BOOT_DIR).mkdir(parents=True, exist_ok=True)
        (run_dir / BOOT_DIR / f"rank{r}").write_text(f"{os.getpid()} {time.time():.3f}\n")
    except OSError:
        pass


def error_detail(exc: BaseException) -> str:
    """The last lines of ``exc``'s traceback, bounded."""
    lines = "".join(traceback.format_exception(exc)).rstrip().splitlines()
    return "\n".join(lines[-MAX_DETAIL_LINES:])[-MAX_DETAIL_CHARS:]


def first_line(text: str) -> str:
    stripped = text.strip()
    return stripped.splitlines()[0] if stripped else ""


MAX_MESSAGE_CHARS = 500


def clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` within ``limit`` characters, its start and its end kept: a refusal
    names the file first and says what to do last (``--init-from``'s likely cause)."""
    if len(text) <= limit:
        return text
    tail = limit * 2 // 5
    return f"{text[: limit - tail - 5]} ... {text[-tail:]}"


def write_error(
    run_dir: Path | None,
    *,
    kind: str,
    message: str,
    detail: str = "",
    host: str = "",
    rank: int | None = None,
    place: str = "",
) -> None:
    """Record why this rank stops; the first record of a rank wins (later ones are
    consequences, e.g. the exit after a peer was found lost)."""
    if run_dir is None:
        return
    r = _rank() if rank is None else rank
    record = {
        "rank": r,
        "host": host or os.environ.get("AUTOHET_HOST", ""),
        "place": place,
        "kind": kind,
        "message": clip(first_line(message)),
        "detail": detail[-MAX_DETAIL_CHARS:],
        "time": round(time.time(), 3),
    }
    target = run_dir / ERRORS_DIR / f"rank{r}.json"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            return
        tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(record) + "\n", encoding="utf-8")
        tmp.replace(target)
    except OSError:
        pass
