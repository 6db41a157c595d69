"""Relative paths given to `autohet launch` (issue 31.1), end to end.

On the localhost cluster a relative ``--data`` and ``--init-from`` typed in some
project directory train (the workers start in ``~/autohet``, so they are given
the paths made absolute). On real sshd hosts a relative path is read from each
host's workdir, and a host that lacks it is named, with flag and path, by the
preflight before any worker starts.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import save_file

from autohet_cli.hfconfig import to_hf_config
from autohet_cli.models import get_model
from tests.cli import autohet
from tests.e2e.sshd import SshdFarm
from tests.e2e.test_launch import _cluster_file, _launch, _plan, _workers_alive
from tests.hf_reference import hf_state
from tests.unit.test_cli_launch_paths import localhost_plan

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(300)
def test_relative_data_and_init_from_train_on_localhost_from_another_directory(
    tmp_path: Path,
) -> None:
    plan = localhost_plan(tmp_path)
    cwd = tmp_path / "proj"
    (cwd / "build").mkdir(parents=True)
    tokens = np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.uint16)
    tokens.tofile(cwd / "build" / "tokens.bin")  # a flat nanoGPT-style token file
    hf = cwd / "my-gpt"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(to_hf_config(get_model("gpt-tiny"))))
    save_file(hf_state(), str(hf / "model.safetensors"))
    res = autohet(
        *("launch", str(plan), "--steps", "2", "--checkpoint-every", "0"),
        *("--data", "build/tokens.bin", "--init-from", "my-gpt"),
        cwd=cwd,
        timeout=280,
        env={"HOME": str(tmp_path), "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"reads --data build/tokens.bin as {cwd}/build/tokens.bin" in res.stdout
    assert f"reads --init-from my-gpt as {cwd}/my-gpt" in res.stdout
    assert re.findall(r"\[localhost\] step (\d+) loss", res.stdout) == ["0", "1"]


@pytest.mark.timeout(180)
def test_a_path_missing_on_a_remote_host_is_named_with_its_host_before_workers_start(
    sshd_farm: SshdFarm, tmp_path: Path
) -> None:
    sshd_farm.start(2)
    cluster = _cluster_file(sshd_farm, tmp_path / "cluster.yaml")
    plan = _plan(tmp_path, cluster, ((2, ((0, 3, "fake-2"), (3, 6, "fake-3"))),))
    first, second = sshd_farm.hosts
    there = first.root / "work" / "build" / "x.bin"  # relative to fake-2's workdir
    there.parent.mkdir(parents=True)
    there.write_bytes(b"\0\0" * 1000)
    started = time.monotonic()
    proc = _launch(plan, tmp_path, "--data", "build/x.bin")
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 1, out
    assert time.monotonic() - started < 60, out  # the preflight's seconds
    assert (
        f"paths: fake-3 ({second.address}) reads --data build/x.bin as "
        f"{second.root}/work/build/x.bin (relative paths on remote hosts are relative to the "
        "workdir)"
    ) in out  # the launch's first lines
    assert (
        f"host fake-3 ({second.address}): --data build/x.bin: no such file or directory "
        f"(read as {second.root}/work/build/x.bin: relative paths on remote hosts are "
        "relative to the workdir)"
    ) in out
    assert "host fake-2" not in out  # it has the file
    assert "rendezvous:" not in out and "Traceback" not in out
    assert not _workers_alive(sshd_farm)
