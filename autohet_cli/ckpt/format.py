"""The checkpoint format (``autohet.checkpoint/v1``), one contract for writer and reader (pure).

The runtime writes it (``ckpt.checkpointer``), recovery reads and moves it
(``recovery``); both import it from here. The full description is
docs/checkpoint-format.md. In short:

Layout
    ``<checkpoint_dir>/<plan name>/<job>/step-<N:08d>/`` on every host: DCP data
    files ``__<rank>_0.distcp``, DCP's ``.metadata`` (rank 0's host), and on rank
    0's host ``manifest.json`` and, last, the empty ``COMPLETE`` marker. ``<job>``
    is the run namespace: a fresh launch starts a new one, a resumed or recovered
    run continues its own, so two runs never mix. A step is written under a
    temporary name and renamed into place; a ``COMPLETE`` step is never
    overwritten, and deleted only by retention (``ckpt.retention``: the newest
    ``--keep-checkpoints`` steps and pinned ones stay). The remote copy has the
    same layout under its root.

Authentication
    Every job has a 32-byte secret, ``<job dir>/.autohet-key`` (mode 0600, in a
    directory of mode 0700) on every host, created by ``autohet launch`` and
    copied over SSH. The manifest carries ``hmac_sha256``, an HMAC-SHA256 with
    that key over the manifest's canonical JSON (sorted keys, no spaces, without
    the ``hmac_sha256`` field). The manifest lists the sha256 of every file, so a
    verified manifest authenticates every byte of the step; readers verify the
    manifest before any file of the step is read (DCP unpickles ``.metadata``), and
    each file's sha256 before it is used. Whoever can write the checkpoint or
    remote directories but cannot read the key cannot make a step that loads.

What each data file holds (optional, since the writer records it)
    A data file may list ``layers`` (the layer indices it holds entries of, from
    DCP's metadata) and ``shared`` (whether it holds entries of no layer: ``step``,
    ``run``, ...); the manifest may list ``tied_layers`` (the layers of each group
    of tied parameters). With all three, recovery moves to a host only the files
    its new layers read (``recovery.transfer``); without them (older checkpoints)
    it moves every file. They are in the canonical JSON, so the HMAC covers them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Where checkpoints live (``ckpt.layout``) and a step directory's names
# (``workerbase.stepfiles``): part of this contract, importable from here.
from autohet_cli.ckpt.layout import ABANDONED_PREFIX as ABANDONED_PREFIX
from autohet_cli.ckpt.layout import KEY_BYTES as KEY_BYTES
from autohet_cli.ckpt.layout import KEY_FILE as KEY_FILE
from autohet_cli.ckpt.layout import REMOTE_ENV as REMOTE_ENV
from autohet_cli.ckpt.layout import TMP_PREFIX as TMP_PREFIX
from autohet_cli.ckpt.layout import check_job as check_job
from autohet_cli.ckpt.layout import check_key as check_key
from autohet_cli.ckpt.layout import local_job_dir as local_job_dir
from autohet_cli.ckpt.layout import local_step_dir as local_step_dir
from autohet_cli.ckpt.layout import namespace as namespace
from autohet_cli.ckpt.layout import new_key as new_key
from autohet_cli.ckpt.layout import remote_root as remote_root
from autohet_cli.ckpt.layout import remote_step_dir as remote_step_dir
from autohet_cli.ckpt.layout import remote_storage as remote_storage
from autohet_cli.ckpt.lineage import (
    DataOrder,
    ModelRecord,
    data_order_from_dict,
    model_record_from_dict,
)
from autohet_cli.errors import ConfigError
from autohet_cli.workerbase.stepfiles import COMPLETE as COMPLETE
from autohet_cli.workerbase.stepfiles import MANIFEST as MANIFEST
from autohet_cli.workerbase.stepfiles import METADATA as METADATA
from autohet_cli.workerbase.stepfiles import parse_step_dir as parse_step_dir
from autohet_cli.workerbase.stepfiles import step_dir_name as step_dir_name
from autohet_cli.yamlio import as_list, as_mapping, check_keys, coerce
from autohet_cli.yamlio import field as get

SCHEMA = "autohet.checkpoint/v1"
MAC_FIELD = "hmac_sha256"
# A plan name as plans are named (``plan.validate_name``): no '/', so a manifest can
# never point a reader or writer outside the checkpoint directory.
_PLAN_REF = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]*)\.v(?P<version>\d+)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_DATA_FILE = re.compile(r"^__(?P<rank>\d+)_\d+\.distcp$")


class ManifestAuthError(ConfigError):
    """A manifest's HMAC is missing or does not verify with the job's key."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ManifestFile:
    """One file of a checkpoint: its name in the step directory and who holds it."""

    path: str  # a bare file name inside the step directory
    sha256: str
    num_bytes: int
    host: str  # the plan host whose checkpoint_dir holds it
    rank: int  # the rank that wrote it
    # What a data file holds; None: not recorded (a checkpoint from before they were).
    layers: tuple[int, ...] | None = None  # layer indices it holds entries of, ascending
    shared: bool | None = None  # whether it holds entries of no layer (step, run, ...)

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
    # Layer indices of each group of tied parameters (embedding and head: ``(0, L-1)``);
    # None: not recorded.
    tied_layers: tuple[tuple[int, ...], ...] | None = None
    # Host -> the partner hosts that keep a copy of its shards (``peer.replicate``);
    # None: not recorded (replication off, or an older writer).
    replicas: Mapping[str, tuple[str, ...]] | None = None
    # What the weights are of and where the data stand (``ckpt.lineage``); None: not
    # recorded (an older writer).
    model: ModelRecord | None = None
    data_order: DataOrder | None = None

    def layer_info_missing(self) -> str | None:
        """Why the manifest does not say which data files hold which layers (None: it
        does, for every data file, and records the tied groups)."""
        if self.tied_layers is None:
            return "the manifest does not record tied_layers"
        unknown = [
            f.path for f in self.files if f.is_data and (f.layers is None or f.shared is None)
        ]
        if unknown:
            return f"the manifest does not record the layers of {', '.join(unknown)}"
        return None

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
    check_keys(
        d,
        where,
        ["schema", "step", "plan", "plan_sha256", "world_size", "files"],
        [MAC_FIELD, "tied_layers", "replicas", "model", "data_order"],
    )
    if d["schema"] != SCHEMA:
        raise ConfigError(f"{where}: schema: expected {SCHEMA!r}, got {d['schema']!r}")
    step = get(d, "step", int, where)
    if step < 0:
        raise ConfigError(f"{where}: step: must be >= 0, got {step}")
    plan = get(d, "plan", str, where)
    if not _PLAN_REF.match(plan):
        raise ConfigError(
            f"{where}: plan: expected '<plan name>.v<N>' (letters, digits, '-', '_', '.'), "
            f"got {plan!r}"
        )
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
    tied = None
    if "tied_layers" in d:
        at = f"{where}: tied_layers"
        tied = tuple(
            _layers(g, f"{at}[{i}]", least=2) for i, g in enumerate(as_list(d["tied_layers"], at))
        )
    return Manifest(
        step=step,
        plan=plan,
        plan_sha256=plan_sha,
        world_size=world,
        files=files,
        tied_layers=tied,
        replicas=_replicas(d["replicas"], f"{where}: replicas") if "replicas" in d else None,
        model=model_record_from_dict(d["model"], f"{where}: model") if "model" in d else None,
        data_order=(
            data_order_from_dict(d["data_order"], f"{where}: data_order")
            if "data_order" in d
            else None
        ),
    )


