"""Before starting workers: can every host run them? (effects, one command per host)

One short Python program per host, run with the host's interpreter in its
workdir, answers at once what would otherwise surface minutes later as a hung or
crashed job blamed on the wrong host:

- does the interpreter start at all (a hung ``python`` is reported by host, with
  the timeout, instead of as a rendezvous that never completes);
- can it find torch, and autohet when the built-in trainer runs there (found, not
  imported: an import takes seconds and the workers import them anyway);
- which torch version (hosts that disagree are warned about);
- the home directory, so ``~`` in the cluster file expands on that host;
- on the master host only, a TCP port free on every interface now, for the
  rendezvous: 29500 is often taken on an ML workstation by another torchrun.

Each host is asked once per :class:`HostPool`: a later preflight on the same pool
(recover's relaunch) reuses what an earlier one found, and ``preflight_ahead``
starts the checks in the background (recover, while it copies the checkpoint), so
the relaunch finds them done. Only the rendezvous port is always looked up fresh,
by a short program (``python -S``: no site, no package lookups). A check that
failed is never kept: the host is asked again, and its error named then.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from autohet_cli.cluster import Host, python_for
from autohet_cli.errors import AutohetError, CommandTimeout, TransportError
from autohet_cli.launch import pathargs
from autohet_cli.launch.pathargs import PathArg
from autohet_cli.transport.fanout import fan_out
from autohet_cli.transport.pool import HostPool

PREFLIGHT_TIMEOUT_S = 90.0

# argv: workdir (may start with ~), "1" to import autohet_cli, "1" to pick a port,
# and the paths to check as JSON: [[path, kind], ...] (kinds: launch.pathargs).
_PROGRAM = r"""
import json, os, socket, sys
def readable(p, d=False):
    return os.access(p, os.R_OK | (os.X_OK if d else 0))
def check(path, kind):
    full = os.path.abspath(os.path.expanduser(path))
    if kind == "data" and not os.path.exists(full):
        prefix = full[:-4] if full.endswith((".bin", ".idx")) else full
        pair = [prefix + ".bin", prefix + ".idx"]
        if not any(map(os.path.exists, pair)):
            return full, "no such file or directory"
        if not all(map(os.path.isfile, pair)):
            return full, "a Megatron dataset needs both %s and %s" % tuple(pair)
        return full, None if all(map(readable, pair)) else "permission denied"
    if not os.path.exists(full):
        return full, {"hf_dir": "no such directory", "file": "no such file"}.get(
            kind, "no such file or directory")
    if kind == "exists":
        return full, None if readable(full, os.path.isdir(full)) else "permission denied"
    if kind == "hf_dir" or (kind == "data" and os.path.isdir(full)):
        if not os.path.isdir(full):
            return full, "not a directory (a HuggingFace model directory holds config.json " \
                "and its safetensors)"
        if not readable(full, True):
            return full, "permission denied"
        need = "config.json" if kind == "hf_dir" else "meta.json"
        if not os.path.isfile(os.path.join(full, need)):
            return full, ("no config.json in it (a HuggingFace model directory holds "
                "config.json and its safetensors)" if kind == "hf_dir" else "a directory "
                "without meta.json, so not one `autohet data prepare` wrote; pass its --out "
                "directory or a token file")
        return full, None if readable(os.path.join(full, need)) else need + ": permission denied"
    if os.path.isdir(full):
        return full, "is a directory, not a file"
    if not os.path.isfile(full):
        return full, "not a regular file"
    return full, None if readable(full) else "permission denied"
os.umask(0o077)  # what we create is ours alone (checkpoint dirs are checked for it)
workdir = os.path.expanduser(sys.argv[1])
os.makedirs(workdir, exist_ok=True)
unsafe = make_private_dir(Path(workdir), Path(workdir))  # privatedir's rule, sent with this
os.chdir(workdir)
sys.path.insert(0, workdir)
out = {"home": os.path.expanduser("~"), "python": sys.version.split()[0]}
if unsafe:
    out["workdir_unsafe"] = "%s: %s" % (os.path.abspath(workdir), unsafe)
# Found, not imported: importing torch takes seconds, and the workers do it anyway.
import importlib.metadata, importlib.util
if importlib.util.find_spec("torch") is None:
    out["error"] = "cannot import torch: no module named 'torch'"
else:
    try:
        out["torch"] = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        out["torch"] = "?"
if "error" not in out and sys.argv[2] == "1" and importlib.util.find_spec("autohet_cli") is None:
    out["error"] = "cannot import autohet_cli: no module named 'autohet_cli'"
if sys.argv[3] == "1":
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("", 0))
    out["free_port"] = s.getsockname()[1]
    s.close()
