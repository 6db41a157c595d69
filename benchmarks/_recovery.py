"""What the recovery benchmarks share: settings from the environment, the 200M llama,
stage cuts, and a printer that timestamps what launch and recover say.

Settings (environment):

``AUTOHET_BENCH_REPEATS``      runs of each way (default 3; medians are printed)
``AUTOHET_BENCH_REMOTE_MBPS``  megabytes per second remote storage is read at
                               (default 300: one VM reading object storage)
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

REPEATS_ENV = "AUTOHET_BENCH_REPEATS"
REMOTE_ENV = "AUTOHET_BENCH_REMOTE_MBPS"
DEFAULT_REMOTE_MB_PER_S = 300.0

# The ~200M llama (fp32 Adam: 12 bytes per parameter, ~2.4 GB per save).
HF_CONFIG_200M = {
    "model_type": "llama",
    "_name_or_path": "llama-200m",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
}

_STARTUP = re.compile(r"startup: .*\((.*)\)")
_PHASE = re.compile(r"([a-z][a-z ]*?) ([0-9.]+) s")


def repeats(env: Mapping[str, str]) -> int:
    """``AUTOHET_BENCH_REPEATS``: a count >= 1 (default 3)."""
    raw = env.get(REPEATS_ENV, "3").strip()
    if not raw.isdigit() or int(raw) < 1:
        raise SystemExit(f"{REPEATS_ENV}={raw!r}: expected a whole number >= 1 (default 3)")
    return int(raw)


def remote_bytes_per_s(env: Mapping[str, str]) -> float:
    """``AUTOHET_BENCH_REMOTE_MBPS`` (megabytes per second, default 300) in bytes/s.

    A stated rate, not one derived from the peer rate: the baseline must not move
    when peer transfers get faster."""
    raw = env.get(REMOTE_ENV, "").strip()
    if not raw:
        return DEFAULT_REMOTE_MB_PER_S * 1e6
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise SystemExit(
            f"{REMOTE_ENV}={raw!r}: expected megabytes per second > 0 "
            f"(default {DEFAULT_REMOTE_MB_PER_S:g}, a VM reading object storage)"
        )
    return value * 1e6


def balanced_cuts(weights: Sequence[int], num_stages: int) -> tuple[tuple[int, int], ...]:
    """Contiguous ``[start, end)`` layer ranges, one per stage, none empty, that make
    the heaviest stage as light as possible (``weights``: parameters per layer, so
    each host holds a like share of the checkpoint; the embedding and the head stay
    in the first and the last stage). Ties go to the earliest cut."""
    n = len(weights)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {num_stages} non-empty stages")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the lightest heaviest stage cutting the first i layers into k stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, end = [], n
    for k in range(num_stages, 0, -1):
        start = cut[k][end]
        bounds.append((start, end))
        end = start
    return tuple(reversed(bounds))


def startup_phases(line: str) -> dict[str, float]:
    """The phases of a worker's ``startup: ... (launch 1.20 s, ...)`` line, in seconds."""
    found = _STARTUP.search(line)
    assert found, line
    return {k.strip().replace(" ", "_"): float(v) for k, v in _PHASE.findall(found.group(1))}


class Stamped:
    """A printer that keeps (monotonic seconds, line) of everything printed."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []
        self.event = threading.Event()
        self.wait_for = ""

    def __call__(self, line: str) -> None:
        self.lines.append((time.monotonic(), line))
        if self.wait_for and self.wait_for in line:
            self.event.set()

    def first(self, pattern: str, after: float = 0.0) -> tuple[float, str] | None:
        rx_ = re.compile(pattern)
        return next(((t, ln) for t, ln in self.lines if t >= after and rx_.search(ln)), None)

    def tail(self, n: int = 30) -> str:
        return "\n".join(ln for _, ln in self.lines[-n:])


def copy_rate(report: Mapping[str, Any], *, remote: bool) -> tuple[float | None, str]:
    """Bytes/s of recover's copies from remote storage (``remote``) or from peers, and
    how it was measured. With ``report["transfers"]`` (one entry per file: bytes,
    seconds, source_kind): the files' bytes over their seconds; without: the bytes
    over the whole transfer phase, a lower bound when both kinds were copied."""
    transfers = report.get("transfers")
    if isinstance(transfers, list):
        mine = [
            t
            for t in transfers
            if isinstance(t, Mapping) and (t.get("source_kind") == "remote") == remote
        ]
        nbytes = sum(float(t.get("bytes") or 0) for t in mine)
        seconds = sum(float(t.get("seconds") or 0) for t in mine)
        return (nbytes / seconds if nbytes and seconds > 0 else None), "per file, from recover"
    nbytes = float(report.get("bytes_from_remote" if remote else "bytes_from_peers") or 0)
    seconds = float((report.get("phases") or {}).get("transfer") or 0)
    rate = nbytes / seconds if nbytes and seconds > 0 else None
    return rate, "bytes over the transfer phase (recover reports no per-file rates)"


def copy_paths(report: Mapping[str, Any]) -> str:
    """Which path recover's copies took (``path`` of ``report["transfers"]``), counted:
    ``"peer direct x3, remote relayed x2"``; empty without per-file records."""
    counts: dict[str, int] = {}
    for t in report.get("transfers") or ():
        if isinstance(t, Mapping):
            key = f"{t.get('source_kind', '?')} {t.get('path', '?')}"
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items()))
