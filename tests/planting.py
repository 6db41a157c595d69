"""An attacker's checkpoint for tests: a copy of a real step whose ``.metadata`` runs a
command when unpickled, with its manifest edited to match (sha256, size, step) but
without the job key, so its HMAC cannot be right."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path


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
