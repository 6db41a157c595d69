"""Loading a step (``--resume [STEP]``): choose it with every rank, authenticate it,
let DCP read what each rank needs (see ``ckpt.checkpointer``'s docstring).

The checkpointer hands itself to ``resume``, typed as ``LoadView`` (what loading reads
of it), so this module never imports the checkpointer above it (``ckpt.view``)."""

from __future__ import annotations

import hashlib
import os
import pickle
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from autohet_cli.ckpt.files import CheckpointError, VerifyingReader, list_steps
from autohet_cli.ckpt.format import (
    COMPLETE,
    MANIFEST,
    METADATA,
    step_dir_name,
    verified_manifest,
)
from autohet_cli.ckpt.ownfiles import open_own_file
from autohet_cli.ckpt.prune import Retention
from autohet_cli.ckpt.remote import RemoteCopy
from autohet_cli.ckpt.state import checkpoint_failure, rename_optimizer
from autohet_cli.ckpt.steptext import after
from autohet_cli.ckpt.view import CheckpointedTrainer, JobView
from autohet_cli.errors import ConfigError
from autohet_cli.workerbase.records import say


class LoadView(JobView, Protocol):
    """The checkpointer as loading uses it: the job, the ranks, the trainer to fill,
    the remote copy to fetch a missing file from, the retention that pins the loaded
    step, and the state as checkpoints name it (``Checkpointer.state``)."""

    trainer: CheckpointedTrainer
    remote: RemoteCopy | None
    retention: Retention

    def state(self, *, template: bool = False) -> tuple[dict[str, Any], dict[str, str]]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceData:
    manifest_text: str
    metadata: bytes


def resume(ckpt: LoadView, step: int | None = None) -> int | None:
    """Load ``step`` (None: the newest complete one); returns the step loaded, or None.

    With ``step`` None and no complete checkpoint, training starts afresh.
    """
    listing = list_steps(ckpt.plan_dir, ckpt.key)
    views: list[Any] = [None] * ckpt.world_size
    dist.all_gather_object(views, listing, group=ckpt.group)
    complete = {s for view in views for s, why in view.items() if why is None}
    seen = {s for view in views for s in view}
    here = ckpt.plan_dir

    def why_not(s: int) -> str:
        reasons = {view[s] for view in views if view.get(s)}
        return "; ".join(sorted(reasons)) or f"{COMPLETE} or {MANIFEST} missing on every host"

    if step is None:
        chosen = max(complete, default=None)
        if ckpt.rank == 0:
            for s in sorted(s for s in seen - complete if chosen is None or s > chosen):
                say(f"note: skipping checkpoint {here / step_dir_name(s)} ({why_not(s)})")
            if chosen is None:
                say(f"note: no complete checkpoint under {here}: starting at step 0")
        if chosen is None:
            return None
    else:
        chosen = step
        if chosen not in complete:
            d = here / step_dir_name(chosen)
            if chosen not in seen:
                raise CheckpointError(f"no checkpoint {d} on any host")
            raise CheckpointError(f"checkpoint {d} is not usable ({why_not(chosen)})")
    source = min(r for r, view in enumerate(views) if view.get(chosen, "") is None)
    _load(ckpt, chosen, source)
    ckpt.retention.hold(chosen)
    return chosen


def _read_source(ckpt: LoadView, step: int) -> SourceData | str:
    d = ckpt.plan_dir / step_dir_name(step)
    try:
        text = (d / MANIFEST).read_text(encoding="utf-8")
        manifest = verified_manifest(text, ckpt.key, str(d / MANIFEST))
    except (OSError, ConfigError) as exc:
        return f"cannot use {d / MANIFEST}: {exc}"
    if manifest.step != step:
        return f"{d / MANIFEST} says step {manifest.step}, but its directory is step {step}"
    if manifest.plan_name != ckpt.trainer.plan.name:
        return f"{d / MANIFEST} was written by plan {manifest.plan}, not by this plan's lineage"
    meta = d / METADATA
    if not os.path.lexists(meta):
        return f"{meta} is missing (DCP's metadata, written on rank 0's host)"
    entry = manifest.file(METADATA)
    try:  # the file itself (no link, FIFO or device), bounded by the manifest's size
        with os.fdopen(open_own_file(meta, CheckpointError), "rb") as f:
            data = f.read(entry.num_bytes + 1)
    except (CheckpointError, OSError) as exc:
        return str(exc) if isinstance(exc, CheckpointError) else f"{meta}: cannot read: {exc}"
    digest, want = hashlib.sha256(data).hexdigest(), entry.sha256
    if digest != want:
        return f"{meta} is corrupt: its sha256 is {digest}, but {MANIFEST} says {want}"
    return SourceData(manifest_text=text, metadata=data)


