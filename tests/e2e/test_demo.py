"""`make demo` on a workstation where another torchrun already holds port 29500.

The demo tokenizes the shipped sample corpus with the shipped tokenizer (`autohet
data prepare`), plans a small LLaMA on the embedded localhost cluster and launches
it with a run config: the validation loss it prints must fall, and the plan's
analytic step time must be near the measured one.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def port_29500_taken() -> Iterator[None]:
    """Listen on 29500 on every interface, as a torchrun would (or find it taken already)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("", 29500))
        s.listen(1)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
    try:
        yield
    finally:
        s.close()


@pytest.mark.slow("make demo itself: SCIP plans, tokenizes, then 80 steps with evals")
def test_make_demo_passes_while_another_process_listens_on_29500(
    port_29500_taken: None, tmp_path: Path
) -> None:
    if shutil.which("make") is None or not (ROOT / ".venv" / ".installed-stamp").exists():
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("CI: make and the .venv from `make install` are required")
        pytest.skip("needs make and the .venv made by `make install`")
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", 29500)) == 0  # really taken
    started = time.time()
    res = subprocess.run(
        ["make", "-C", str(ROOT), "demo", f"PLANS={tmp_path}", f"DATA={tmp_path / 'data'}"],
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST")},
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "EADDRINUSE" not in out and "autohet recover" not in out, out[-4000:]
    assert "finished:" in out and "checkpoints: auto" in out, out[-4000:]
    assert "202,842 tokens (uint16, vocab 2,048)" in out, out[-4000:]
    assert "predicted vs measured" in out and "prediction-check.json" in out, out[-4000:]
    assert "memory under-predicted" not in out, out[-4000:]
    evals = [float(v) for v in re.findall(r"eval_loss ([0-9.]+)", out)]
    assert len(evals) >= 3, out[-4000:]
    assert evals[0] > 7.0 and evals[-1] < evals[0] - 1.5, evals  # ln(2048) = 7.62 at the start
    _the_prediction_is_near_the_real_step(out, started)


# The demo's prediction against its real steps (issue 31.6; this was its own test, which
# launched the demo's plan up to three more times). `make demo` plans llama-tiny on the
# embedded localhost cluster with no profile, so its step time is the analytic model's.
# Before the model counted fixed costs (per op, per message, per step) it predicted 37 ms
# for a ~420 ms step (0.09x) and did not say the figure was a catalog estimate. The
# issue's band, 1.5x, holds on the quiet machine the CPU stand-in's figures were measured
# on (154 ms predicted, 128-172 measured); a CPU twice as fast or as loaded moves the
# measured step 2x, which no analytic figure can follow, so this guards the order of
# magnitude anywhere: 3x, which the old 0.09x fails by far.
BAND = 3.0


def _the_prediction_is_near_the_real_step(out: str, started: float) -> None:
    # the check says where its prediction came from, in plain words
    assert "ms predicted from the analytic model (no measured profile" in out, out[-4000:]
    assert "`autohet profile run` measures this cluster" in out, out[-4000:]
    found = [
        p
        for p in (ROOT / "runs").glob("demo-local.v*/*/prediction-check.json")
        if p.stat().st_mtime >= started
    ]
    assert len(found) == 1, found
    check = json.loads(found[0].read_text(encoding="utf-8"))
    assert check["prediction_source"] == "analytic"
    assert check["steps_measured"] >= 10
    ratio = check["step"]["predicted_ms"] / check["step"]["measured_ms"]
    assert 1 / BAND <= ratio <= BAND, check["step"]
