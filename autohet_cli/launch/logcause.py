"""What a host's output says about why its workers failed, when no rank recorded it (pure).

A failed host's output holds the workers' own lines (an argparse refusal, a
traceback), torchrun's log and, last, torchrun's summary of the failures, whose
"Root Cause (first observed failure)" block names the first worker that failed:
its rank and its exit code. The workers torchrun stopped once that one failed end
with SIGTERM; they are never the cause. Causes, most telling first:

0. a message of the worker: our runtime's error line, an argparse refusal
   (``usage:`` then ``PROG: error: ...``, exit code 2), an exception, an
   out-of-memory message (CUDA, ``MemoryError``, torch's CPU allocator);
1. the first failed worker's exit: a signal other than SIGTERM (SIGKILL is called
   the kernel's out-of-memory killer only with the agent's evidence,
   ``runtime.oom``), or an exit code with the worker's last lines;
2. an exception that is a consequence: the worker lost its peer (a connection
   closed or reset, a broken pipe), because another worker failed first;
3. SIGTERM: torchrun stopping the others, a shutdown, a scheduler.

Across hosts the most telling cause wins (``triage.root_cause``), so a host whose
workers were stopped or lost their peer does not hide the host that failed first.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass

from autohet_cli.oom import EVIDENCE_PREFIX

MESSAGE, EXIT, CONSEQUENCE, STOPPED = range(4)
WORKER_PROG = "python -m autohet_cli.runtime.train"
# Python's last traceback line; a bare ``MemoryError`` has no message.
_EXC_LINE = re.compile(
    r"^\s*(?:\[[^\]]*\]:?\s*)*([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt))(?::\s*(.*))?$"
)
_RUNTIME_ERROR = re.compile(r"autohet runtime: error: (.+)$")
_USAGE = re.compile(r"^usage: ")
_ARGPARSE_ERROR = re.compile(r"^(\S[^:]*): error: (.+)$")
_SIGNAL = re.compile(r"Signal (\d+) \((SIG\w+)\) received by PID (\d+)")
_NOISE = ("ChildFailedError", "torch.distributed.elastic.multiprocessing.errors")
# A worker that lost its peer says so in one of these ways (gloo, NCCL, sockets).
_PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|SignalException|"
    r"NCCL communicator was aborted|Socket Timeout|"
    # NCCL: a peer that died (``DistBackendError: NCCL error in: ..., remote process
    # exited or there was a network error``) or the watchdog giving up on a
    # collective the dead peer never joined (then SIGABRT)
    r"remote process exited|network error|DistBackendError|Watchdog caught collective|"
    r"ProcessGroupNCCL.*(?:timeout|timed out|abort)",
    re.I,
)
OOM_TEXT = re.compile(
    r"out of memory|out-of-memory killer|OutOfMemoryError|\bMemoryError\b|"
    r"can't allocate memory|not enough memory",
    re.I,
)
# torchrun's own lines: its log (``W1126 06:44:40.713000 10089 torch/...py:1028] ...``)
# and the summary block.
_TORCHRUN_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d[.\d]* +\d+ \S+:\d+\] ")
_FAILED_LOG = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_ROOT_BLOCK = "Root Cause (first observed failure):"
_BLOCK_RANK = re.compile(r"^\s*rank\s*: (\d+)")
_BLOCK_EXIT = re.compile(r"^\s*exitcode\s*: (-?\d+) \(pid: (\d+)\)")
_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")
LAST_LINES = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class Cause:
    message: str
    weight: int  # MESSAGE (most telling) .. STOPPED
    rank: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class FirstFailure:
    """torchrun's first failed worker: its global rank (when known), exit code, pid."""

    rank: int | None
    exit_code: int
    pid: int


def cause_from_output(lines: Sequence[str], exit_code: int | None = None) -> Cause | None:
    """The most telling cause in one host's output; ``exit_code``: the host's own."""
    first = first_failure(lines)
    rank = first.rank if first else None
    if ours := [m.group(1) for m in map(_RUNTIME_ERROR.search, lines) if m]:
        return Cause(message=ours[0], weight=MESSAGE, rank=rank)
    if refused := _argparse(lines, first):
        return Cause(message=refused, weight=MESSAGE, rank=rank)
    if said := _exception(lines):
        telling = _PEER_LOST.search(said) is None
        return Cause(message=said, weight=MESSAGE if telling else CONSEQUENCE, rank=rank)
    if first is not None:
        return Cause(
            message=_exit_words(first, lines), weight=_exit_weight(first, lines), rank=rank
        )
    return _from_signals(lines, exit_code)


def first_failure(lines: Sequence[str]) -> FirstFailure | None:
    """From torchrun's summary block, else its first ``failed (exitcode: ...)`` line."""
    if _ROOT_BLOCK in (stripped := [ln.strip() for ln in lines]):
        block = lines[stripped.index(_ROOT_BLOCK) + 1 :]
        ranks = [int(m.group(1)) for m in map(_BLOCK_RANK.match, block) if m]
        exits = [m for m in map(_BLOCK_EXIT.match, block) if m]
        if exits:
            return FirstFailure(
                rank=ranks[0] if ranks else None,
                exit_code=int(exits[0].group(1)),
                pid=int(exits[0].group(2)),
            )
    for m in map(_FAILED_LOG.search, lines):
        if m:
            return FirstFailure(rank=None, exit_code=int(m.group(1)), pid=int(m.group(3)))
    return None


