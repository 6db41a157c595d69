"""Loading a plan's three inputs (cluster, model, profile) with their fingerprints.

Fingerprints (sha256 of each input file) go into the plan so that ``launch``
and ``estimate`` can refuse a plan made for a different cluster or profile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from autohet_cli.cluster import Cluster, load_cluster
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.defaults import resolve_cluster_path
from autohet_cli.estimates.profile import Profile
from autohet_cli.estimates.profile_io import load_profile
from autohet_cli.models import ModelSpec, get_model
from autohet_cli.settings import TrainingSettings
from autohet_cli.yamlio import sha256_file


@dataclass(frozen=True, slots=True, kw_only=True)
class Inputs:
    cluster: Cluster
    model: ModelSpec
    profile: Profile | None
    fingerprints: dict[str, dict[str, str]] = field(default_factory=dict)


def load_inputs(
    cluster_path: str | None, model: str | ModelSpec, profile_paths: Sequence[str] = ()
) -> Inputs:
    """``model``: a zoo name, a HuggingFace config.json, or a spec a plan carries."""
    cpath = resolve_cluster_path(cluster_path)
    cluster = load_cluster(cpath)
    spec = model if isinstance(model, ModelSpec) else get_model(model)
    prints: dict[str, dict[str, str]] = {
        "cluster": {"path": str(cpath), "sha256": sha256_file(cpath)},
        "model": {"name": spec.name},
    }
    if isinstance(model, str) and model.endswith(".json"):
        prints["model"].update(path=model, sha256=sha256_file(model))
    profile: Profile | None = None
    for i, p in enumerate(profile_paths):
        loaded = load_profile(p)
        profile = loaded if profile is None else profile.merged_with(loaded)
        prints[f"profile{'' if i == 0 else i}"] = {"path": str(p), "sha256": sha256_file(p)}
    return Inputs(cluster=cluster, model=spec, profile=profile, fingerprints=prints)


def tables_for(inputs: Inputs, training: TrainingSettings) -> CostTables:
    return CostTables(inputs.model, inputs.profile, training, gpu_specs=inputs.cluster.gpu_specs)
