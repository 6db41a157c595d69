"""What ``autohet recover`` reports (``--json``): phases, bytes moved, new plan, step (pure).

The contract keys, relied on by scripts and the recovery benchmark:
``new_plan_path``, ``bytes_from_peers``, ``bytes_from_remote``, ``phases``
(phase name -> seconds, in the order they ran) and ``resumed_step``. Beside the
bytes moved: ``transfer_rule`` ("layers": each host got only the files its new
layers read; "all": every file, for a checkpoint without the layer record),
``transfer_rule_reason`` and ``bytes_skipped`` (bytes "all" would have moved on top).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autohet_cli.ckpt.steptext import after

if TYPE_CHECKING:
    from autohet_cli.recovery.replan import Replan
    from autohet_cli.recovery.transfer import TransferPlan

SCHEMA = "autohet.recovery/v1"
# The phases of a recovery, in order (others may be added; order is as recorded).
PHASES = ("detect", "checkpoint", "replan", "transfer", "verify", "relaunch", "first_step")


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoveryReport:
    new_plan_path: str
    resumed_step: int
    bytes_from_peers: int
    bytes_from_remote: int
    phases: Mapping[str, float] = field(default_factory=dict)  # seconds, in order
    transfer_rule: str = ""  # "layers" | "all" (recovery.transfer)
    transfer_rule_reason: str = ""
    bytes_skipped: int = 0  # not moved because the rule says no host reads them there
    old_plan_path: str = ""
    lost_hosts: tuple[str, ...] = ()
    added_hosts: tuple[str, ...] = ()
    chosen: str = ""  # contingency | solved | kept
    solved: bool = False
    kept_in_place_fraction: float | None = None
    iteration_time_s: float | None = None  # predicted, of the new plan
    predicted_transfer_s: float | None = None
    notes: tuple[str, ...] = ()
    # Each file that arrived: file, dest, source_kind, source, path (direct, relayed,
    # ...), bytes, seconds, bytes_per_s (copies.execute_transfers).
    transfers: tuple[Mapping[str, Any], ...] = ()

    @property
    def peer_rate_bytes_per_s(self) -> float | None:
        """The direct copies' bytes over the wall time their fetchers took (they run
        at once, one per destination, several files each); without direct copies,
        the peer copies' bytes over their summed times (they ran one after another)."""
        direct = [t for t in self.transfers if t.get("batch_s")]
        peer = direct or [t for t in self.transfers if t["source_kind"] != "remote"]
        if not peer:
            return None
        secs = (
            max(float(t["batch_s"]) for t in direct)
            if direct
            else sum(float(t["seconds"]) for t in peer)
        )
        total = sum(int(t["bytes"]) for t in peer)
        return total / secs if secs > 0 else None

    @property
    def total_s(self) -> float:
        return sum(self.phases.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "new_plan_path": self.new_plan_path,
            "old_plan_path": self.old_plan_path,
            "resumed_step": self.resumed_step,
            "bytes_from_peers": self.bytes_from_peers,
            "bytes_from_remote": self.bytes_from_remote,
            "bytes_skipped": self.bytes_skipped,
            "transfer_rule": self.transfer_rule,
            "transfer_rule_reason": self.transfer_rule_reason,
            "phases": {k: round(v, 6) for k, v in self.phases.items()},
            "total_s": round(self.total_s, 6),
            "lost_hosts": list(self.lost_hosts),
            "added_hosts": list(self.added_hosts),
            "chosen": self.chosen,
            "solved": self.solved,
            "kept_in_place_fraction": _round(self.kept_in_place_fraction),
            "iteration_time_s": _round(self.iteration_time_s),
            "predicted_transfer_s": _round(self.predicted_transfer_s),
            "notes": list(self.notes),
            "transfers": [dict(t) for t in self.transfers],
            "peer_rate_bytes_per_s": _round(self.peer_rate_bytes_per_s),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 6)


