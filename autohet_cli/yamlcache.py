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
"""

from __future__ import annotations

import hashlib
import marshal
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

MIN_BYTES = 64 << 10  # smaller files parse in milliseconds: not worth a disk entry
VERSION = b"autohet-yaml-cache-1\0"
ENV = "AUTOHET_YAML_CACHE"


def cache_dir(env: dict[str, str] | None = None) -> Path | None:
    e = os.environ if env is None else env
    if e.get(ENV, "1") == "0":
        return None
    base = e.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autohet" / "yaml"


def cached_parse(data: bytes, parse: Callable[[], Any]) -> Any:
    """``parse()``'s result for ``data`` (the file's bytes), from the cache when it
    holds an entry for exactly these bytes, else parsed and stored."""
    where = cache_dir() if len(data) >= MIN_BYTES else None
    if where is None:
        return parse()
    entry = where / (hashlib.sha256(VERSION + data).hexdigest() + ".marshal")
    try:
        return marshal.loads(entry.read_bytes())
    except (OSError, EOFError, ValueError, TypeError):
        pass  # no entry (or a damaged one): parse
    value = parse()
    try:
        blob = marshal.dumps(value)
    except ValueError:  # a type marshal does not hold (a timestamp): not cached
        return value
    try:
        where.mkdir(parents=True, exist_ok=True, mode=0o700)
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
