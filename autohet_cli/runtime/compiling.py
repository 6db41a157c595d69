"""torch.compile per transformer block, as torchtitan compiles.

Each layer between the first (which takes token ids) and the last (the head,
whose chunked loss is its own code) is compiled on its own with
``nn.Module.compile()``: in place, so parameter names, state dicts, DCP
checkpoints, tied weights and TP's DTensors stay as they are; a pipeline stage
cut anywhere compiles whatever blocks it holds, and a recompute stage
checkpoints the compiled block as it did the eager one. Identical blocks share
one compiled graph (dynamo guards on shapes, not on the module), so compiling
costs one block's compilation, not one per block.

On by default on CUDA (``--compile auto``), off on the CPU, where inductor's C++
compilation costs more than it wins on small runs; ``--compile on|off`` decides.
The seconds spent compiling are summed from dynamo's own start/end callbacks
(``CompileClock``) and reported with the first step (``runtime.startup``).
"""

from __future__ import annotations

import inspect
import threading
import time
from typing import Any

import torch
from torch import nn

MODES = ("auto", "on", "off")


def wants_compile(mode: str, device: torch.device) -> bool:
    """``auto``: on CUDA devices only."""
    if mode not in MODES:
        raise ValueError(f"--compile {mode!r}: expected one of {', '.join(MODES)}")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def compile_blocks(layers: nn.ModuleDict, num_layers: int) -> list[int]:
    """Compile in place every held layer but the model's first and last (and any layer
    with its own ``loss``); returns the indices compiled."""
    done = []
    for key, layer in layers.items():
        index = int(key)
        if index in (0, num_layers - 1) or inspect.ismethod(getattr(layer, "loss", None)):
            continue
        layer.compile()
        done.append(index)
    return done


class CompileClock:
    """Seconds dynamo spent compiling since ``start()`` (its callbacks, which bracket
    each compilation, backward graphs included); None where this torch lacks them."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._open: float | None = None
        self._lock = threading.Lock()
        self.available = False

    def start(self) -> CompileClock:
        try:  # a private module: a torch without it (or other names) is timed as None
            from torch._dynamo.callback import callback_handler

            callback_handler.register_start_callback(self._begin)
            callback_handler.register_end_callback(self._end)
        except (ImportError, AttributeError):
            return self
        self.available = True
        return self

    def _begin(self, *_: Any) -> None:
        with self._lock:
            if self._open is None:
                self._open = time.perf_counter()

    def _end(self, *_: Any) -> None:
        with self._lock:
            if self._open is not None:
                self.seconds += time.perf_counter() - self._open
                self._open = None

    def total_s(self) -> float | None:
        return self.seconds if self.available else None
