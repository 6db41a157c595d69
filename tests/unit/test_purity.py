"""Rule of the house: the pure core imports no torch, paramiko or subprocess.

Each pure module is imported in a fresh interpreter (so nothing this test
process already loaded can hide or fake an import) and must leave none of the
forbidden modules in ``sys.modules``. An import hook records which autohet
module pulled a forbidden one in, so a failure says where to look.
pyscipopt is forbidden at import time too: solver code imports it lazily.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "autohet_cli"

# Modules of the pure core (packages: every module under them, found on disk).
PURE_MODULES = (
    "autohet_cli.errors",
    "autohet_cli.yamlio",
    "autohet_cli.tomlio",
    "autohet_cli.catalog",
    "autohet_cli.gputypes",
    "autohet_cli.cluster",
    "autohet_cli.models",
    "autohet_cli.layerspec",
    "autohet_cli.modelspec",
    "autohet_cli.hffamilies",
    "autohet_cli.slurmconf",
    "autohet_cli.launch.backend",
    "autohet_cli.architecture",
    "autohet_cli.hfconfig",
    "autohet_cli.plan",
    "autohet_cli.defaults",
    "autohet_cli.profiling.schema",
    "autohet_cli.profiling.analytic",
    "autohet_cli.profiling.sailor",
    "autohet_cli.profiling.measure",
    "autohet_cli.profiling.fixedfit",
    "autohet_cli.settings",
    "autohet_cli.limits",
    "autohet_cli.names",
    "autohet_cli.inputs",
    "autohet_cli.launch.specs",
    "autohet_cli.launch.triage",
    "autohet_cli.launch.logcause",
    "autohet_cli.oom",
    "autohet_cli.paths",
    "autohet_cli.recovery.manifest",
    "autohet_cli.recovery.replan",
    "autohet_cli.recovery.transfer",
    "autohet_cli.recovery.report",
    "autohet_cli.runconfig",
    "autohet_cli.dataset.formats",
    "autohet_cli.dataset.megatron",
    "autohet_cli.dataset.permutation",
    "autohet_cli.dataset.vocab",
    "autohet_cli.trace",
    "autohet_cli.launch.compare",
    "autohet_cli.profiling.calibrate",
    "autohet_cli.profiling.runshapes",
    # The checkpoint contract; the rest of autohet_cli.ckpt is the workers' side (torch).
    "autohet_cli.ckpt",
    "autohet_cli.ckpt.format",
    "autohet_cli.ckpt.policy",
    "autohet_cli.ckpt.retention",
    "autohet_cli.ckpt.notice",
    "autohet_cli.ckpt.steptext",
)
# The run folder's readers: `autohet runs` must start fast (matplotlib only for a PNG).
PURE_PACKAGES = (
    "autohet_cli.costmodel",
    "autohet_cli.planner",
    "autohet_cli.runfiles",
    "autohet_cli.estimates",
)

# The only names above that may be absent (not written yet). Keep this explicit:
# a listed module that exists is checked anyway; an unlisted one that is missing fails.
NOT_WRITTEN_YET: frozenset[str] = frozenset()

FORBIDDEN = ("torch", "paramiko", "subprocess", "pyscipopt")
EFFECT_MODULES = ("autohet_cli.cli", "autohet_cli.transport", "autohet_cli.runtime")

_PROBE = r"""
import importlib, json, sys, traceback

target, pkg_dir, watched = sys.argv[1], sys.argv[2], tuple(json.loads(sys.argv[3]))
culprits = {}


class Spy:
    def find_spec(self, name, path=None, target=None):
        top = next((w for w in watched if name == w or name.startswith(w + ".")), None)
        if top is not None and top not in culprits:
            frames = [f for f in traceback.extract_stack() if f.filename.startswith(pkg_dir)]
            culprits[top] = [f"{f.filename[len(pkg_dir):]}:{f.lineno}" for f in frames]
        return None


sys.meta_path.insert(0, Spy())
importlib.import_module(target)
loaded = {w: culprits.get(w, []) for w in watched if w in sys.modules}
print(json.dumps(loaded))
"""


def _module_file(name: str) -> Path | None:
    rel = Path(*name.split(".")[1:])
    for candidate in (PKG / rel.with_suffix(".py"), PKG / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _package_modules(package: str) -> list[str]:
    init = _module_file(package)
    if init is None or init.name != "__init__.py":
        return [package]
    found = []
    for path in sorted(init.parent.rglob("*.py")):
        parts = path.relative_to(PKG).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found.append(".".join(("autohet_cli", *parts)))
    return found


def _modules_to_check() -> list[str]:
    names = list(PURE_MODULES)
    for package in PURE_PACKAGES:
        names += _package_modules(package)
    return names


def _probe(module: str, pkg_dir: Path, watched: list[str], *path: Path) -> dict[str, list[str]]:
    """Import ``module`` in a fresh interpreter; the watched modules it loaded, and via where."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, module, str(pkg_dir) + os.sep, json.dumps(watched)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in path)},
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"importing {module} failed:\n{proc.stderr}"
    loaded: dict[str, list[str]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return loaded


@pytest.mark.parametrize("module", _modules_to_check())
def test_pure_module_imports_no_effects(module: str) -> None:
    if _module_file(module) is None:
        if module in NOT_WRITTEN_YET:
            pytest.skip(f"{module} is not written yet")
        pytest.fail(f"{module} does not exist; fix the list in {Path(__file__).name}")
    loaded = _probe(module, PKG, [*FORBIDDEN, *EFFECT_MODULES], ROOT)
    problems = [f"{name} (imported via {' -> '.join(via) or '?'})" for name, via in loaded.items()]
    assert not problems, f"{module} must stay pure but loads: {'; '.join(problems)}"


def test_probe_catches_and_locates_a_forbidden_import(tmp_path: Path) -> None:
    (tmp_path / "impure.py").write_text("import json\nimport subprocess\n", encoding="utf-8")
    (tmp_path / "clean.py").write_text("import json\n", encoding="utf-8")
    watched = [*FORBIDDEN, *EFFECT_MODULES]
    assert _probe("impure", tmp_path, watched, tmp_path, ROOT) == {"subprocess": ["impure.py:2"]}
    assert _probe("clean", tmp_path, watched, tmp_path, ROOT) == {}
