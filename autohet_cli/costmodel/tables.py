"""Per-layer cost tables of one model and training run, built when first asked (pure).

A table is what one GPU of a TP group spends per micro-batch on each layer of
the model, for one (GPU type, TP degree, micro-batch size, intra-host
bandwidth), summed up front (``costmodel.layertable``) so a stage's cost is O(1).
It comes from the profile when the profile measured that combination, else from
the analytic model; analytic tables get the Megatron TP all-reduces added here
(two per block forward, two backward), because measured times already contain them.

A stage with activation recomputation (``Stage.recompute``: every layer wrapped
in a non-reentrant ``torch.utils.checkpoint``) costs, per micro-batch:

- forward and backward as the profile measured them under recomputation
  (``LayerTiming.recompute_fwd_ms`` / ``recompute_bwd_ms``: checkpoint's per-call
  work runs on the CPU and can starve a fast GPU, so neither is the plain times'
  sum); without such a measurement, the forward and backward + forward again
  (the re-run, TP all-reduces included, since the forward's communication
  repeats too);
- kept per micro-batch in flight: each layer's input, the hidden state entering
  it, instead of everything the layer saves for backward. The runtime keeps the
  residual stream in fp32 under autocast (settings.py), so a hidden state counts
  RESIDUAL_BYTES per element whatever the compute dtype; the model's first layer
  takes int64 token ids, TOKEN_ID_BYTES each;
- once, while one layer runs its backward: that layer's full activations, the
  largest ``act_bytes`` among the stage's layers (``transient_bytes``).

Under bf16 or fp16 on a GPU the runtime keeps fp32 master weights and runs the
forward under autocast, which casts each matmul weight to 16 bits: 2 bytes per
parameter of every layer but the embedding (a lookup, not cast). Profiles time
16-bit modules directly, so they lack these copies; ``CostTables.table`` adds
them (GPT-2.7B at micro-batch 4 on an H100: 4.9 GiB that a plan predicted at
81% of memory did not count, and it ran out). A plain stage casts once per step
and shares the copies among its micro-batches (``runtime.pipeline``: autocast's
cache outlives each forward), so they count once (``StageCost.cast_bytes``); a
recompute stage keeps no copy beyond the layer at work (``transient_bytes``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from autohet_cli import catalog
from autohet_cli.catalog import GpuSpec
from autohet_cli.costmodel.layertable import LayerTable as LayerTable
from autohet_cli.costmodel.layertable import StageCost as StageCost
from autohet_cli.errors import UnknownNameError
from autohet_cli.estimates.analytic import analytic_entry
from autohet_cli.estimates.fixed import TP_COLLECTIVES, ring_latency_ms
from autohet_cli.estimates.fixed import step_ms as fixed_step_ms
from autohet_cli.estimates.profile import EntryKey, LayerTiming, Profile, ProfileEntry
from autohet_cli.models import ModelSpec
from autohet_cli.settings import TrainingSettings

TOKEN_ID_BYTES = 8  # int64: what the model's first layer (the embedding) takes
AUTOCAST_COPY_BYTES = 2  # a 16-bit copy of an fp32 master weight, held for the step
RESIDUAL_BYTES = 4  # fp32: the hidden state between layers, under autocast too


def _ratio(measured: float, estimated: float) -> float:
    return measured / estimated if estimated > 0 and measured > 0 else 1.0


def _calibrated(
    estimate: ProfileEntry, anchor: ProfileEntry, anchor_estimate: ProfileEntry
) -> ProfileEntry:
    """Scale an analytic entry per layer by measured/analytic at the anchor."""
    layers = []
    for est, meas, base in zip(estimate.layers, anchor.layers, anchor_estimate.layers, strict=True):
        layers.append(
            LayerTiming(
                fwd_ms=est.fwd_ms * _ratio(meas.fwd_ms, base.fwd_ms),
                bwd_ms=est.bwd_ms * _ratio(meas.bwd_ms, base.bwd_ms),
                update_ms=est.update_ms * _ratio(meas.update_ms, base.update_ms),
                num_params=round(est.num_params * _ratio(meas.num_params, base.num_params)),
                act_bytes=est.act_bytes * _ratio(meas.act_bytes, base.act_bytes),
                output_bytes=est.output_bytes * _ratio(meas.output_bytes, base.output_bytes),
                **_recompute_scaled(est, meas, base),
            )
        )
    return replace(estimate, layers=tuple(layers), source="calibrated")


def _recompute_scaled(
    est: LayerTiming, meas: LayerTiming, base: LayerTiming
) -> dict[str, float | None]:
    """The estimate's recomputation times, scaled like its plain ones when the anchor
    measured them (else left to the estimate's plain times, as analytic ones are)."""
    if meas.recompute_fwd_ms is None:
        return {"recompute_fwd_ms": None, "recompute_bwd_ms": None}
    return {
        "recompute_fwd_ms": est.rc_fwd_ms * _ratio(meas.rc_fwd_ms, base.rc_fwd_ms),
        "recompute_bwd_ms": est.rc_bwd_ms * _ratio(meas.rc_bwd_ms, base.rc_bwd_ms),
    }


class CostTables:
    """All layer tables for one model and training settings, built lazily and cached.

    ``gpu_specs`` are the GPU types the cluster file defines (``Cluster.gpu_specs``);
    every figure of a type (memory reserve, peak TFLOP/s, intra-host bandwidth) is
    read through ``spec()`` so that such types plan like catalog ones.
    """

    def __init__(
        self,
        model: ModelSpec,
        profile: Profile | None,
        training: TrainingSettings,
        *,
        gpu_specs: Mapping[str, GpuSpec] | None = None,
    ) -> None:
        self.model = model
        self.profile = profile or Profile()
        self.training = training
        self.gpu_specs: Mapping[str, GpuSpec] = gpu_specs or {}
        self._cache: dict[tuple[str, int, int, float], LayerTable] = {}
        self._layers = model.layers()
        self._p2p: dict[tuple[str, str], float] = {}  # p2p_latency_ms, per type pair
        # costmodel.evaluate's memo per cluster (keyed by its id): its entries depend
        # on these tables' training settings, so copies start their own
        self.evaluate_memos: dict[int, Any] = {}

    def with_zero1(self, zero1: bool) -> CostTables:
        """These tables under ZeRO-1 on or off, sharing the layer tables built so far
        (a layer's times and bytes do not depend on it; evaluate and the search read
        ``training.zero1`` for the optimizer state and the update)."""
        if self.training.zero1 == zero1:
            return self
        other = copy.copy(self)
        other.training = replace(self.training, zero1=zero1)
        other.evaluate_memos = {}
        return other

    def spec(self, gpu_type: str) -> GpuSpec:
        """The cluster's definition, else the catalog, else a measured profile's device
        facts (a type that ``autohet profile run`` measured is usable without figures)."""
        found = self.gpu_specs.get(gpu_type) or catalog.CATALOG.get(gpu_type)
        if found is not None:
            return found
        facts = self.profile.devices.get(gpu_type)
        if facts is None or facts.source != "measured":
            raise UnknownNameError(catalog.unknown_gpu_message(gpu_type, self.gpu_specs))
        return GpuSpec(
            name=gpu_type,
            mem_bytes=facts.mem_bytes,
            peak_tflops=facts.matmul_tflops,
            mem_bandwidth_gbytes_s=facts.mem_bandwidth_gbytes_s,
            intra_node_gbps=256.0,  # PCIe 4.0 x16: nothing better is known
            pcie_gbps=256.0,
            nvlink=False,
            description=f"measured by autohet profile run ({gpu_type})",
        )

    def _key(self, gpu_type: str, tp: int, mbs: int) -> EntryKey:
        return EntryKey(
            model=self.model.name,
            gpu_type=gpu_type,
            tensor_parallel=tp,
            micro_batch_size=mbs,
            seq_len=self.training.seq_len,
        )

    def entry(self, gpu_type: str, tp: int, mbs: int) -> ProfileEntry:
        key = self._key(gpu_type, tp, mbs)
        found = self.profile.entry(key)
        # A measurement at another precision (fp32 on a CPU, say) does not time
        # a bf16 run; it can still anchor a calibrated estimate below.
        if found is not None and found.dtype == self.training.precision:
            return self._keeps_at_least_the_runtime(found, gpu_type, tp, mbs)
        estimate = self._analytic(gpu_type, tp, mbs)
        anchor = self._nearest_measured(key)
        if anchor is None:
            return estimate
        # The measured anchor includes TP communication, so the ratio is taken
        # against the analytic time with its all-reduces, applied to the
        # estimate with its all-reduces, and the result is marked "calibrated"
        # so that table() does not add the all-reduces a second time.
        base = self._analytic(gpu_type, anchor.key.tensor_parallel, anchor.key.micro_batch_size)
        calibrated = _calibrated(
            self._with_tp_comm(estimate, tp, mbs),
            anchor,
            self._with_tp_comm(base, anchor.key.tensor_parallel, anchor.key.micro_batch_size),
        )
        if anchor.source == "sailor":
            return calibrated
        return self._keeps_at_least_the_runtime(calibrated, gpu_type, tp, mbs, estimate)

    def _keeps_at_least_the_runtime(
        self,
        entry: ProfileEntry,
        gpu_type: str,
        tp: int,
        mbs: int,
        analytic: ProfileEntry | None = None,
    ) -> ProfileEntry:
        """Our probe's measurements with each layer's kept bytes at least what the
        runtime keeps (``models.LayerSpec``): the probe times 16-bit modules alone, so it
        sees neither the fp32 residual and norms nor autocast's per-projection copies,
        and a plan on its bytes alone under-predicts (the H100 run of issue 33). Imported
        profiles (Sailor's) describe their own framework's runs and stay as they are."""
        if entry.source not in ("measured", "calibrated"):
            return entry
        analytic = analytic or self._analytic(gpu_type, tp, mbs)
        layers = tuple(
            lt if lt.act_bytes >= a.act_bytes else replace(lt, act_bytes=a.act_bytes)
            for lt, a in zip(entry.layers, analytic.layers, strict=True)
        )
        return replace(entry, layers=layers)

    def with_tp_comm(self, entry: ProfileEntry, tp: int, mbs: int) -> ProfileEntry:
        """``entry`` as a measurement would be: TP all-reduces folded in when analytic."""
        return self._with_tp_comm(entry, tp, mbs) if entry.source == "analytic" else entry

    def _with_tp_comm(self, entry: ProfileEntry, tp: int, mbs: int) -> ProfileEntry:
        """An analytic entry with TP all-reduces folded in, at the type's
        intra-host bandwidth."""
        if tp == 1:
            return entry
        gpu = entry.key.gpu_type
        gbps, hop = self.spec(gpu).intra_node_gbps, self.hop_ms(gpu)
        comm = [self._tp_comm_ms(i, tp, mbs, gbps, hop) for i in range(len(entry.layers))]
        layers = tuple(
            replace(lt, fwd_ms=lt.fwd_ms + c, bwd_ms=lt.bwd_ms + c)
            for lt, c in zip(entry.layers, comm, strict=True)
        )
        return replace(entry, layers=layers)

    def _analytic(self, gpu_type: str, tp: int, mbs: int) -> ProfileEntry:
        return analytic_entry(
            self.model,
            self.spec(gpu_type),
            tp=tp,
            micro_batch_size=mbs,
            seq_len=self.training.seq_len,
            precision=self.training.precision,
            optimizer=self.training.optimizer,
            measured=self.profile.devices.get(gpu_type),
        )

    def _nearest_measured(self, key: EntryKey) -> ProfileEntry | None:
        """The measured entry of the same GPU type and model closest in (TP, mbs).

        Measured profiles often lack a combination because it ran out of memory;
        a raw catalog estimate beside measured numbers would then look several
        times faster than the real card. Anchoring it to the nearest measurement
        keeps one GPU type's numbers consistent with each other.
        """
        same = [
            e
            for k, e in self.profile.entries.items()
            if k.model == key.model
            and k.gpu_type == key.gpu_type
            and k.seq_len == key.seq_len
            and e.source != "analytic"
            and len(e.layers) == len(self._layers)
        ]
        if not same:
            return None

        def distance(e: ProfileEntry) -> tuple[int, int]:
            k = e.key
            return (
                abs(k.tensor_parallel.bit_length() - key.tensor_parallel.bit_length()),
                abs(k.micro_batch_size.bit_length() - key.micro_batch_size.bit_length()),
            )

        return min(same, key=distance)

    def reserve_bytes(self, gpu_type: str) -> int:
        """Memory a GPU of this type holds beyond the plan's tensors: the type's runtime
        reserve plus what calibration measured beyond the model (``Overhead``)."""
        extra = self.profile.overheads.get(gpu_type)
        return self.spec(gpu_type).runtime_reserve_bytes + (extra.mem_bytes if extra else 0)

    def intra_allreduce_ms(self, gpu_type: str, nbytes: float, participants: int) -> float | None:
        """A gradient all-reduce on one host as the probe measured this type's
        collective library (latency + rate); None when it did not."""
        facts = self.profile.devices.get(gpu_type)
        return None if facts is None else facts.allreduce_ms(nbytes, participants)

    def allreduce_gbps(self, gpu_type: str) -> float | None:
        """The measured one-host all-reduce rate of this type in Gbit/s (None: not
        measured), for estimates per parameter that have no room for latency."""
        facts = self.profile.devices.get(gpu_type)
        rate = None if facts is None else facts.allreduce_gbytes_s
        return None if rate is None else rate * 8.0

    def sync_factor(self, gpu_type: str) -> float:
        """Measured / predicted gradient all-reduce time for this GPU type's ranks
        (calibrated; 1 uncalibrated): the collective library's real rate."""
        extra = self.profile.overheads.get(gpu_type)
        return extra.sync_x if extra else 1.0

    def shard_factor(self, gpu_type: str) -> float:
        """Measured / predicted exposed collectives of a weight-sharded stage of this
        GPU type (``Overhead.shard_x``, from a calibrated run of one); else the
        gradient all-reduce's factor, the same library moving the same links."""
        extra = self.profile.overheads.get(gpu_type)
        if extra is None:
            return 1.0
        return extra.shard_x if extra.shard_x != 1.0 else extra.sync_x

    def hop_ms(self, gpu_type: str) -> float:
        """One message of a collective among devices of this type: the probe's
        all-reduce fit where it measured one, else the catalog's (``FixedCosts``)."""
        facts = self.profile.devices.get(gpu_type)
        if facts is not None and facts.allreduce_hop_ms is not None:
            return facts.allreduce_hop_ms
        return self.spec(gpu_type).fixed.hop_us / 1e3

    def p2p_latency_ms(self, a: str, b: str) -> float:
        """Fixed cost of one exchange between stages of these GPU types: calibrated
        from runs where a run measured either type, else one message's latency
        (memoised: the planner asks for every link of every template it tries)."""
        got = self._p2p.get((a, b))
        if got is None:
            found = [o for o in (self.profile.overheads.get(t) for t in (a, b)) if o is not None]
            if found:
                got = max(o.p2p_ms for o in found)
            else:
                got = max(self.hop_ms(a), self.hop_ms(b))
            self._p2p[(a, b)] = got
        return got

    def step_overhead_ms(self, gpu_type: str, tp: int = 1, world: int = 1) -> float:
        """The fixed per-step cost of a stage of this type and TP degree among
        ``world`` ranks: calibrated from runs when a run measured it; else the
        probe's iteration cost beyond the layers, or the catalog's step cost, plus
        the step's world all-reduces (``estimates.fixed``)."""
        extra = self.profile.overheads.get(gpu_type)
        if extra is not None:
            return extra.step_cost_ms(tp)
        facts = self.profile.devices.get(gpu_type)
        loop_ms = facts.step_ms if facts is not None else None
        if loop_ms is None:
            loop_ms = self.spec(gpu_type).fixed.step_us / 1e3
        return fixed_step_ms(loop_ms, self.hop_ms(gpu_type), world)

    def is_measured(self, gpu_type: str, tp: int, mbs: int) -> bool:
        """Measured, imported, or refitted to a run (``autohet profile calibrate`` stores
        ``calibrated`` entries; the planner's own calibrated estimates are never stored)."""
        found = self.entry(gpu_type, tp, mbs)
        if found.source in ("measured", "sailor"):
            return True
        return (
            found.source == "calibrated"
            and self.profile.entry(self._key(gpu_type, tp, mbs)) is found
        )

    def calibration_anchor(self, gpu_type: str, tp: int, mbs: int) -> ProfileEntry | None:
        """The measurement ``entry()`` scaled an estimate of this combination to; None
        when it did not (a profile entry was used as is, or no anchor exists)."""
        key = self._key(gpu_type, tp, mbs)
        found = self.profile.entry(key)
        if found is not None and found.dtype == self.training.precision:
            return None
        return self._nearest_measured(key)

    def table(self, gpu_type: str, tp: int, mbs: int, intra_gbps: float) -> LayerTable:
        key = (gpu_type, tp, mbs, intra_gbps)
        cached = self._cache.get(key)
        if cached is None:
            entry = self.entry(gpu_type, tp, mbs)
            comm = [0.0] * len(entry.layers)
            if entry.source == "analytic" and tp > 1:
                hop = self.hop_ms(gpu_type)
                comm = [
                    self._tp_comm_ms(i, tp, mbs, intra_gbps, hop) for i in range(len(entry.layers))
                ]
            cast = self.cast_bytes(gpu_type, entry)
            cached = self._cache[key] = LayerTable(entry, comm, self.input_bytes(mbs), cast)
        return cached

    def cast_bytes(self, gpu_type: str, entry: ProfileEntry) -> list[float]:
        """Per layer, autocast's 16-bit weight copies (module doc): none in fp32, and
        none on a CPU, where the runtime computes in fp32 whatever the plan says."""
        if self.training.precision == "fp32" or gpu_type == "cpu":
            return [0.0] * len(entry.layers)
        return [
            0.0 if layer.kind == "embedding" else float(AUTOCAST_COPY_BYTES * lt.num_params)
            for layer, lt in zip(self._layers, entry.layers, strict=True)
        ]

    def input_bytes(self, mbs: int) -> list[float]:
        """Per layer, the bytes entering it for one micro-batch: token ids for the
        first layer, else the previous layer's output as an fp32 hidden state."""
        seq = self.training.seq_len
        out = [float(seq * mbs * TOKEN_ID_BYTES)]
        out += [layer.output_bytes(seq, mbs, RESIDUAL_BYTES) for layer in self._layers[:-1]]
        return out

    def _tp_comm_ms(
        self, index: int, tp: int, mbs: int, intra_gbps: float, hop_ms: float = 0.0
    ) -> float:
        """TP communication of one layer per pass (forward, and again backward): a
        block's two activation all-reduces, plus every collective's latency
        (``fixed.TP_COLLECTIVES``; a layer whose passes differ is charged their mean
        in each, which keeps the step's sum)."""
        layer = self._layers[index]
        fwd, bwd = TP_COLLECTIVES[layer.kind]
        latency = (fwd + bwd) / 2 * ring_latency_ms(hop_ms, tp)
        if layer.kind != "block":
            return latency
        nbytes = layer.output_bytes(self.training.seq_len, mbs, self.training.dtype_bytes)
        one = 2.0 * (tp - 1) / tp * nbytes / (intra_gbps * 1e9 / 8) * 1e3
        return 2.0 * one + latency  # two all-reduces per block per pass
