"""``run.json``: the machine-readable record of one run, in its run folder (pure).

Written by the launcher when the run starts (status ``running``) and replaced when it
ends (status, last step and loss, end time), atomically both times, so a reader never
sees half a record. It says what ran (plan, cluster, backend, job, the checkpoint step
it resumed from), where the job's checkpoints are (per host, and the remote copy) and
how it ended; ``autohet runs`` lists folders by it, and links the runs of one job
(``runfiles.jobs``) by their job and start times when read, so no old record is
ever rewritten. The launcher's host and pid tell a run whose launcher died (the
record still says ``running``) from one that runs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from autohet_cli.errors import ConfigError
from autohet_cli.yamlio import write_replace

SCHEMA = "autohet.run/v1"
RECORD_FILE = "run.json"
RUNNING = "running"


_OPT_STR = (str, type(None))
_TYPES: dict[str, tuple[type, ...]] = {
    "plan_file": (str,),
    "cluster": (str,),
    "cluster_file": (str,),
    "backend": (str,),
    "trainer": (str,),
    "job": _OPT_STR,
    "remote_checkpoints": _OPT_STR,
    "detail": (str,),
    "exit_code": (int, type(None)),
    "ended_at": _OPT_STR,
    "last_step": (int, type(None)),
    "last_loss": (int, float, type(None)),
    "resumed_from_step": (int, type(None)),
    "launcher_host": (str,),
    "launcher_pid": (int,),
}


class RunRecordError(ConfigError):
    """A run.json that cannot be read (names the file and the field)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunRecord:
    run_id: str
    plan: str  # "<name>.v<version>"
    plan_file: str
    cluster: str  # the cluster's name
    cluster_file: str
    backend: str  # ssh | slurm
    trainer: str  # "built-in", or "script" (a user script writes no metrics of ours)
    job: str | None  # the checkpoint namespace (built-in trainer): runs of one job link
    hosts: tuple[str, ...]
    checkpoints: Mapping[str, str] = field(default_factory=dict)  # host -> the job's dir
    remote_checkpoints: str | None = None
    status: str = RUNNING
    detail: str = ""
    exit_code: int | None = None
    started_at: str  # UTC, ISO 8601: 2026-11-25T14:03:05Z
    ended_at: str | None = None
    last_step: int | None = None
    last_loss: float | None = None
    launcher_host: str = ""
    launcher_pid: int = 0
    # The checkpoint step it loaded (the next step it ran, ``ckpt.steptext``); None: it
    # started afresh, or resumed "the newest" and no step of it was seen yet.
    resumed_from_step: int | None = None

    def __post_init__(self) -> None:
        if self.last_loss is not None and not math.isfinite(self.last_loss):
            object.__setattr__(self, "last_loss", None)  # not JSON; the metrics say nan

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["hosts"] = list(self.hosts)
        out["checkpoints"] = dict(self.checkpoints)
        return {"schema": SCHEMA, **out}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str) -> RunRecord:
        if raw.get("schema") != SCHEMA:
            raise RunRecordError(f"{source}: schema {raw.get('schema')!r}, expected {SCHEMA!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known - {"schema"})
        if unknown:
            raise RunRecordError(
                f"{source}: unknown field(s) {', '.join(unknown)} (written by a newer autohet?)"
            )
        values = {k: v for k, v in raw.items() if k != "schema"}
        for name in ("run_id", "plan", "status", "started_at"):
            if not isinstance(values.get(name), str) or not values[name]:
                raise RunRecordError(f"{source}: field {name!r} must be a non-empty string")
        hosts = values.get("hosts", [])
        checkpoints = values.get("checkpoints", {})
        if not isinstance(hosts, list) or not isinstance(checkpoints, dict):
            raise RunRecordError(f"{source}: 'hosts' must be a list, 'checkpoints' a mapping")
        for name, kinds in _TYPES.items():
            value = values.get(name)
            if name in values and not (isinstance(value, kinds) and not isinstance(value, bool)):
                raise RunRecordError(
                    f"{source}: field {name!r} is {value!r}, expected "
                    f"{' or '.join('null' if k is type(None) else k.__name__ for k in kinds)}"
                )
        values["hosts"] = tuple(str(h) for h in hosts)
        values["checkpoints"] = {str(k): str(v) for k, v in checkpoints.items()}
        try:
            return cls(**values)
        except TypeError as exc:
            raise RunRecordError(f"{source}: {exc}") from None


def write_record(folder: Path, record: RunRecord) -> Path:
    """Write (or replace) ``folder/run.json`` atomically."""
    return write_replace(folder / RECORD_FILE, json.dumps(record.to_dict(), indent=1) + "\n")


def read_record(folder: Path) -> RunRecord | None:
    """``folder``'s record; None when it has none (a run of an older autohet)."""
    path = folder / RECORD_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RunRecordError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise RunRecordError(f"{path}: not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise RunRecordError(f"{path}: not a JSON object")
    return RunRecord.from_dict(raw, str(path))
