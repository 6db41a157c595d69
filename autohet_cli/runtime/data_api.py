"""The plug-in point for training data: what a data function receives and returns.

The runtime trains on whatever object serves its micro-batches. Three sources,
first match wins (``build_batches``):

1. ``--data-fn package.module:function``: your function builds it;
2. ``--data PATH``: a token file, opened by ``autohet_cli.dataset`` (an autohet
   prepared directory, a flat nanoGPT ``.bin``, a ``.npy`` array or a Megatron
   ``PREFIX.bin``/``.idx`` pair) and shuffled by ``TokenDataset``;
3. neither: ``SyntheticCorpus``, random words, so a plan can be tried without data.

Write a function ``build(request: DataRequest) -> Batches`` in an importable
module and pass ``--data-fn package.module:build``. The contract:

- ``request``: the plan's ``seq_len``, ``global_batch_size`` and
  ``micro_batch_size``, the run's ``seed``, the model's ``vocab_size`` (every id
  must be below it), and the ``--data`` / ``--data-dtype`` / ``--val-fraction``
  values, so one function can serve several corpora given by path.
- ``microbatches(step, *, batch_size, sample_range, micro_batch_size)``: a list of
  ``(inputs, targets)`` pairs of int64 tensors ``[micro_batch_size, seq_len]``
  (on the CPU; the runtime moves them). Step ``step``'s *global* batch has
  ``batch_size`` rows; each pipeline asks only for its rows ``sample_range =
  [start, stop)`` (``Topology.sample_range``), cut every ``micro_batch_size``
  rows. So the rows must be a function of (seed, step, row) alone: rows
  ``start..stop`` must be the same whichever range is asked, on any rank, under
  any plan, after any restart. Never draw from a global RNG or an iterator that
  advances per call; resuming at step ``t`` only calls ``microbatches(t, ...)``.
- optional ``eval_microbatches(index, *, batch_size, sample_range,
  micro_batch_size)``: evaluation batch ``index`` (0, 1, ...), the same contract,
  the same samples every run so that evaluation losses compare.
- optional ``describe() -> dict``: JSON-able facts that identify the data (logged
  and stored with checkpoints, to refuse resuming on other data).
- optional ``samples_indexed = True``: row ``r`` of step ``step`` is sample
  ``step * batch_size + r`` of one stream, whatever ``batch_size``. Then a resume
  under another global batch continues at the checkpoint's next sample (it asks
  for the step that starts there); without it such a resume is refused.

The function runs on every rank; keep it cheap (memory-map files, do not load them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from torch import Tensor

from autohet_cli import fnspec
from autohet_cli.dataset import DataError
from autohet_cli.dataset.formats import open_tokens
from autohet_cli.dataset.sampling import DEFAULT_VAL_FRACTION, TokenDataset
from autohet_cli.errors import ConfigError
from autohet_cli.runtime.data import SyntheticCorpus


@dataclass(frozen=True, slots=True, kw_only=True)
class DataRequest:
    """What the runtime asks a data function for."""

    seq_len: int  # plan.training.seq_len
    seed: int  # --seed
    vocab_size: int  # the model's: every token id must be below it
    global_batch_size: int  # plan.training.global_batch_size
    micro_batch_size: int  # plan.training.micro_batch_size
    data: str | None = None  # --data, if given
    data_dtype: str | None = None  # --data-dtype, if given (flat token files)
    val_fraction: float = DEFAULT_VAL_FRACTION  # --val-fraction


@runtime_checkable
class Batches(Protocol):
    """What a data function returns; see the module docstring for the contract."""

    def microbatches(
        self, step: int, *, batch_size: int, sample_range: tuple[int, int], micro_batch_size: int
    ) -> list[tuple[Tensor, Tensor]]: ...


DataFn = Callable[[DataRequest], Batches]


def load_data_fn(spec: str) -> DataFn:
    """Resolve ``package.module:function`` or ``FILE.py:function`` (``fnspec``)."""
    module_name, attr = fnspec.split(spec)
    if not module_name or not attr:
        raise ConfigError(
            f"--data-fn {spec!r}: expected package.module:function or FILE.py:function"
        )
    try:
        module = fnspec.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"--data-fn {spec!r}: cannot import {module_name}: {exc}; check the name and "
            "that the module is on PYTHONPATH on every host"
        ) from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"--data-fn {spec!r}: {module_name} has no attribute {attr!r}")
    if not callable(fn):
        raise ConfigError(
            f"--data-fn {spec!r}: {module_name}.{attr} is a {type(fn).__name__}, not a function"
        )
    return fn  # type: ignore[no-any-return]


def build_batches(request: DataRequest, *, data_fn: str | None) -> Batches:
    """The run's batches: from ``data_fn``, else ``request.data``, else synthetic."""
    if data_fn is not None:
        batches = load_data_fn(data_fn)(request)
        if not callable(getattr(batches, "microbatches", None)):
            raise ConfigError(
                f"--data-fn {data_fn!r} returned a {type(batches).__name__}, which has no "
                "microbatches(step, *, batch_size, sample_range, micro_batch_size) method; "
                "see autohet_cli.runtime.data_api for the contract"
            )
        return batches
    if request.data is not None:
        source = open_tokens(Path(request.data), dtype=request.data_dtype)
        if source.kind == "flat" and request.data_dtype is None and request.vocab_size > 65536:
            raise DataError(
                f"--data {request.data}: a headerless token file and a vocabulary of "
                f"{request.vocab_size:,} ids, more than uint16 holds: pass --data-dtype uint32 "
                "(or uint16 if the file really is 16-bit)"
            )
        return TokenDataset(
            source,
            seq_len=request.seq_len,
            seed=request.seed,
            val_fraction=request.val_fraction,
            vocab_size=request.vocab_size,
        )
    if request.data_dtype is not None:
        raise ConfigError("--data-dtype is given without --data; pass the file it describes")
    return SyntheticCorpus(
        vocab_size=request.vocab_size, seq_len=request.seq_len, seed=request.seed
    )


def describe_batches(batches: Batches) -> dict[str, object]:
    """``batches.describe()`` if it has one, else just its type (for logs and checkpoints)."""
    describe = getattr(batches, "describe", None)
    if callable(describe):
        return dict(describe())
    return {"kind": type(batches).__module__ + "." + type(batches).__qualname__}


def can_evaluate(batches: Batches) -> bool:
    """Whether ``batches`` serves evaluation batches (``eval_microbatches``).

    False too for a ``TokenDataset`` run with ``--val-fraction 0``: it has the method
    but no validation sample to serve.
    """
    if getattr(batches, "num_val_samples", None) == 0:
        return False
    return callable(getattr(batches, "eval_microbatches", None))
