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

import contextlib
import os
import shutil
import threading
import time
from typing import Any

import torch
from torch import nn

from autohet_cli.runtime.stage import layer_loss

MODES = ("auto", "on", "off")


def wants_compile(mode: str, device: torch.device) -> bool:
    """``auto``: on CUDA devices only."""
    if mode not in MODES:
        raise ValueError(f"--compile {mode!r}: expected one of {', '.join(MODES)}")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def compile_problem(device: torch.device) -> str | None:
    """Why inductor cannot compile for ``device`` here (None: it can): Triton for CUDA
    kernels, a C++ compiler for the CPU's and for Triton's launchers."""
    if device.type == "cuda":
        try:
            from torch.utils._triton import has_triton
        except ImportError:  # a private module; without it, let inductor try
            return None
        if not has_triton():
            return "Triton is not installed (pip install triton, or pass --no-compile)"
        return None
    if not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++")):
        return "no C++ compiler on this host (install g++, or pass --no-compile)"
    return None


def setup(mode: str, device: torch.device) -> tuple[bool, str | None]:
    """(compile?, a note for the log). ``on`` insists (a missing toolchain is an
    error); ``auto`` compiles where it can and, where inductor fails on a block
    anyway, runs that block eagerly (dynamo's ``suppress_errors``) rather than
    stopping the run."""
    if not wants_compile(mode, device):
        return False, None
    problem = compile_problem(device)
    if problem is not None:
        if mode == "on":
            raise ValueError(f"--compile on: {problem}")
        return False, f"torch.compile off: {problem}"
    if mode == "auto":
        import torch._dynamo

        torch._dynamo.config.suppress_errors = True
    return True, None


def compile_blocks(layers: nn.ModuleDict, num_layers: int) -> list[int]:
    """Compile in place every held layer but the model's first and last (and any layer
    with its own ``loss``); returns the indices compiled."""
    done = []
    for key, layer in layers.items():
        index = int(key)
        if index in (0, num_layers - 1) or layer_loss(layer) is not None:
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

    def stop(self) -> None:
        """Unregister the callbacks (a later trainer in this process starts its own)."""
        if not self.available:
            return
        from torch._dynamo.callback import callback_handler

        for remove, fn in (
            (callback_handler.remove_start_callback, self._begin),
            (callback_handler.remove_end_callback, self._end),
        ):
            with contextlib.suppress(ValueError, AttributeError):
                remove(fn)
        self.available = False

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
