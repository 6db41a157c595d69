"""A run's loss curve: as plain text for the terminal, and as a PNG (matplotlib).

The text plot needs nothing but the series, so it works over SSH, in CI logs and in
a pipe. Each point is drawn where its step and loss fall (several steps share a
column when there are more steps than columns: the spread then shows the noise);
validation points are drawn over the training ones. NaN and infinite losses are not
drawn, nor are losses beyond ``MAX_DRAWN`` (a diverged run's 1e308: the axis
arithmetic overflows on them, in our labels and in matplotlib's ticks, and the
real curve would be one flat line under it); the header (the PNG's title) says
how many were left out. A job's curve spans several runs: where one ended and the
next resumed is a column of ``BREAK_MARK`` (a dashed line in the PNG, and the
steps the next run did again shaded), so a jump in the loss is seen to be a resume,
not the training. matplotlib is imported only to draw the PNG, so that ``autohet
--help`` and ``autohet runs`` stay fast.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from autohet_cli.runfiles.listing import RunsError
from autohet_cli.runfiles.metricsfile import LossSeries

TRAIN_MARK, EVAL_MARK, BREAK_MARK = "*", "o", ":"
PNG_FILE = "loss.png"
MAX_DRAWN = 1e30  # no loss gets near it but a diverged one


def drawable(
    series: LossSeries,
) -> tuple[list[tuple[int, float]], list[tuple[int, float]], str]:
    """The train and validation points that can be drawn, and what was left out
    (``"; 2 not finite (nan/inf), not drawn"``, "" when nothing was)."""
    train = [(s, v) for s, v in series.train if math.isfinite(v) and abs(v) <= MAX_DRAWN]
    evals = [(s, v) for s, v in series.eval if math.isfinite(v) and abs(v) <= MAX_DRAWN]
    values = [v for _, v in (*series.train, *series.eval)]
    not_finite = sum(1 for v in values if not math.isfinite(v))
    huge = sum(1 for v in values if math.isfinite(v) and abs(v) > MAX_DRAWN)
    note = f"; {not_finite} not finite (nan/inf), not drawn" if not_finite else ""
    if huge:
        note += f"; {huge} above {MAX_DRAWN:.0e}, not drawn"
    return train, evals, note


def terminal_plot(
    series: LossSeries, *, width: int = 72, height: int = 14, breaks: Sequence[int] = ()
) -> str:
    """The loss curve in ``width`` columns: a header, ``height`` rows, the step axis.
    ``breaks``: the steps a run resumed at (a job's curve), drawn behind the points."""
    train, evals, left_out = drawable(series)
    header = f"loss ({TRAIN_MARK} train" + (f", {EVAL_MARK} validation" if evals else "")
    header += f", {BREAK_MARK} a run resumed)" if breaks else ")"
    header += left_out
    points = train + evals
    if not points:
        return header + "\n(no finite loss to plot)"
    lo, hi = _span(min(v for _, v in points), max(v for _, v in points))
    first, last = min(s for s, _ in points), max(s for s, _ in points)
    labels = {row: f"{hi - row * (hi - lo) / (height - 1):.4g}" for row in _label_rows(height)}
    label_w = max(len(t) for t in labels.values())
    cols = max(2, width - label_w - 2)
    grid = [[" "] * cols for _ in range(height)]

    def column(step: int) -> int:
        return 0 if last == first else round((step - first) / (last - first) * (cols - 1))

    for step in breaks:
        if first <= step <= last:
            for cells in grid:
                cells[column(step)] = BREAK_MARK
    for mark, pts in ((TRAIN_MARK, train), (EVAL_MARK, evals)):
        for step, value in pts:
            row = round((hi - value) / (hi - lo) * (height - 1))
            grid[row][column(step)] = mark
    lines = [header]
    for row, cells in enumerate(grid):
        lines.append(f"{labels.get(row, ''):>{label_w}} |{''.join(cells).rstrip()}")
    lines.append(" " * label_w + " +" + "-" * cols)
    left, right = str(first), f"{last} step"
    gap = max(1, cols - len(left) - len(right))
    lines.append(" " * (label_w + 2) + left + " " * gap + right)
    return "\n".join(lines)


def _span(lo: float, hi: float) -> tuple[float, float]:
    """The value range, widened when every point has the same loss."""
    if hi > lo:
        return lo, hi
    pad = abs(lo) * 0.05 or 0.5
    return lo - pad, hi + pad


def _label_rows(height: int) -> list[int]:
    """Rows that carry a value: top, bottom, and every quarter between."""
    return sorted({0, height - 1, *(round(q * (height - 1) / 4) for q in (1, 2, 3))})


def write_png(
    series: LossSeries,
    path: Path,
    *,
    title: str,
    breaks: Sequence[tuple[int, str]] = (),
    replaced: Sequence[tuple[int, int]] = (),
) -> Path:
    """Draw the loss curve into ``path`` (replaced atomically); returns ``path``.
    ``breaks``: (step, the run that resumed there); ``replaced``: step spans logged
    again by a later run (shaded)."""
    from matplotlib.figure import Figure  # lazily: see the module's docstring

    train, evals, left_out = drawable(series)
    fig = Figure(figsize=(8, 4.5), dpi=100)
    ax = fig.add_subplot()
    if train:
        steps, losses = zip(*train, strict=True)
        ax.plot(steps, losses, linewidth=1.2, label="train loss")
    if evals:
        steps, losses = zip(*evals, strict=True)
        ax.plot(steps, losses, "o-", markersize=4, label="validation loss")
    for start, end in replaced:
        ax.axvspan(start, end, color="tab:orange", alpha=0.12, linewidth=0)
    for step, run in breaks:
        ax.axvline(step, color="gray", linestyle="--", linewidth=0.8)
        ax.annotate(
            run,
            (step, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
            color="gray",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title + (f"\n{left_out.removeprefix('; ')}" if left_out else ""))
    ax.grid(alpha=0.3)
    if train or evals:
        ax.legend()
    fig.tight_layout()
    # A fresh, exclusive temporary name (mkstemp), never one a symlink planted at a
    # predictable name could redirect; renamed over the old plot when complete.
    tmp: Path | None = None
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        tmp = Path(name)
        with os.fdopen(fd, "wb") as fh:
            fig.savefig(fh, format="png")
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise RunsError(f"{path}: cannot write the plot: {exc.strerror or exc}") from None
    return path
