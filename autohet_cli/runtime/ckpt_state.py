"""Checkpoint state names that hold under every plan: tied weights, optimizer keys, errors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from autohet_cli.errors import AutohetError
from autohet_cli.runtime.ckpt_files import CheckpointError

# --------------------------------------------------------------------- tied names


def tied_aliases(optimizer_keys: Sequence[str], tied: Sequence[Sequence[str]]) -> dict[str, str]:
    """Held name -> first name of its group, for tied parameters filed under another name.

    ``get_state_dict`` files a tied parameter's optimizer state under the first of
    its names the rank holds (a rank holding only the LM head uses the head's name);
    the checkpoint always uses the group's first name.
    """
    aliases = {}
    for group in tied:
        canonical = group[0]
        if any(k.startswith(f"state.{canonical}.") for k in optimizer_keys):
            continue
        for name in group[1:]:
            if any(
                k.startswith((f"state.{name}.", f"param_groups.{name}.")) for k in optimizer_keys
            ):
                aliases[name] = canonical
                break
    return aliases


def rename_optimizer(flat: Mapping[str, Any], aliases: Mapping[str, str]) -> dict[str, Any]:
    """Rename the keys of a flattened optimizer state dict by parameter name."""
    if not aliases:
        return dict(flat)
    out = {}
    for key, value in flat.items():
        kind, _, rest = key.partition(".")
        for old, new in aliases.items():
            if rest.startswith(f"{old}."):
                key = f"{kind}.{new}{rest[len(old) :]}"
                break
        out[key] = value
    return out


def checkpoint_failure(exc: CheckpointException) -> CheckpointError:
    """DCP's per-rank failures as one message (ours verbatim, others with their type)."""
    parts = []
    seen = set()
    for rank, (error, _trace) in sorted(exc.failures.items()):
        text = str(error) if isinstance(error, AutohetError) else f"{type(error).__name__}: {error}"
        if text not in seen:
            seen.add(text)
            parts.append(text if isinstance(error, AutohetError) else f"rank {rank}: {text}")
    return CheckpointError("; ".join(parts) or "checkpoint load failed")
