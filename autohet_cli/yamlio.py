"""Strict YAML reading and atomic, non-overwriting writes.

Every artifact of autohet (cluster, profile, plan) is validated by hand-written
``from_dict`` functions built on these helpers, so that an error always names
the file and the field (``lab.yaml: hosts[2].gpus.count: expected an integer``)
and unknown keys are rejected instead of silently ignored (a typo such as
``cuont`` must not fall back to a default).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from autohet_cli.errors import ConfigError

T = TypeVar("T")
_MISSING: Any = object()


def load_yaml(path: str | Path) -> Any:
    """Parse a YAML file; a missing file or a syntax error becomes a ConfigError."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{p}: file not found") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from None
    try:
        # The C loader is ~5x faster on big profiles; fall back when libyaml is absent.
        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{p}{line}: not valid YAML: {exc}") from None


def as_mapping(obj: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise ConfigError(f"{where}: expected a mapping (key: value), got {_show(obj)}")
    return obj


def as_list(obj: Any, where: str) -> list[Any]:
    if not isinstance(obj, list):
        raise ConfigError(f"{where}: expected a list, got {_show(obj)}")
    return obj


def check_keys(
    d: Mapping[str, Any], where: str, required: Iterable[str], optional: Iterable[str] = ()
) -> None:
    """Reject unknown keys and report missing ones, naming the allowed set."""
    req, opt = list(required), list(optional)
    allowed = set(req) | set(opt)
    for key in d:
        if key not in allowed:
            raise ConfigError(
                f"{where}: unknown key {key!r} (allowed: {', '.join(sorted(allowed))})"
            )
    for key in req:
        if key not in d:
            raise ConfigError(f"{where}: missing required key {key!r}")


def field(d: Mapping[str, Any], key: str, typ: type[T], where: str, default: Any = _MISSING) -> T:
    """Read ``d[key]`` as ``typ`` (int, float, str, bool) with a precise error."""
    at = f"{where}.{key}" if where else key
    if key not in d or d[key] is None:
        if default is _MISSING:
            raise ConfigError(f"{at}: missing required value")
        return default  # type: ignore[no-any-return]
    return coerce(d[key], typ, at)


def coerce(value: Any, typ: type[T], at: str) -> T:
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{at}: expected a number, got {_show(value)}")
        return float(value)  # type: ignore[return-value]
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{at}: expected an integer, got {_show(value)}")
        return value  # type: ignore[return-value]
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{at}: expected true or false, got {_show(value)}")
        return value  # type: ignore[return-value]
    if typ is str:
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ConfigError(f"{at}: expected a string, got {_show(value)}")
        return str(value)  # type: ignore[return-value]
    raise TypeError(f"unsupported field type {typ}")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def dump_yaml(data: Any) -> str:
    """Deterministic YAML: key order as built, block style, no aliases."""

    class _NoAlias(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump(data, Dumper=_NoAlias, sort_keys=False, default_flow_style=None, width=100)


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_new(path: str | Path, text: str) -> Path:
    """Atomically create ``path`` with ``text``; refuse to replace an existing file.

    The temp file is fsynced and then hard-linked into place: ``os.link`` fails
    if the target exists, so two writers racing for the same name cannot both
    win and nobody ever sees a half-written artifact.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        os.fchmod(fd, _umask_mode())  # mkstemp's 0600 is for secrets, not artifacts
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, target)
        except FileExistsError:
            raise ConfigError(
                f"{target}: already exists; artifacts are never overwritten"
            ) from None
    finally:
        os.unlink(tmp)
    return target


def write_replace(path: str | Path, text: str) -> Path:
    """Atomically write ``path`` (temp file + rename), for files the user asked to replace."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        os.fchmod(fd, _umask_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target
