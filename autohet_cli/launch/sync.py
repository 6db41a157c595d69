"""Copy a local directory to a host with rsync semantics: only what differs moves.

The host reports the sha256 of the files it has under the target directory
(`sha256sum`, run over the transport); a file is sent only when it is missing
there or its digest differs, each through the runner's atomic ``put``. Files on
the host that are not in the source are left alone (no deletion), like rsync
without ``--delete``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from autohet_cli.transport.base import Runner

_LIST = 'cd "$1" 2>/dev/null && find . -type f -exec sha256sum -- {} + ; true'


def local_digests(root: Path) -> dict[str, str]:
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        if any(part in ("__pycache__", ".git", ".venv") for part in path.parts):
            continue
        out[path.relative_to(root).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def remote_digests(runner: Runner, target: str) -> dict[str, str]:
    res = runner.run(["sh", "-c", _LIST, "sh", target], timeout_s=600)
    out = {}
    for line in res.stdout.splitlines():
        digest, _, name = line.partition("  ")
        if name:
            out[name.strip().removeprefix("./")] = digest
    return out


def sync_dir(runner: Runner, source: Path, target: str) -> list[str]:
    """Make ``target`` on the host hold ``source``'s files; returns the files sent."""
    have = remote_digests(runner, target)
    sent = []
    for rel, digest in local_digests(source).items():
        if have.get(rel) != digest:
            runner.put(source / rel, f"{target.rstrip('/')}/{rel}")
            sent.append(rel)
    return sent
