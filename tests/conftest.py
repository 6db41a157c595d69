"""Suite-wide rules: private caches, tiers by folder, and the guard against regrowth.

- Every test process (and what it starts) keeps autohet's on-disk caches in a
  directory of its own, not the user's ``~/.cache`` (``autohet_cli.yamlcache``).
- A test's tier is its folder: ``tests/unit`` (logic, in this process), ``tests/dist``
  (gloo worker processes) and ``tests/e2e`` (real sshd, torchrun, Slurm, the CLI as a
  user runs it) get the ``unit``, ``dist`` and ``e2e`` markers, so ``-m`` selects a tier.
  ``tests/unit/conftest.py`` refuses worker processes, sshd and Slurm in the unit tier.
- The tests listed in ``tests/torch_range.py`` get the ``torch_range`` marker: what
  ``make test-torch TORCH=X`` runs under another torch release.
- A test whose call takes more than ``SLOW_LIMIT_S`` carries its reason,
  ``@pytest.mark.slow("one line: why it cannot be cheaper")``; one that does not fails
  the session, naming itself (the suite has to fit a 2-core machine: issue 44).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Generator
from pathlib import Path

import pytest

from tests.torch_range import TORCH_RANGE

os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="autohet-test-cache-")

SLOW_LIMIT_S = 30.0
_TIERS = ("unit", "dist", "e2e")
_RUN_ORDER = ("e2e", "dist", "unit")  # the heaviest tier first
_HERE = Path(__file__).resolve().parent


def suite_id(item: pytest.Item) -> tuple[str, str] | None:
    """(``tests/<tier>/<file>.py``, ``...::name``) of a test of this suite, else None."""
    try:
        path = Path(item.path).resolve().relative_to(_HERE.parent).as_posix()
    except ValueError:
        return None
    return path, f"{path}::{item.name}"


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The heavy tiers first (e2e, then dist, then unit; a file's tests stay in order):
    # xdist hands out files in this order (the Makefile's --no-loadscope-reorder), and
    # the many small unit files even out the two workers' ends.
    items.sort(key=_tier_rank)
    for item in items:
        ids = suite_id(item)
        if ids is None:
            continue
        path, test = ids
        tier = path.split("/")[1]
        if tier in _TIERS:
            item.add_marker(tier)
        if path in TORCH_RANGE or test in TORCH_RANGE:
            item.add_marker("torch_range")


def _tier_rank(item: pytest.Item) -> int:
    ids = suite_id(item)
    tier = ids[0].split("/")[1] if ids is not None else ""
    return _RUN_ORDER.index(tier) if tier in _RUN_ORDER else len(_RUN_ORDER)


def slow_reason(item: pytest.Item) -> str | None:
    """The one-line reason a test gives for being slow, or None."""
    marker = item.get_closest_marker("slow")
    if marker is None:
        return None
    reason = marker.args[0] if marker.args else marker.kwargs.get("reason")
    return reason.strip() if isinstance(reason, str) and reason.strip() else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call":
        # Runs where the test runs (an xdist worker too); the controller sees only the
        # report, so the reason travels in it.
        report.user_properties.append(("slow_reason", slow_reason(item) or ""))
    return report


class SlowGuard:
    """Collects, on the process that prints the summary (xdist's controller or the only
    process), the tests that ran over the limit without a reason, and fails the session."""

    def __init__(self, limit_s: float = SLOW_LIMIT_S) -> None:
        self.limit_s = limit_s
        self.unreasoned: list[str] = []

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call" or report.duration <= self.limit_s or report.skipped:
            return
        if not dict(report.user_properties).get("slow_reason"):
            self.unreasoned.append(f"{report.nodeid} ({report.duration:.1f} s)")

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.unreasoned:
            return
        terminalreporter.section("tests over the slow limit without a reason", red=True)
        terminalreporter.write_line(
            f"each test over {self.limit_s:g} s carries @pytest.mark.slow('why'): "
            "make it cheaper or say why it cannot be"
        )
        for line in self.unreasoned:
            terminalreporter.write_line(f"  {line}")

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.unreasoned and exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # not an xdist worker
        config.pluginmanager.register(SlowGuard(), "autohet-slow-guard")
    else:
        # An xdist worker has one of the machine's cores, not the two the planner sees:
        # it forks no helper process unless a test asks for one (test_planner_parallel,
        # test_planner_speed_parts set it). In one full run a planner child forked from a
        # worker (execnet's thread, earlier tests' threads) never answered and the search
        # waited out its 60 s limit; alone it takes 1.7 s.
        os.environ.setdefault("AUTOHET_PLANNER_PROCESSES", "1")
