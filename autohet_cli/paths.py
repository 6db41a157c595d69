"""Paths on a host, as a cluster file writes them (pure).

``~`` in a cluster file means the home directory on *that* host, which only the
host can tell; these helpers expand it once the home is known and render it for
a shell line that has to run as printed.
"""

from __future__ import annotations

import re
import shlex

_OPTION_HOME = re.compile(r"(--?[A-Za-z0-9][A-Za-z0-9_-]*=)~(/|\Z)")


def expand_home(path: str, home: str) -> str:
    """``~`` or ``~/x`` on a host whose home is ``home``; other paths unchanged."""
    if path == "~":
        return home
    if path.startswith("~/"):
        return home.rstrip("/") + path[1:]
    return path


def shell_word(text: str) -> str:
    """``text`` quoted for a POSIX shell, except that a leading ``~`` (the host's home)
    becomes ``"$HOME"``, which expands in any position (``~`` does not after ``=``),
    also after an option's ``=`` (``--data=~/x``: a path flag, ``launch.pathargs``)."""
    option = _OPTION_HOME.match(text)
    if option:
        return shlex.quote(option.group(1)) + shell_word(text[option.end(1) :])
    if text == "~":
        return '"$HOME"'
    if text.startswith("~/"):
        rest = text[2:]
        return '"$HOME"/' + shlex.quote(rest) if rest else '"$HOME"/'
    return shlex.quote(text)
