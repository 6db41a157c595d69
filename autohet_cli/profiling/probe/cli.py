"""The probe's command line: read the spec, run, write the result atomically.

    python probe.pyz --spec spec.json --out result.json

``autohet profile run`` waits for the result file, so it is written whole or not
at all (a temporary file renamed into place); a malformed spec or an unreadable
file is exit status 2 with one line on stderr, and progress lines go to stderr
as ``probe: ...`` for autohet to show beside the host. torch is imported only
once the arguments are read, so ``--help`` answers at once, even without torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

from .spec import SpecError

DESCRIPTION = "autohet probe: time a model's layers on this host's accelerator (self-contained)."


def _write_atomic(path: str, text: str) -> None:
    """``text`` to ``path`` through a temporary file beside it, renamed into place."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".probe-", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def main(argv: list[str] | None = None) -> int:
    """Run the probe as its command line says; the process's exit status."""
    parser = argparse.ArgumentParser(prog="probe.pyz", description=DESCRIPTION)
    parser.add_argument("--spec", required=True, help="spec JSON file, or - for stdin")
    parser.add_argument("--out", help="result JSON file (default: stdout)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)

    def log(msg: str) -> None:
        if not args.quiet:
            print(f"probe: {msg}", file=sys.stderr, flush=True)

    from .driver import run  # torch: only once the arguments are read

    try:
        if args.spec == "-":
            raw = json.load(sys.stdin)
        else:
            with open(args.spec, encoding="utf-8") as f:
                raw = json.load(f)
        result = run(raw, log)
    except (OSError, json.JSONDecodeError, SpecError) as exc:
        print(f"probe: error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        _write_atomic(args.out, text + "\n")
    else:
        print(text)
    return 0
