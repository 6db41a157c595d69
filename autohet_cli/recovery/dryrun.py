"""What a dry run of ``autohet recover`` reports: the lost hosts, the step, the new
plan's hosts and how it differs from the old one, and the transfers it would make
(pure)."""

from __future__ import annotations

from typing import Any

from autohet_cli.plan import Plan
from autohet_cli.recovery.manifest import CheckpointChoice
from autohet_cli.recovery.transfer import TransferPlan


def dry_run_report(
    old: Plan, new: Plan, gone: list[str], choice: CheckpointChoice, tp: TransferPlan
) -> dict[str, Any]:
    return {
        "lost": gone,
        "step": choice.step,
        "new_plan_hosts": new.hosts(),
        "plan_diff": plan_diff(old, new),
        "notes": list(new.notes),
        "transfers": tp.to_dict(),
    }


def plan_diff(old: Plan, new: Plan) -> dict[str, object]:
    """Stage by stage, old and new: host:gpus [start, end) per pipeline, and the batch."""

    def shape(p: Plan) -> list[str]:
        return [
            f"m={pl.num_microbatches}: "
            + " | ".join(
                f"{s.host}:{','.join(str(d.gpu) for d in s.devices)} [{s.layer_start},"
                f"{s.layer_end})"
                for s in pl.stages
            )
            for pl in p.pipelines
        ]

    removed = sorted(set(old.hosts()) - set(new.hosts()))
    return {
        "old": shape(old),
        "new": shape(new),
        "hosts_dropped": removed,
        "tensor_parallel": [old.tensor_parallel, new.tensor_parallel],
        "micro_batch_size": [old.training.micro_batch_size, new.training.micro_batch_size],
    }
