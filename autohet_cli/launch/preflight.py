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
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from autohet_cli.cluster import python_for
from autohet_cli.errors import AutohetError, CommandTimeout, TransportError
from autohet_cli.transport.fanout import fan_out
from autohet_cli.transport.pool import HostPool

PREFLIGHT_TIMEOUT_S = 90.0

# argv: workdir (may start with ~), "1" to import autohet_cli, "1" to pick a port.
_PROGRAM = r"""
import json, os, socket, sys
os.umask(0o077)  # what we create is ours alone (checkpoint dirs are checked for it)
workdir = os.path.expanduser(sys.argv[1])
os.makedirs(workdir, exist_ok=True)
os.chdir(workdir)
sys.path.insert(0, workdir)
out = {"home": os.path.expanduser("~"), "python": sys.version.split()[0]}
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
print("__autohet_preflight__ " + json.dumps(out))
"""
_MARK = "__autohet_preflight__ "


class PreflightError(AutohetError):
    """A host cannot run the workers; the message names the host and what to do."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HostReport:
    host: str
    home: str
    python: str
    torch: str
    free_port: int | None = None


def preflight(
    pool: HostPool,
    hosts: Sequence[str],
    *,
    needs_autohet: bool,
    port_host: str | None,
    timeout_s: float = PREFLIGHT_TIMEOUT_S,
) -> dict[str, HostReport]:
    """Check every host in parallel; raise one error naming every host that fails."""

    def check(name: str) -> HostReport:
        host = pool.host(name)
        argv = [
            python_for(host),
            "-c",
            _PROGRAM,
            host.workdir,
            "1" if needs_autohet else "0",
            "1" if name == port_host else "0",
        ]
        try:
            res = pool.runner(name).run(argv, timeout_s=timeout_s)
        except CommandTimeout:
            raise PreflightError(
                f"{name}: `{host.python}` did not answer within "
                f"{timeout_s:.0f} s (a hung interpreter? a slow network home?)"
            ) from None
        line = next((x for x in res.stdout.splitlines() if x.startswith(_MARK)), None)
        if line is None:
            tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
            raise PreflightError(
                f"{name}: `{host.python}` did not run (exit {res.exit_code}): "
                + (" | ".join(tail) or "no output")
                + "; set `python:` for this host in the cluster file"
            )
        info = json.loads(line[len(_MARK) :])
        if "error" in info:
            hint = (
                "install autohet there (pip install autohet-cli), or sync your code with "
                "autohet launch --sync-dir"
                if "autohet_cli" in info["error"]
                else "install torch in that interpreter or point `python:` at one that has it"
            )
            raise PreflightError(f"{name} ({host.python}): {info['error']}; {hint}")
        port = info.get("free_port")
        return HostReport(
            host=name,
            home=str(info["home"]),
            python=str(info["python"]),
            torch=str(info["torch"]),
            free_port=int(port) if port is not None else None,
        )

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


def version_warnings(reports: dict[str, HostReport]) -> list[str]:
    """Hosts whose torch or Python differ: collectives across versions may not agree."""
    out = []
    for what in ("torch", "python"):
        seen = {getattr(r, what) for r in reports.values()}
        if len(seen) > 1:
            detail = ", ".join(f"{h} {getattr(r, what)}" for h, r in sorted(reports.items()))
            out.append(f"warning: hosts run different {what} versions ({detail})")
    return out
