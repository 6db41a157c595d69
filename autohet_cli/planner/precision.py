"""Profile entries measured in another precision than the plan's, and the way out (pure).

The cost model takes a profile entry as it is only at the plan's own precision
(``CostTables.entry``): an fp32 measurement does not time a bf16 run. The entry
still exists, so "profile them" is the wrong advice for it: the user has just
done that (issue 46: CPU hosts profiled in fp32, a bf16 plan calling every stage
unmeasured). These helpers find such entries and say the two ways out: plan in
the precision measured, or measure in the one planned.

On a CPU the runtime trains in fp32 whatever the plan asks (``runtime.trainer``),
so a CPU is measured in fp32 only (``profile run`` refuses 16 bits there), and a
16-bit plan on CPU hosts is told to plan in fp32 instead of to measure again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from autohet_cli.costmodel.tables import CostTables
from autohet_cli.estimates.profile import EntryKey

CPU = "cpu"
CPU_PRECISION = "fp32"  # what the runtime computes in on a CPU, whatever the plan says
GPU_AUTO_PRECISION = "bf16"  # what `profile run --precision auto` measures a recent GPU in
CPU_WHY = "the runtime trains in fp32 on a CPU whatever the plan asks"


def measured_as(tables: CostTables, gpu_type: str, tp: int, mbs: int) -> str | None:
    """The precision the profile measured this combination in (measured, imported or
    refitted to runs) when it is not the plan's, so that the cost model estimated it
    instead; None otherwise."""
    key = EntryKey(
        model=tables.model.name,
        gpu_type=gpu_type,
        tensor_parallel=tp,
        micro_batch_size=mbs,
        seq_len=tables.training.seq_len,
    )
    found = tables.profile.entry(key)
    if found is None or found.source == "analytic" or found.dtype == tables.training.precision:
        return None
    return found.dtype


def measurable(gpu_type: str, precision: str) -> bool:
    """Whether ``profile run`` can measure this type in ``precision`` for a plan."""
    return gpu_type != CPU or precision == CPU_PRECISION


def precision_flag(precision: str, gpu_types: Iterable[str], *, always: bool = False) -> str:
    """`` --precision P`` for a suggested ``profile run`` over ``gpu_types``: where its
    default (auto) would measure one of them in another precision, or ``always``.
    Empty when none of them can be measured in ``precision`` (CPUs under 16 bits)."""
    types = [t for t in gpu_types if measurable(t, precision)]
    auto = {CPU_PRECISION if t == CPU else GPU_AUTO_PRECISION for t in types}
    if not types or (auto == {precision} and not always):
        return ""
    return f" --precision {precision}"


def cpu_advice(gpu_types: Iterable[str], precision: str) -> str:
    """``; on cpu plan with --precision fp32 ...`` where a 16-bit plan puts stages on
    CPU hosts, which no profile can give entries in its precision; else empty."""
    cpus = sorted({t for t in gpu_types if not measurable(t, precision)})
    if not cpus:
        return ""
    return (
        f"; on {', '.join(cpus)} plan with --precision {CPU_PRECISION} to use what the "
        f"profile measures ({CPU_WHY})"
    )


def advice(model: str, precision: str, found: Mapping[str, str], measure: str | None) -> str:
    """What to do about the GPU types in ``found`` (type -> precision measured), all
    measured in another precision than the plan's ``precision``. ``measure`` is the
    ``profile run`` line (with its --precision) for those of them that can be
    measured in ``precision``; None when none can."""
    by_dtype: dict[str, list[str]] = {}
    for gpu, dtype in sorted(found.items()):
        by_dtype.setdefault(dtype, []).append(gpu)
    where = " and ".join(f"on {', '.join(g)} in {d}" for d, g in by_dtype.items())
    if len(by_dtype) == 1:
        use = f"plan with --precision {next(iter(by_dtype))} to use them"
    else:
        options = " or ".join(f"--precision {d} ({', '.join(g)})" for d, g in by_dtype.items())
        use = f"plan with {options} to use them"
    text = f"the profile measured {model} {where}, the plan asks {precision}; {use}"
    if any(not measurable(g, precision) for g in found):
        text += f" ({CPU_WHY})"
    if measure is not None:
        again = [g for g in sorted(found) if measurable(g, precision)]
        which = "them" if len(again) == len(found) else ", ".join(again)
        text += f", or measure {which} in {precision} with `{measure}`"
    return text
