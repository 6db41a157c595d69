"""Paths a user gives launch/recover, as each host reads them (pure).

The workers start in their host's workdir (``cd ~/autohet``), so a path passed
through as written would be read from there, not from where the user typed it.
The rules, one per kind of host:

- a host that is this machine (address ``localhost``/``local``): a relative path
  is read from the directory autohet runs in (the caller's), ``~`` is this user's
  home; both are made absolute here, before the workers see them;
- any other host: an absolute path and ``~/...`` (that host's home) as written; a
  relative path is relative to the host's workdir, and is written out as
  ``WORKDIR/PATH`` so the command line (and ``--dry-run``) shows what is read.

The paths are the worker flags that name something to read (``PATH_FLAGS``),
wherever they come from: ``--data``/``--data-fn``/``--init-from``, a run
config's ``data:`` (each becomes its flag, ``runconfig.worker_args``), or
``--train-arg=--data=...``. Only the last of a repeated flag counts (argparse
keeps the last), so only it is checked. ``launch.session`` applies the rules
(``build_launch_specs`` writes the resolved paths into each host's command) and
the preflight checks each read path on its host (``preflight.CHECK_PATHS``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from autohet_cli import fnspec
from autohet_cli.cluster import Host
from autohet_cli.errors import ConfigError
from autohet_cli.paths import expand_home

# The rule in words, for launch's and recover's --help.
HELP = (
    "Paths (--data, --init-from, a run config's data:, FILE.py:FN for --model-fn and "
    "--data-fn, the same given with --train-arg): on hosts that are this machine (address "
    "localhost) a relative path is read from the current directory; on other hosts a path "
    "is absolute, ~/... (that host's home) or relative to the host's workdir. --dry-run "
    "lists how each host reads them; every host checks them before any worker starts.\n"
)

# What each flag's path must be: "data" (a token file, directory or Megatron prefix;
# "exists" with a --data-fn, which reads it as it likes), "hf_dir" (a directory with
# config.json), "file", "fn" (a FILE.py:function spec: its file), "out" (written by
# the workers: resolved, never checked). A URL (s3://...) is not a path.
PATH_FLAGS: Mapping[str, str] = {
    "--data": "data",
    "--init-from": "hf_dir",
    "--config": "file",
    "--model-fn": "fn",
    "--data-fn": "fn",
    "--dump-state": "out",
    "--metrics": "out",
    "--trace": "out",
}
_OPTIONAL_VALUE = frozenset({"--trace"})  # nargs="?": a next token starting with - is not it

# How a path was read: as written (absolute), from a home, from the caller's
# directory (this machine), from the host's workdir (another host).
ABSOLUTE, HOME, CALLER_DIR, WORKDIR = "absolute", "home", "caller_dir", "workdir"


@dataclass(frozen=True, slots=True, kw_only=True)
class Caller:
    """Where autohet runs: the directory and home that this machine's paths start from."""

    cwd: str
    home: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PathArg:
    """One path flag as one host reads it."""

    flag: str  # "--data"
    given: str  # as the user wrote it
    path: str  # as the host reads it: absolute, or ~/... where the home is not known yet
    kind: str  # PATH_FLAGS' value
    how: str  # ABSOLUTE, HOME, CALLER_DIR or WORKDIR

    @property
    def checked(self) -> bool:
        """Whether the preflight looks at it: read by the workers, not written."""
        return self.kind != "out"


@dataclass(frozen=True, slots=True, kw_only=True)
class HostPaths:
    """A host's worker arguments with every path resolved, and the paths themselves."""

    host: str
    address: str
    args: tuple[str, ...]
    paths: tuple[PathArg, ...]  # the last of each flag, in argument order


@dataclass(frozen=True, slots=True, kw_only=True)
class _Found:
    index: int  # of the token holding the value
    flag: str
    value: str  # the whole value (for a function spec: FILE.py:function)
    joined: bool  # --flag=value (else --flag value)


