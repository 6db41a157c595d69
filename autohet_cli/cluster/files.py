"""A cluster file from disk: ``autohet.cluster/v1`` YAML, or a hostfile."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from autohet_cli.cluster.hostfile import looks_like_hostfile, parse_hostfile
from autohet_cli.cluster.schema import Cluster
from autohet_cli.cluster.yamlform import cluster_from_dict
from autohet_cli.yamlio import load_yaml, read_text


def load_cluster(path: str | Path) -> Cluster:
    """Load a cluster file; a file whose lines look like ``host slots=N`` is a hostfile."""
    p = Path(path)
    if p.suffix not in (".yaml", ".yml", ".json"):
        text = read_text(p)
        if looks_like_hostfile(text):
            return parse_hostfile(text, str(p), name=p.stem)
    cluster = cluster_from_dict(load_yaml(p), str(p))
    kh = cluster.known_hosts
    if kh is not None and not kh.startswith("~") and not Path(kh).is_absolute():
        # Relative to the cluster file, as a path written in a file is read.
        cluster = dataclasses.replace(cluster, known_hosts=str(p.resolve().parent / kh))
    return cluster
