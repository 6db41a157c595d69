"""`autohet recover` pins the step it copies on each source host and in the remote copy."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from autohet_cli.ckpt.prune import read_pins
from autohet_cli.ckpt.retention import choose_prune, parse_pin_name
from autohet_cli.cluster import Cluster, Host
from autohet_cli.recovery.pins import PIN_TTL_S, pinned_step
from autohet_cli.transport.pool import ConnectOptions, HostPool
from tests.planting import cpu_host

NS = "lab/J"


def _host(name: str, checkpoint_dir: Path) -> Host:
    return cpu_host(name, checkpoint_dir=str(checkpoint_dir))


def _reader(d: Path) -> Callable[[str], str]:
    return lambda name: (d / name).read_text()


def _pins(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if parse_pin_name(p.name) is not None)


def test_the_step_is_pinned_while_recover_copies_it_and_unpinned_after(tmp_path: Path) -> None:
    job = tmp_path / "ck" / NS
    remote = tmp_path / "remote"
    for d in (job, remote / NS):
        for step in (4, 8):
            (d / f"step-{step:08d}").mkdir(parents=True)
    said: list[str] = []
    cluster = Cluster(name="c", hosts=(_host("h", tmp_path / "ck"),), inter_node_gbps=10.0)
    with HostPool(cluster, ConnectOptions()) as pool:
        with pinned_step(pool, ["h"], NS, 4, str(remote), said.append):
            for d in (job, remote / NS):
                (name,) = _pins(d)
                now = time.time()
                assert read_pins([name], _reader(d), now_unix=now) == ({4}, [])
                # Until its lease ends: a dead recover's pin lapses then.
                later = now + PIN_TTL_S
                assert read_pins([name], _reader(d), now_unix=later) == (set(), [name])
            # What a worker's prune then chooses: step 4 stays beyond --keep-checkpoints 1.
            names = [*_pins(job), "step-00000004", "step-00000008"]
            assert choose_prune(names, complete={4, 8}, keep=1, pinned={4}).remove == ()
        assert _pins(job) == [] and _pins(remote / NS) == []
    assert said == []


def test_a_pin_that_cannot_be_written_warns_and_recover_goes_on(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cluster = Cluster(name="c", hosts=(_host("h", blocker / "ck"),), inter_node_gbps=10.0)
    said: list[str] = []
    ran = False
    with HostPool(cluster, ConnectOptions()) as pool:
        with pinned_step(pool, ["h"], NS, 4, None, said.append):
            ran = True
    assert ran and len(said) == 1
    assert said[0].startswith("warning: could not pin step 4 on h (")
    assert said[0].endswith("); copying it anyway")