def _replicas(raw: Any, at: str) -> dict[str, tuple[str, ...]]:
    """host -> partner hosts (names as in the plan)."""
    out: dict[str, tuple[str, ...]] = {}
    for host, partners in as_mapping(raw, at).items():
        names = tuple(
            coerce(v, str, f"{at}.{host}[{j}]")
            for j, v in enumerate(as_list(partners, f"{at}.{host}"))
        )
        if host in names:
            raise ConfigError(f"{at}.{host}: a host cannot be its own partner")
        out[str(host)] = names
    return out


def _layers(raw: Any, at: str, *, least: int = 0) -> tuple[int, ...]:
    """Layer indices: distinct, ascending integers >= 0 (one canonical form, so a
    parsed manifest writes back the same JSON)."""
    items = as_list(raw, at)
    out = tuple(coerce(v, int, f"{at}[{j}]") for j, v in enumerate(items))
    if any(x < 0 for x in out):
        raise ConfigError(f"{at}: layer indices must be >= 0, got {list(out)}")
    if list(out) != sorted(set(out)):
        raise ConfigError(f"{at}: layer indices must be distinct and ascending, got {list(out)}")
    if len(out) < least:
        raise ConfigError(f"{at}: a tied group spans at least {least} layers, got {list(out)}")
    return out


