"""How a cluster file names its backend and asks for Slurm, and what it says to sbatch (pure).

Part of the cluster file's schema (``cluster`` reads it), so it lives beside it at
the bottom of the layers, not in the ``slurm`` package that runs jobs.

    backend: slurm            # ssh (the default) or slurm
    slurm:
      partition: gpu
      account: mylab
      qos: normal
      time_limit: "1-00:00:00"   # sbatch --time
      signal_before_end_s: 120   # SIGTERM this long before the time limit: the
                                 # workers save the finished step and stop (0: off)
      cpus_per_gpu: 8            # --cpus-per-task per GPU used (default 4; 1 per CPU device)
      sbatch_args: ["--mem=0"]   # given to every component as is
      gpu_types:                 # per GPU type of the cluster: GRES type, constraint
        A100-40GB: {gres: a100, constraint: a100}
        V100-16GB: {gres: v100}

Host names are Slurm node names: a plan's hosts are the nodes it is pinned to.
Every value ends up on an ``#SBATCH`` line, so each is checked against a strict
pattern here (no spaces, quotes or newlines that could end the line or start
another directive) and the error names the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autohet_cli.errors import ConfigError
from autohet_cli.yamlio import as_list, as_mapping, check_keys, coerce

# The backends a cluster file may name; ``launch.backend.register`` adds one.
BACKENDS: list[str] = ["ssh", "slurm"]
DEFAULT_SIGNAL_BEFORE_END_S = 120
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:,+@%=/-]*\Z")
_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}\Z|(\d+-\d+)\Z|UNLIMITED\Z|INFINITE\Z")
_ARG = re.compile(r"--[a-z][a-z0-9-]*(=[A-Za-z0-9_.:,+@%=/-]+)?\Z")
# Options autohet sets itself for every component: a second value would fight ours.
_OURS = (
    "--nodes",
    "--nodelist",
    "--ntasks-per-node",
    "--gres",
    "--output",
    "--error",
    "--job-name",
    "--het-group",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SlurmGpuType:
    gres: str | None = None  # the GRES type: --gres=gpu:<gres>:<n>; None: --gres=gpu:<n>
    constraint: str | None = None  # a node feature: --constraint=<constraint>


@dataclass(frozen=True, slots=True, kw_only=True)
class SlurmSettings:
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_limit: str | None = None
    signal_before_end_s: int = DEFAULT_SIGNAL_BEFORE_END_S
    cpus_per_gpu: int | None = None
    sbatch_args: tuple[str, ...] = ()
    gpu_types: Mapping[str, SlurmGpuType] = field(default_factory=dict)

    def gpu_type(self, name: str) -> SlurmGpuType:
        return self.gpu_types.get(name, SlurmGpuType())

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in ("partition", "account", "qos", "time_limit", "cpus_per_gpu"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        out["signal_before_end_s"] = self.signal_before_end_s
        if self.sbatch_args:
            out["sbatch_args"] = list(self.sbatch_args)
        if self.gpu_types:
            out["gpu_types"] = {
                name: {k: v for k, v in (("gres", t.gres), ("constraint", t.constraint)) if v}
                for name, t in self.gpu_types.items()
            }
        return out


def backend_from(raw: Any, at: str) -> str:
    """``at``: where the value was written (``FILE: backend``, ``--backend``)."""
    value = coerce(raw if raw is not None else "ssh", str, at)
    if value not in BACKENDS:
        raise ConfigError(f"{at}: {value!r} is not a launch backend; use one of {list(BACKENDS)}")
    return value


def settings_from_dict(raw: Any, where: str, gpu_type_names: set[str]) -> SlurmSettings:
    """Parse ``slurm:``; ``gpu_type_names``: the cluster's types (a key naming none is
    a typo that would silently drop a constraint)."""
    at = f"{where}: slurm"
    d = as_mapping(raw if raw is not None else {}, at)
    check_keys(
        d,
        at,
        [],
        [
            "partition",
            "account",
            "qos",
            "time_limit",
            "signal_before_end_s",
            "cpus_per_gpu",
            "sbatch_args",
            "gpu_types",
        ],
    )
    words = {k: _word(d.get(k), f"{at}.{k}") for k in ("partition", "account", "qos")}
    time_limit = None
    if d.get("time_limit") is not None:
        time_limit = coerce(d["time_limit"], str, f"{at}.time_limit")
        if not _TIME.match(time_limit):
            raise ConfigError(
                f"{at}.time_limit: {time_limit!r} is not a Slurm time; write minutes, "
                'HH:MM:SS or D-HH:MM:SS (quoted in YAML, e.g. "12:00:00")'
            )
    signal_s = coerce(d.get("signal_before_end_s", DEFAULT_SIGNAL_BEFORE_END_S), int, at)
    if not 0 <= signal_s <= 65535:
        raise ConfigError(f"{at}.signal_before_end_s: use 0 (off) to 65535 seconds")
    cpus = d.get("cpus_per_gpu")
    cpus_per_gpu = None if cpus is None else coerce(cpus, int, f"{at}.cpus_per_gpu")
    if cpus_per_gpu is not None and cpus_per_gpu < 1:
        raise ConfigError(f"{at}.cpus_per_gpu: must be at least 1, got {cpus_per_gpu}")
    args = []
    for i, a in enumerate(as_list(d.get("sbatch_args") or [], f"{at}.sbatch_args")):
        arg = coerce(a, str, f"{at}.sbatch_args[{i}]")
        if not _ARG.match(arg):
            raise ConfigError(
                f"{at}.sbatch_args[{i}]: {arg!r}: write one long option per item, "
                "--name or --name=value (no spaces or quotes), e.g. --mem=0"
            )
        if arg.split("=")[0] in _OURS:
            raise ConfigError(
                f"{at}.sbatch_args[{i}]: {arg!r}: autohet sets {arg.split('=')[0]} itself "
                "from the plan (one component per host group, pinned to its nodes)"
            )
        args.append(arg)
    types: dict[str, SlurmGpuType] = {}
    raw_types = as_mapping(d.get("gpu_types") or {}, f"{at}.gpu_types")
    for name, spec in raw_types.items():
        tat = f"{at}.gpu_types.{name}"
        if str(name) not in gpu_type_names:
            raise ConfigError(
                f"{tat}: no host of this cluster has GPU type {name!r}; "
                f"its types are {sorted(gpu_type_names)}"
            )
        s = as_mapping(spec, tat)
        check_keys(s, tat, [], ["gres", "constraint"])
        types[str(name)] = SlurmGpuType(
            gres=_word(s.get("gres"), f"{tat}.gres"),
            constraint=_constraint(s.get("constraint"), f"{tat}.constraint"),
        )
    return SlurmSettings(
        partition=words["partition"],
        account=words["account"],
        qos=words["qos"],
        time_limit=time_limit,
        signal_before_end_s=signal_s,
        cpus_per_gpu=cpus_per_gpu,
        sbatch_args=tuple(args),
        gpu_types=types,
    )


def _word(raw: Any, at: str) -> str | None:
    if raw is None:
        return None
    value = coerce(raw, str, at)
    if not _WORD.match(value):
        raise ConfigError(
            f"{at}: {value!r}: use letters, digits and _.:,+@%=/- only (it goes on an #SBATCH line)"
        )
    return value


_CONSTRAINT = re.compile(r"[A-Za-z0-9_.&|!*\[\]()-]+\Z")


def _constraint(raw: Any, at: str) -> str | None:
    """A feature expression (``a100``, ``a100&ib``, ``[rack1|rack2]``)."""
    if raw is None:
        return None
    value = coerce(raw, str, at)
    if not _CONSTRAINT.match(value):
        raise ConfigError(
            f"{at}: {value!r}: a Slurm feature expression has letters, digits, _.- and "
            "&|!*[]() only"
        )
    return value
