"""Which checkpoint steps a job keeps: ``--keep-checkpoints K`` and pins (pure).

Why
    Every save is a full copy of the training state (a 1.2B llama writes 15 GB per
    save), so a run that saved every step it reached would fill its disks. A job
    keeps its newest K complete steps (default 3: the newest, and two to fall back
    on when the newest turns out bad or lost a shard with its host); ``0`` keeps
    every step. The runtime applies this after each save, on every host and in the
    remote copy (``ckpt.prune``); this module only decides.

What is never removed (:func:`choose_prune`)
    - a step among the newest K complete ones. *Complete* means ``COMPLETE`` and a
      manifest that authenticates, somewhere: only rank 0's host holds them, so
      completeness is decided over every host, and a planted step (which does not
      authenticate) neither counts towards K nor is removed;
    - a pinned step (below);
    - anything not complete: a ``.tmp-step-*`` of a save in flight, a step
      directory ``autohet recover`` is still filling, a half-uploaded remote step;
    - any name that is not a step directory (the key, pins, files of others).

    Removal renames a local step to ``.del-step-<N>-<token>`` first, so a removal
    cut short never leaves a step that looks complete but lacks files; such
    leftovers are the one other thing a prune removes.

Pins
    A pin keeps one step whatever K says while someone reads it. A run resumed
    from step S keeps S (in memory, on every rank) until it has saved K steps newer
    than S, so it can always go back to where it started. ``autohet recover`` pins
    the step it copies with a file ``<job dir>/.pin-step-<N:08d>-<token>.json`` on
    every host it copies from, and in the remote copy (schema below). A pin file
    lapses at ``expires_unix``, or, when read on the machine that wrote it, as soon
    as its process is gone: a pin left by a dead process never blocks for ever.
    Pins of all hosts count together (a step is one unit across hosts).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from autohet_cli.ckpt.format import parse_step_dir, step_dir_name
from autohet_cli.errors import ConfigError

FLAG = "--keep-checkpoints"
DEFAULT_KEEP = 3
PIN_SCHEMA = "autohet.pin/v1"
PIN_PREFIX = ".pin-"
DELETING_PREFIX = ".del-"

_PIN = re.compile(r"^\.pin-step-(?P<step>\d{8,})-[A-Za-z0-9]{1,64}\.json$")
_DELETING = re.compile(r"^\.del-step-\d{8,}-[A-Za-z0-9]{1,64}$")
_TOKEN = re.compile(r"^[A-Za-z0-9]{1,64}$")


# --------------------------------------------------------------------- the flag


def parse_keep(text: str | int) -> int:
    """``--keep-checkpoints``: a count >= 0 (0: keep every step)."""
    try:
        value = text if isinstance(text, int) else int(str(text).strip())
    except ValueError:
        value = -1
    if isinstance(value, bool) or value < 0:
        raise ValueError(
            f"{FLAG} {text!r}: expected how many complete steps to keep (1 or more), "
            "or 0 to keep every step"
        )
    return value


def keep_of(args: Sequence[str]) -> int:
    """The value the worker will use: the last ``--keep-checkpoints`` in ``args``
    (argparse keeps the last); the default when absent."""
    value: str | int = DEFAULT_KEEP
    for i, arg in enumerate(args):
        if arg == FLAG and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(FLAG + "="):
            value = arg.split("=", 1)[1]
    return parse_keep(value)


def describe_keep(keep: int) -> str:
    if keep == 0:
        return f"every step kept ({FLAG} 0)"
    return f"the newest {keep} complete step{'s' if keep != 1 else ''} kept"


# --------------------------------------------------------------------- pins


@dataclass(frozen=True, slots=True, kw_only=True)
class Pin:
    """Someone reads ``step``: keep it until ``expires_unix`` or until its writer,
    process ``pid`` on machine ``machine`` (a host name), is gone."""

    step: int
    holder: str  # who, for people reading the directory ("autohet recover on ctl")
    machine: str
    pid: int
    expires_unix: float


def pin_name(step: int, token: str) -> str:
    if not _TOKEN.match(token):
        raise ValueError(f"a pin token is 1-64 letters or digits, got {token!r}")
    return f"{PIN_PREFIX}{step_dir_name(step)}-{token}.json"


def parse_pin_name(name: str) -> int | None:
    """The step a pin file's name pins; None for any other name."""
    m = _PIN.match(name)
    return int(m.group("step")) if m else None


