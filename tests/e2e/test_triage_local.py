"""A real launch on the localhost cluster whose worker fails in a way the launcher
cannot check first (issue 31.2): a user script's own arguments. The root cause is the
failing worker's argparse line, not the SIGTERM torchrun sent the other worker, and
nothing says "out of memory"."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.cli import autohet

pytestmark = pytest.mark.e2e

SCRIPT = """\
import argparse, os, time
parser = argparse.ArgumentParser(prog="my_train.py")
parser.add_argument("--epochs", type=int, required=True)
if os.environ["RANK"] == "1":
    parser.parse_args()
time.sleep(120)  # rank 0: until torchrun stops it
"""


@pytest.mark.timeout(300)
def test_a_user_scripts_refused_argument_is_the_root_cause_not_a_signal(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path)}  # the localhost workdir is ~/autohet
    made = autohet(
        "plan", "--model", "llama-tiny", "--global-batch-size", "8", "--precision", "fp32",
        cwd=tmp_path, env=env,
    )  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    plan = next((tmp_path / "plans").glob("*.yaml"))
    script = tmp_path / "my_train.py"
    script.write_text(SCRIPT)
    started = time.monotonic()
    res = autohet(
        "launch", str(plan), "--", str(script), "--epochs=abc", cwd=tmp_path, env=env, timeout=240
    )
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert time.monotonic() - started < 200, out  # not the 120 s rank 0 would sleep
    failed = re.search(r"^failed: .*$", res.stdout, re.M)
    assert failed is not None, out
    assert failed.group(0).endswith(
        "root cause: rank 1 on localhost: my_train.py refused its arguments: argument "
        "--epochs: invalid int value: 'abc' (exit code 2)"
    ), failed.group(0)
    assert "memory" not in out.lower(), out
