"""Strict YAML reading and atomic, non-overwriting writes.

Every artifact of autohet (cluster, profile, plan) is validated by hand-written
``from_dict`` functions built on these helpers, so that an error always names
the file and the field (``lab.yaml: hosts[2].gpus.count: expected an integer``)
and unknown keys are rejected instead of silently ignored (a typo such as
``cuont`` must not fall back to a default).

``load_yaml`` (``parse_yaml`` for text already read) is the only YAML reader
of the package, so it is also where hostile files stop: nesting and alias
expansion are capped (``_Limits``), and every way a read fails (missing, a
folder, not UTF-8, too large, bad YAML) is one ConfigError line. Writes fail
the same way (full disk, a file where the output folder should be), leaving
nothing behind.
"""

from __future__ import annotations

import difflib
import hashlib
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from yaml.composer import Composer, ComposerError
from yaml.constructor import SafeConstructor
from yaml.resolver import Resolver

from autohet_cli import __version__
from autohet_cli.errors import ConfigError
from autohet_cli.limits import MAX_INT, shown
from autohet_cli.regular_file import open_regular
from autohet_cli.yamlcache import cached_parse

T = TypeVar("T")
_MISSING: Any = object()


# Our artifacts nest about 8 levels (plan > pipelines > stages > devices > host);
# 64 leaves hand-written files room and stays far below the interpreter's stack.
MAX_DEPTH = 64
# Nodes that aliases may add on top of the file's own: anchors for shared host
# defaults cost a few nodes per use, while a "billion laughs" of nine nested
# aliases of nine needs 10^9 and took 2.5 GB when its notes were printed.
MAX_ALIASED_NODES = 100_000


class _Limits(Composer):
    """Composer that refuses deep nesting and alias expansion past the limits.

    The composer is the recursive part of a YAML loader: PyYAML's C composer
    overflows the C stack (a segfault, not an exception) on ``[`` x 100000,
    and the Python one raises RecursionError. Nodes are counted as composed; an
    anchored node's weight is the nodes it expands to, charged at every alias.
    """

    def __init__(self) -> None:
        super().__init__()
        self._depth = 0
        self._nodes = 0
        self._aliased = 0
        self._weights: dict[int, int] = {}

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()  # type: ignore[attr-defined]
        if isinstance(event, yaml.AliasEvent):
            node = super().compose_node(parent, index)
            weight = self._weights.get(id(node))
            if weight is None:  # the anchored node is still open: it contains itself
                raise _refused(event, f"alias *{event.anchor} refers to a node that contains it")
            self._nodes += weight
            self._aliased += weight
            if self._aliased > MAX_ALIASED_NODES:
                raise _refused(
                    event,
                    f"aliases expand to more than {MAX_ALIASED_NODES} nodes; "
                    "write the values out instead",
                )
            return node
        if self._depth >= MAX_DEPTH:
            raise _refused(event, f"nested more than {MAX_DEPTH} levels deep")
        self._depth += 1
        start = self._nodes
        self._nodes += 1
        node = super().compose_node(parent, index)
        self._depth -= 1
        if getattr(event, "anchor", None) is not None:
            self._weights[id(node)] = self._nodes - start
        return node


def _refused(event: Any, problem: str) -> ComposerError:
    return ComposerError(None, None, problem, event.start_mark)


if hasattr(yaml, "CSafeLoader"):
    from yaml._yaml import CParser

    class _LimitedLoader(_Limits, CParser, SafeConstructor, Resolver):
        """libyaml's scanner and parser (an explicit state stack, ~4x faster than
        Python's on our 450 KB profiles) under the Python composer with limits."""

        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            _Limits.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)

else:  # pragma: no cover - PyYAML built without libyaml

    class _LimitedLoader(_Limits, yaml.SafeLoader):  # type: ignore[no-redef]
        def __init__(self, stream: str) -> None:
            yaml.SafeLoader.__init__(self, stream)
            _Limits.__init__(self)


def read_text(path: str | Path, *, max_bytes: int | None = None) -> str:
    """A hand-written input file as text; every way reading fails is one ConfigError.

    ``max_bytes``: a file larger than this is refused unread (past its first
    ``max_bytes + 1`` bytes), for inputs that are small by nature."""
    p = Path(path)
    try:
        if os.path.isdir(p):
            raise IsADirectoryError
        if not os.path.exists(p):
            raise FileNotFoundError
        # Never a FIFO or device: open() on a named pipe waits for a writer forever.
        fd = open_regular(p)
        with os.fdopen(fd, "rb") as fh:
            data = fh.read() if max_bytes is None else fh.read(max_bytes + 1)
    except FileNotFoundError:
        raise ConfigError(f"{p}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{p}: is a directory; pass the path of a file") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from None
    if max_bytes is not None and len(data) > max_bytes:
        size = f"{max_bytes >> 20} MiB" if max_bytes % (1 << 20) == 0 else f"{max_bytes:,} bytes"
        raise ConfigError(
            f"{p}: larger than {size}, the most this file may hold; is it the right file?"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{p} (line {line}): not UTF-8 text (byte 0x{data[exc.start]:02x}); "
            "save the file as UTF-8"
        ) from None


# What a cached parse depends on besides the bytes (``yamlcache``'s key).
_RULES = f"{yaml.__version__} {MAX_DEPTH} {MAX_ALIASED_NODES} {__version__}".encode()


def load_yaml(path: str | Path) -> Any:
    """Parse a YAML artifact; every failure, hostile input included, is one ConfigError.

    Every YAML read of the package comes through here (or ``parse_yaml``), so the
    limits on nesting and alias expansion (``_LimitedLoader``) hold for every input.
    """
    p = Path(path)
    text = read_text(p)
    # A large file's parse is kept by content (a 450 KB profile: ~0.8 s per command).
    return cached_parse(text.encode("utf-8"), lambda: parse_yaml(text, str(p)), _RULES)


