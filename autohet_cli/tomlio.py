"""TOML reading with the limits ``yamlio`` puts on YAML (pure).

``tomllib`` recurses once per nested array or inline table, so ``[`` x 100000
is a RecursionError, and it keeps every prefix of a dotted key, so one key of
100,000 parts (``a.a.a...``, 200 KB) took gigabytes before the process was
killed. Both have to stop before ``tomllib`` sees the text: ``nesting`` scans
it once, skipping strings and comments, and counts what ``tomllib`` would nest
(a table header's parts, a key's dotted parts, open arrays and inline tables);
past ``MAX_DEPTH`` the file is refused, which no hand-written file reaches.
"""

from __future__ import annotations

import re
import tomllib
from typing import Any

from autohet_cli.errors import ConfigError
from autohet_cli.yamlio import MAX_DEPTH


def parse_toml(text: str, where: str) -> dict[str, Any]:
    """``text`` as TOML; nesting past ``MAX_DEPTH`` or any failure is one ConfigError."""
    if nesting(text) > MAX_DEPTH:
        raise ConfigError(f"{where}: not valid TOML: nested more than {MAX_DEPTH} levels deep")
    try:
        return tomllib.loads(text)
    except ValueError as exc:  # TOMLDecodeError, and integers past Python's digit limit
        raise ConfigError(f"{where}: not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{where}: not valid TOML: nested too deeply") from None


def nesting(text: str, *, stop_past: int = MAX_DEPTH) -> int:
    """How deep ``text`` nests as TOML, counted from above: a header ``[a.b]`` puts
    the lines below it 2 deep (3 for ``[[a.b]]``), and a key ``c.d = [{e = 1}]``
    under it reaches 5 (its second part, the array and the table add one each).
    Dots count only where a key is read: a float's point is not nesting. The scan
    stops once the depth passes ``stop_past``. Invalid TOML may be counted wrongly;
    ``tomllib`` then refuses it where its own reading stops, before any deep work."""
    scan = _Scan(text)
    scan.run(stop_past)
    return scan.deepest


# The characters the scan acts on; runs of others are skipped at once.
_SPECIAL = re.compile(r"[\"'#\n\[\]{},=.]")


class _Scan:
    """One pass over TOML text, outside strings and comments."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.deepest = 0
        self.base = 0  # depth of the current table (its header)
        self.stack: list[str] = []  # open "[" arrays, "{" inline tables, "h" a header
        self.extra: list[int] = []  # per open level: the dotted parts of the key before it
        self.extra_sum = 0
        self.in_key = True  # reading a key (at a line's start, after "{" or ",")
        self.key_dots = 0  # dots of the key being read
        self.line_start = True  # only whitespace so far on this line

    def run(self, stop_past: int) -> None:
        text, i = self.text, 0
        while self.deepest <= stop_past:
            m = _SPECIAL.search(text, i)
            if m is None:
                return
            j = m.start()
            if text[i:j].strip():
                self.line_start = False
            c = text[j]
            if c in "\"'":
                i = self._skip_string(j)
                self.line_start = False
                continue
            if c == "#":
                end = text.find("\n", j)
                i = len(text) if end < 0 else end
                continue
            self._char(c)
            depth = self.base + len(self.stack) + self.extra_sum + self.key_dots
            self.deepest = max(self.deepest, depth)
            i = j + 1

    def _char(self, c: str) -> None:
        top = self.stack[-1] if self.stack else ""
        if c == "\n":
            if not self.stack:
                self.in_key, self.key_dots, self.line_start = True, 0, True
            return
        starts_line, self.line_start = self.line_start, False
        if c == "[":
            if starts_line and not self.stack:  # a table header
                self.stack.append("h")
                self.extra.append(0)
                self.base = 0
            elif top == "h":  # [[an array of tables]]
                self.extra[-1] += 1
                self.extra_sum += 1
            else:
                self._open("[")
                self.in_key = False
        elif c == "{":
            self._open("{")
            self.in_key = True
        elif c in "]}":
            if top == "h":
                self.base = self.extra[-1] + self.key_dots + 1
                self.key_dots = 0
            if self.stack:
                self.stack.pop()
                self.extra_sum -= self.extra.pop()
            self.in_key = False
        elif c == ",":
            self.in_key = top == "{"
            self.key_dots = 0
        elif c == "=":
            self.in_key = False
        elif c == "." and (self.in_key or top == "h"):
            self.key_dots += 1

    def _open(self, kind: str) -> None:
        self.stack.append(kind)
        self.extra.append(self.key_dots)  # a key's parts nest what it opens
        self.extra_sum += self.key_dots
        self.key_dots = 0

    def _skip_string(self, i: int) -> int:
        """The index after the string that starts at ``i`` (basic or literal, on one
        line or several); the end of the text if it is never closed."""
        for pattern in _STRINGS:
            m = pattern.match(self.text, i)
            if m:
                return m.end()
        return len(self.text)


# TOML's strings, longest opening first: a multi-line one ends at three quotes
# (up to two more belong to it: '"""a""""' holds 'a"'); a one-line one at its quote
# (or, unclosed, at the line's end, where tomllib refuses it).
_STRINGS = (
    re.compile(r'"""(?:[^"\\]|\\.|""?(?!"))*"""(?:"{0,2})', re.S),
    re.compile(r"'''(?:[^']|''?(?!'))*'''(?:'{0,2})", re.S),
    re.compile(r'"(?:[^"\\\n]|\\.)*"?'),
    re.compile(r"'[^'\n]*'?"),
)
