"""The ``autohet.profile/v1`` artifact: device facts and per-layer timings (pure).

An entry is keyed by (model, GPU type, TP degree, micro-batch size, sequence
length) and lists, per partitionable layer, forward/backward/optimizer-update
milliseconds for one micro-batch on one GPU of the TP group, the parameters that
GPU holds, the activation bytes it keeps for backward and the bytes the layer
sends to the next stage. ``source`` says where numbers came from: ``measured``
(autohet profile run), ``sailor`` (imported measurements), ``analytic``
(computed from the catalog) or ``calibrated`` (analytic scaled per layer to the
nearest measurement of the same GPU type; made at planning time, never stored).
Measured, imported and calibrated entries already include TP communication;
analytic ones do not, and the cost model adds it.

We store parameter *counts* (``num_params``) rather than bytes, so that memory
follows the training precision and optimizer chosen at plan time.

Below the cost model, beside the estimates that fill it (``estimates.analytic``):
the cost model reads profiles and profiling (the SSH probe, importers, calibration)
writes them, so the artifact belongs to neither. Reading and writing it as YAML is
``estimates.profile_io``; ``profiling.schema`` re-exports both for older imports.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from autohet_cli.errors import ConfigError

SCHEMA = "autohet.profile/v1"
SOURCES = ("measured", "sailor", "analytic", "calibrated")
# Profile meta: the entries whose recomputation times a recompute run fitted
# (profiling.calibrate: a plain run's ratios then leave them alone); merging keeps
# the marks of entries the newer profile does not replace.
RC_FITTED = "recompute_calibrated"


def rc_mark(k: EntryKey) -> str:
    """An entry's name in ``RC_FITTED``."""
    return f"{k.model}|{k.gpu_type}|tp{k.tensor_parallel}|mbs{k.micro_batch_size}|{k.seq_len}"


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerTiming:
    fwd_ms: float
    bwd_ms: float
    update_ms: float
    num_params: int
    act_bytes: float
    output_bytes: float
    # Under activation recomputation (the layer wrapped in a non-reentrant
    # torch.utils.checkpoint, as the runtime runs a recompute stage): the forward,
    # and the backward with the forward re-run in it. Measured, because neither is
    # the plain times' sum: checkpoint's per-call work runs on the CPU and can
    # starve a fast GPU (GPT-1.3B on an H100, micro-batch 2: the forward took 1.9x
    # the plain one). None (analytic, imported or older profiles): the forward,
    # and backward + forward, which is what the GPU computes.
    recompute_fwd_ms: float | None = None
    recompute_bwd_ms: float | None = None

    @property
    def rc_fwd_ms(self) -> float:
        """The forward under recomputation (measured, else the plain forward)."""
        return self.fwd_ms if self.recompute_fwd_ms is None else self.recompute_fwd_ms

    @property
    def rc_bwd_ms(self) -> float:
        """The backward under recomputation, the re-run forward included."""
        if self.recompute_bwd_ms is None:
            return self.bwd_ms + self.fwd_ms
        return self.recompute_bwd_ms


