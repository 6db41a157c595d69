"""A diverged run's losses (1e308, inf, nan) read as numbers, not 300 digits or a
matplotlib warning (issue 45, item 7a)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest

from autohet_cli.runfiles.describe import loss_text
from autohet_cli.runfiles.metricsfile import LossSeries
from autohet_cli.runfiles.plot import TRAIN_MARK, terminal_plot, write_png
from tests.unit.test_runs_listing import plant, record, runs_command


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (4.6, "4.6000"),
        (0.0, "0.0000"),
        (1e308, "1e+308"),
        (-1e308, "-1e+308"),
        (123456.0, "1.235e+05"),
        (1.5e-7, "1.5e-07"),
        (math.inf, "inf"),
        (-math.inf, "-inf"),
        (math.nan, "nan"),
        (None, "-"),
    ],
)
def test_losses_are_short_whatever_their_size(value: float | None, text: str) -> None:
    assert loss_text(value) == text


def test_the_listing_and_show_print_a_huge_loss_short_and_plot_without_warnings(
    tmp_path: Path,
) -> None:
    plant(tmp_path / "runs", record(status="finished"), [6.0, 5.0, 1e308])
    listed = runs_command(tmp_path)
    assert "1e+308" in listed and "0" * 30 not in listed
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's overflow warning fails the test
        shown = runs_command(tmp_path, "show", "latest")
    assert "finished at step 2, loss 1e+308" in shown and "0" * 30 not in shown
    assert "1 above 1e+30, not drawn" in shown
    assert "inf |" not in shown  # the axis labels are numbers


def test_the_terminal_plot_leaves_out_huge_losses_and_says_so() -> None:
    series = LossSeries(train=((1, 6.0), (2, 1e308), (3, 5.0), (4, math.inf), (5, -1e40)))
    text = terminal_plot(series)
    header = text.splitlines()[0]
    assert "1 not finite (nan/inf), not drawn" in header
    assert "2 above 1e+30, not drawn" in header
    rows = [ln.split("|", 1) for ln in text.splitlines()[1:] if "|" in ln]
    assert sum(r[1].count(TRAIN_MARK) for r in rows) == 2
    assert [r[0].strip() for r in rows if r[0].strip()][::4] == ["6", "5"]


def test_the_png_skips_what_cannot_be_drawn_without_a_warning(tmp_path: Path) -> None:
    series = LossSeries(
        train=((1, 6.0), (2, 1e308), (3, math.inf), (4, math.nan), (5, 5.0)),
        eval=((5, 1e300),),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        png = write_png(series, tmp_path / "loss.png", title="lab.v1 run")
    assert png.read_bytes().startswith(b"\x89PNG")
    only_huge = LossSeries(train=((1, 1e308),))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_png(only_huge, tmp_path / "none.png", title="lab.v1 run")
