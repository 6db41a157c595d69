"""Checkpoint manifests (``autohet.checkpoint/v1``) and the newest complete checkpoint (pure).

The contract is docs/checkpoint-format.md. A step directory
``<checkpoint_dir>/<plan name>/step-<N:08d>/`` holds DCP data files
``__<rank>_0.distcp``, DCP's ``.metadata`` (rank 0's host), ``manifest.json`` and,
written last, the empty ``COMPLETE`` marker (both on rank 0's host). The remote
copy has the same layout under ``<remote root>/<plan name>/``.

A checkpoint is *usable* for recovery when

1. some surviving host (or the remote copy) has both ``COMPLETE`` and
   ``manifest.json`` in that step directory,
2. its manifest parses and names the step of its directory, and
3. every file the manifest lists is present on a surviving host or in the remote
   copy (by name here; contents are verified against the sha256 before loading).

:func:`newest_complete` picks the highest usable step and says why every newer
step directory was passed over.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autohet_cli.errors import ConfigError
from autohet_cli.recovery.errors import RecoveryError
from autohet_cli.yamlio import as_list, as_mapping, check_keys
from autohet_cli.yamlio import field as get

SCHEMA = "autohet.checkpoint/v1"
MANIFEST = "manifest.json"
COMPLETE = "COMPLETE"
METADATA = ".metadata"
DEFAULT_REMOTE_ROOT = "/tmp/autohet-remote"
REMOTE_ENV = "AUTOHET_REMOTE"
REMOTE = "remote"  # the name the remote copy goes by in listings and reports

_STEP_DIR = re.compile(r"^step-(?P<step>\d{8,})$")
_PLAN_REF = re.compile(r"^(?P<name>.+)\.v(?P<version>\d+)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_DATA_FILE = re.compile(r"^__(?P<rank>\d+)_\d+\.distcp$")


@dataclass(frozen=True, slots=True, kw_only=True)
class ManifestFile:
    """One file of a checkpoint: its name in the step directory and who holds it."""

    path: str  # a bare file name inside the step directory
    sha256: str
    num_bytes: int
    host: str  # the plan host whose checkpoint_dir holds it
    rank: int  # the rank that wrote it

    @property
    def is_data(self) -> bool:
        """A DCP data file (``__<rank>_<n>.distcp``), not ``.metadata``."""
        return _DATA_FILE.match(self.path) is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    step: int  # the next step to run after loading
    plan: str  # "<name>.v<N>" of the plan that wrote it
    plan_sha256: str
    world_size: int
    files: tuple[ManifestFile, ...]

    @property
    def plan_name(self) -> str:
        m = _PLAN_REF.match(self.plan)
        assert m is not None  # checked when parsed
        return m.group("name")

    @property
    def plan_version(self) -> int:
        m = _PLAN_REF.match(self.plan)
        assert m is not None
        return int(m.group("version"))

    @property
    def num_bytes(self) -> int:
        return sum(f.num_bytes for f in self.files)

    def file(self, path: str) -> ManifestFile:
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(path)


# --------------------------------------------------------------------- parsing


def parse_manifest(raw: Any, where: str) -> Manifest:
    """Validate a decoded ``manifest.json``; errors name ``where`` and the field."""
    d = as_mapping(raw, where)
    check_keys(d, where, ["schema", "step", "plan", "plan_sha256", "world_size", "files"])
    if d["schema"] != SCHEMA:
        raise ConfigError(f"{where}: schema: expected {SCHEMA!r}, got {d['schema']!r}")
    step = get(d, "step", int, where)
    if step < 0:
        raise ConfigError(f"{where}: step: must be >= 0, got {step}")
    plan = get(d, "plan", str, where)
    if not _PLAN_REF.match(plan):
        raise ConfigError(f"{where}: plan: expected '<plan name>.v<N>', got {plan!r}")
    plan_sha = get(d, "plan_sha256", str, where)
    _check_sha(plan_sha, f"{where}: plan_sha256")
    world = get(d, "world_size", int, where)
    if world < 1:
        raise ConfigError(f"{where}: world_size: must be at least 1, got {world}")
    files = tuple(
        _file(fv, f"{where}: files[{i}]", world)
        for i, fv in enumerate(as_list(d["files"], f"{where}: files"))
    )
    seen: dict[str, int] = {}
    for i, f in enumerate(files):
        if f.path in seen:
            raise ConfigError(
                f"{where}: files[{i}].path: {f.path!r} is already listed as files[{seen[f.path]}]"
            )
        seen[f.path] = i
    if METADATA not in seen:
        raise ConfigError(f"{where}: files: no {METADATA!r} entry (DCP's metadata, from rank 0)")
    return Manifest(step=step, plan=plan, plan_sha256=plan_sha, world_size=world, files=files)


def _file(raw: Any, at: str, world_size: int) -> ManifestFile:
    m = as_mapping(raw, at)
    check_keys(m, at, ["path", "sha256", "bytes", "host", "rank"])
    path = get(m, "path", str, at)
    if not path or "/" in path or "\\" in path or path in (".", "..") or "\0" in path:
        raise ConfigError(
            f"{at}.path: {path!r} must be a plain file name inside the step directory"
        )
    if path in (MANIFEST, COMPLETE):
        raise ConfigError(f"{at}.path: {path!r} is not a checkpoint data file")
    sha = get(m, "sha256", str, at)
    _check_sha(sha, f"{at}.sha256")
    nbytes = get(m, "bytes", int, at)
    if nbytes < 0:
        raise ConfigError(f"{at}.bytes: must be >= 0, got {nbytes}")
    host = get(m, "host", str, at)
    if not host:
        raise ConfigError(f"{at}.host: must not be empty")
    rank = get(m, "rank", int, at)
    if not 0 <= rank < world_size:
        raise ConfigError(f"{at}.rank: {rank} is outside world_size {world_size}")
    data = _DATA_FILE.match(path)
    if data is not None and int(data.group("rank")) != rank:
        raise ConfigError(f"{at}.rank: {rank}, but {path!r} is rank {data.group('rank')}'s file")
    return ManifestFile(path=path, sha256=sha, num_bytes=nbytes, host=host, rank=rank)


def _check_sha(value: str, at: str) -> None:
    if not _SHA256.match(value):
        raise ConfigError(f"{at}: expected 64 lowercase hex digits, got {value!r}")


def manifest_from_json(text: str, where: str) -> Manifest:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON (line {exc.lineno}): {exc.msg}") from None
    return parse_manifest(raw, where)


def load_manifest(path: str | Path) -> Manifest:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{p}: file not found") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from None
    return manifest_from_json(text, str(p))


def manifest_to_dict(m: Manifest) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "step": m.step,
        "plan": m.plan,
        "plan_sha256": m.plan_sha256,
        "world_size": m.world_size,
        "files": [
            {
                "path": f.path,
                "sha256": f.sha256,
                "bytes": f.num_bytes,
                "host": f.host,
                "rank": f.rank,
            }
            for f in m.files
        ],
    }


# --------------------------------------------------------------------- paths


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step-<N:08d>`` directory name; None for anything else."""
    m = _STEP_DIR.match(name)
    return int(m.group("step")) if m else None


def local_step_dir(checkpoint_dir: str, plan_name: str, step: int) -> str:
    """``<host.checkpoint_dir>/<plan name>/step-<N:08d>`` (POSIX, on the host)."""
    return f"{checkpoint_dir.rstrip('/') or '/'}/{plan_name}/{step_dir_name(step)}"


def remote_root(cluster_remote: str | None, env: Mapping[str, str]) -> str:
    """Where the remote copy lives: the cluster's ``remote_storage``, else
    ``$AUTOHET_REMOTE``, else a local directory standing in for object storage."""
    return cluster_remote or env.get(REMOTE_ENV) or DEFAULT_REMOTE_ROOT


def remote_step_dir(root: str, plan_name: str, step: int) -> str:
    return f"{root.rstrip('/')}/{plan_name}/{step_dir_name(step)}"


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