def _load(ckpt: LoadView, step: int, source: int) -> None:
    payload: list[Any] = [_read_source(ckpt, step) if ckpt.rank == source else None]
    dist.broadcast_object_list(payload, src=source, group=ckpt.group)
    got = payload[0]
    if isinstance(got, str):
        raise CheckpointError(got)
    assert isinstance(got, SourceData)
    # Verified again here: every rank trusts only what its own key authenticates.
    manifest = verified_manifest(got.manifest_text, ckpt.key, MANIFEST)
    if hashlib.sha256(got.metadata).hexdigest() != manifest.file(METADATA).sha256:
        raise CheckpointError(f"{METADATA} of step {step} does not match its manifest")
    local = ckpt.plan_dir / step_dir_name(step)
    # Before any tensor: another architecture with the same shapes would load silently.
    check_model = getattr(ckpt.trainer, "check_same_model", None)
    if check_model is not None:
        check_model(manifest.model, str(local))
    metadata = pickle.loads(got.metadata)  # authenticated above: the job wrote it
    remote = ckpt.remote

    def fetch(name: str, dest: Any) -> bool:
        return remote is not None and remote.fetch(manifest.step, name, dest)

    reader = VerifyingReader(
        local, metadata=metadata, manifest=manifest, rank=ckpt.rank, fetch=fetch
    )
    # DCP loads into existing tensors; torch would make the optimizer's by running a
    # whole step on zero gradients (see materialize_state)
    materialize_state(getattr(ckpt.trainer, "optimizer", None))
    state, aliases = ckpt.state(template=True)
    if "run" not in getattr(metadata, "state_dict_metadata", {"run": None}):
        state.pop("run")  # written before checkpoints held the schedule and data
    try:
        dcp_load(state, storage_reader=reader, process_group=ckpt.group)
    except CheckpointException as exc:
        raise checkpoint_failure(exc) from None
    finally:
        reader.close()  # its descriptors: what it hashed is what DCP read
    for name in reader.fetched:
        assert remote is not None
        say(f"note: fetched {name} from {remote.url} into {local}")
    state["optimizer"] = rename_optimizer(
        state["optimizer"], {new: old for old, new in aliases.items()}
    )
    ckpt.trainer.load_state_dict(state)
    if ckpt.trainer.step != manifest.step:
        raise CheckpointError(
            f"{local}: the state says step {ckpt.trainer.step}, {MANIFEST} says {manifest.step}"
        )
    if ckpt.rank == 0:
        say(
            f"resumed from {local} at step {step} ({after(step)}; saved by plan {manifest.plan}, "
            f"{manifest.world_size} ranks)"
        )


def materialize_state(optimizer: torch.optim.Optimizer | None) -> bool:
    """Give an Adam/AdamW without state its state tensors (zeros), as its first step
    would; True when it did. Before a checkpoint load: DCP loads into existing
    tensors, and torch's ``get_state_dict`` makes them by running a whole optimizer
    step on zero gradients (``_init_optim_state``: a zero gradient per parameter, then
    the update over every parameter): 5.5 s of a 9.3 s load for a 200M model on this
    2-core machine, against about 0.5 s here. Other optimizers are left to torch.
    The layout (step a 0-d tensor, on the parameter's device when fused or
    capturable; moments like the parameter, DTensor included) is Adam's own
    ``_init_group``'s; ``test_optimizer_state_init`` holds it to torch's result."""
    if optimizer is None or optimizer.state:
        return False
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    from torch.optim import optimizer as torch_optimizer

    scalar_dtype: Any = torch_optimizer._get_scalar_dtype  # untyped in torch
    for group in optimizer.param_groups:
        on_device = bool(group.get("capturable") or group.get("fused"))
        keys = (
            ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
            if group.get("amsgrad")
            else (
                "exp_avg",
                "exp_avg_sq",
            )
        )
        for p in group["params"]:
            if not p.requires_grad:
                continue
            step = (
                torch.zeros((), dtype=scalar_dtype(is_fused=group.get("fused")), device=p.device)
                if on_device
                else torch.tensor(0.0, dtype=scalar_dtype())
            )
            state: dict[str, Any] = {"step": step}
            for key in keys:
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state
    return True
