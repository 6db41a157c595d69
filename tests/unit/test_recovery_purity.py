"""The pure half of recovery imports no torch, paramiko, subprocess or pyscipopt
(each module imported in a fresh interpreter, as in test_purity)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.cli import run

ROOT = Path(__file__).resolve().parents[2]
PURE = (
    "autohet_cli.recovery",
    "autohet_cli.recovery.errors",
    "autohet_cli.recovery.manifest",
    "autohet_cli.recovery.replan",
    "autohet_cli.recovery.transfer",
    "autohet_cli.recovery.report",
)
FORBIDDEN = (
    "torch",
    "paramiko",
    "subprocess",
    "pyscipopt",
    "autohet_cli.transport",
    "autohet_cli.runtime",
    "autohet_cli.cli",
)
_PROBE = (
    "import importlib, json, sys; importlib.import_module(sys.argv[1]); "
    "print(json.dumps(sorted(m for m in json.loads(sys.argv[2]) if m in sys.modules)))"
)


@pytest.mark.parametrize("module", PURE)
def test_recovery_module_is_pure(module: str) -> None:
    proc = run([sys.executable, "-c", _PROBE, module, json.dumps(FORBIDDEN)], cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