@dataclass(frozen=True, slots=True, kw_only=True)
class EntryKey:
    model: str
    gpu_type: str
    tensor_parallel: int
    micro_batch_size: int
    seq_len: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileEntry:
    key: EntryKey
    source: str
    dtype: str
    layers: tuple[LayerTiming, ...]

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ConfigError(f"profile entry source {self.source!r}: expected one of {SOURCES}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceFacts:
    gpu_type: str
    mem_bytes: int
    matmul_tflops: float
    mem_bandwidth_gbytes_s: float
    source: str  # catalog | measured
    # A real intra-host all-reduce (NCCL/gloo) fitted as latency + rate by the probe:
    # each of a ring's 2(n-1) steps costs ``allreduce_hop_ms`` plus its bytes at
    # ``allreduce_gbytes_s``. None: not measured (the cluster's link speed is used).
    allreduce_hop_ms: float | None = None
    allreduce_gbytes_s: float | None = None
    # Fixed costs the probe measured (None: not measured, the catalog's figures
    # stand): one eager op's host time (dispatch, autograd, launch), and a training
    # iteration's time beyond its layers (the intercept of its time against the
    # number of layers: the loss, the optimizer's and zero_grad's fixed work).
    op_us: float | None = None
    step_ms: float | None = None

    def allreduce_ms(self, nbytes: float, participants: int) -> float | None:
        """A ring all-reduce of ``nbytes`` among ``participants`` on one host, from
        the measured fit (None without one)."""
        if self.allreduce_gbytes_s is None or self.allreduce_hop_ms is None:
            return None
        if participants <= 1 or nbytes <= 0:
            return 0.0
        steps = 2 * (participants - 1)
        moved = steps / participants * nbytes
        return steps * self.allreduce_hop_ms + moved / (self.allreduce_gbytes_s * 1e9) * 1e3


@dataclass(frozen=True, slots=True, kw_only=True)
class Overhead:
    """What a GPU type costs beyond its layers, measured from runs
    (``autohet profile calibrate``): a fixed time per step (optimizer launch,
    framework, the step's small collectives) and memory the process holds beyond
    weights, optimizer state and activations (allocator, libraries, buffers)."""

    step_ms: float = 0.0
    mem_bytes: int = 0
    sync_x: float = 1.0  # measured / predicted gradient all-reduce time
    # measured / predicted exposed gathers and reduce-scatters of weight-sharded
    # stages (FSDP, issue 48); 1 until a run of such stages was calibrated
    shard_x: float = 1.0
    p2p_ms: float = 0.0  # fixed cost of one stage-to-stage exchange (latency)
    source: str = "calibrated"
    runs: int = 1  # runs it was measured from
    # Per TP degree > 1, what a step of a TP stage costs beyond ``step_ms`` (DTensor's
    # optimizer and norm over shards): averaged into step_ms, a TP run's fixed cost
    # would be charged to every TP 1 plan.
    tp_step_ms: Mapping[int, float] = field(default_factory=dict)

    def step_cost_ms(self, tp: int) -> float:
        return self.step_ms + (self.tp_step_ms.get(tp, 0.0) if tp > 1 else 0.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    devices: Mapping[str, DeviceFacts] = field(default_factory=dict)
    entries: Mapping[EntryKey, ProfileEntry] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)
    overheads: Mapping[str, Overhead] = field(default_factory=dict)  # per GPU type

    def entry(self, key: EntryKey) -> ProfileEntry | None:
        return self.entries.get(key)

    def models(self) -> list[str]:
        return sorted({k.model for k in self.entries})

    def merged_with(self, newer: Profile) -> Profile:
        """``newer`` wins per entry and per device, except that an analytic entry
        never replaces a measured one: re-profiling one GPU type keeps the rest."""
        entries = dict(self.entries)
        for k, e in newer.entries.items():
            old = entries.get(k)
            if old is None or e.source != "analytic" or old.source == "analytic":
                entries[k] = e
        devices = dict(self.devices)
        overheads = {**self.overheads, **newer.overheads}
        for name, dev in newer.devices.items():
            old_dev = devices.get(name)
            if old_dev is None or dev.source == "measured" or old_dev.source != "measured":
                if old_dev is not None and dev.allreduce_gbytes_s is None:
                    # a re-probe without TP > 1 measured no all-reduce: keep the fit
                    dev = replace(
                        dev,
                        allreduce_hop_ms=old_dev.allreduce_hop_ms,
                        allreduce_gbytes_s=old_dev.allreduce_gbytes_s,
                    )
                if old_dev is not None and dev.op_us is None:  # a probe before 1.2
                    dev = replace(dev, op_us=old_dev.op_us, step_ms=old_dev.step_ms)
                devices[name] = dev
                if dev.source == "measured" and name not in newer.overheads:
                    # Overheads are refitted against the numbers they corrected
                    # (sync factor against the old all-reduce model, step cost
                    # against the old layer times): new numbers void them.
                    overheads.pop(name, None)
        meta = dict(self.meta)
        history = list(meta.get("history", [])) + list(newer.meta.get("history", []))
        absorbed = list(meta.get("calibrated_from", []))
        absorbed += [r for r in newer.meta.get("calibrated_from", []) if r not in absorbed]
        runs = {**meta.get("runtime_runs", {}), **newer.meta.get("runtime_runs", {})}
        # recomputation times a run fitted: kept unless newer entries replaced them
        replaced = {rc_mark(k) for k in newer.entries}
        rc_fitted = [m for m in meta.get(RC_FITTED, []) if m not in replaced]
        rc_fitted += [m for m in newer.meta.get(RC_FITTED, []) if m not in rc_fitted]
        meta.update({k: v for k, v in newer.meta.items() if k != "history"})
        if history:
            meta["history"] = history
        if absorbed:
            meta["calibrated_from"] = absorbed
        if runs:
            meta["runtime_runs"] = runs
        meta.pop(RC_FITTED, None)
        if rc_fitted:
            meta[RC_FITTED] = sorted(rc_fitted)
        return Profile(devices=devices, entries=entries, meta=meta, overheads=overheads)

    def with_entries(self, entries: Iterable[ProfileEntry]) -> Profile:
        merged = dict(self.entries)
        merged.update({e.key: e for e in entries})
        return replace(self, entries=merged)