out["paths"] = [check(p, k) for p, k in json.loads(sys.argv[4])] if len(sys.argv) > 4 else []
print("__autohet_preflight__ " + json.dumps(out))
"""
_PORT_PROGRAM = r"""
import json, socket
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.bind(("", 0))
print("__autohet_preflight__ " + json.dumps({"free_port": s.getsockname()[1]}))
s.close()
"""
_MARK = "__autohet_preflight__ "


def _privatedir_source() -> str:
    import inspect

    from autohet_cli import privatedir

    return inspect.getsource(privatedir)


def _program() -> str:
    """The check program after ``privatedir``'s source (standard library only): the
    workdir, where the workers import code from, is held to the private-directory rule
    that checkpoint and cache directories follow."""
    return _privatedir_source() + _PROGRAM


def private_dir_argv(host: Host, path: str, root: str) -> list[str]:
    """A host command that makes ``path`` (0700) under ``root`` by ``privatedir``'s rule
    and prints why it is unsafe (nothing when it is safe): for code sent to a host's
    workdir to run there (``autohet profile``'s probes)."""
    main = "\nimport sys\nprint(make_private_dir(Path(sys.argv[1]), Path(sys.argv[2])) or '')\n"
    return [python_for(host), "-c", _privatedir_source() + main, path, root]


class PreflightError(AutohetError):
    """A host cannot run the workers; the message names the host and what to do."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HostReport:
    host: str
    home: str
    python: str
    torch: str
    free_port: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class _Check:
    """One host's check, done or under way, whether it looked for autohet, and the
    paths it found readable there (``launch.pathargs``)."""

    needs_autohet: bool
    report: Future[HostReport]
    paths: frozenset[PathArg] = frozenset()


# Per pool (its hosts' facts hold while its connections do), per host.
_CHECKS: weakref.WeakKeyDictionary[HostPool, dict[str, _Check]] = weakref.WeakKeyDictionary()
_CHECKS_LOCK = threading.Lock()


def preflight(
    pool: HostPool,
    hosts: Sequence[str],
    *,
    needs_autohet: bool,
    port_host: str | None,
    timeout_s: float = PREFLIGHT_TIMEOUT_S,
    paths: Mapping[str, Sequence[PathArg]] | None = None,
) -> dict[str, HostReport]:
    """Check every host in parallel (or reuse this pool's earlier check of it); raise
    one error naming every host that fails. ``paths``: per host, the paths its
    workers will read (``pathargs.resolve``), checked in the same round trip."""

    def check(name: str) -> HostReport:
        want = _wanted(paths, name)
        known = _known(pool, name, needs_autohet, want, timeout_s)
        if known is None:
            return _remember(
                pool,
                name,
                needs_autohet,
                want,
                _ask(pool, name, needs_autohet, name == port_host, timeout_s, want),
            )
        if name == port_host:
            return dataclasses.replace(known, free_port=_ask_port(pool, name, timeout_s))
        return dataclasses.replace(known, free_port=None)

    results = fan_out([pool.host(h) for h in hosts], lambda h: check(h.name))
    problems = [str(r) for r in results.values() if isinstance(r, Exception)]
    if problems:
        errors = [r for r in results.values() if isinstance(r, TransportError)]
        if errors and len(errors) == len(problems):
            raise errors[0] if len(errors) == 1 else TransportError("; ".join(problems))
        raise PreflightError("; ".join(problems))
    reports = {n: r for n, r in results.items() if isinstance(r, HostReport)}
    for name, report in reports.items():
        pool.set_home(name, report.home)
    return reports


def preflight_ahead(
    pool: HostPool,
    hosts: Sequence[str],
    *,
    needs_autohet: bool,
    timeout_s: float = PREFLIGHT_TIMEOUT_S,
    paths: Mapping[str, Sequence[PathArg]] | None = None,
) -> None:
    """Start checking ``hosts`` in the background (daemon threads); a ``preflight`` on
    the same pool waits for these instead of asking again. Errors surface there.
    Slurm nodes are not reached from here (nor checked by a Slurm launch)."""
    if pool.cluster.backend == "slurm":
        return
    for name in hosts:
        want = _wanted(paths, name)
        with _CHECKS_LOCK:
            checks = _CHECKS.setdefault(pool, {})
            have = checks.get(name)
            if _covers(have, needs_autohet, want):
                continue
            future: Future[HostReport] = Future()
            checks[name] = _Check(needs_autohet=needs_autohet, report=future, paths=want)

        def run(
            name: str = name, future: Future[HostReport] = future, want: frozenset[PathArg] = want
        ) -> None:
            try:
                future.set_result(_ask(pool, name, needs_autohet, False, timeout_s, want))
            except BaseException as exc:  # kept for the preflight that waits for it
                future.set_exception(exc)

        threading.Thread(target=run, name=f"{name}-preflight", daemon=True).start()


def _wanted(paths: Mapping[str, Sequence[PathArg]] | None, name: str) -> frozenset[PathArg]:
    """The paths to check on ``name``: read by its workers (not written)."""
    return frozenset(a for a in (paths or {}).get(name, ()) if a.checked)


def _covers(have: _Check | None, needs_autohet: bool, want: frozenset[PathArg]) -> bool:
    """Whether an earlier check stands for one that needs autohet and these paths."""
    if have is None or (needs_autohet and not have.needs_autohet):
        return False
    return want <= have.paths


def _known(
    pool: HostPool, name: str, needs_autohet: bool, want: frozenset[PathArg], timeout_s: float
) -> HostReport | None:
    """This pool's earlier check of ``name`` (waiting up to ``timeout_s`` for one under
    way), if it covers ``needs_autohet`` and the paths ``want`` and succeeded; a failed
    one is forgotten (asked again)."""
    with _CHECKS_LOCK:
        have = _CHECKS.get(pool, {}).get(name)
    if have is None or not _covers(have, needs_autohet, want):
        return None
    try:
        return have.report.result(timeout=timeout_s)
    except FutureTimeout:
        raise _no_answer(pool.host(name), timeout_s) from None
    except Exception:
        with _CHECKS_LOCK:
            checks = _CHECKS.get(pool, {})
            if checks.get(name) is have:
                del checks[name]
        return None


def _remember(
    pool: HostPool, name: str, needs_autohet: bool, want: frozenset[PathArg], report: HostReport
) -> HostReport:
    done: Future[HostReport] = Future()
    done.set_result(report)
    with _CHECKS_LOCK:
        _CHECKS.setdefault(pool, {})[name] = _Check(
            needs_autohet=needs_autohet, report=done, paths=want
        )
    return report


def _ask(
    pool: HostPool,
    name: str,
    needs_autohet: bool,
    port: bool,
    timeout_s: float,
    want: frozenset[PathArg] = frozenset(),
) -> HostReport:
    """Run the check program on ``name`` (one round trip), paths included."""
    host = pool.host(name)
    order = sorted(want, key=lambda a: a.flag)
    info = _answer(
        pool,
        host,
        [
            python_for(host),
            "-c",
            _program(),
            host.workdir,
            "1" if needs_autohet else "0",
            "1" if port else "0",
            json.dumps([[a.path, a.kind] for a in order]),
        ],
        timeout_s,
    )
    problems = [
        pathargs.problem(arg, host, str(what), str(full))
        for arg, (full, what) in zip(order, info.get("paths", ()), strict=False)
        if what
    ]
    if "error" in info:
        hint = (
            "install autohet there (pip install autohet-cli), or sync your code with "
            "autohet launch --sync-dir"
            if "autohet_cli" in info["error"]
            else "install torch in that interpreter or point `python:` at one that has it"
        )
        problems.insert(0, f"{name} ({host.python}): {info['error']}; {hint}")
    if "workdir_unsafe" in info:
        problems.insert(
            0,
            f"{name}: refusing the workdir {info['workdir_unsafe']}; the workers run from it "
            "and import the code synced there, so someone else could plant code they run. "
            "Use a directory only you can write (the default is ~/autohet)",
        )
    if problems:
        raise PreflightError("; ".join(problems))
    free = info.get("free_port")
    return HostReport(
        host=name,
        home=str(info["home"]),
        python=str(info["python"]),
        torch=str(info["torch"]),
        free_port=int(free) if free is not None else None,
    )


def _ask_port(pool: HostPool, name: str, timeout_s: float) -> int:
    """A TCP port free on ``name`` now (a host whose other facts are known)."""
    host = pool.host(name)
    info = _answer(pool, host, [python_for(host), "-S", "-c", _PORT_PROGRAM], timeout_s)
    return int(info["free_port"])


def _answer(pool: HostPool, host: Host, argv: list[str], timeout_s: float) -> dict[str, Any]:
    """The JSON a check program printed on ``host``, or the error naming why not."""
    try:
        res = pool.runner(host.name).run(argv, timeout_s=timeout_s)
    except CommandTimeout:
        raise _no_answer(host, timeout_s) from None
    line = next((x for x in res.stdout.splitlines() if x.startswith(_MARK)), None)
    if line is None:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        raise PreflightError(
            f"{host.name}: `{host.python}` did not run (exit {res.exit_code}): "
            + (" | ".join(tail) or "no output")
            + "; set `python:` for this host in the cluster file"
        )
    info: dict[str, Any] = json.loads(line[len(_MARK) :])
    return info


def version_warnings(reports: dict[str, HostReport]) -> list[str]:
    """Hosts whose torch or Python differ: collectives across versions may not agree."""
    out = []
    for what in ("torch", "python"):
        seen = {getattr(r, what) for r in reports.values()}
        if len(seen) > 1:
            detail = ", ".join(f"{h} {getattr(r, what)}" for h, r in sorted(reports.items()))
            out.append(f"warning: hosts run different {what} versions ({detail})")
    return out


def _no_answer(host: Host, timeout_s: float) -> PreflightError:
    return PreflightError(
        f"{host.name}: `{host.python}` did not answer within "
        f"{timeout_s:.0f} s (a hung interpreter? a slow network home?)"
    )