def resolve(args: Sequence[str], host: Host, caller: Caller, home: str | None = None) -> HostPaths:
    """``args`` as ``host`` must get them; ``home``: the host's, once known (``~``
    then expands; before, ``~/...`` stays for the host's shell or the preflight)."""
    out = list(args)
    last: dict[str, PathArg] = {}
    everything = _find(args)
    data_fn = _data_fn(everything)
    for found in everything:
        kind = "exists" if found.flag == "--data" and data_fn else PATH_FLAGS[found.flag]
        given, suffix = found.value, ""
        if kind == "fn":
            module, attr = fnspec.split(found.value)
            if not fnspec.is_file(module):
                last.pop(found.flag, None)  # a module name (the worker's path), not a path
                continue
            given, suffix = module, f":{attr}"
        if not given or "://" in given:
            last.pop(found.flag, None)  # nothing, or a URL: not a path on the host
            continue
        if given.startswith("~") and not (given == "~" or given.startswith("~/")):
            # ~user: the preflight's expanduser would find it, but the worker gets it
            # quoted and reads it under its workdir; the cluster file refuses it too.
            raise ConfigError(
                f"{found.flag} {given}: ~user/... paths are not expanded on the hosts; "
                "give the absolute path (or ~/... for the host user's home)"
            )
        path, how = _read_as(given, host, caller, home)
        out[found.index] = f"{found.flag}={path}{suffix}" if found.joined else path + suffix
        last.pop(found.flag, None)  # re-inserted: argument order of the last ones
        last[found.flag] = PathArg(flag=found.flag, given=given, path=path, kind=kind, how=how)
    return HostPaths(
        host=host.name, address=host.address, args=tuple(out), paths=tuple(last.values())
    )


def _data_fn(found: Sequence[_Found]) -> bool:
    """Whether the workers take their batches from a function, which reads ``--data``
    as it likes (then the path need only exist)."""
    fns = [f for f in found if f.flag == "--data-fn"]
    return bool(fns and fns[-1].value)


def _find(args: Sequence[str]) -> list[_Found]:
    found = []
    for i, token in enumerate(args):
        flag, eq, value = token.partition("=")
        if flag not in PATH_FLAGS:
            continue
        if eq:
            found.append(_Found(index=i, flag=flag, value=value, joined=True))
        elif i + 1 < len(args) and not (flag in _OPTIONAL_VALUE and args[i + 1].startswith("-")):
            found.append(_Found(index=i + 1, flag=flag, value=args[i + 1], joined=False))
    return found


def _read_as(path: str, host: Host, caller: Caller, home: str | None) -> tuple[str, str]:
    """``(path as the host reads it, how)`` by the module docstring's rules."""
    if path.startswith("/") or not path:
        return path, ABSOLUTE
    if path == "~" or path.startswith("~/"):
        if host.is_local:
            return expand_home(path, caller.home), HOME
        return (expand_home(path, home) if home else path), HOME
    if host.is_local:
        return str(PurePosixPath(caller.cwd) / path), CALLER_DIR
    workdir = host.workdir.rstrip("/") or "/"
    if home:
        workdir = expand_home(workdir, home)
    return str(PurePosixPath(workdir) / path), WORKDIR


def why(arg: PathArg, host: Host) -> str:
    """How a relative path was read, in words (for notes and errors); "" otherwise."""
    if arg.how == CALLER_DIR:
        return "relative paths on this machine are read from the current directory"
    if arg.how == WORKDIR:
        return "relative paths on remote hosts are relative to the workdir"
    return ""


def notes(resolved: Sequence[HostPaths], hosts: Mapping[str, Host]) -> list[str]:
    """One line per relative path: how each host reads it (the launch's first lines)."""
    out = []
    for hp in resolved:
        for arg in hp.paths:
            if arg.how in (CALLER_DIR, WORKDIR):
                out.append(
                    f"paths: {hp.host} ({hp.address}) reads {arg.flag} {arg.given} as "
                    f"{arg.path} ({why(arg, hosts[hp.host])})"
                )
    return out


def listing(hp: HostPaths | None, host: Host) -> list[str]:
    """Every path a host reads or writes (``--dry-run``'s comment lines)."""
    if hp is None:
        return []
    out = []
    for arg in hp.paths:
        reason = why(arg, host)
        out.append(f"# {hp.host}: {arg.flag} {arg.given} -> {arg.path}")
        out[-1] += f" ({reason})" if reason else ""
    return out


def problem(arg: PathArg, host: Host, what: str, read_as: str) -> str:
    """The one-line error for a path the host cannot read, e.g. ``host a (127.0.0.2):
    --data build/x: no such file or directory (read as /home/u/autohet/build/x: ...)``."""
    reason = why(arg, host)
    shown = f" (read as {read_as}" + (f": {reason})" if reason else ")")
    if read_as == arg.given and not reason:
        shown = ""
    return f"host {host.name} ({host.address}): {arg.flag} {arg.given}: {what}{shown}"
