"""What tests and benchmarks plant: hosts with a cpu "GPU" (``cpu_host``), small plans
(``stage``, ``plan_of``) and an attacker's checkpoint (``plant_step``).

The attacker's checkpoint is a copy of a real step whose ``.metadata`` runs a command
when unpickled, with its manifest edited to match (sha256, size, step) but without the
job key, so its HMAC cannot be right."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autohet_cli.cluster import Host
from autohet_cli.models import ModelSpec, get_model
from autohet_cli.plan import Device, Pipeline, Plan, Stage
from autohet_cli.settings import TrainingSettings


def cpu_host(name: str, address: str = "localhost", **fields: Any) -> Host:
    """A cluster host with cpu "GPUs" at ``address``; ``fields``: the host's others
    (unless given: one GPU of 1 GiB, 80 Gbit/s within the host)."""
    fields = {"num_gpus": 1, "gpu_mem_bytes": 1 << 30, "intra_node_gbps": 80.0, **fields}
    return Host(name=name, address=address, gpu_type="cpu", **fields)


def stage(
    start: int,
    end: int,
    host: str,
    *gpus: int,
    gpu_type: str = "cpu",
    shard: str = "none",
    reshard_after_forward: bool = True,
) -> Stage:
    """Layers ``[start, end)`` on ``gpus`` of ``host`` (GPU 0 if none), TP over them;
    ``shard`` and ``reshard_after_forward`` as ``Stage`` has them."""
    devices = tuple(Device(host=host, gpu=g) for g in gpus or (0,))
    return Stage(
        layer_start=start,
        layer_end=end,
        gpu_type=gpu_type,
        tensor_parallel=len(devices),
        devices=devices,
        shard=shard,
        reshard_after_forward=reshard_after_forward,
    )


def plan_of(
    *pipelines: Sequence[Stage],
    microbatches: int | Sequence[int] = 2,
    micro_batch_size: int = 1,
    seq_len: int = 64,
    precision: str = "bf16",
    optimizer: str = "adam",
    model: ModelSpec | str = "gpt-tiny",
    name: str = "lab",
    version: int = 1,
    **fields: Any,
) -> Plan:
    """A plan of ``pipelines`` (their stages), each taking ``microbatches`` (one count,
    or one per pipeline) of ``micro_batch_size`` samples a step: that is the global
    batch. ``model``: a zoo name, or a spec the plan carries as its architecture.
    ``fields``: the plan's other fields (``inputs``, ``notes``, or ``training`` and
    ``num_layers`` in place of those derived)."""
    spec = model if isinstance(model, ModelSpec) else get_model(model)
    counts = [microbatches] * len(pipelines) if isinstance(microbatches, int) else microbatches
    fields.setdefault(
        "training",
        TrainingSettings(
            global_batch_size=sum(counts) * micro_batch_size,
            micro_batch_size=micro_batch_size,
            seq_len=seq_len,
            precision=precision,
            optimizer=optimizer,
        ),
    )
    fields.setdefault("num_layers", spec.num_layers)
    fields.setdefault("tensor_parallel", max(s.tensor_parallel for p in pipelines for s in p))
    if isinstance(model, ModelSpec):
        fields.setdefault("architecture", model)
    return Plan(
        name=name,
        version=version,
        model_name=spec.name,
        pipelines=tuple(
            Pipeline(num_microbatches=m, stages=tuple(p))
            for m, p in zip(counts, pipelines, strict=True)
        ),
        **fields,
    )


class _Touch:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        # Unpickling calls pathlib's Path.touch(marker): only pathlib is needed to run it.
        return (Path.touch, (self.marker,))


def plant_step(good: Path, step: int, marker: Path) -> Path:
    """``good``'s sibling ``step-<step>``; loading it would create ``marker``."""
    planted = good.parent / f"step-{step:08d}"
    shutil.copytree(good, planted)
    payload = pickle.dumps(_Touch(marker))
    (planted / ".metadata").write_bytes(payload)
    manifest = json.loads((planted / "manifest.json").read_text())
    manifest["step"] = step
    for f in manifest["files"]:
        if f["path"] == ".metadata":
            f["sha256"], f["bytes"] = hashlib.sha256(payload).hexdigest(), len(payload)
    (planted / "manifest.json").write_text(json.dumps(manifest))
    return planted
