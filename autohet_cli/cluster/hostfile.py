"""DeepSpeed-style hostfiles as clusters: ``host slots=N [gpu=TYPE]`` per line (pure).

A hostfile cannot define GPU types the catalog lacks; its error prints the
equivalent cluster YAML to write instead.
"""

from __future__ import annotations

from typing import Any

from autohet_cli import catalog
from autohet_cli.cluster.schema import SCHEMA, Cluster
from autohet_cli.cluster.yamlform import host_from_dict
from autohet_cli.errors import ConfigError, UnknownNameError


def looks_like_hostfile(text: str) -> bool:
    """Every line that is not a comment says ``slots=`` and no YAML ``:``."""
    lines = [ln.split("#")[0].strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln]
    return bool(lines) and all("slots=" in ln and ":" not in ln for ln in lines)


def parse_hostfile(text: str, where: str, *, name: str = "hostfile") -> Cluster:
    """DeepSpeed hostfile: ``host slots=N [gpu=TYPE]`` per line; ``#`` comments.

    Plain DeepSpeed hostfiles carry no GPU type; we read it from ``gpu=`` and
    otherwise ask for it, since planning on a guessed type would be wrong. A
    type outside the catalog needs figures a hostfile has no place for, so the
    error prints the equivalent cluster YAML with a ``gpu_types:`` entry to fill.
    """
    rows: list[tuple[str, dict[str, Any]]] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#")[0].strip()
        if not line:
            continue
        at = f"{where}:{lineno}"
        address, *tokens = line.split()
        if address in seen:
            raise ConfigError(f"{at}: host {address!r} already listed on line {seen[address]}")
        seen[address] = lineno
        opts: dict[str, str] = {}
        for tok in tokens:
            key, sep, value = tok.partition("=")
            if not sep or key not in ("slots", "gpu"):
                raise ConfigError(f"{at}: cannot read {tok!r}; expected 'slots=N' or 'gpu=TYPE'")
            opts[key] = value
        if "gpu" not in opts:
            raise ConfigError(
                f"{at}: no GPU type for {address!r}; append 'gpu=A100-40' (or the right type) "
                "to the line, or write an autohet.cluster/v1 YAML file"
            )
        try:
            slots = int(opts.get("slots", ""))
        except ValueError:
            raise ConfigError(f"{at}: slots must be a whole number, e.g. slots=8") from None
        rows.append((at, {"name": address, "gpus": {"type": opts["gpu"], "count": slots}}))
    if not rows:
        raise ConfigError(f"{where}: no hosts in hostfile")
    unknown = [h["gpus"]["type"] for _, h in rows if not _is_known(h["gpus"]["type"])]
    if unknown:
        at = next(at for at, h in rows if h["gpus"]["type"] == unknown[0])
        raise ConfigError(
            f"{at}: {catalog.unknown_gpu_message(unknown[0])}.\nA hostfile cannot define GPU "
            f"types: save this as {name}.yaml, fill in the datasheet figures, and pass that "
            f"file instead:\n{_hostfile_as_yaml(name, [h for _, h in rows], unknown)}"
        )
    hosts = tuple(host_from_dict({**h, "address": h["name"]}, {}, {}, at) for at, h in rows)
    return Cluster(name=name, hosts=hosts, inter_node_gbps=100.0)


def _is_known(raw: str) -> bool:
    try:
        catalog.canonical_gpu_name(raw)
    except UnknownNameError:
        return False
    return True


def _hostfile_as_yaml(name: str, hosts: list[dict[str, Any]], unknown: list[str]) -> str:
    lines = [f"schema: {SCHEMA}", f"name: {name}", "gpu_types:"]
    lines += [
        f"  {t}: {{mem_gb: TODO, peak_tflops: {{bf16: TODO, fp32: TODO}}, "
        "mem_bandwidth_gbytes_s: TODO}"
        for t in dict.fromkeys(unknown)
    ]
    lines.append("hosts:")
    for h in hosts:
        gpus = h["gpus"]
        lines.append(
            f"  - {{name: {h['name']}, gpus: {{type: {gpus['type']}, count: {gpus['count']}}}}}"
        )
    return "\n".join(lines)
