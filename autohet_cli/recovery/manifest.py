"""Which checkpoint to recover from (pure); the format itself is ``autohet_cli.ckpt.format``.

A checkpoint is *usable* for recovery when

1. some surviving host (or the remote copy) has both ``COMPLETE`` and
   ``manifest.json`` in that step directory,
2. its manifest parses, names the step of its directory and (when the reader
   passes verified manifests) authenticates with the job's key, and
3. every file the manifest lists is present on a surviving host or in the remote
   copy (by name here; contents are verified against the sha256 before loading).

:func:`newest_complete` picks the highest usable step and says why every newer
step directory was passed over.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from autohet_cli.ckpt.format import (
    COMPLETE,
    KEY_FILE,
    MANIFEST,
    METADATA,
    SCHEMA,
    Manifest,
    ManifestFile,
    load_manifest,
    local_job_dir,
    local_step_dir,
    manifest_from_json,
    manifest_to_dict,
    namespace,
    parse_manifest,
    parse_step_dir,
    remote_root,
    remote_step_dir,
    step_dir_name,
)
from autohet_cli.errors import ConfigError
from autohet_cli.recovery.errors import RecoveryError

__all__ = [
    "remote_root",
    "COMPLETE",
    "KEY_FILE",
    "MANIFEST",
    "METADATA",
    "REMOTE",
    "SCHEMA",
    "CheckpointChoice",
    "Manifest",
    "ManifestFile",
    "load_manifest",
    "local_job_dir",
    "local_step_dir",
    "manifest_from_json",
    "manifest_to_dict",
    "namespace",
    "newest_complete",
    "parse_manifest",
    "parse_step_dir",
    "remote_root",
    "remote_step_dir",
    "step_dir_name",
]

REMOTE = "remote"  # the name the remote copy goes by in listings and reports


# --------------------------------------------------------------------- choice


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointChoice:
    """The checkpoint to resume from and where its files are (by listing)."""

    step_dir: str
    manifest: Manifest
    holders: Mapping[str, tuple[str, ...]]  # file -> surviving hosts listing it
    remote_only: tuple[str, ...]  # files no surviving host lists: remote copy needed
    skipped: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # newer dirs, why

    @property
    def step(self) -> int:
        return self.manifest.step


Listing = Mapping[str, Collection[str]]  # step directory name -> file names in it


def newest_complete(
    listings: Mapping[str, Listing],
    manifests: Mapping[str, Manifest | str],
    *,
    remote: Listing | None = None,
    before_step: int | None = None,
) -> CheckpointChoice:
    """The newest usable checkpoint.

    ``listings`` maps each *surviving* host to its step directories and the file
    names in each; ``remote`` is the same for the remote copy (None: not listed).
    ``manifests`` maps step directory name to its manifest (parsed, or the raw
    JSON text, which is validated here so a corrupt newer manifest only skips
    that checkpoint). ``before_step`` skips steps >= it (to fall back further
    when a chosen checkpoint turned out to be unrecoverable).
    """
    sources: dict[str, Listing] = dict(listings)
    if remote is not None:
        sources[REMOTE] = remote
    dirs = {d for listing in sources.values() for d in listing if parse_step_dir(d) is not None}
    skipped: list[tuple[str, str]] = []
    for d in sorted(dirs, key=lambda x: parse_step_dir(x) or 0, reverse=True):
        step = parse_step_dir(d)
        assert step is not None
        if before_step is not None and step >= before_step:
            continue
        choice, why = _usable(d, step, sources, manifests.get(d))
        if choice is not None:
            return CheckpointChoice(
                step_dir=d,
                manifest=choice.manifest,
                holders=choice.holders,
                remote_only=choice.remote_only,
                skipped=tuple(skipped),
            )
        skipped.append((d, why))
    where = ", ".join(sorted(sources)) or "no host"
    if not skipped:
        raise RecoveryError(f"no checkpoint step directory found on {where}")
    detail = "; ".join(f"{d}: {why}" for d, why in skipped)
    raise RecoveryError(f"no complete checkpoint to recover from on {where} ({detail})")


def _usable(
    d: str, step: int, sources: Mapping[str, Listing], raw: Manifest | str | None
) -> tuple[CheckpointChoice | None, str]:
    marked = [
        s for s, listing in sources.items() if {COMPLETE, MANIFEST} <= set(listing.get(d, ()))
    ]
    if not marked:
        return None, f"incomplete (no host has both {COMPLETE} and {MANIFEST})"
    if raw is None:
        return None, f"{MANIFEST} was not read"
    if isinstance(raw, str) and not raw.lstrip().startswith("{"):
        return None, raw  # the reader's reason (unauthenticated, another lineage, ...)
    try:
        manifest = raw if isinstance(raw, Manifest) else manifest_from_json(raw, f"{d}/{MANIFEST}")
    except ConfigError as exc:
        return None, f"invalid manifest: {exc}"
    if manifest.step != step:
        return None, f"{MANIFEST} says step {manifest.step}, not {step}"
    holders: dict[str, tuple[str, ...]] = {}
    remote_only: list[str] = []
    missing: list[str] = []
    for f in manifest.files:
        hosts = tuple(
            sorted(
                s for s, listing in sources.items() if s != REMOTE and f.path in listing.get(d, ())
            )
        )
        holders[f.path] = hosts
        if not hosts:
            if REMOTE in sources and f.path in sources[REMOTE].get(d, ()):
                remote_only.append(f.path)
            else:
                missing.append(f"{f.path} (written on {f.host})")
    if missing:
        return None, f"lost everywhere: {', '.join(missing)}"
    choice = CheckpointChoice(
        step_dir=d, manifest=manifest, holders=holders, remote_only=tuple(remote_only)
    )
    return choice, ""