class PhaseClock:
    """Times named phases for the report: ``with clock.phase("transfer"): ...``.

    A phase entered twice adds up. The clock is injectable for tests.
    """

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self._now()
        try:
            yield
        finally:
            self._phases[name] = self._phases.get(name, 0.0) + self._now() - start

    @property
    def phases(self) -> dict[str, float]:
        return dict(self._phases)


def build_report(
    *,
    replan: Replan,
    transfer: TransferPlan,
    new_plan_path: str,
    old_plan_path: str,
    phases: Mapping[str, float],
    resumed_step: int | None = None,
    moved: tuple[int, int] | None = None,
    transfers: Sequence[Mapping[str, Any]] = (),
) -> RecoveryReport:
    """The report from the replan and the transfer plan that were carried out.

    ``resumed_step`` defaults to the checkpoint's step (the next step to run).
    ``moved``: the bytes that really came from peers and from remote storage
    (``executor.execute_transfers``), which differ from the plan's when a copy fell
    back to its next source; None: as planned.
    """
    chosen = replan.candidate(replan.chosen)
    prediction = replan.plan.prediction
    peers, remote = (
        (transfer.bytes_from_peers, transfer.bytes_from_remote) if moved is None else moved
    )
    return RecoveryReport(
        new_plan_path=new_plan_path,
        old_plan_path=old_plan_path,
        resumed_step=transfer.step if resumed_step is None else resumed_step,
        bytes_from_peers=peers,
        bytes_from_remote=remote,
        bytes_skipped=transfer.bytes_skipped,
        transfer_rule=transfer.rule,
        transfer_rule_reason=transfer.rule_reason,
        phases=dict(phases),
        lost_hosts=replan.lost,
        added_hosts=replan.added,
        chosen=replan.chosen,
        solved=replan.solved,
        kept_in_place_fraction=None if chosen is None else chosen.stability.fraction,
        iteration_time_s=None if prediction is None else prediction.iteration_time_s,
        predicted_transfer_s=transfer.predicted_time_s,
        notes=replan.plan.notes,
        transfers=tuple(transfers),
    )


def phases_text(phases: Mapping[str, float]) -> str:
    """``detect 0.4 s, checkpoint 0.2 s, ... (total 31.9 s)``: a line, not a dict."""
    parts = [f"{name} {seconds:.1f} s" for name, seconds in phases.items()]
    return ", ".join(parts) + f" (total {sum(phases.values()):.1f} s)"


def dry_run_text(planned: Mapping[str, Any]) -> list[str]:
    """A dry run's plan as lines a person reads (``--json`` gives the mapping)."""
    diff = planned.get("plan_diff") or {}
    moves = planned.get("transfers") or {}
    items = moves.get("items") or []
    lines = [
        "dry run: nothing moved, no plan written, nothing started (--json for every detail)",
        f"  lost: {', '.join(planned.get('lost') or []) or 'none'}; resume job "
        f"{planned.get('job', '?')} at {_checkpoint_step(planned.get('step'))}",
        f"  new plan on: {', '.join(planned.get('new_plan_hosts') or [])}",
    ]
    for was, now in zip(diff.get("old") or [], diff.get("new") or [], strict=False):
        lines.append(f"    was {was}")
        lines.append(f"    now {now}")
    for extra in (diff.get("new") or [])[len(diff.get("old") or []) :]:
        lines.append(f"    now {extra}")
    lines.append(
        f"  copies: {len(items)} file(s), {moves.get('bytes_from_peers', 0):,} B from peers, "
        f"{moves.get('bytes_from_remote', 0):,} B from remote storage (rule "
        f"{moves.get('rule', '?')}; about {moves.get('predicted_time_s', 0.0):.1f} s)"
    )
    for host, flags in (planned.get("paths") or {}).items():
        if flags:
            given = ", ".join(f"{flag} {path}" for flag, path in flags.items())
            lines.append(f"  paths on {host}: {given}")
    lines += [f"  note: {n}" for n in planned.get("notes") or []]
    return lines


def _checkpoint_step(step: object) -> str:
    """``checkpoint step 6 (after step 5)``: a checkpoint's step named as the log's."""
    return f"checkpoint step {step} ({after(step)})" if isinstance(step, int) else f"step {step}"
