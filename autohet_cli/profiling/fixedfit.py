"""The fixed costs the probe measured, fitted from its timings (pure).

Fixed costs do not show in any one measurement: a layer's time holds its ops'
dispatch, a training iteration's holds its loss, clip and optimizer launches.
They show as the intercept of time against work, so this module fits
``time = intercept + slope * work`` to the probe's medians at several amounts of
work:

- one op's host time (``DeviceFacts.op_us``, what the analytic model charges per
  op: ``catalog.FixedCosts.op_us``): the block's forward + backward at TP 1
  against the micro-batch size; at zero samples the block is its ops' dispatch
  alone, so the intercept over the block's op count (``estimates.fixed``) is the
  time of one op;
- a training iteration's cost beyond its layers (``DeviceFacts.step_ms``): the
  probe's iteration over 1, 2 and 4 norm layers (``fixed.iteration_ms``) against
  the number of layers. The runtime runs of ``profile run`` later refit the whole
  per-step cost, the trainer's own loop included (``Overhead.step_ms``).

On a shared host one size's median can still be off, so the line is Theil-Sen's
(``robust_line``). A fit needs two different amounts of work; one whose times do
not rise with the work measured nothing and is dropped (None: the catalog's
figure stands).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autohet_cli.estimates.fixed import layer_ops
from autohet_cli.estimates.profile import EntryKey, ProfileEntry
from autohet_cli.models import ModelSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasuredFixed:
    op_us: float | None  # one eager op's host time
    step_ms: float | None  # a training iteration beyond its layers

    def note(self) -> str:
        """The profile's note on what was fitted."""
        op = "not measured" if self.op_us is None else f"{self.op_us:.1f} us"
        step = "not measured" if self.step_ms is None else f"{self.step_ms:.2f} ms"
        return (
            f"fixed costs (fitted intercepts): {op} per op, {step} per training iteration "
            "beyond its layers"
        )


def fit_line(
    points: Sequence[tuple[float, float]], weights: Sequence[float] | None = None
) -> tuple[float, float] | None:
    """Weighted least squares (intercept, slope) of time against work; the intercept
    is clamped at 0. None without two different amounts of work."""
    w = list(weights) if weights is not None else [1.0] * len(points)
    if len(w) != len(points) or len({x for x, _ in points}) < 2:
        return None
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, points, strict=True)) / sw
    my = sum(wi * y for wi, (_, y) in zip(w, points, strict=True)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, points, strict=True))
    sxy = sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, points, strict=True))
    if sxx <= 0:
        return None
    slope = sxy / sxx
    return max(0.0, my - slope * mx), slope


def robust_line(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Theil-Sen (intercept, slope): the median of the slopes between every two points
    and the median intercept under it, so that one time a busy host inflated does not
    tilt the line as it would a least-squares fit; the intercept clamped at 0. None
    without two different amounts of work."""
    slopes = [
        (y2 - y1) / (x2 - x1)
        for i, (x1, y1) in enumerate(points)
        for x2, y2 in points[i + 1 :]
        if x2 != x1
    ]
    if not slopes:
        return None
    slope = statistics.median(slopes)
    return max(0.0, statistics.median(y - slope * x for x, y in points)), slope


def points_of(raw: Any) -> list[tuple[float, float]]:
    """(work, ms) pairs of a ``{work: ms}`` mapping; malformed pairs are skipped."""
    if not isinstance(raw, Mapping):
        return []
    out = []
    for work, ms in raw.items():
        try:
            x, y = float(work), float(ms)
        except (TypeError, ValueError):
            continue
        if x >= 0 and math.isfinite(y) and y >= 0:
            out.append((x, y))
    return out


def fixed_fit(
    iteration_ms: Any, block_ms: Sequence[tuple[float, float]], block_ops: int
) -> MeasuredFixed:
    """``iteration_ms``: the probe's ``{layers: ms}``; ``block_ms``: (micro-batch size,
    forward + backward ms) of one block at TP 1; ``block_ops``: the block's ops in
    both passes. None where a line has too few points or does not rise."""
    op_us = None
    block = robust_line(block_ms)
    if block is not None and block[1] > 0 and block[0] > 0 and block_ops > 0:
        op_us = block[0] / block_ops * 1e3
    iteration = robust_line(points_of(iteration_ms))
    step_ms = iteration[0] if iteration is not None and iteration[1] > 0 else None
    return MeasuredFixed(op_us=op_us, step_ms=step_ms)


def probe_fixed(
    model: ModelSpec, fixed: Any, entries: Mapping[EntryKey, ProfileEntry]
) -> MeasuredFixed:
    """The fit of one probe's result: one op's time from the block's TP 1 entries
    (``entries``, measured), an iteration's fixed part from its ``fixed`` section
    (absent before probe 1.2)."""
    layers = model.layers()
    block = next((i for i, layer in enumerate(layers) if layer.kind == "block"), None)
    points = []
    ops = 0
    if block is not None:
        ops = sum(layer_ops(layers[block], model))
        for k, e in entries.items():
            if k.tensor_parallel == 1:
                lt = e.layers[block]
                points.append((float(k.micro_batch_size), lt.fwd_ms + lt.bwd_ms))
    iterations = fixed.get("iteration_ms") if isinstance(fixed, Mapping) else None
    return fixed_fit(iterations, points, ops)
