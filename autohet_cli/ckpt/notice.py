"""Will a save fit a spot host's notice? An estimate at launch (pure).

A preemption notice is only as good as the save it triggers: GCP gives a spot VM
30 s between its notice and the end, AWS two minutes. The launcher warns, before
any worker starts, about spot hosts whose save would not fit the shorter of the
two; the workers warn again once a save has been measured
(``runtime.checkpoint_hook``), which is the figure to trust.

The estimate: the bytes a host writes are at most the fp32 weights and optimizer
state of the layers its stages hold (a stage's TP ranks share one host, so together
they hold the stage's layers whole; replicas in other pipelines may write some of
them instead, so this is an upper bound), over a sustained write rate of
``ASSUMED_WRITE_GBPS`` (a checkpoint disk with sha256 on the way; an H100 host
measured 0.3 GB/s for a synchronous 15 GB save and 1.6 GB/s for the bare disk).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from autohet_cli.plan import Plan

NOTICE_S = 30.0  # the shortest notice a major cloud gives a spot VM (GCP)
# In each host's job directory: the seconds its last save took (its directory owner's
# measure, written by the workers, read by the next launch or resume of the job).
LAST_SAVE_FILE = ".last-save-s"
# Beside it, the last save's metrics record (``ckpt_blocked_s``, ``ckpt_persist_s``, ...):
# a resumed run's first save waits for the interval these give (``runtime.checkpoint_hook``).
LAST_SAVE_RECORD = ".last-save.json"
ASSUMED_WRITE_GBPS = 0.5
WEIGHT_BYTES = 4  # fp32 master weights, whatever the compute precision
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd": 4}


def save_bytes_per_host(plan: Plan) -> dict[str, int]:
    """Upper bound of the bytes each host of ``plan`` writes per save (empty when the
    plan does not carry its model's architecture)."""
    if plan.architecture is None:
        return {}
    layers = plan.architecture.layers()
    per_param = WEIGHT_BYTES + OPTIMIZER_STATE_BYTES.get(plan.training.optimizer.lower(), 8)
    held: dict[str, set[int]] = {}
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            held.setdefault(stage.host, set()).update(range(stage.layer_start, stage.layer_end))
    return {
        host: per_param * sum(layers[i].num_params for i in sorted(idx))
        for host, idx in held.items()
    }


def notice_warnings(
    plan: Plan,
    is_spot: Callable[[str], bool],
    *,
    notice_s: float = NOTICE_S,
    write_gbps: float = ASSUMED_WRITE_GBPS,
    measured_s: Mapping[str, float] | None = None,
) -> list[str]:
    """One line per spot host whose save (``measured_s`` where known, else the
    estimate) would not fit a ``notice_s`` notice."""
    out = []
    estimates = save_bytes_per_host(plan)
    for host in plan.hosts():
        if not is_spot(host):
            continue
        if measured_s and host in measured_s:
            save_s, how = measured_s[host], "measured"
        elif host in estimates:
            gb = estimates[host] / 1e9
            save_s, how = gb / write_gbps, f"estimated: {gb:.1f} GB at {write_gbps:g} GB/s"
        else:
            continue
        if save_s > notice_s:
            out.append(
                f"warning: spot host {host}: a save takes about {save_s:.0f} s ({how}), longer "
                f"than a {notice_s:g} s preemption notice: a preemption there loses the steps "
                "since the last periodic save. Put checkpoints on a faster local disk "
                "(checkpoint_dir in the cluster file), spread the model over more hosts, or "
                "plan with --zero1; the workers report the measured time after their first "
                "save"
            )
    return out
