"""What ``recovery_e2e`` prints for one size: bytes and rates, the breakdown, the
projection to real sizes and where issue 30's targets stand (from its per-run records)."""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks._common import table
from benchmarks._recovery import REMOTE_ENV
from benchmarks.recovery_projection import (
    GBIT,
    H200_1_2B,
    MeasuredWay,
    RealSize,
    issue_targets,
    project,
    project_with,
    speedup,
)

Runs = dict[str, list[dict[str, Any]]]
BREAKDOWN = ("detect", "replan", "transfer", "restart", "load", "first_step", "total")
RESTART_PARTS = ("prep", "launch", "imports", "process_group", "build")
FIXED = ("detect", "replan", "restart", "first_step")  # do not grow with the checkpoint
DISK_BYTES_PER_S = 2e9  # the alternative load rate the projection also shows


def median(runs: Sequence[dict[str, Any]], key: str) -> float | None:
    """The median of ``key`` over the runs that measured it (None: none did)."""
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value / scale:.{digits}f}"


def report(
    size: str, results: Runs, *, remote_bytes_per_s: float, link_bytes_per_s: float | None
) -> None:
    """``link_bytes_per_s``: one pair of hosts alone (``peer_link``), the peer rate the
    targets take; the per-file rate during recovery shares the cores with the other
    destinations' copies."""
    every = [r for runs in results.values() for r in runs]
    nbytes = median(every, "bytes_checkpoint") or 0.0
    steps = sorted({(r["killed_after_step"], r["resumed_step"]) for r in every})
    print(
        f"{size}: {nbytes / 1e9:.2f} GB per save; killed once step(s) "
        f"{', '.join(str(k) for k, _ in steps)} were durable, resumed from "
        f"{', '.join(str(s) for _, s in steps)}; remote storage read at "
        f"{remote_bytes_per_s / 1e6:.0f} MB/s ({REMOTE_ENV}); load average "
        f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; medians of "
        f"{len(next(iter(results.values())))}"
    )
    rows = [
        [
            way,
            _fmt(median(runs, "bytes_peers"), 1e6, 1),
            _fmt(median(runs, "bytes_remote"), 1e6, 1),
            _fmt(median(runs, "peer_rate"), 1e6, 0),
            _fmt(median(runs, "remote_rate"), 1e6, 0),
        ]
        for way, runs in results.items()
    ]
    print(table(["way", "MB from peers", "MB from remote", "peer MB/s", "remote MB/s"], rows))
    hows = sorted({r["peer_rate_how"] for r in every if r.get("peer_rate") is not None})
    print(f"copy rates: {'; '.join(hows) or 'n/a (nothing copied)'}")
    for way, runs in results.items():
        paths = sorted({r.get("paths") or "" for r in runs} - {""})
        if paths:
            print(f"  {way} copies went: {' | '.join(paths)}")
    print(table(["median s", *BREAKDOWN], _rows(results, BREAKDOWN)))
    print("the restart, in parts (prep: recover's bookkeeping and launch's preflight; the")
    print("rest as rank 0 measured it: launch = SSH + torchrun start + rendezvous + spawn)")
    print(table(["median s", *RESTART_PARTS], _rows(results, RESTART_PARTS)))
    ours, base = median(results["autohet"], "total"), median(results["remote-only"], "total")
    if ours and base:
        print(
            f"kill to first resumed step: autohet {ours:.1f} s, remote-only {base:.1f} s: "
            f"{base / ours:.2f}x faster (AutoHet reports 4.38x)"
        )
        # recover relays what it reads from remote storage through this process (SFTP
        # to the host), slower than the stated rate: the baseline as if it did not.
        stated = statistics.median(
            r["total"] - r["transfer"] + r["bytes_remote"] / remote_bytes_per_s
            for r in results["remote-only"]
        )
        print(
            f"  remote-only with its transfer charged at the stated "
            f"{remote_bytes_per_s / 1e6:.0f} MB/s (not recover's relay, "
            f"{_fmt(median(results['remote-only'], 'remote_rate'), 1e6, 0)} MB/s): "
            f"{stated:.1f} s: autohet {stated / ours:.2f}x faster"
        )
    scaled = _projection(results, nbytes)
    projected = _projection_real_parts(results, nbytes)
    worst_remote = max(r["bytes_remote"] for r in results["autohet"])
    during = median(results["autohet"], "peer_rate")
    print(
        f"peer rate: one pair of hosts alone (peer_link) {_fmt(link_bytes_per_s, 1e9)} GB/s; "
        f"per file during recovery, every destination at once, {_fmt(during, 1e9)} GB/s"
    )
    print(f"targets (issue 30; {size}, the autohet way, one host lost):")
    if scaled is not None:
        print(f"  (the projection below uses the real-size parts; scaled from here: {scaled:.2f}x)")
    for target in issue_targets(
        bytes_from_remote=worst_remote,
        peer_bytes_per_s=link_bytes_per_s,
        total_200m_s=ours if size == "200m" else None,
        projected_speedup=projected,
    ):
        print(f"  {target.line()}")