def pin_to_text(pin: Pin) -> str:
    return json.dumps(
        {
            "schema": PIN_SCHEMA,
            "step": pin.step,
            "holder": pin.holder,
            "machine": pin.machine,
            "pid": pin.pid,
            "expires_unix": pin.expires_unix,
        },
        sort_keys=True,
    )


def pin_from_text(text: str, where: str) -> Pin:
    """Parse a pin file; errors name ``where`` and the field."""
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON: {exc.msg}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    want = {"schema", "step", "holder", "machine", "pid", "expires_unix"}
    if set(raw) != want:
        raise ConfigError(f"{where}: expected the keys {', '.join(sorted(want))}")
    if raw["schema"] != PIN_SCHEMA:
        raise ConfigError(f"{where}: schema: expected {PIN_SCHEMA!r}, got {raw['schema']!r}")
    for key, kind in (("step", int), ("pid", int), ("holder", str), ("machine", str)):
        if not isinstance(raw[key], kind) or isinstance(raw[key], bool):
            raise ConfigError(f"{where}: {key}: expected {kind.__name__}, got {raw[key]!r}")
    expires = raw["expires_unix"]
    if not isinstance(expires, int | float) or isinstance(expires, bool):
        raise ConfigError(f"{where}: expires_unix: expected a number, got {expires!r}")
    return Pin(
        step=raw["step"],
        holder=raw["holder"],
        machine=raw["machine"],
        pid=raw["pid"],
        expires_unix=float(expires),
    )


def pin_holds(pin: Pin, *, now_unix: float, writer_gone: bool) -> bool:
    """Whether ``pin`` still keeps its step. ``writer_gone``: the reader is on the
    pin's machine and found its process gone (the edge checks; elsewhere False)."""
    return now_unix < pin.expires_unix and not writer_gone


# --------------------------------------------------------------------- the choice


@dataclass(frozen=True, slots=True, kw_only=True)
class Prune:
    """What one directory's prune removes, and what the job keeps."""

    remove: tuple[int, ...]  # complete steps present here that go, ascending
    leftovers: tuple[str, ...]  # ``.del-step-*`` of an earlier removal, to finish
    kept: tuple[int, ...]  # complete steps of the job that stay, ascending
    pinned: tuple[int, ...]  # of ``kept``: only because pinned

    @property
    def empty(self) -> bool:
        return not self.remove and not self.leftovers


def choose_prune(
    names: Iterable[str],
    *,
    complete: Collection[int],
    keep: int,
    pinned: Collection[int] = (),
) -> Prune:
    """Which entries of one job directory go.

    ``names``: the directory's entries (a host's job directory, or the remote
    copy's); ``complete``: the job's complete, authenticated steps over every host;
    ``keep``: K (0: keep every step); ``pinned``: steps someone reads. Only a step
    directory of a complete step outside the newest K and unpinned is removed,
    plus leftovers of an earlier removal; everything else is left as it is.
    """
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    done = sorted(set(complete))
    newest = set(done[-keep:]) if keep else set(done)
    kept = sorted(newest | (set(pinned) & set(done)))
    entries = list(names)
    present = {s for s in map(parse_step_dir, entries) if s is not None}
    remove = sorted(s for s in present & set(done) if s not in kept)
    return Prune(
        remove=tuple(remove),
        leftovers=tuple(sorted(n for n in entries if _DELETING.match(n))),
        kept=tuple(kept),
        pinned=tuple(s for s in kept if s not in newest),
    )


def deleting_name(step: int, token: str) -> str:
    """What a step directory is renamed to before it is deleted."""
    if not _TOKEN.match(token):
        raise ValueError(f"a removal token is 1-64 letters or digits, got {token!r}")
    return f"{DELETING_PREFIX}{step_dir_name(step)}-{token}"


def prune_message(
    *, job: str, removed: Sequence[int], prune: Prune, keep: int, where: str = ""
) -> str:
    """``checkpoints: removed step 10, 20 of job J (keeping 30, 40, 50; --keep-checkpoints 3)``."""
    steps = ", ".join(map(str, removed))
    pinned = f"; {', '.join(map(str, prune.pinned))} pinned" if prune.pinned else ""
    kept = ", ".join(map(str, prune.kept)) or "none"
    return (
        f"checkpoints: removed step {steps} of job {job}{where} "
        f"(keeping {kept}{pinned}; {FLAG} {keep})"
    )
