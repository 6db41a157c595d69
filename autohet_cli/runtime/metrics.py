"""What a step reports and where it goes: JSON lines always, TensorBoard when installed.

Rank 0 writes both. ``metrics.jsonl`` (one object per step; a validation loss is
its own object ``{"step": N, "eval_loss": X}`` after step N's) is the record scripts
and tests read; the launcher's run folder gets the same lines (``runfiles.metricsfile``:
a copy written here when the folder is on this machine, else printed for the
launcher to collect); TensorBoard event files (``tensorboard`` is an optional extra:
``pip install 'autohet-cli[tensorboard]'``) hold the same scalars for people.
MFU counts the model's FLOPs (3x the forward: forward, input and weight
gradients; recomputation not counted, the usual convention) against the sum of
the plan devices' peak FLOP/s at the plan's precision.
"""

from __future__ import annotations

import json
import resource
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autohet_cli.plan import Plan
from autohet_cli.runfiles.metricsfile import METRIC_PREFIX, tb_scalars

_APPEND_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    step: int
    loss: float  # mean over the global batch
    tokens: int
    time_s: float
    skipped: bool = False  # fp16 overflow: no optimizer step
    lr: float = 0.0
    grad_norm: float | None = None  # before clipping
    epoch: float | None = None  # fractional epochs of the training data done after the step
    peak_mem_bytes: tuple[int, ...] = ()  # per global rank
    mfu: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s if self.time_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "step": self.step,
            "loss": self.loss,
            "tokens": self.tokens,
            "time_s": round(self.time_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "skipped": self.skipped,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "peak_mem_bytes": list(self.peak_mem_bytes),
            "mfu": None if self.mfu is None else round(self.mfu, 6),
        }
        if self.epoch is not None:
            out["epoch"] = round(self.epoch, 6)
        return out


def peak_memory_bytes(device: torch.device) -> int:
    """The CUDA allocator's peak on a GPU; the process's peak RSS on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def flops_per_token(plan: Plan) -> float | None:
    """Training FLOPs per token of the plan's model (None: a model we cannot count)."""
    from autohet_cli.models import get_model

    try:
        spec = plan.architecture or get_model(plan.model_name)
    except Exception:  # a --model-fn model outside the zoo
        return None
    seq = plan.training.seq_len
    fwd = sum(layer.fwd_flops(seq, 1) for layer in spec.layers()) / seq
    return 3.0 * fwd


def peak_flops(plan: Plan, device: torch.device) -> float | None:
    """Sum of the plan devices' peak FLOP/s (catalog types only; None otherwise)."""
    from autohet_cli import catalog

    precision = plan.training.precision if device.type == "cuda" else "fp32"
    total = 0.0
    for stage in (s for p in plan.pipelines for s in p.stages):
        spec = catalog.CATALOG.get(stage.gpu_type)
        if spec is None:
            return None
        try:
            total += spec.peak_tflops_at(precision) * 1e12 * len(stage.devices)
        except Exception:
            return None
    return total or None


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class MetricsWriter:
    """Rank 0's sinks: JSON lines, TensorBoard (optional), one printed line per step.

    ``copy_to``: a second JSON-lines file (the launcher's run folder on this machine),
    best effort: the run goes on without it. ``stream``: each line is also printed
    after ``METRIC_PREFIX``, for a launcher on another machine."""

    def __init__(
        self,
        path: Path | None,
        *,
        tensorboard_dir: Path | None = None,
        echo: bool = True,
        copy_to: Path | None = None,
        stream: bool = False,
    ) -> None:
        self.path, self.echo = path, echo
        self.copy_to, self.stream = copy_to, stream
        self.tb: Any = None
        self.tb_missing = False
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is an optional extra
                self.tb_missing = True
            else:
                self.tb = SummaryWriter(str(tensorboard_dir))

    def _append(self, record: dict[str, Any]) -> None:
        """One JSON line; checkpoint records come from the save's thread, hence the lock."""
        line = json.dumps(record)
        with _APPEND_LOCK:
            if self.path is not None:
                with self.path.open("a", encoding="utf-8") as f:
                    f.write(line + "\n")
            if self.copy_to is not None:
                self._copy(line)
            if self.stream:  # one write of the whole line: print() writes "\n" apart, and
                # the save's thread and the step's could glue two lines (a lost point)
                _say(METRIC_PREFIX + line)

    def _copy(self, line: str) -> None:
        assert self.copy_to is not None
        try:
            with self.copy_to.open("a", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError as exc:  # the run folder went away: the host's file goes on
            print(f"note: metrics no longer copied to {self.copy_to}: {exc}", flush=True)
            self.copy_to = None

    def write(self, result: StepResult) -> None:
        self._append(result.to_json())
        if self.tb is not None:
            self._scalars(result)
        if self.echo:
            line = f"step {result.step} loss {result.loss:.6f} tokens/s {result.tokens_per_s:.0f}"
            line += f" lr {result.lr:.3g}"
            if result.grad_norm is not None:
                line += f" grad_norm {result.grad_norm:.3f}"
            _say(line)

    def write_checkpoint(self, record: dict[str, Any]) -> None:
        """A save's figures (``ckpt.persist.SaveRecord.to_json``): step, ckpt_blocked_s,
        ckpt_persist_s, ckpt_bytes. Written when the save is durable, so its line may
        follow later steps' lines."""
        self._append(record)
        tb = self.tb  # closed (None) once training ended: the final save's line is enough
        if tb is not None:
            for tag, value in tb_scalars(record):
                tb.add_scalar(tag, value, record["step"])

    def write_eval(self, step: int, loss: float) -> None:
        record = {"step": step, "eval_loss": loss}
        self._append(record)
        if self.tb is not None:
            for tag, value in tb_scalars(record):
                self.tb.add_scalar(tag, value, step)
        if self.echo:
            _say(f"step {step} eval_loss {loss:.6f}")

    def _scalars(self, r: StepResult) -> None:
        """The tags the launcher's collector writes too (``runfiles.metricsfile``)."""
        for tag, value in tb_scalars({**r.to_json(), "tokens_per_s": r.tokens_per_s}):
            self.tb.add_scalar(tag, value, r.step)

    def close(self) -> None:
        tb, self.tb = self.tb, None
        if tb is not None:
            tb.close()
