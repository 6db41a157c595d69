"""Plans as versioned files: ``plans/<name>.v<N>.yaml``, read, named and never overwritten.

A new plan (a re-plan, a recovery) is the next free version of its name, written
with ``write_new`` so two writers racing for one version cannot both win.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from autohet_cli.errors import ConfigError, PlanError
from autohet_cli.plan.schema import Plan, validate_name
from autohet_cli.plan.yamlform import plan_from_dict, plan_to_dict
from autohet_cli.yamlio import dump_yaml, load_yaml, write_new

_VERSIONED = re.compile(r"^(?P<name>.+)\.v(?P<version>\d+)\.yaml$")


def load_plan(path: str | Path) -> Plan:
    return plan_from_dict(load_yaml(path), str(path))


def next_version(directory: Path, name: str) -> int:
    versions = [
        int(m.group("version"))
        for f in directory.glob(f"{name}.v*.yaml")
        if (m := _VERSIONED.match(f.name)) and m.group("name") == name
    ]
    return max(versions, default=0) + 1


def default_plan_name(cluster_name: str, model_name: str) -> str:
    """``<cluster>-<model>``, made a valid plan name: without the model, plans of
    different models on one cluster became versions of one plan (v1..v4), and a
    version is meant to be a re-plan of the same job."""
    raw = f"{cluster_name}-{model_name}"
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", raw).replace(".v", "-v").strip("-_.")
    return validate_name(re.sub(r"-{2,}", "-", name) or "plan")


def write_plan(plan: Plan, directory: str | Path) -> tuple[Plan, Path]:
    """Write ``plan`` as the next free version; never overwrites, safe against races."""
    folder = Path(directory)
    validate_name(plan.name)
    plan.validate()
    for _ in range(100):
        versioned = replace(plan, version=next_version(folder, plan.name))
        target = folder / f"{plan.name}.v{versioned.version}.yaml"
        try:
            return versioned, write_new(target, dump_yaml(plan_to_dict(versioned)))
        except ConfigError:
            if not target.exists():
                raise
    raise PlanError(f"{folder}: could not find a free version for {plan.name!r}")
