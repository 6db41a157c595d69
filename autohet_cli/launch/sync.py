"""Copy a local directory to a host with rsync semantics: only what differs moves.

The host reports the sha256 of the files it has under the target directory
(`sha256sum`, run over the transport); a file is sent only when it is missing
there or its digest differs, each through the runner's atomic ``put``. Files on
the host that are not in the source are left alone (no deletion), like rsync
without ``--delete``.

Symbolic links never lead out of the source: a link to a regular file inside
it is sent as that file's contents, and any other link (outside the source, to
a directory, dangling) is skipped with a warning line. Following links out
once uploaded whatever they pointed at (``/etc/hostname``, an SSH key) to
every host.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path

from autohet_cli.transport.base import Runner

Warn = Callable[[str], None]
_SKIPPED_DIRS = ("__pycache__", ".git", ".venv")  # never sent, as files or folders

_LIST = 'cd "$1" 2>/dev/null && find . -type f -exec sha256sum -- {} + ; true'


def _warn_stderr(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr)


def local_files(root: Path, warn: Warn = _warn_stderr) -> dict[str, Path]:
    """The files to send, by path relative to ``root``, mapped to the regular file
    to read: itself, or for a link the file it resolves to inside ``root``.
    Directories are walked without following links; everything else is skipped
    with a ``warn`` line naming it."""
    base = root.resolve()
    out: dict[str, Path] = {}
    for folder, dirs, names in os.walk(base):  # followlinks=False: never enters a link
        here = Path(folder)
        linked = [d for d in dirs if (here / d).is_symlink()]
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS and d not in linked)
        for name in sorted(n for n in [*names, *linked] if n not in _SKIPPED_DIRS):
            path = here / name
            rel = path.relative_to(base).as_posix()
            mode = path.lstat().st_mode
            if stat.S_ISREG(mode):
                out[rel] = path
                continue
            if not stat.S_ISLNK(mode):
                warn(f"{root}: skipped {rel}: not a regular file")
                continue
            real = Path(os.path.realpath(path))
            if not real.is_relative_to(base):
                warn(f"{root}: skipped {rel}: a link to {real}, outside {root}")
            elif not (real.exists() and stat.S_ISREG(real.stat().st_mode)):
                warn(f"{root}: skipped {rel}: a link to a directory or to nothing")
            else:
                out[rel] = real
    return dict(sorted(out.items()))


def local_digests(root: Path, warn: Warn = _warn_stderr) -> dict[str, str]:
    return {
        rel: hashlib.sha256(path.read_bytes()).hexdigest()
        for rel, path in local_files(root, warn).items()
    }


def remote_digests(runner: Runner, target: str) -> dict[str, str]:
    res = runner.run(["sh", "-c", _LIST, "sh", target], timeout_s=600)
    out = {}
    for line in res.stdout.splitlines():
        digest, _, name = line.partition("  ")
        if name:
            out[name.strip().removeprefix("./")] = digest
    return out


def sync_dir(runner: Runner, source: Path, target: str, warn: Warn = _warn_stderr) -> list[str]:
    """Make ``target`` on the host hold ``source``'s files; returns the files sent.
    Links that ``local_files`` refuses are named through ``warn``, never sent."""
    have = remote_digests(runner, target)
    sent = []
    for rel, path in local_files(source, warn).items():
        if have.get(rel) != hashlib.sha256(path.read_bytes()).hexdigest():
            runner.put(path, f"{target.rstrip('/')}/{rel}")
            sent.append(rel)
    return sent
