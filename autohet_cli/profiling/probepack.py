"""The probe packed as one file for hosts: a zipapp of the ``probe`` package.

Hosts need not have autohet installed, so ``autohet profile run`` cannot import
the probe there; it copies one file, ``probe.pyz``, and runs it with the host's
Python (``python probe.pyz --spec ... --out ...``). Python runs a zip archive
with a top-level ``__main__.py`` as a script (since 2.6; no install, no unpacking)
and imports the archive's packages from it, so the probe can be a package of
small modules here and one file there.

The archive holds every module of ``autohet_cli/profiling/probe/`` under the
package name ``autohet_probe`` (its modules import each other relatively, so the
name is theirs to ignore) and a ``__main__.py`` that calls its ``cli.main``. It is
built in memory from the sources at ship time, so it can never be stale, and
byte for byte the same for the same sources (fixed timestamps and order), with
no compression, so a host's Python needs no zlib to read it.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).with_name("probe")
PACKAGE = "autohet_probe"  # the package's name inside the archive
PROBE_FILE = "probe.pyz"  # the packed probe's file name on hosts
MAIN = f"import sys\n\nfrom {PACKAGE}.cli import main\n\nsys.exit(main())\n"
_EPOCH = (1980, 1, 1, 0, 0, 0)  # the oldest time a zip entry can carry


def probe_modules() -> list[Path]:
    """The probe package's modules, in a fixed order (it has no subpackages)."""
    return sorted(PACKAGE_DIR.glob("*.py"))


def pack_probe() -> bytes:
    """The zipapp's bytes: every module of the probe package and a ``__main__.py``."""
    members = [(f"{PACKAGE}/{p.name}", p.read_bytes()) for p in probe_modules()]
    members.append(("__main__.py", MAIN.encode("utf-8")))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        for name, data in members:
            info = zipfile.ZipInfo(name, date_time=_EPOCH)
            info.external_attr = 0o644 << 16  # rw-r--r-- where it is unpacked
            archive.writestr(info, data)
    return buffer.getvalue()


def write_probe(path: Path) -> Path:
    """Write the packed probe to ``path`` (a scratch file, to be copied to hosts)."""
    path.write_bytes(pack_probe())
    return path
