"""Memory: what a shard keeps for backward, what it may need, and running out of it.

autohet plans stages against device memory, so the probe reports each shard's
activation bytes as autograd really keeps them (``saved_bytes``), not as a
formula. Running out is an expected answer, not a failure: a combination that
does not fit is reported ``oom`` (``is_oom``), and on a CPU host one predicted
not to fit (``rough_bytes``) is not even tried, so that the host is never
pushed into swap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .loss import CHUNK_LOGIT_BYTES


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` says the device (or the host) ran out of memory."""
    if isinstance(exc, MemoryError):
        return True
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def saved_bytes(module: nn.Module, run: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``run`` and sum the unique storages autograd keeps for backward,
    leaving out the module's own parameters."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            st = t.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
        except (RuntimeError, NotImplementedError):
            return t
        if ptr and ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), int(n))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(seen.values())


def rough_bytes(kind: str, s: dict[str, Any], tp: int, mbs: int, seq: int, nbytes: int) -> float:
    """A generous estimate of a shard's peak memory, to avoid swapping a CPU host to death."""
    tokens = mbs * seq
    h = int(s["hidden_size"])
    if kind == "block":
        width = 8 * h + (3 * int(s["ffn_hidden_size"]) + 4 * h) / tp
        attn = mbs * int(s["num_heads"]) / tp * seq * seq * 4  # a non-flash kernel's scores
        params = (4 * h * h + 3 * h * int(s["ffn_hidden_size"])) / tp
        return tokens * width * nbytes * 3 + attn + params * nbytes * 3
    if kind in ("embedding", "head"):
        rows = int(s["vocab_size"]) / tp
        chunk = max(1, min(tokens, CHUNK_LOGIT_BYTES // (4 * rows)))
        logits = chunk * rows * 12 + rows * int(s["embed_dim"]) * 4 if kind == "head" else 0.0
        return rows * int(s["embed_dim"]) * nbytes * 3 + tokens * h * nbytes * 4 + logits
    return tokens * h * nbytes * 4


def free(dev: torch.device) -> None:
    """Give a GPU's cached memory back before the next shard (nothing to do on a CPU)."""
    if dev.type == "cuda":  # a full collection costs ~0.1 s: only where memory is tight
        import gc

        gc.collect()
        torch.cuda.empty_cache()
