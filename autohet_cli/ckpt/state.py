"""Checkpoint state names that hold under every plan: tied weights, optimizer keys, what
each data file holds (for the manifest), errors."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from autohet_cli.ckpt.files import CheckpointError
from autohet_cli.ckpt.format import ManifestFile
from autohet_cli.errors import AutohetError
from autohet_cli.workerbase.paramnames import layer_of

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


def nested_optimizer(flat: Mapping[str, Any]) -> dict[str, Any]:
    """A flattened optimizer state dict (``state.<name>.<key>``,
    ``param_groups.<name>.<key>``) in the nested form ``set_state_dict`` also takes:
    ``state`` by name, and one param group per name (torch maps each to the
    optimizer's group holding that parameter).

    Why not hand torch the flat form: torch 2.5's reader of that form wants state
    under every name of a tied parameter, and checkpoints file it under one name
    (``KeyError: 'state.layers.5.lm_head.weight.step'``); every admitted release
    reads the nested form the same way, a tied parameter under any one name."""
    state: dict[str, dict[str, Any]] = {}
    groups: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        kind, _, rest = key.partition(".")
        name, _, field = rest.rpartition(".")
        if kind not in ("state", "param_groups") or not name:
            raise ValueError(f"not a flattened optimizer entry: {key!r}")
        (state if kind == "state" else groups).setdefault(name, {})[field] = value
    return {"state": state, "param_groups": [{**g, "params": [n]} for n, g in groups.items()]}


def keep_written(
    state: dict[str, Any],
    writes: Callable[[tuple[int, ...]], bool],
    tied: Sequence[Sequence[str]],
    *,
    shared: bool = True,
) -> dict[str, Any]:
    """``state`` without the model and optimizer entries of parameters this rank does
    not write (``writes(layers)`` False: ``Topology.writes_layout``). A model entry
    is its own layer's (each name of a tied group is stored under itself); a tied
    parameter's optimizer state is filed under its group's first name by every
    holder of any of the group's layers (``rename_optimizer``), so all those
    layers decide it.

    ``shared`` False also drops every entry of no layer (``step``, ``loss_scale``,
    ``run``): they are equal on every rank, and written by rank 0 alone they all
    land in rank 0's file, which recovery then knows to move to every host (DCP
    would otherwise spread them over any rank's file)."""
    group_layers = {n: tuple(layer_of(x) for x in g) for g in tied for n in g}

    def kept(name: str, *, group: bool) -> bool:
        try:
            own = (layer_of(name),)
        except ValueError:
            return shared  # not a layer's entry: everyone's, written by rank 0
        return writes(group_layers.get(name, own) if group else own)

    out = dict(state) if shared else {k: state[k] for k in ("model", "optimizer")}
    out["model"] = {k: v for k, v in state["model"].items() if kept(k, group=False)}
    out["optimizer"] = {
        k: v
        for k, v in state["optimizer"].items()
        if kept(k.partition(".")[2].rpartition(".")[0], group=True)
    }
    return out


# --------------------------------------------------------------------- what files hold


def entry_layer(path: Sequence[str]) -> int | None:
    """The layer of a saved entry by its path in the state (``("model", "layers.3.w")``,
    ``("optimizer", "state.layers.3.w.exp_avg")``); None for an entry of no layer."""
    if len(path) != 2 or path[0] not in ("model", "optimizer"):
        return None
    name = path[1] if path[0] == "model" else path[1].partition(".")[2]
    try:
        return layer_of(name)
    except ValueError:
        return None


def stored_layers(metadata: Metadata) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Data file -> (the layers it holds entries of, whether it holds entries of no
    layer), exactly as DCP's metadata places every entry.

    ``metadata`` is what the coordinator wrote (``FileSystemReader.read_metadata``):
    the copy ``save`` returns lacks ``storage_data`` in some admitted torch releases
    (2.11's ``FileSystemWriter.finish`` fills a replaced copy), and a manifest built
    without it would record no layers at all."""
    if metadata.storage_data is None:
        raise CheckpointError(
            "DCP's metadata records no storage_data (where each entry was written): "
            "read it back from the checkpoint's .metadata, not from what save() returned"
        )
    planner = getattr(metadata, "planner_data", None) or {}
    layers: dict[str, set[int]] = {}
    shared: set[str] = set()
    for index, info in metadata.storage_data.items():
        fqn = index.fqn
        path = planner.get(fqn) or tuple(fqn.split(".", 1))
        layer = entry_layer(path)
        held = layers.setdefault(info.relative_path, set())
        if layer is None:
            shared.add(info.relative_path)
        else:
            held.add(layer)
    return {f: (tuple(sorted(ls)), f in shared) for f, ls in layers.items()}


def manifest_files(
    entries: Sequence[Mapping[str, Any]], held: Mapping[str, tuple[tuple[int, ...], bool]]
) -> tuple[ManifestFile, ...]:
    """The manifest's files from every rank's gathered entries (path, sha256, bytes,
    host, rank), each data file with what ``held`` (``stored_layers``) says it holds;
    a data file DCP put nothing in holds no layer and nothing shared."""
    out = []
    for e in entries:
        f = ManifestFile(
            path=e["path"], sha256=e["sha256"], num_bytes=e["bytes"], host=e["host"], rank=e["rank"]
        )
        if f.is_data:
            layers, shared = held.get(f.path, ((), False))
            f = replace(f, layers=layers, shared=shared)
        out.append(f)
    return tuple(out)


def tied_layer_groups(tied: Sequence[Sequence[str]]) -> tuple[tuple[int, ...], ...]:
    """The layers of each tied group (those spanning one layer need nothing moved)."""
    groups = {tuple(sorted({layer_of(n) for n in g})) for g in tied}
    return tuple(sorted(g for g in groups if len(g) > 1))


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