def parse_yaml(text: str, where: str) -> Any:
    """``load_yaml`` for text already read (``where`` names it in errors): a run
    config, read with a size limit first."""
    try:
        loader = _LimitedLoader(text)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f" (line {mark.line + 1})" if mark is not None else ""
        why = ", ".join(str(x) for x in (exc.context, exc.problem) if x)
        if "nesting depth" in why:  # PyYAML >= 6.0.4's scanner stops first, at its limit
            why = f"nested more than {MAX_DEPTH} levels deep"
        raise ConfigError(f"{where}{line}: not valid YAML: {why}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {' '.join(str(exc).split())}") from None
    except (ValueError, TypeError, OverflowError) as exc:
        # The safe constructor's own conversions: a 13th month, ``!!int 0x``, an
        # integer of more digits than Python converts.
        raise ConfigError(f"{where}: not valid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{where}: not valid YAML: nested too deeply") from None


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
    """Reject unknown keys and report missing ones, naming the allowed set (and the
    nearest allowed key, since most unknown keys in hand-written files are typos)."""
    req, opt = list(required), list(optional)
    allowed = set(req) | set(opt)
    for key in d:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), sorted(allowed), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"{where}: unknown key {key!r} (allowed: {', '.join(sorted(allowed))}){hint}"
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


# A number in exponent form that YAML 1.1 (PyYAML) reads as text: its floats need a
# dot and a signed exponent (1.0e-9, 1.0e+9), so 1e-9, 1.0e9 and 1E5 are strings.
_TEXT_EXPONENT = re.compile(r"([-+]?)(\d*)(?:\.(\d*))?([eE])([-+]?)(\d+)")


def yaml_number_hint(value: Any, typ: type) -> str:
    """``"; YAML reads 1e-9 as text; write 1.0e-9"`` when ``value`` is text a reader
    would take for a number (``typ``: float or int), else "". For every field that
    expects a number: the error alone (``got '1e-9'``) looks like a number refused."""
    m = _TEXT_EXPONENT.fullmatch(value) if isinstance(value, str) else None
    if m is None or not (m[2] or m[3]):
        return ""
    sign, whole, frac, e, exp_sign, exp = m.groups()
    if typ is int:
        number = float(value)
        if not number.is_integer() or abs(number) > MAX_INT:
            return ""
        written = str(int(number))
    else:
        written = f"{sign}{whole}.{frac or ('' if not whole else '0')}{e}{exp_sign or '+'}{exp}"
    if written == value:  # YAML's own spelling, so it was quoted
        return f"; write {value} without quotes"
    return f"; YAML reads {value} as text; write {written}"


def coerce(value: Any, typ: type[T], at: str) -> T:
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(
                f"{at}: expected a number, got {_show(value)}{yaml_number_hint(value, float)}"
            )
        try:
            number = float(value)
        except OverflowError:  # an integer beyond any double
            number = math.inf
        # No field of any artifact means anything as .nan or .inf, and NaN slips
        # past every range check (nan <= 0 is False).
        if not math.isfinite(number):
            raise ConfigError(f"{at}: expected a finite number, got {_show(value)}")
        return number  # type: ignore[return-value]
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(
                f"{at}: expected an integer, got {_show(value)}{yaml_number_hint(value, int)}"
            )
        if abs(value) > MAX_INT:
            side = "larger" if value > 0 else "smaller"
            raise ConfigError(
                f"{at}: {_show(value)} is {side} than any field holds (64-bit integers, "
                f"{_show(-MAX_INT)} to {_show(MAX_INT)}); is it a typo?"
            )
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
    return shown(value)


# libyaml's emitter where PyYAML has it, 4x faster: a 256-GPU plan took 0.19 s to
# dump, a twentieth of ``autohet plan`` (issue 32). Its text is Python's on every file
# we ship and on plans (test_yaml_dump); it folds a few scalars differently (double-
# quoted ones over the width with non-ASCII characters or tabs, keys over 125
# characters), which load back the same.
_DUMPER_BASE: Any = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class _NoAlias(_DUMPER_BASE):  # type: ignore[misc]
    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_yaml(data: Any) -> str:
    """Deterministic YAML: key order as built, block style, no aliases."""
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

    def publish(tmp: str) -> None:
        try:
            os.link(tmp, target)
        except FileExistsError:
            raise ConfigError(
                f"{target}: already exists; artifacts are never overwritten"
            ) from None

    return _write_atomically(target, text, publish)


def write_replace(path: str | Path, text: str) -> Path:
    """Atomically write ``path`` (temp file + rename), for files the user asked to replace."""
    target = Path(path)
    return _write_atomically(target, text, lambda tmp: os.replace(tmp, target))


def _write_atomically(target: Path, text: str, publish: Callable[[str], None]) -> Path:
    """Write ``text`` to a temp file beside ``target`` and ``publish`` it; the temp
    file never outlives the call. A full disk, a folder that is a file or a
    missing permission is one ConfigError naming the target, with nothing written."""
    tmp: str | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        os.fchmod(fd, _umask_mode())  # mkstemp's 0600 is for secrets, not artifacts
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        publish(tmp)
    except (FileExistsError, NotADirectoryError) as exc:
        if tmp is not None:  # publish's own race, or the target is a folder
            raise ConfigError(f"{target}: cannot write: {exc.strerror}") from None
        raise ConfigError(
            f"{target.parent}: not a directory; choose a folder (or a new name) for the output"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"{target}: cannot write: {exc.strerror or exc}; nothing was written"
        ) from None
    finally:
        if tmp is not None and os.path.lexists(tmp):
            os.unlink(tmp)
    return target
