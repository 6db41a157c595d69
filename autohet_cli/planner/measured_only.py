"""What ``--measured-only`` may use, and why it found no plan: what was measured, and
the ``autohet profile run`` that measures more (pure)."""

from __future__ import annotations

from autohet_cli.planner.precision import advice, cpu_advice, measured_as, precision_flag
from autohet_cli.planner.request import SearchRequest


def usable_combinations(req: SearchRequest) -> list[tuple[str, int, int]]:
    """The (GPU type, TP, micro-batch size) combinations the search may use: TP
    degrees a host of the type holds, micro-batch sizes dividing the batch."""
    out = []
    for gpu in req.cluster.gpu_types():
        most = max(h.num_gpus for h in req.cluster.hosts if h.gpu_type == gpu)
        for tp in req.tp_candidates:
            for mbs in req.mbs_candidates:
                if tp <= most and req.global_batch_size % mbs == 0:
                    out.append((gpu, tp, mbs))
    return out


def measured_only_message(req: SearchRequest, reason: str | None, model_ref: str) -> str:
    """Why --measured-only found no plan: what was measured, and how to measure more."""
    usable = usable_combinations(req)
    measured = [c for c in usable if req.tables.is_measured(*c)]
    t = req.tables.training
    per_type = []
    for gpu in req.cluster.gpu_types():
        pairs = ", ".join(f"tp{tp} mbs{mbs}" for g, tp, mbs in measured if g == gpu)
        per_type.append(f"{gpu}: {pairs or 'none'}")
    tps = ",".join(str(tp) for tp in sorted({tp for _, tp, _ in usable}))
    mbss = ",".join(str(m) for m in sorted({m for _, _, m in usable}))
    seq = "" if t.seq_len == req.model.default_seq_len else f" --seq-len {t.seq_len}"
    if measured:
        head = f"no plan for {req.model.name} on {req.cluster.name} fits using only measured "
        head += "profile entries"
    elif not req.tables.profile.entries:
        head = "no profile was given (--profile), so nothing is measured"
    else:
        head = f"the profile measures none of the combinations {req.model.name} could use "
        head += f"on {req.cluster.name}"
    said = f" (the search said: {reason})" if reason else ""
    text = (
        f"--measured-only: {head}{said}. Measured at seq_len {t.seq_len}, {t.precision}: "
        f"{'; '.join(per_type)}. "
    )
    # Measured in another precision: say so, or "measure more" repeats what was done.
    found = {g: d for g, tp, mbs in usable if (d := measured_as(req.tables, g, tp, mbs))}
    if found:
        said_found = advice(req.model.name, t.precision, found, None)
        text += f"{said_found[0].upper()}{said_found[1:]}. "
    types = req.cluster.gpu_types()
    flag = precision_flag(t.precision, types, always=bool(found))
    cpus = cpu_advice((g for g in types if g not in found), t.precision)  # not said twice
    text += (
        f"Measure more with `autohet profile run CLUSTER --model {model_ref} --tp {tps} "
        f"--micro-batch-sizes {mbss}{seq}{flag}` and pass the profile it writes with "
        f"--profile{cpus}, or plan"
    )
    return f"{text} without --measured-only to let estimates fill the gaps"
