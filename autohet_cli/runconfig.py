"""A run config file: training settings in YAML or TOML instead of many flags (pure).

    # run.yaml
    steps: 2000
    data: /data/fineweb-10B          # on every host
    lr: 6.0e-4
    warmup_steps: 200
    lr_schedule: cosine
    eval_every: 100

``autohet launch PLAN --config run.yaml`` (and ``recover``) read it on this machine,
check it, and pass each setting to the workers as its flag; the worker itself
takes ``--config FILE`` too. Flags given on the command line override the file.
Each key is the worker flag's name with ``_`` for ``-``; unknown keys are refused
with the list of known ones, so a typo never silently keeps a default.

The file is read like every YAML input (``yamlio.parse_yaml``: aliases and
nesting capped) or through ``tomlio`` (nesting capped before ``tomllib``
recurses), at most ``MAX_RUN_CONFIG_BYTES``; integers have upper bounds
(``steps`` at most ``MAX_STEPS``) and errors show values through
``limits.shown``, so an alias bomb or a 400-digit number is refused in one
short line instead of being printed.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autohet_cli.errors import ConfigError
from autohet_cli.limits import MAX_INT, MAX_RUN_CONFIG_BYTES, MAX_STEPS, at_most, shown
from autohet_cli.tomlio import parse_toml
from autohet_cli.yamlio import parse_yaml, read_text

SCHEMA = "autohet.run/v1"


@dataclass(frozen=True, slots=True)
class Setting:
    key: str
    kind: type  # int | float | str
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: int = MAX_INT  # integers only (a float is checked to be finite)

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


SETTINGS: tuple[Setting, ...] = (
    Setting("steps", int, "train until this step", minimum=0, maximum=MAX_STEPS),
    Setting("seed", int, "seed of weights and data"),
    Setting("lr", float, "peak learning rate", minimum=0.0),
    Setting("min_lr", float, "learning rate at the end of decay (default lr/10)", minimum=0.0),
    Setting("warmup_steps", int, "linear warmup steps", minimum=0, maximum=MAX_STEPS),
    Setting(
        "decay_steps",
        int,
        "step the decay ends at (default: steps)",
        minimum=0,
        maximum=MAX_STEPS,
    ),
    Setting("lr_schedule", str, "decay after warmup", choices=("cosine", "linear", "constant")),
    Setting(
        "lr_extend",
        str,
        "a resume past the decay end: redecay, rewarm or continue",
        choices=("redecay", "rewarm", "continue"),
    ),
    Setting("weight_decay", float, "AdamW decay of matrices", minimum=0.0),
    Setting("beta1", float, "AdamW beta1", minimum=0.0),
    Setting("beta2", float, "AdamW beta2", minimum=0.0),
    Setting("grad_clip", float, "max global gradient norm (0: off)", minimum=0.0),
    Setting("max_nonfinite_steps", int, "non-finite losses in a row that stop the run", minimum=1),
    Setting("data", str, "token file or directory on every host"),
    Setting("data_dtype", str, "dtype of a headerless token file", choices=("uint16", "uint32")),
    Setting("data_fn", str, "package.module:function giving the batches"),
    Setting("val_fraction", float, "held-out share of the samples", minimum=0.0),
    Setting(
        "eval_every",
        int,
        "steps between validation losses (0: never)",
        minimum=0,
        maximum=MAX_STEPS,
    ),
    Setting(
        "eval_batches", int, "global batches per validation loss", minimum=1, maximum=MAX_STEPS
    ),
    Setting("model_fn", str, "package.module:function building the model"),
    Setting("init_from", str, "HuggingFace model directory on every host"),
    Setting("checkpoint_every", str, "K, auto or 0"),
    Setting(
        "keep_checkpoints",
        int,
        "complete steps kept per job (0: every step)",
        minimum=0,
        maximum=MAX_STEPS,
    ),
    Setting(
        "replicas", int, "partner hosts keeping a copy of each host's shards", minimum=0, maximum=8
    ),
    Setting(
        "replica_budget", str, "most bytes of others' shards a host keeps per step (e.g. 20GB)"
    ),
)
BY_KEY = {s.key: s for s in SETTINGS}


def load_run_config(path: Path) -> dict[str, Any]:
    """The file's settings, checked; keys as in ``SETTINGS``."""
    if not path.exists():
        raise ConfigError(f"--config {path}: no such run config file (read as {path.absolute()})")
    text = read_text(path, max_bytes=MAX_RUN_CONFIG_BYTES)
    where = str(path)
    raw = parse_toml(text, where) if path.suffix == ".toml" else parse_yaml(text, where)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(raw).__name__}")
    return check_settings(raw, where)


def check_settings(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "schema":
            if value != SCHEMA:
                raise ConfigError(f"{where}: schema: expected {SCHEMA!r}, got {shown(value)}")
            continue
        setting = BY_KEY.get(str(key))
        if setting is None:
            near = difflib.get_close_matches(str(key), BY_KEY, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(
                f"{where}: unknown setting {shown(key)}{hint}; known: {', '.join(BY_KEY)}"
            )
        out[setting.key] = _value(setting, value, where)
    return out


def _value(s: Setting, value: Any, where: str) -> Any:
    field = f"{where}: {s.key}"
    if s.key == "checkpoint_every" and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if s.kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if s.kind is float and isinstance(value, str):
        # YAML 1.1 (PyYAML) reads 3e-4 as a string: it needs "3.0e-4". Accept both.
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, s.kind):
        raise ConfigError(f"{field}: expected {s.kind.__name__} ({s.help}), got {shown(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{field}: must be a finite number, got {shown(value)}")
    if s.choices and value not in s.choices:
        raise ConfigError(f"{field}: expected one of {', '.join(s.choices)}, got {shown(value)}")
    if s.minimum is not None and isinstance(value, int | float) and value < s.minimum:
        raise ConfigError(f"{field}: must be at least {s.minimum:g}, got {shown(value)}")
    if isinstance(value, int):
        if value < -MAX_INT:
            raise ConfigError(f"{field}: {shown(value)} is smaller than any 64-bit integer")
        at_most(value, s.maximum, field, _WHY_MAX.get(s.maximum, "the largest 64-bit integer"))
    return value


# Why each bound (limits.py has the reasons in full).
_WHY_MAX = {MAX_STEPS: "published runs take 10^5-10^6 steps"}


def worker_args(settings: Mapping[str, Any]) -> list[str]:
    """``--flag=value`` for each setting, in ``SETTINGS`` order (one token each, so
    values starting with ``-`` survive)."""
    return [f"{s.flag}={settings[s.key]}" for s in SETTINGS if s.key in settings]
