"""Real text for the runtime tests: the shipped sample corpus as byte-level tokens.

gpt-tiny has a 256-token vocabulary, so each UTF-8 byte of
``autohet_cli/data/sample/corpus.txt`` (the King James Bible, public domain) is one
token id: real text with real statistics, read by the runtime as a ``.npy`` token
file. Written once per content into the temp directory, atomically.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "autohet_cli" / "data" / "sample" / "corpus.txt"

# The worker flags every exactness test trains with: real data, clipping that acts
# (gpt-tiny's gradient norm starts near 2), warmup, then cosine decay.
TRAINING_FLAGS = ("--grad-clip", "0.5", "--warmup-steps", "2", "--lr-schedule", "cosine")
CLIP = 0.5


def byte_tokens() -> Path:
    data = CORPUS.read_bytes()
    digest = hashlib.sha256(data).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"autohet-test-corpus-bytes-{digest}.npy"
    if not path.is_file():
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npy")
        with os.fdopen(fd, "wb") as f:
            np.save(f, np.frombuffer(data, dtype=np.uint8).astype(np.uint16))
        os.replace(tmp, path)
    return path


def data_flags() -> tuple[str, ...]:
    return ("--data", str(byte_tokens()), *TRAINING_FLAGS)
