"""What the peer-replica tests share: the job key, a step, and host b's receiver."""

from __future__ import annotations

from pathlib import Path

from autohet_cli.peer.replicate import Replicator

KEY = b"k" * 32
STEP = "step-00000002"


def receiver(job: Path, budget_bytes: int | None = None) -> Replicator:
    """Host b's replica receiver on loopback, keeping copies in ``job``."""
    return Replicator(
        host="b",
        plan_dir=job,
        key=KEY,
        replicas=1,
        budget_bytes=budget_bytes,
        owner=True,
        env={"AUTOHET_HOST_ADDR": "127.0.0.1"},
    )
