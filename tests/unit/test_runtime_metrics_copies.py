"""Rank 0's metrics reach the launcher's run folder: a copy on this machine, or a stream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autohet_cli.runfiles.metricsfile import METRIC_PREFIX
from autohet_cli.runtime.hooks import MetricsHook
from autohet_cli.runtime.metrics import MetricsWriter, StepResult

SAVE = {"step": 1, "ckpt_blocked_s": 0.1, "ckpt_persist_s": 1.0, "ckpt_bytes": 10}


def _step(step: int) -> StepResult:
    return StepResult(step=step, loss=7.0 - step, tokens=64, time_s=0.5, lr=1e-3)


def test_the_copy_and_the_stream_carry_the_hosts_lines_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, folder = tmp_path / "host.jsonl", tmp_path / "folder.jsonl"
    writer = MetricsWriter(host, echo=False, copy_to=folder, stream=True)
    writer.write(_step(0))
    writer.write_eval(0, 7.5)
    writer.write_checkpoint(SAVE)
    writer.close()
    lines = host.read_text().splitlines()
    assert len(lines) == 3 and folder.read_text().splitlines() == lines
    streamed = [ln[len(METRIC_PREFIX) :] for ln in capsys.readouterr().out.splitlines()]
    assert streamed == lines
    assert json.loads(lines[1]) == {"step": 0, "eval_loss": 7.5}


def test_a_copy_that_cannot_be_written_is_dropped_with_a_note_and_training_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host = tmp_path / "host.jsonl"
    writer = MetricsWriter(host, echo=False, copy_to=tmp_path / "gone" / "metrics.jsonl")
    writer.write(_step(0))
    writer.write(_step(1))
    out = capsys.readouterr().out
    assert out.count("note: metrics no longer copied to") == 1
    assert len(host.read_text().splitlines()) == 2


def test_a_save_recorded_after_training_ended_reaches_the_copy_too(tmp_path: Path) -> None:
    folder = tmp_path / "folder.jsonl"
    hook = MetricsHook(tmp_path / "host.jsonl", copy_to=folder)  # its writer closed (None)
    hook.write_checkpoint(SAVE)
    assert [json.loads(ln) for ln in folder.read_text().splitlines()] == [SAVE]
    only_folder = MetricsHook(None, copy_to=tmp_path / "only.jsonl")
    only_folder.write_checkpoint(SAVE)
    assert (tmp_path / "only.jsonl").is_file()


def test_streamed_lines_from_the_save_thread_and_the_steps_never_glue() -> None:
    """print() wrote the text and its newline apart: a checkpoint record from the
    save's thread and a step's line glued into one unparsable line (about 3% of
    them, here), and the launcher lost those points of a remote rank 0's curve."""
    import json
    import subprocess
    import sys
    import textwrap

    from autohet_cli.runfiles.metricsfile import METRIC_PREFIX

    script = textwrap.dedent(
        """
        import threading
        from autohet_cli.runtime.metrics import MetricsWriter, StepResult
        w = MetricsWriter(None, stream=True, echo=True)
        def saves():
            for i in range(3000):
                w.write_checkpoint({"step": i, "ckpt_blocked_s": 0.1,
                                    "ckpt_persist_s": 0.2, "ckpt_bytes": 10})
        t = threading.Thread(target=saves)
        t.start()
        for i in range(3000):
            w.write(StepResult(step=i, loss=1.0, tokens=10, time_s=0.1, grad_norm=0.5))
        t.join()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    ).stdout.splitlines()
    streamed = [ln for ln in out if METRIC_PREFIX in ln]
    assert len(streamed) == 6000
    for ln in streamed:
        assert ln.startswith(METRIC_PREFIX), ln
        json.loads(ln[len(METRIC_PREFIX) :])
    assert sum(ln.startswith("step ") for ln in out) == 3000
