"""Upper bounds on the sizes inputs may state, each with the reason for its value (pure).

Every count in a cluster file, a model config, a plan or a command line ends up
as a loop bound or an allocation somewhere: ``gpus.count: 10**30`` made the
planner enumerate that many devices, ``num_hidden_layers: 1000000000`` built a
billion layer records, and a global batch of 10^9 made the 1F1B simulator run
for hours. Each bound is far above anything real (so no honest input meets
it) and low enough that what passes cannot exhaust the machine. A value over
its bound is almost always a typo or an attack; the error says which field.

The error shows the value as ``shown`` does: whole up to 15 digits, else in a
few characters (``1e+400``, not 400 digits), and any structure cut short, so a
hostile value cannot make the message itself the problem.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any

from autohet_cli.errors import ConfigError

# Any integer field of any file: the readers downstream (numpy, torch, JSON
# tools) hold 64 bits, and no count, size or id of ours comes near 9.2e18.
MAX_INT = (1 << 63) - 1
# Training steps: published runs take 10^5-10^6 optimizer steps; 10^12 steps of
# even 1 ms each would take 30 years. The step count sizes the learning-rate
# schedule and the checkpoint plan, so a typo there must not pass.
MAX_STEPS = 10**12
# A run config is a screenful of settings: 1 MiB leaves room for any comments
# and keeps a hostile file from costing the parser much time or memory.
MAX_RUN_CONFIG_BYTES = 1 << 20

# Hosts carry 8 or 16 GPUs; the largest NVLink domain sold (NVL72) has 72.
MAX_GPUS_PER_HOST = 1024
# The largest single training fleets reported hold ~200k GPUs; the planner
# builds one record per device, so a million stays a few hundred MB at worst.
MAX_CLUSTER_GPUS = 1 << 20
# Published LLM runs use 1-16k sequences per step (LLaMA-3: 2048, DeepSeek-V3:
# 15360), LAMB's BERT 64k; the simulator is linear in micro-batches and polls
# the planner's deadline, so 2^20 is 16x the largest and still stops on time.
MAX_GLOBAL_BATCH = 1 << 20
# Context lengths advertised today reach 10M tokens (LLaMA-4 Scout).
MAX_SEQ_LEN = 1 << 24
# Production LLMs have <= 128 blocks; the deepest research transformer 1,000 (DeepNet).
MAX_BLOCKS = 1 << 14
# Widest published models: hidden 25,600 (Megatron 1T), MLP 73,728 (PaLM).
MAX_HIDDEN = 1 << 17
MAX_FFN_HIDDEN = 1 << 19
# The largest vocabulary is 262,144 (Gemma-3). A vocabulary only scales numbers
# at plan time (no loop runs over it), so the bound is the int32 token id; a
# vocabulary no GPU holds is then reported where memory is checked, as it was.
MAX_VOCAB = 1 << 31
# Tensor parallelism stays inside a host's GPUs.
MAX_TENSOR_PARALLEL = MAX_GPUS_PER_HOST

# ModelSpec field -> (bound, what real models have); checked by ModelSpec itself.
_CONTEXT = "the longest contexts are ~10M tokens"
MODEL_BOUNDS: dict[str, tuple[int, str]] = {
    "num_blocks": (MAX_BLOCKS, "LLMs have <= 128 blocks, DeepNet 1,000"),
    "hidden_size": (MAX_HIDDEN, "the widest models have 25,600"),
    "num_heads": (MAX_HIDDEN, "heads divide the hidden size"),
    "num_kv_heads": (MAX_HIDDEN, "heads divide the hidden size"),
    "embed_proj_dim": (MAX_HIDDEN, "the widest models have 25,600"),
    "ffn_hidden_size": (MAX_FFN_HIDDEN, "the widest MLPs have 73,728"),
    "vocab_size": (MAX_VOCAB, "token ids are 32-bit; the largest vocabulary has 262,144"),
    "make_vocab_size_divisible_by": (MAX_VOCAB, "Megatron pads to 128"),
    "num_positions": (MAX_SEQ_LEN, _CONTEXT),
    "default_seq_len": (MAX_SEQ_LEN, _CONTEXT),
    "max_position_embeddings": (MAX_SEQ_LEN, _CONTEXT),
    "sliding_window": (MAX_SEQ_LEN, _CONTEXT),
}

# ModelSpec float field -> (least, most, what real models have); checked by ModelSpec.
# A config.json may state anything: a rope_scaling.factor of 1e-300 planned fine and
# trained to NaN. Each range is far wider than any published model's.
MODEL_FLOAT_RANGES: dict[str, tuple[float, float, str]] = {
    "norm_eps": (1e-20, 0.1, "published norm epsilons are 1e-12 to 1e-5"),
    "rope_theta": (10.0, 1e12, "rotary bases are 10,000 to 10^7"),
    "rope_scaling.factor": (1.0, 1024.0, "factors are 2 to 64; transformers warns below 1"),
    "rope_scaling.low_freq_factor": (1e-3, 1e3, "LLaMA-3.1 uses 1"),
    "rope_scaling.high_freq_factor": (1e-3, 1e3, "LLaMA-3.1 uses 4"),
}


def within(value: float, name: str, where: str) -> float:
    """``value`` if finite and within ``MODEL_FLOAT_RANGES[name]``; else a ConfigError
    naming ``where`` (the model) and ``name``."""
    least, most, why = MODEL_FLOAT_RANGES[name]
    if not math.isfinite(value):  # a config.json may say NaN or Infinity
        raise ConfigError(f"{where}: {name}: expected a finite number, got {value}")
    if not least <= value <= most:
        raise ConfigError(
            f"{where}: {name}: {value!r} is outside {least:g} to {most:g} ({why}); is it a typo?"
        )
    return value


def at_most(value: int, bound: int, at: str, why: str) -> int:
    """``value`` if it is within ``bound``; otherwise a ConfigError naming ``at``.

    ``why`` finishes "larger than ..." (what real inputs look like), so the
    user can tell a typo from a limit they have genuinely outgrown.
    """
    if value > bound:
        raise ConfigError(f"{at}: {shown(value)} is larger than {bound:,} ({why}); is it a typo?")
    return value


# Integers past this many digits are shown in scientific form.
_WHOLE_DIGITS = 15
# Below Python's limit on int-to-str conversion (4,300 digits), with a margin.
_STR_BITS = 14_000
# The most characters a value takes in a message.
_SHOWN_CHARS = 60


def _shown_int(n: int) -> str:
    sign = "-" if n < 0 else ""
    if abs(n) < 10**_WHOLE_DIGITS:
        return str(n)
    if n.bit_length() > _STR_BITS:
        return f"a number of about {int(n.bit_length() * math.log10(2)):,} digits"
    digits = str(abs(n))
    mantissa = f"{digits[0]}.{digits[1:3]}".rstrip("0").rstrip(".")
    return f"{sign}{mantissa}e+{len(digits) - 1}"


class _Bounded(reprlib.Repr):
    """``repr`` that never walks or prints more than a few items of anything."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxstring = self.maxother = _SHOWN_CHARS
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = 6

    def repr_int(self, x: int, level: int) -> str:
        return _shown_int(x)


_BOUNDED = _Bounded()


def shown(value: Any) -> str:
    """``value`` as an error message shows it: at most 60 characters, with integers
    whole up to 15 digits and as ``1.23e+28`` beyond, whatever the value's size or
    depth (a 10^400 or an alias-expanded list must not become the message)."""
    if isinstance(value, bool):
        return repr(value)
    text = _BOUNDED.repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def size_text(n: float) -> str:
    """Bytes for a person, in powers of 1000 as disks and links are sold: ``812.40 MB``."""
    for unit, factor in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= factor:
            return f"{n / factor:.2f} {unit}"
    return f"{n:.0f} B"
