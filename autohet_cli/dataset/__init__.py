"""Real training data: token files opened as memory maps, and the order they are read in.

- ``formats``: ``open_tokens(path)`` opens an autohet prepared directory, a flat
  token file (nanoGPT's ``train.bin``), a ``.npy`` array or a Megatron-LM indexed
  dataset as one read-only ``TokenSource`` (``megatron`` parses Megatron's index).
- ``permutation``: a keyed bijection of ``[0, n)`` evaluated position by position,
  so shuffling a billion samples costs no memory.
- ``sampling``: ``TokenDataset`` cuts a source into ``seq_len + 1`` windows, holds
  out a validation split and serves the runtime's micro-batches, deterministic in
  (seed, step) whatever the plan.
- ``vocab``: the check that every token id fits the model's vocabulary.

``formats``, ``megatron``, ``permutation`` and ``vocab`` import no torch (only
numpy), so tools that prepare or inspect data can use them; ``sampling`` builds
torch tensors. This file imports none of them, so importing ``DataError`` stays cheap.
"""

from __future__ import annotations

from autohet_cli.errors import AutohetError, ConfigError


class DataError(ConfigError):
    """A data file (or a data option) is unusable; the message names the file and the fix."""


class WorkerDied(AutohetError):
    """A tokenizer process of ``data prepare`` died (killed, out of memory, crashed).

    Not a ``DataError``: the inputs are fine, so the work finished so far is kept and
    the same command resumes from it."""
