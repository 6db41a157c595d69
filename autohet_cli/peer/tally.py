"""What one save's replication came to: each rank's tally, and rank 0's lines.

Apart from ``peer.replicate`` (which moves the bytes) so the checkpointer's finish
step can word the outcome without the sending and receiving machinery.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from autohet_cli.peer.placement import Placement


@dataclass(slots=True)
class Tally:
    sent_bytes: int = 0
    skipped: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    reached: list[str] = field(default_factory=list)  # partners every push reached
    host: str = ""


def summary(step: int, tallies: Sequence[Tally], placement: Placement, *, first: bool) -> list[str]:
    """Rank 0's lines for a replicated step: one figure line, then warnings (a host
    without a partner only at the run's ``first`` save: it does not change)."""
    sent = sum(t.sent_bytes for t in tallies)
    secs = max((t.seconds for t in tallies), default=0.0)
    lines: list[str] = []
    pairs = ", ".join(f"{h}->{'+'.join(ps)}" for h, ps in placement.partners.items() if ps)
    if sent or pairs:
        rate = f" ({sent / secs / 1e9:.2f} GB/s)" if secs > 0 and sent else ""
        lines.append(
            f"replicas of step {step}: {sent / 1e9:.2f} GB to partners in {secs:.2f} s{rate} "
            f"[{pairs or 'none'}]"
        )
    for host, why in placement.short.items() if first else ():
        lines.append(f"warning: step {step}: {host}'s shards have no (or too few) partner: {why}")
    errors = [e for t in tallies for e in t.errors]
    if errors:
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        lines.append(
            f"warning: step {step} is saved, but some replicas were not: "
            + "; ".join(errors[:3])
            + more
            + ". A lost host's shards then come from the remote copy or an older step."
        )
    return lines