def _argparse(lines: Sequence[str], first: FirstFailure | None) -> str:
    """An argparse refusal (``usage:`` ... ``PROG: error: MESSAGE``), in words; or ""."""
    usage = next((i for i, ln in enumerate(lines) if _USAGE.match(ln)), None)
    if usage is None:
        return ""
    m = next((m for m in map(_ARGPARSE_ERROR.match, lines[usage + 1 :]) if m), None)
    if m is None:
        return ""
    prog, message = m.group(1), m.group(2)
    if prog == WORKER_PROG:
        return (
            f"the worker refused its flags: {message} (check --train-arg and the run "
            f"config; `{WORKER_PROG} --help` lists them)"
        )
    code = f" (exit code {first.exit_code})" if first is not None else ""
    return f"{prog} refused its arguments: {message}{code}"


def _exception(lines: Sequence[str]) -> str:
    """The last exception line that is not torchrun's wrapper; one that is not a lost
    peer wins over those that are."""
    found = []
    for line in lines:
        m = _EXC_LINE.match(line)
        if m and not any(n in m.group(1) for n in _NOISE):
            found.append(f"{m.group(1)}: {m.group(2)}" if m.group(2) else m.group(1))
    telling = [f for f in found if not _PEER_LOST.search(f)]
    return (telling or found or [""])[-1]


def _exit_weight(first: FirstFailure, lines: Sequence[str]) -> int:
    if first.exit_code == -signal.SIGTERM:
        return STOPPED
    if any(_PEER_LOST.search(ln) for ln in lines):
        return CONSEQUENCE  # it lost its peer (NCCL's watchdog aborts it: SIGABRT)
    return EXIT


def _exit_words(first: FirstFailure, lines: Sequence[str]) -> str:
    if first.exit_code < 0:
        return signal_words(-first.exit_code, first.pid, _oom_evidence(lines))
    return _exited(first.exit_code, lines)


def signal_words(number: int, pid: int | None, oom_evidence: str = "") -> str:
    """How a worker died, and only what is known about why."""
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    who = "a worker" if pid is None else f"a worker (pid {pid})"
    said = f"{who} was killed by signal {number} ({name})"
    if number == signal.SIGKILL and oom_evidence:
        if "/proc/vmstat" in oom_evidence:  # host-wide: some process was OOM-killed
            return (
                f"{said}: probably the kernel's out-of-memory killer (it killed a process "
                f"on this host meanwhile: {oom_evidence})"
            )
        return f"{said}: the kernel's out-of-memory killer ({oom_evidence})"
    if number == signal.SIGTERM:
        return (
            f"{said}: torchrun stops every worker this way once one fails, and a "
            "shutdown or a scheduler sends it too; no worker recorded a cause"
        )
    return said


def _oom_evidence(lines: Sequence[str]) -> str:
    found = [ln.split(EVIDENCE_PREFIX, 1)[1] for ln in lines if EVIDENCE_PREFIX in ln]
    return found[-1] if found else ""


def last_lines(lines: Sequence[str]) -> list[str]:
    """The worker's own last lines: those before torchrun began reporting the failure,
    without torchrun's log lines and the agent's notes."""
    end = next(
        (i for i, ln in enumerate(lines) if _TORCHRUN_LOG.match(ln) and _reports_end(ln)),
        len(lines),
    )
    own = [
        ln.strip()[:200]
        for ln in lines[:end]
        if ln.strip() and not _TORCHRUN_LOG.match(ln) and not ln.startswith("[autohet agent]")
    ]
    return own[-LAST_LINES:]


def _reports_end(line: str) -> bool:
    return "closing signal" in line or _FAILED_LOG.search(line) is not None


def _from_signals(lines: Sequence[str], exit_code: int | None) -> Cause | None:
    """No summary block (an older torchrun, a cut tail): signals torchrun reported,
    else a negative exit code, else the host's own exit with its last lines."""
    signals = [m for m in map(_SIGNAL.search, lines) if m]
    if signals:
        sig = next((x for x in signals if x.group(2) != "SIGTERM"), signals[0])
        return _signal_cause(int(sig.group(1)), int(sig.group(3)), lines)
    for line in reversed(lines):
        if (code := _EXITCODE.search(line)) and int(code.group(1)) < 0:
            return _signal_cause(-int(code.group(1)), None, lines)
    if exit_code not in (None, 0):
        return Cause(message=_exited(exit_code, lines), weight=EXIT)
    return None


def _signal_cause(number: int, pid: int | None, lines: Sequence[str]) -> Cause:
    words = signal_words(number, pid, _oom_evidence(lines))
    return Cause(message=words, weight=STOPPED if number == signal.SIGTERM else EXIT)


def _exited(code: int, lines: Sequence[str]) -> str:
    last = last_lines(lines)
    said = f"its last lines: {' | '.join(last)}" if last else "it printed nothing"
    return f"exited with code {code}; {said}"
