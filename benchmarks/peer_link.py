"""One pair of hosts: how fast a shard moves from a surviving peer (issue 30's peer rate).

What recover runs on two hosts, run here on two loopback addresses of this machine:
``peer.stream``'s script (``stream.script_source()``, as ``python -c``), ``serve`` on
the source bound to 127.0.0.2 and ``fetch`` on the destination (SSH only starts the
two; no byte of the shard passes through it). The shard is a file of random bytes
(``AUTOHET_BENCH_PEER_MB``, default 1536), fetched ``AUTOHET_BENCH_REPEATS`` times
(default 3) into a new file, hashed as it lands; the rate is the fetcher's own
per-file seconds, as recover reports it.

Beside it, for scale: the same number of bytes written from memory into a new file
of the same directory, just before each copy (no socket, no hash). On this 2-core
VM it swings between 0.3 and 3 GB/s from run to run: a page the VM touches for
the first time is slow to get, so a run's rate depends on the memory freed before it.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks._common import machine

CHUNK = 8 << 20


@dataclass(frozen=True, slots=True)
class Link:
    nbytes: int
    copy_s: list[float]  # the fetcher's own seconds per copy
    write_s: list[float]  # a plain write of the same bytes, before each copy

    @property
    def copy_bytes_per_s(self) -> float:
        return self.nbytes / statistics.median(self.copy_s)

    @property
    def write_bytes_per_s(self) -> float:
        return self.nbytes / statistics.median(self.write_s)


def _random_file(path: Path, nbytes: int) -> str:
    digest = hashlib.sha256()
    block = os.urandom(CHUNK)
    with path.open("wb") as f:
        left = nbytes
        while left:
            piece = block[: min(CHUNK, left)]
            f.write(piece)
            digest.update(piece)
            left -= len(piece)
    return digest.hexdigest()


def _plain_write(path: Path, nbytes: int) -> float:
    block = os.urandom(CHUNK)
    t0 = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, memoryview(block)[: min(CHUNK, left)])
    finally:
        os.close(fd)
    seconds = time.monotonic() - t0
    path.unlink()
    return seconds


def measure(work: Path, nbytes: int, repeats: int, python: str = sys.executable) -> Link:
    """``repeats`` copies of an ``nbytes`` shard from 127.0.0.2 to a fetcher here."""
    from autohet_cli.peer import stream

    source = stream.script_source()
    src_dir, dst_dir = work / "a", work / "b"
    src_dir.mkdir(parents=True)
    dst_dir.mkdir(parents=True)
    key_file = work / "key"
    key_file.write_bytes(secrets.token_bytes(32))
    shard = src_dir / "__0_0.distcp"
    sha = _random_file(shard, nbytes)
    with shard.open("rb") as f:  # the source's page cache holds it, as after a save
        while f.read(CHUNK):
            pass
    server = subprocess.Popen(
        [python, "-c", source, "serve", "127.0.0.2", str(key_file), "600", str(shard)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        if not line.startswith("PORT "):
            raise SystemExit(f"the peer server did not start: {line!r}")
        port = int(line.split()[1])
        copies, writes = [], []
        for i in range(repeats):
            writes.append(_plain_write(dst_dir / f"plain-{i}", nbytes))
            dest = dst_dir / f"copy-{i}"
            spec = [{"addr": "127.0.0.2", "port": port, "path": str(shard), "dest": str(dest),
                     "bytes": nbytes, "sha256": sha}]  # fmt: skip
            out = subprocess.run(
                [python, "-c", source, "fetch", str(key_file), "4", json.dumps(spec)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            verdict = json.loads(out.stdout.splitlines()[-1])
            if not verdict["ok"]:
                raise SystemExit(f"the copy failed: {verdict}")
            copies.append(float(verdict["s"]))
            dest.unlink()
        return Link(nbytes=nbytes, copy_s=copies, write_s=writes)
    finally:
        server.kill()
        server.wait()


def main() -> None:
    print(__doc__.split("\n\n")[0])
    nbytes = int(float(os.environ.get("AUTOHET_BENCH_PEER_MB", "1536")) * (1 << 20))
    repeats = int(os.environ.get("AUTOHET_BENCH_REPEATS", "3"))
    print(machine())
    with tempfile.TemporaryDirectory(prefix="autohet-peer-link-") as tmp:
        link = measure(Path(tmp), nbytes, repeats)
    print(
        f"peer copy, 127.0.0.2 -> here, {nbytes / 1e9:.2f} GB, median of {repeats}: "
        f"{link.copy_bytes_per_s / 1e9:.2f} GB/s "
        f"(runs {', '.join(f'{nbytes / s / 1e9:.2f}' for s in link.copy_s)}; target >= 1 GB/s)"
    )
    print(
        f"a plain write of the same bytes into a new file: "
        f"{link.write_bytes_per_s / 1e9:.2f} GB/s "
        f"(runs {', '.join(f'{nbytes / s / 1e9:.2f}' for s in link.write_s)}): "
        f"the copy reaches {link.copy_bytes_per_s / link.write_bytes_per_s:.0%} of it"
    )


if __name__ == "__main__":
    main()
