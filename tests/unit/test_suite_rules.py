"""The suite's own rules (issue 44): tiers by folder, the unit tier starts no workers,
sshd or Slurm, a test over the slow limit says why, the torch range names real tests."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.torch_range import TORCH_RANGE
from tests.unit.conftest import other_tier

ROOT = Path(__file__).resolve().parents[2]
pytest_plugins = ["pytester"]


@pytest.mark.parametrize(
    ("argv", "tier"),
    [
        (["/usr/sbin/sshd", "-D", "-f", "x"], "e2e"),
        (["/usr/sbin/slurmd", "-D"], "e2e"),
        (["sbatch", "job.sh"], "e2e"),
        ([sys.executable, "-m", "torch.distributed.run", "--standalone"], "dist"),
        ([sys.executable, "-m", "autohet_cli.runtime.agent", "--nnodes", "1"], "dist"),
        ([sys.executable, "-u", "-m", "autohet_cli.runtime.train", "--plan", "p"], "dist"),
        (["torchrun", "--nproc-per-node", "2", "x.py"], "dist"),
        ([sys.executable, "-m", "autohet_cli.runtime.train", "--help"], None),
        ([sys.executable, "-c", "import autohet_cli.runtime.train_args"], None),
        ([sys.executable, "-m", "autohet_cli", "plan", "--model", "gpt-tiny"], None),
        (["ps", "-eo", "args"], None),
    ],
)
def test_the_unit_tier_knows_what_starts_workers_sshd_or_slurm(
    argv: list[str], tier: str | None
) -> None:
    assert other_tier(argv) == tier


def test_a_unit_test_that_starts_sshd_or_torchrun_fails_naming_the_tier() -> None:
    with pytest.raises(AssertionError, match=r"belong in tests/e2e"):
        subprocess.run(["/usr/sbin/sshd", "-D"], check=False)
    with pytest.raises(AssertionError, match=r"belong in tests/dist"):
        subprocess.Popen(f"{sys.executable} -m torch.distributed.run x.py", shell=True)
    import torch.multiprocessing as mp

    with pytest.raises(AssertionError, match=r"gloo worker processes.*tests/dist"):
        mp.spawn(print, nprocs=2)
    ok = subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True, text=True)
    assert ok.stdout == "1\n"  # a plain interpreter is fine


_INNER_CONFTEST = """
import pytest
from tests.conftest import SlowGuard, pytest_runtest_makereport  # noqa: F401

def pytest_configure(config):
    config.pluginmanager.register(SlowGuard(limit_s=0.2), "guard")
"""


def test_a_test_over_the_limit_without_a_reason_fails_the_session(
    pytester: pytest.Pytester,
) -> None:
    pytester.syspathinsert(ROOT)
    pytester.makeconftest(_INNER_CONFTEST)
    pytester.makepyfile(
        test_inner="""
        import time, pytest

        def test_quick():
            pass

        @pytest.mark.slow("it waits out a real deadline")
        def test_slow_with_reason():
            time.sleep(0.3)

        @pytest.mark.slow
        def test_slow_marker_without_reason():
            time.sleep(0.3)

        def test_slow_unmarked():
            time.sleep(0.3)
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(passed=4)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    text = result.stdout.str()
    assert "tests over the slow limit without a reason" in text
    named = set(re.findall(r"test_inner\.py::(\w+) \(", text))
    assert named == {"test_slow_marker_without_reason", "test_slow_unmarked"}


def test_tiers_come_from_folders_and_the_torch_range_names_collected_tests(
    pytestconfig: pytest.Config,
) -> None:
    for key in TORCH_RANGE:
        path, _, name = key.partition("::")
        assert (ROOT / path).is_file(), f"tests/torch_range.py: {path} does not exist"
        if name:
            func, _, param = name.partition("[")
            text = (ROOT / path).read_text(encoding="utf-8")
            assert re.search(rf"^def {re.escape(func)}\(", text, re.M), key
            assert not param or param.rstrip("]") in text, key
    assert pytestconfig.getini("norecursedirs"), "pytest's default skips tests/dist"
    assert "dist" not in pytestconfig.getini("norecursedirs")
