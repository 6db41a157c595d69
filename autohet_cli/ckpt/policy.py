"""When to save: ``--checkpoint-every K|auto|0`` (pure; the runtime's hook applies it).

``auto`` (the default of launch, recover and the worker) saves after the first step
of a run, which gives a recovery point at once and measures what a save costs, and
then every K steps with

    K = min(ceil(save_s / (0.02 * step_s)), floor(1800 s / step_s)), at least 1,

i.e. as often as keeps saving under 2% of the training time, but at least every
30 minutes of training (a spot host that vanishes then costs at most 30 minutes of
work; when one save takes more than 36 s that bound wins and the overhead exceeds
2%, which the worker says). ``save_s`` and ``step_s`` are re-measured at every save
and agreed over all ranks (their maximum), so every rank picks the same steps. The
training state is the same whichever steps are saved, so the choice never changes
results. Every run with checkpoints on also saves once more after its last step.

``0`` turns the periodic saves off, not that last save: a run that ends normally
keeps its work (its last step saved), and a preemption notice still saves the step
it stopped at. Only ``--checkpoint-every 0 --no-emergency-save`` saves nothing at
all (benchmarks, throwaway tries), which the launch and the worker say.

Why this default: a preemption costs half an interval of work on average,
checkpointing costs one save per interval; 2% keeps the cost invisible beside the
step-time noise of a shared fleet, while small models (the demo, most tests) still
save within seconds of starting.

Saves are asynchronous (``ckpt.checkpointer``): ``save_s`` is what training loses
to one, the time it stood still (``ckpt_blocked_s``), and since one save is in
flight at a time, K steps must also cover the time a save takes to become durable
(``ckpt_persist_s`` of the latest finished one): K >= persist_s / step_s.

A resumed run does not save right after its first step: its first save comes
K steps after the step it resumed from, K from the figures of the job's last save
(kept beside its checkpoints) and the first step's time; without such figures it
saves after its first step, as a fresh run does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

AUTO = "auto"
OVERHEAD_FRACTION = 0.02
MAX_INTERVAL_S = 1800.0
FLAG = "--checkpoint-every"


def parse_every(text: str | int) -> int | None:
    """``auto`` → None, else a step count >= 0 (0: no periodic saves)."""
    if isinstance(text, int):
        value = text
    elif text.strip().lower() == AUTO:
        return None
    else:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(
                f"{FLAG} {text!r}: expected 'auto', 0 (no periodic saves) or a number of steps"
            ) from None
    if value < 0:
        raise ValueError(f"{FLAG} must be >= 0 or 'auto', got {value}")
    return value


def saves_anything(every: int | None, *, emergency: bool) -> bool:
    """Whether a run saves at all: periodic saves, or (``0``) its last step and a
    preemption notice's; off only with ``--no-emergency-save`` too."""
    return every != 0 or emergency


def describe_every(every: int | None, *, emergency: bool = True) -> str:
    """The saves a run makes, as the launch and the worker announce them."""
    if every is None:
        return (
            f"auto (after the first step, then as often as keeps saving under "
            f"{OVERHEAD_FRACTION:.0%} of the time, at least every {MAX_INTERVAL_S / 60:.0f} min, "
            "and after the last step)"
        )
    if every == 0 and not emergency:
        return (
            f"none ({FLAG} 0 with --no-emergency-save): a lost host cannot be recovered, "
            "and neither the last step nor a preemption notice's step is saved"
        )
    if every == 0:
        return (
            f"no periodic saves ({FLAG} 0: a lost host cannot be recovered); the last step "
            "is saved, and a preemption notice saves its step"
        )
    return f"every {every} step{'s' if every != 1 else ''} and after the last step"


def checkpoint_every_of(args: Sequence[str]) -> int | None:
    """The value the worker will use: the last ``--checkpoint-every`` in ``args``
    (argparse keeps the last); ``auto`` when absent."""
    value: str = AUTO
    for i, arg in enumerate(args):
        if arg == FLAG and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(FLAG + "="):
            value = arg.split("=", 1)[1]
    return parse_every(value)


def auto_interval_steps(
    save_s: float,
    step_s: float,
    *,
    persist_s: float = 0.0,
    overhead_fraction: float = OVERHEAD_FRACTION,
    max_interval_s: float = MAX_INTERVAL_S,
) -> int:
    """Steps between saves for the ``auto`` policy (see the module docstring)."""
    if step_s <= 0 or not math.isfinite(step_s):
        return 1
    by_overhead = math.ceil(max(save_s, 0.0) / (overhead_fraction * step_s))
    by_time = max(1, math.floor(max_interval_s / step_s))
    in_flight = math.ceil(max(persist_s, 0.0) / step_s) if math.isfinite(persist_s) else 1
    return max(1, min(by_overhead, by_time), in_flight)
