"""Parsed YAML kept on disk by content, so a large input is parsed once per machine.

Why: Sailor's measured profiles are 450 KB of YAML, which take ~0.8 s to parse on a
small machine even with libyaml's scanner (the composer that enforces our limits is
Python), and every ``autohet plan`` and ``autohet recover`` reads one: on a replan
after a preemption that is recovery time.

The key is the sha256 of the file's bytes (and this format's version), so an edited
file is parsed afresh and nothing can be served for bytes it was not parsed from.
The value is ``marshal``'s encoding of what the parse returned, which holds exactly
the types a safe YAML load gives but for timestamps (those files are not cached).
The cache lives in ``$XDG_CACHE_HOME/autohet/yaml`` (default ``~/.cache``), 0700;
``AUTOHET_YAML_CACHE=0`` turns it off. Any failure to read or write it is ignored:
the file is parsed as if there were no cache. Entries are written atomically
(temporary name, then rename), so a reader never sees half of one.

Who may write an entry matters more than its name (a content hash proves nothing
about who wrote it, and ``marshal`` is not meant for untrusted bytes): the cache is
used only where checkpoints would be (``privatedir``: its directory and the one
above it this user's alone, the rest of the path nobody else's to change), and an
entry only when it is a regular file of this user, opened without following links
and no larger than its source could make it. The key also holds the parser's
version and our limits on nesting and aliases, so an entry never outlives the rules
it was parsed under.
"""

from __future__ import annotations

import hashlib
import marshal
import os
import secrets
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from autohet_cli.privatedir import make_private_dir

MIN_BYTES = 64 << 10  # smaller files parse in milliseconds: not worth a disk entry
VERSION = b"autohet-yaml-cache-1\0"
ENV = "AUTOHET_YAML_CACHE"


def cache_dir(env: Mapping[str, str] | None = None) -> Path | None:
    e = os.environ if env is None else env
    if e.get(ENV, "1") == "0":
        return None
    base = e.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if not os.path.isabs(base):  # no home to speak of: not the current directory
        return None
    return Path(base) / "autohet" / "yaml"


def _read_entry(entry: Path, most_bytes: int) -> bytes | None:
    try:
        fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > most_bytes:
            return None
        return fh.read(most_bytes + 1)


def cached_parse(data: bytes, parse: Callable[[], Any], salt: bytes = b"") -> Any:
    """``parse()``'s result for ``data`` (the file's bytes), from the cache when it
    holds an entry for exactly these bytes (and ``salt``: the parser's rules), else
    parsed and stored."""
    where = cache_dir() if len(data) >= MIN_BYTES else None
    if where is None:
        return parse()
    try:
        if make_private_dir(where, where.parent) is not None:
            return parse()  # others could write there
    except OSError:
        return parse()
    key = hashlib.sha256(VERSION + salt + b"\0" + data).hexdigest()
    entry = where / f"{key}.marshal"
    most = 64 * len(data) + (1 << 20)  # marshal's encoding is near the YAML's size
    blob = _read_entry(entry, most)
    if blob is not None:
        try:
            return marshal.loads(blob)
        except (EOFError, ValueError, TypeError):
            pass  # a damaged entry: parse (and replace it)
    value = parse()
    try:
        blob = marshal.dumps(value)
    except ValueError:  # a type marshal does not hold (a timestamp): not cached
        return value
    try:
        tmp = entry.with_name(f".{entry.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(blob)
        os.replace(tmp, entry)
    except OSError:
        try:
            os.unlink(tmp)
        except (OSError, UnboundLocalError):
            pass
    return value