def _rows(results: Runs, cols: Sequence[str]) -> list[list[str]]:
    return [[way, *(_fmt(median(runs, c)) for c in cols)] for way, runs in results.items()]


def _projection(results: Runs, measured_bytes: float) -> float | None:
    """Prints both ways at real size from their medians; the speedup (None: no bytes)."""
    if measured_bytes <= 0:
        print("projection: n/a (the checkpoint's size is unknown)")
        return None
    real = RealSize()
    ways = {}
    for way, runs in results.items():
        fixed = sum(median(runs, k) or 0.0 for k in FIXED)
        measured = MeasuredWay(
            fixed_s=fixed,
            load_s=median(runs, "load") or 0.0,
            bytes_from_peers=median(runs, "bytes_peers") or 0.0,
            bytes_from_remote=median(runs, "bytes_remote") or 0.0,
        )
        ways[way] = (measured, project(measured, measured_bytes=measured_bytes, real=real))
    print(
        f"projection to a 1.2B llama: {real.checkpoint_bytes / 1e9:.0f} GB checkpoint, peers at "
        f"{real.peer_bytes_per_s / GBIT:g} Gbit/s ({real.peer_bytes_per_s / 1e6:.0f} MB/s), "
        f"remote at {real.remote_bytes_per_s / GBIT:g} Gbit/s "
        f"({real.remote_bytes_per_s / 1e6:.0f} MB/s), load at the rate measured here"
    )
    print(
        "  total = fixed (detect + replan + restart + first step, as measured)\n"
        f"        + {real.checkpoint_bytes / 1e9:.0f} GB x peer fraction / peer rate"
        f" + {real.checkpoint_bytes / 1e9:.0f} GB x remote fraction / remote rate\n"
        f"        + load s x {real.checkpoint_bytes / 1e9:.0f} GB / "
        f"{measured_bytes / 1e9:.3f} GB (the checkpoint measured)"
    )
    rows = [
        [
            way,
            f"{m.fixed_s:.2f}",
            f"{m.bytes_from_peers / measured_bytes:.2f}",
            f"{m.bytes_from_remote / measured_bytes:.2f}",
            f"{m.load_s:.2f}",
            f"{p.transfer_s:.2f}",
            f"{p.load_s:.2f}",
            f"{p.total_s:.2f}",
        ]
        for way, (m, p) in ways.items()
    ]
    headers = ["way", "fixed s", "peer frac", "remote frac", "load s", "xfer s*", "load s*"]
    print(table([*headers, "total s*"], rows))
    ratio = speedup(ways["autohet"][1], ways["remote-only"][1])
    print(
        f"  projected (*): autohet {ways['autohet'][1].total_s:.1f} s, remote-only "
        f"{ways['remote-only'][1].total_s:.1f} s: {ratio:.2f}x faster"
    )
    # The measured load includes fixed costs (listing, verification, DCP's plan) that a
    # small checkpoint inflates once scaled: the same at a stated disk rate, for scale.
    disk = RealSize(load_bytes_per_s=DISK_BYTES_PER_S)
    ours, base = (project(m, measured_bytes=measured_bytes, real=disk) for m, _ in ways.values())
    print(
        f"  with the load at a stated {DISK_BYTES_PER_S / 1e9:g} GB/s instead (a VM's local "
        f"NVMe; {ours.load_s:.1f} s): autohet {ours.total_s:.1f} s, remote-only "
        f"{base.total_s:.1f} s: {speedup(ours, base):.2f}x faster"
    )
    return ratio


def _projection_real_parts(results: Runs, measured_bytes: float) -> float | None:
    """Both ways with the restart, load and first step measured at the real size on a
    GPU host (``H200_1_2B``); detect, replan and the bytes' shares from here."""
    if measured_bytes <= 0:
        return None
    parts, real = H200_1_2B, RealSize()
    ways = {}
    for way, runs in results.items():
        measured = MeasuredWay(
            fixed_s=0.0,
            load_s=median(runs, "load") or 0.0,
            bytes_from_peers=median(runs, "bytes_peers") or 0.0,
            bytes_from_remote=median(runs, "bytes_remote") or 0.0,
        )
        detect_replan = (median(runs, "detect") or 0.0) + (median(runs, "replan") or 0.0)
        ways[way] = project_with(
            measured, detect_replan_s=detect_replan, measured_bytes=measured_bytes,
            parts=parts, real=real,
        )  # fmt: skip
    print(
        f"projection with the parts measured at the real size ({parts.where}): restart "
        f"{parts.restart_s:.2f} s, load {parts.load_s:.2f} s, first step {parts.first_step_s:.2f} s"
    )
    rows = [
        [way, f"{p.fixed_s:.2f}", f"{p.transfer_s:.2f}", f"{p.load_s:.2f}", f"{p.total_s:.2f}"]
        for way, p in ways.items()
    ]
    print(table(["way", "fixed s", "xfer s", "load s", "total s"], rows))
    ratio = speedup(ways["autohet"], ways["remote-only"])
    print(
        f"  projected: autohet {ways['autohet'].total_s:.1f} s, remote-only "
        f"{ways['remote-only'].total_s:.1f} s: {ratio:.2f}x faster"
    )
    return ratio