def _file(raw: Any, at: str, world_size: int) -> ManifestFile:
    m = as_mapping(raw, at)
    check_keys(m, at, ["path", "sha256", "bytes", "host", "rank"], ["layers", "shared"])
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
    layers, shared = None, None
    if "layers" in m or "shared" in m:
        if data is None:
            raise ConfigError(f"{at}: only a DCP data file lists layers and shared, not {path!r}")
        for key in ("layers", "shared"):
            if key not in m:  # half a record would make the rule skip a needed file
                raise ConfigError(f"{at}.{key}: missing (layers and shared go together)")
        layers = _layers(m["layers"], f"{at}.layers")
        shared = coerce(m["shared"], bool, f"{at}.shared")
    return ManifestFile(
        path=path, sha256=sha, num_bytes=nbytes, host=host, rank=rank, layers=layers, shared=shared
    )


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
    """The JSON form; fields not recorded (None) are left out, as older writers did."""
    d: dict[str, Any] = {
        "schema": SCHEMA,
        "step": m.step,
        "plan": m.plan,
        "plan_sha256": m.plan_sha256,
        "world_size": m.world_size,
        "files": [_file_dict(f) for f in m.files],
    }
    if m.tied_layers is not None:
        d["tied_layers"] = [list(g) for g in m.tied_layers]
    if m.replicas is not None:
        d["replicas"] = {h: list(ps) for h, ps in m.replicas.items()}
    if m.model is not None:
        d["model"] = m.model.to_dict()
    if m.data_order is not None:
        d["data_order"] = m.data_order.to_dict()
    return d


def _file_dict(f: ManifestFile) -> dict[str, Any]:
    d: dict[str, Any] = {
        "path": f.path,
        "sha256": f.sha256,
        "bytes": f.num_bytes,
        "host": f.host,
        "rank": f.rank,
    }
    if f.layers is not None:
        d["layers"] = list(f.layers)
    if f.shared is not None:
        d["shared"] = f.shared
    return d


# --------------------------------------------------------------------- authentication


def canonical_bytes(d: dict[str, Any]) -> bytes:
    """What the HMAC covers: the manifest without its MAC, as compact sorted JSON."""
    body = {k: v for k, v in d.items() if k != MAC_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def mac_of(d: dict[str, Any], key: bytes) -> str:
    return hmac.new(key, canonical_bytes(d), hashlib.sha256).hexdigest()


def signed_manifest_text(m: Manifest, key: bytes) -> str:
    """``manifest.json`` as written: the manifest plus its HMAC."""
    d = manifest_to_dict(m)
    d[MAC_FIELD] = mac_of(d, key)
    return json.dumps(d, indent=2) + "\n"


def verified_manifest(text: str, key: bytes, where: str) -> Manifest:
    """Parse ``text`` and check its HMAC with the job key; ManifestAuthError if not."""
    m = manifest_from_json(text, where)
    raw = json.loads(text)
    mac = raw.get(MAC_FIELD)
    if not isinstance(mac, str):
        raise ManifestAuthError(
            f"{where}: not authenticated (no {MAC_FIELD}): written by an older autohet or "
            "by someone else; it is not loaded"
        )
    if not hmac.compare_digest(mac, mac_of(raw, key)):
        raise ManifestAuthError(
            f"{where}: its {MAC_FIELD} does not verify with this job's key: not written "
            "by this job (planted or altered?); it is not loaded"
        )
    return m


def belongs_to(m: Manifest, plan_name: str) -> bool:
    """Whether a manifest was written by the plan lineage ``plan_name``."""
    return m.plan_name == plan_name
