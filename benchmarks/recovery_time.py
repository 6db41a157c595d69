"""Shard transfer time of `autohet recover`: local-first vs remote-only, same checkpoint.

Three real sshd "hosts" on loopback each hold their rank's shard of a synthetic
checkpoint (3 x 32 MiB); host 3 is lost. The new plan puts its ranks on hosts 1
and 2, which (rule "all") need every shard. Local-first copies what survivors
hold from peers and only the lost host's shard from remote storage;
remote-only takes everything from remote storage. Remote storage is an fsspec
filesystem read at a stated rate, ``AUTOHET_BENCH_REMOTE_MBPS`` (default 300 MB/s:
one VM reading object storage), not one derived from the peer rate (AutoHet reports
4.38x faster recovery than reloading from the cloud). Median of
``AUTOHET_BENCH_REPEATS`` (3) runs; files are removed between runs so every run
copies the same bytes.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from autohet_cli.cluster import Cluster
from autohet_cli.plan import Plan
from autohet_cli.recovery import copies
from autohet_cli.recovery import executor as rx
from autohet_cli.recovery.manifest import Manifest, ManifestFile
from autohet_cli.recovery.transfer import plan_transfers
from autohet_cli.transport.pool import ConnectOptions, HostPool
from benchmarks._recovery import DEFAULT_REMOTE_MB_PER_S, REMOTE_ENV, remote_bytes_per_s, repeats
from benchmarks._sshd import sshd_farm, sshd_missing
from tests.e2e.sshd import SshdFarm
from tests.planting import plan_of, stage

SHARD_MIB = 32
RATE: dict[str, float] = {"bytes_per_s": DEFAULT_REMOTE_MB_PER_S * 1e6}


class ThrottledFS(LocalFileSystem):
    """Local files read at RATE bytes/s: a stand-in for slow object storage."""

    protocol = "throttled"

    def _open(self, path: str, mode: str = "rb", **kw: Any) -> Any:
        f = super()._open(self._strip_protocol(path), mode, **kw)
        if "r" in mode:
            size = os.path.getsize(self._strip_protocol(path))
            time.sleep(size / RATE["bytes_per_s"])
        return f


fsspec.register_implementation("throttled", ThrottledFS, clobber=True)


def _plan(hosts: list[str]) -> Plan:
    return plan_of([stage(0, 3, hosts[0]), stage(3, 6, hosts[1])], name="bench", version=2)


def main() -> None:
    if sshd_missing():
        return
    with sshd_farm() as (root, farm):
        _run(root, farm)


def _run(root: Path, farm: SshdFarm) -> None:
    farm.start(3)
    hosts = tuple(h.as_host(python=sys.executable) for h in farm.hosts)
    remote_dir = root / "remote"
    cluster = Cluster(
        name="bench", hosts=hosts, inter_node_gbps=10.0, remote_storage=f"throttled://{remote_dir}"
    )
    step = "step-00000010"
    files = []
    for rank, h in enumerate(farm.hosts):
        blob = os.urandom(SHARD_MIB << 20)
        name = f"__{rank}_0.distcp"
        for d in (h.checkpoint_dir / "bench" / step, remote_dir / "bench" / step):
            d.mkdir(parents=True, exist_ok=True)
            (d / name).write_bytes(blob)
        files.append(
            ManifestFile(
                path=name,
                sha256=hashlib.sha256(blob).hexdigest(),
                num_bytes=len(blob),
                host=h.name,
                rank=rank,
            )
        )
    manifest = Manifest(
        step=10, plan="bench.v1", plan_sha256="0" * 64, world_size=3, files=tuple(files)
    )
    new = _plan([hosts[0].name, hosts[1].name])
    conn = HostPool(cluster, ConnectOptions(known_hosts=farm.known_hosts))
    try:
        peer_rate = _measure_peer_rate(conn, hosts[0].name, farm.hosts[0].checkpoint_dir)
        RATE["bytes_per_s"] = remote_bytes_per_s(os.environ)
        results = {}
        for label, use_peers in (("local-first", True), ("remote-only", False)):
            times = []
            for _ in range(repeats(os.environ)):
                _reset(farm, step, keep_own=True)
                present = (
                    rx.hashes_present([h.name for h in hosts[:2]], "bench", step, conn)
                    if use_peers
                    else {}
                )
                tp = plan_transfers(
                    manifest,
                    new,
                    cluster,
                    present,
                    remote_root=f"throttled://{remote_dir}",
                    lost=(hosts[2].name,),
                )
                if not use_peers:  # every file from remote, including what is on disk
                    _reset(farm, step, keep_own=False)
                    tp = plan_transfers(
                        manifest,
                        new,
                        cluster,
                        {},
                        remote_root=f"throttled://{remote_dir}",
                        lost=(hosts[2].name,),
                    )
                start = time.perf_counter()
                copies.execute_transfers(tp, conn, lambda _m: None)
                times.append(time.perf_counter() - start)
            results[label] = (statistics.median(times), tp.bytes_from_peers, tp.bytes_from_remote)
    finally:
        conn.close()
    print(
        f"peer copy rate through the controller: {peer_rate / 1e6:.0f} MB/s; remote "
        f"storage read at {RATE['bytes_per_s'] / 1e6:.0f} MB/s ({REMOTE_ENV})"
    )
    print(f"{'mode':12} {'median s':>9} {'MB from peers':>14} {'MB from remote':>15}")
    for label, (sec, peers, remote) in results.items():
        print(f"{label:12} {sec:9.2f} {peers / 1e6:14.0f} {remote / 1e6:15.0f}")
    ratio = results["remote-only"][0] / results["local-first"][0]
    print(f"local-first is {ratio:.2f}x faster (AutoHet reports 4.38x)")


def _measure_peer_rate(conn: HostPool, host: str, ckpt: Path) -> float:
    probe = ckpt / "rate-probe"
    probe.write_bytes(os.urandom(32 << 20))
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        conn.runner(host).get(str(probe), Path(tmp) / "x")
        conn.runner(host).put(Path(tmp) / "x", str(probe) + ".back")
        seconds = time.perf_counter() - start
    probe.unlink()
    Path(str(probe) + ".back").unlink()
    return (32 << 20) / seconds


def _reset(farm: SshdFarm, step: str, *, keep_own: bool) -> None:
    """Back to the state right after the loss: each host has only its own shard."""
    for rank, h in enumerate(farm.hosts[:2]):
        d = h.checkpoint_dir / "bench" / step
        for f in d.glob("__*_0.distcp"):
            if not keep_own or f.name != f"__{rank}_0.distcp":
                f.unlink()


if __name__ == "__main__":
    main()
