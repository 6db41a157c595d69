"""What a checkpoint is of: the model's architecture and the data's order (pure).

DCP loads a checkpoint into any model whose tensors have the same names and
shapes, and checks nothing else: 4 heads of 32 and 8 heads of 16, or another
``rope_theta``, are the same weights to it, so a resume under another plan would
train a different model from weights made for this one, without a word. The
manifest (signed, read before any tensor) therefore records the architecture
(every ``ModelSpec`` field that gives the weights their meaning, and a canonical
sha256 of them) and the data order (global batch, samples seen, seed, the data's
fingerprint); resume, recover and export compare them and refuse with both sides
named. A deliberate change of model goes through ``--init-from`` (weights only).

The resumed step's samples follow ``samples_seen``, not the step: the data place
step ``s`` at rows ``s * global_batch_size`` (``runtime.data_api``), so a resume
under another global batch continues at the next unseen sample when the new batch
divides the samples seen (``data_shift``), and is refused otherwise.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autohet_cli.architecture import spec_to_dict
from autohet_cli.errors import ConfigError
from autohet_cli.models import ModelSpec
from autohet_cli.yamlio import as_mapping, check_keys
from autohet_cli.yamlio import field as get

# Fields that do not change what the weights mean: a display name (a zoo name and the
# config.json of the same model differ), and the planner's default sequence length.
NOT_ARCHITECTURE = ("name", "default_seq_len")


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelRecord:
    """The architecture a checkpoint's weights were trained as."""

    sha256: str  # of ``fields`` as canonical JSON
    fields: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "fields": dict(self.fields)}


def model_record(spec: ModelSpec) -> ModelRecord:
    fields = {k: v for k, v in spec_to_dict(spec).items() if k not in NOT_ARCHITECTURE}
    return ModelRecord(sha256=_digest(fields), fields=fields)


def model_record_from_dict(raw: Any, where: str) -> ModelRecord:
    d = as_mapping(raw, where)
    check_keys(d, where, ["sha256", "fields"], [])
    fields = dict(as_mapping(d["fields"], f"{where}.fields"))
    sha = get(d, "sha256", str, where)
    if _digest(fields) != sha:
        raise ConfigError(f"{where}.sha256: does not match its fields (an edited manifest?)")
    return ModelRecord(sha256=sha, fields=fields)


def model_differences(saved: ModelRecord, mine: ModelRecord) -> list[str]:
    """``"num_heads 4 then, 8 now"`` for each field that differs (empty: the same)."""
    if saved.sha256 == mine.sha256:
        return []
    keys = sorted(set(saved.fields) | set(mine.fields))
    return [
        f"{k} {saved.fields.get(k, '-')} then, {mine.fields.get(k, '-')} now"
        for k in keys
        if saved.fields.get(k) != mine.fields.get(k)
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class DataOrder:
    """Where a checkpoint is in its data: the next sample, and what decides the order."""

    global_batch_size: int
    samples_seen: int  # the next step starts at this sample of the (shuffled) stream
    seed: int
    data_sha256: str  # of the data's describe() less its path (which differs by host)

    def to_dict(self) -> dict[str, Any]:
        return {
            "global_batch_size": self.global_batch_size,
            "samples_seen": self.samples_seen,
            "seed": self.seed,
            "data_sha256": self.data_sha256,
        }


def data_sha256(described: Mapping[str, Any]) -> str:
    return _digest({k: v for k, v in described.items() if k != "path"})


def data_order_from_dict(raw: Any, where: str) -> DataOrder:
    d = as_mapping(raw, where)
    names = ["global_batch_size", "samples_seen", "seed", "data_sha256"]
    check_keys(d, where, names, [])
    order = DataOrder(
        global_batch_size=get(d, "global_batch_size", int, where),
        samples_seen=get(d, "samples_seen", int, where),
        seed=get(d, "seed", int, where),
        data_sha256=get(d, "data_sha256", str, where),
    )
    if order.global_batch_size < 1 or order.samples_seen < 0:
        raise ConfigError(f"{where}: global_batch_size must be >= 1 and samples_seen >= 0")
    return order


def data_shift(*, samples_seen: int, step: int, global_batch_size: int) -> int | None:
    """The shift ``k`` such that training step ``s`` reads the data's step ``s + k`` and
    so continues at sample ``samples_seen``; None when the batch does not divide it."""
    if samples_seen % global_batch_size:
        return None
    return samples_seen // global_batch_size - step


def batch_change_refusal(
    *, where: str, samples_seen: int, step: int, saved_batch: int, batch: int
) -> str:
    """Why a resume under global batch ``batch`` cannot continue the samples exactly."""
    divisors = [b for b in range(batch // 2, 2 * batch + 1) if b and samples_seen % b == 0]
    near = min(divisors, key=lambda b: (abs(b - batch), b), default=saved_batch)
    return (
        f"{where}: the checkpoint has seen {samples_seen} samples (step {step} at a global "
        f"batch of {saved_batch}); this plan's global batch of {batch} does not divide "
        f"{samples_seen}, so its next step cannot start at sample {samples_seen}: it would "
        f"skip or repeat samples. Resume with a plan whose global_batch_size divides "
        f"{samples_seen} (the checkpoint's {saved_batch}, or e.g. {near}), or start a new job"
    )
