"""Workers and agents exit without the final garbage collections
(``workerbase.exiting``), and with everything else a normal exit gives."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from autohet_cli.runtime import agent, train

# A cycle whose finaliser runs only if the exit collects it; an exit hook registered
# after the freeze, as a library's would be; block-buffered output at the end.
SCRIPT = """
import atexit, sys
from autohet_cli.workerbase.exiting import skip_final_collection

class Cycle:
    def __del__(self):
        print("collected", file=sys.stderr, flush=True)

if sys.argv[1] == "freeze":
    skip_final_collection()
atexit.register(lambda: print("hook ran", file=sys.stderr, flush=True))
cycle = Cycle()
cycle.me = cycle
del cycle
import gc; gc.disable()  # only the exit's collections could find it
print("output")
sys.exit(3)
"""


def _exit(mode: str) -> subprocess.CompletedProcess[str]:
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, mode],
        cwd=root,
        env={"PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_exit_skips_the_collection_and_keeps_hooks_output_and_code() -> None:
    plain, frozen = _exit("plain"), _exit("freeze")
    assert "collected" in plain.stderr  # the script's cycle is what an exit collects
    assert "collected" not in frozen.stderr
    for res in (plain, frozen):
        assert res.returncode == 3 and res.stdout == "output\n", res
        assert "hook ran" in res.stderr


def test_the_worker_and_the_agent_exit_this_way() -> None:
    for module in (train, agent):
        main_block = Path(module.__file__).read_text().split('if __name__ == "__main__":')[1]
        assert "skip_final_collection()" in main_block, module.__name__
