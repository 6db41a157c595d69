"""The inventory: hosts, their GPUs, and the links between them (pure).

Read from an ``autohet.cluster/v1`` YAML file or a DeepSpeed-style hostfile
(``host slots=N``, plus our optional ``gpu=TYPE``). Validation errors name the
file, the field and the fix, because a cluster file is hand-written. A YAML file
may define GPU types the catalog lacks (``gpu_types:``, see gputypes.py); a
hostfile cannot, and its error prints the YAML to write instead.

One name to import from; the parts, by responsibility: ``schema`` (the types),
``yamlform`` (the YAML form, both ways), ``hostfile`` (hostfiles), ``files``
(either, from disk).
"""

from __future__ import annotations

from autohet_cli.cluster.files import load_cluster
from autohet_cli.cluster.hostfile import parse_hostfile
from autohet_cli.cluster.schema import (
    DEFAULT_CHECKPOINT_DIR,
    LOCAL_ADDRESSES,
    SCHEMA,
    Cluster,
    Host,
    python_for,
)
from autohet_cli.cluster.yamlform import PREEMPTION_KEY, cluster_from_dict, cluster_to_dict

__all__ = [
    "DEFAULT_CHECKPOINT_DIR",
    "LOCAL_ADDRESSES",
    "PREEMPTION_KEY",
    "SCHEMA",
    "Cluster",
    "Host",
    "cluster_from_dict",
    "cluster_to_dict",
    "load_cluster",
    "parse_hostfile",
    "python_for",
]
