"""The loss curve as text, and the metrics lines it is drawn from (runfiles.plot, metricsfile)."""

from __future__ import annotations

import json
import math

from autohet_cli.runfiles.metricsfile import LossSeries, parse_lines, tb_scalars
from autohet_cli.runfiles.plot import EVAL_MARK, TRAIN_MARK, terminal_plot


def _rows(text: str) -> list[str]:
    """The plot's rows: between the header and the axis."""
    return [ln.split("|", 1)[1] for ln in text.splitlines()[1:] if "|" in ln]


def test_a_falling_curve_starts_top_left_and_ends_bottom_right_within_72_columns() -> None:
    train = tuple((s, 8.0 - 0.03 * s) for s in range(200))  # more steps than columns
    text = terminal_plot(LossSeries(train=train))
    lines = text.splitlines()
    assert max(len(ln) for ln in lines) <= 72
    rows = _rows(text)
    assert len(rows) == 14
    assert rows[0].startswith(TRAIN_MARK)  # step 0 at the top, first column
    width = max(len(r) for r in rows)
    assert rows[-1].rstrip().endswith(TRAIN_MARK) and len(rows[-1].rstrip()) == width
    assert lines[0].startswith("loss (* train)")
    assert lines[1].strip().startswith("8 |")  # the top row carries the highest loss
    assert lines[-3].strip().startswith("2.03 |")  # the bottom row the lowest
    assert lines[-1].split() == ["0", "199", "step"]


def test_validation_points_are_drawn_over_the_training_curve_and_named() -> None:
    train = tuple((s, 5.0 - 0.01 * s) for s in range(1, 101))
    evals = ((50, 4.2), (100, 3.5))  # below the training loss: a plain overlay
    text = terminal_plot(LossSeries(train=train, eval=evals), width=60, height=10)
    assert text.splitlines()[0] == f"loss ({TRAIN_MARK} train, {EVAL_MARK} validation)"
    assert sum(r.count(EVAL_MARK) for r in _rows(text)) == 2
    assert max(len(ln) for ln in text.splitlines()) <= 60
    assert _rows(text)[-1].rstrip().endswith(EVAL_MARK)  # the lowest point, the last step
    same = terminal_plot(LossSeries(train=((1, 5.0), (2, 4.0)), eval=((2, 4.0),)))
    assert _rows(same)[-1].rstrip().endswith(EVAL_MARK)  # on one cell, validation shows


def test_nan_and_inf_are_left_out_and_counted() -> None:
    series = LossSeries(train=((1, 6.0), (2, math.nan), (3, 5.0), (4, math.inf)))
    text = terminal_plot(series)
    assert "2 not finite (nan/inf), not drawn" in text.splitlines()[0]
    assert sum(r.count(TRAIN_MARK) for r in _rows(text)) == 2


def test_a_flat_curve_and_a_single_point_still_draw() -> None:
    flat = terminal_plot(LossSeries(train=((1, 3.0), (2, 3.0), (3, 3.0))))
    assert sum(r.count(TRAIN_MARK) for r in _rows(flat)) == 3
    one = terminal_plot(LossSeries(train=((7, 2.5),)))
    assert sum(r.count(TRAIN_MARK) for r in _rows(one)) == 1
    assert "(no finite loss to plot)" in terminal_plot(LossSeries(train=((1, math.nan),)))


def test_metrics_lines_give_train_and_eval_series_the_last_line_of_a_step_winning() -> None:
    lines = [
        json.dumps({"step": 0, "loss": 7.5, "tokens": 64}),
        json.dumps({"step": 1, "loss": 7.0}),
        json.dumps({"step": 1, "ckpt_blocked_s": 0.2, "ckpt_persist_s": 1.0, "ckpt_bytes": 9}),
        json.dumps({"step": 1, "eval_loss": 7.2}),
        json.dumps({"step": 1, "loss": 6.9}),  # the step again (a resumed run)
        "not json",
        json.dumps(["a", "list"]),
        json.dumps({"step": "2", "loss": 1.0}),
        '{"step": 2, "loss": 6.',  # cut short: the file is being written
    ]
    series = parse_lines(lines)
    assert series.train == ((0, 7.5), (1, 6.9))
    assert series.eval == ((1, 7.2),)
    assert (series.last_step, series.last_loss, series.last_eval_loss) == (1, 6.9, 7.2)
    nan = parse_lines(['{"step": 3, "loss": NaN}'])
    assert nan.to_json()["train"] == [{"step": 3, "loss": None}]


def test_tensorboard_tags_of_each_kind_of_line() -> None:
    step = {"step": 3, "loss": 2.0, "lr": 0.1, "grad_norm": None, "tokens_per_s": 10.0}
    step |= {"mfu": 0.5, "peak_mem_bytes": [5, 6]}
    assert tb_scalars(step) == [
        ("train/loss", 2.0),
        ("train/lr", 0.1),
        ("perf/tokens_per_s", 10.0),
        ("perf/mfu", 0.5),
        ("memory/peak_bytes/rank0", 5.0),
        ("memory/peak_bytes/rank1", 6.0),
    ]
    assert tb_scalars({"step": 3, "eval_loss": 1.5}) == [("eval/loss", 1.5)]
    save = {"step": 3, "ckpt_blocked_s": 0.1, "ckpt_persist_s": 2.0, "ckpt_bytes": 7}
    assert [t for t, _ in tb_scalars(save)] == [
        "checkpoint/blocked_s",
        "checkpoint/persist_s",
        "checkpoint/bytes",
    ]
