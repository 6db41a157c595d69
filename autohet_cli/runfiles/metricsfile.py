"""The ``metrics.jsonl`` contract: its lines, how they reach the run folder, their tags.

Each line is one JSON object with a ``step``: a step's figures (``loss``, ``tokens``,
``lr``, ``grad_norm``, ...), a validation loss (``{"step": N, "eval_loss": X}``) or a
save's figures (``ckpt_blocked_s``, ``ckpt_persist_s``, ``ckpt_bytes``). Rank 0 writes
them in its host's run directory and, for the launcher's run folder:

- rank 0's host is this machine (``FOLDER_ENV`` names the folder): it appends the same
  lines to the folder's ``metrics.jsonl`` and writes TensorBoard events there itself;
- a remote host (``STREAM_ENV``): it also prints each line on stdout after
  ``METRIC_PREFIX``, and the launcher, which reads that output anyway, appends it to
  the folder's file (``launch.collect``).

``tb_scalars`` is the one mapping of a line to TensorBoard tags, for both writers.
Pure: reading a file is the only effect.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autohet_cli.runfiles.record import RunRecordError

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
# The launcher's run folder (absolute, on this machine): rank 0 writes its metrics there too.
FOLDER_ENV = "AUTOHET_RUN_FOLDER"
# "1": rank 0 prints each metrics line for the launcher (its host is not the launcher's).
STREAM_ENV = "AUTOHET_METRICS_STREAM"
METRIC_PREFIX = "autohet-metric: "


def tb_scalars(record: Mapping[str, Any]) -> list[tuple[str, float]]:
    """A metrics line as TensorBoard ``(tag, value)`` pairs, at ``record["step"]``."""
    if "eval_loss" in record:
        return [("eval/loss", float(record["eval_loss"]))]
    if "ckpt_blocked_s" in record:
        keys = ("ckpt_blocked_s", "ckpt_persist_s", "ckpt_bytes")
        return [(f"checkpoint/{k.removeprefix('ckpt_')}", float(record[k])) for k in keys]
    if "loss" not in record:
        return []
    out = [("train/loss", float(record["loss"])), ("train/lr", float(record.get("lr", 0.0)))]
    if record.get("grad_norm") is not None:
        out.append(("train/grad_norm", float(record["grad_norm"])))
    out.append(("perf/tokens_per_s", float(record.get("tokens_per_s", 0.0))))
    if record.get("mfu") is not None:
        out.append(("perf/mfu", float(record["mfu"])))
    for rank, nbytes in enumerate(record.get("peak_mem_bytes") or ()):
        out.append((f"memory/peak_bytes/rank{rank}", float(nbytes)))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class LossSeries:
    """Train and validation loss by step (the last line of a step wins), step order."""

    train: tuple[tuple[int, float], ...] = ()
    eval: tuple[tuple[int, float], ...] = ()

    @property
    def last_step(self) -> int | None:
        return self.train[-1][0] if self.train else None

    @property
    def last_loss(self) -> float | None:
        return self.train[-1][1] if self.train else None

    @property
    def last_eval_loss(self) -> float | None:
        return self.eval[-1][1] if self.eval else None

    def to_json(self) -> dict[str, Any]:
        return {
            "train": [{"step": s, "loss": _json_number(v)} for s, v in self.train],
            "eval": [{"step": s, "eval_loss": _json_number(v)} for s, v in self.eval],
        }


def parse_lines(lines: Iterable[str]) -> LossSeries:
    """The loss series of metrics lines. A line that is not a JSON object with an integer
    step is skipped: the last line of a file being written may be cut short."""
    train: dict[int, float] = {}
    evals: dict[int, float] = {}
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        for key, into in (("loss", train), ("eval_loss", evals)):
            value = record.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                into[step] = float(value)
    return LossSeries(train=tuple(sorted(train.items())), eval=tuple(sorted(evals.items())))


TAIL_BYTES = 256 * 1024  # enough for the last few hundred steps' lines


def read_series(path: Path, *, tail_bytes: int | None = None) -> LossSeries | None:
    """``path``'s loss series; None when the file does not exist. ``tail_bytes``: only
    the file's end (its last whole lines): the last step and loss of a long run
    without reading its whole history (500k steps are ~130 MB of lines)."""
    try:
        if tail_bytes is None:
            text = path.read_text(encoding="utf-8", errors="replace")
        else:
            with path.open("rb") as fh:
                size = fh.seek(0, os.SEEK_END)
                fh.seek(max(0, size - tail_bytes))
                raw = fh.read()
            if size > tail_bytes:
                raw = raw.partition(b"\n")[2]  # a cut first line is not a line
            text = raw.decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None
    except OSError as exc:  # a directory, another user's file: one run's problem
        raise RunRecordError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return parse_lines(text.splitlines())


HEAD_BYTES = 64 * 1024  # the first few hundred lines: a run's first steps


def first_train_step(path: Path, *, head_bytes: int = HEAD_BYTES) -> int | None:
    """The first step ``path``'s run trained: 0 for a fresh run, the checkpoint's step
    for a resumed one (it runs that step first). Read from the file's head, so a
    listing links the runs of a job without reading their whole histories; None
    when there is no file, or no step in its head (an unreadable file is said by
    ``read_series``)."""
    try:
        with path.open("rb") as fh:
            raw = fh.read(head_bytes + 1)
    except OSError:
        return None
    if len(raw) > head_bytes:
        raw = raw[:head_bytes].rpartition(b"\n")[0]  # a cut last line is not a line
    series = parse_lines(raw.decode("utf-8", errors="replace").splitlines())
    return min((s for s, _ in series.train), default=None)


def _json_number(value: float) -> float | None:
    """NaN and infinity are not JSON: scripts get null (the text says nan)."""
    return value if math.isfinite(value) else None
