"""Direct peer copies: one-shot TCP stream between two hosts (here two local runners)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from autohet_cli.cluster import Host
from autohet_cli.errors import AutohetError
from autohet_cli.recovery.direct import direct_copy
from autohet_cli.transport.local import LocalRunner

LOCAL = Host(
    name="localhost",
    address="localhost",
    gpu_type="cpu",
    num_gpus=1,
    gpu_mem_bytes=1 << 30,
    intra_node_gbps=80.0,
)


def test_file_arrives_intact_and_atomically(tmp_path: Path) -> None:
    src = tmp_path / "a" / "__0_0.distcp"
    src.parent.mkdir()
    blob = os.urandom(3 << 20)
    src.write_bytes(blob)
    dest = tmp_path / "b" / "step" / "__0_0.distcp"
    with LocalRunner("a") as ra, LocalRunner("b") as rb:
        direct_copy(ra, LOCAL, str(src), rb, LOCAL, str(dest))
    assert dest.read_bytes() == blob
    assert not list(dest.parent.glob("*.autohet-part"))


def test_a_missing_source_fails_so_the_caller_can_relay(tmp_path: Path) -> None:
    with LocalRunner("a") as ra, LocalRunner("b") as rb, pytest.raises(AutohetError):
        direct_copy(ra, LOCAL, str(tmp_path / "nope"), rb, LOCAL, str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()
