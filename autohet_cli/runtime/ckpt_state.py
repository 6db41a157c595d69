"""Checkpoint state names that hold under every plan: tied weights, optimizer keys, errors."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from autohet_cli.errors import AutohetError
from autohet_cli.runtime.ckpt_files import CheckpointError
from autohet_cli.runtime.model_api import layer_of

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


def keep_written(
    state: dict[str, Any], writes: Callable[[tuple[int, ...]], bool], tied: Sequence[Sequence[str]]
) -> dict[str, Any]:
    """``state`` without the model and optimizer entries of parameters this rank does
    not write (``writes(layers)`` False: ``Topology.writes_layout``). A model entry
    is its own layer's (each name of a tied group is stored under itself); a tied
    parameter's optimizer state is filed under its group's first name by every
    holder of any of the group's layers (``rename_optimizer``), so all those
    layers decide it."""
    group_layers = {n: tuple(layer_of(x) for x in g) for g in tied for n in g}

    def kept(name: str, *, group: bool) -> bool:
        try:
            own = (layer_of(name),)
        except ValueError:
            return True  # not a layer's entry: everyone's
        return writes(group_layers.get(name, own) if group else own)

    out = dict(state)
    out["model"] = {k: v for k, v in state["model"].items() if kept(k, group=False)}
    out["optimizer"] = {
        k: v
        for k, v in state["optimizer"].items()
        if kept(k.partition(".")[2].rpartition(".")[0], group=True)
    }
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
