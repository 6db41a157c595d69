"""GPU types a cluster file defines beside the catalog (pure).

The catalog knows common datacenter and consumer cards; a real fleet often has
one it does not (RTX A6000, L20, MI250). A cluster file names such a type once,
with its datasheet figures, and hosts then use it like a catalog type::

    gpu_types:
      A6000:
        mem_gb: 48                      # GiB of device memory
        peak_tflops: {bf16: 154.8, fp16: 154.8, fp32: 38.7}   # dense; or one number
        mem_bandwidth_gbytes_s: 768
        intra_node_gbps: 256            # optional, per direction; default PCIe 4.0 x16
    hosts:
      - {name: ws-0, gpus: {type: A6000, count: 4}}

The figures feed the analytic profile (and memory limits) until ``autohet
profile run`` measures the card; measured numbers then win, as for any type.

A name the catalog already knows, in any spelling (``A100-40``, ``a100_40g``),
is refused rather than overriding the catalog: profiles and plans key every
measurement by type name, so one name must mean one card everywhere (Sailor's
A100-40 measurements must not be read as some other card's). A card that
differs from its catalog entry gets its own name (``A100-lab``), or keeps the
catalog name with per-host ``gpus.mem_gb`` / ``intra_node_gbps`` adjustments.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from autohet_cli import catalog
from autohet_cli.catalog import GpuSpec
from autohet_cli.errors import ConfigError, UnknownNameError
from autohet_cli.settings import PRECISIONS
from autohet_cli.yamlio import as_mapping, check_keys, coerce
from autohet_cli.yamlio import field as get

_REQUIRED = ("mem_gb", "peak_tflops", "mem_bandwidth_gbytes_s")
_OPTIONAL = ("intra_node_gbps", "description")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
PCIE4_GBPS = 256.0  # PCIe 4.0 x16 per direction: what a card without NVLink talks over


def parse_gpu_types(raw: Any, where: str) -> dict[str, GpuSpec]:
    """The ``gpu_types:`` section of a cluster file, every field checked."""
    section = as_mapping(raw or {}, f"{where}: gpu_types")
    return {
        str(name): _gpu_type(str(name), body, f"{where}: gpu_types.{name}")
        for name, body in section.items()
    }


def _gpu_type(name: str, body: Any, at: str) -> GpuSpec:
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"{at}: a type name is letters, digits and . _ + - (no spaces), e.g. A6000 or L20"
        )
    try:
        known = catalog.canonical_gpu_name(name)
    except UnknownNameError:
        known = None
    if known is not None:
        raise ConfigError(
            f"{at}: {name!r} is the catalog's {known}; a defined type cannot replace a catalog "
            f"type (profiles and plans key measurements by name). Use {known} as it is, give "
            f"hosts gpus.mem_gb or intra_node_gbps to adjust it, or pick another name such as "
            f"{name}-custom"
        )
    d = as_mapping(body, at)
    check_keys(d, at, _REQUIRED, _OPTIONAL)
    mem_gb = _positive(get(d, "mem_gb", float, at), f"{at}.mem_gb")
    by_precision = _peaks(d["peak_tflops"], f"{at}.peak_tflops")
    bandwidth = _positive(
        get(d, "mem_bandwidth_gbytes_s", float, at), f"{at}.mem_bandwidth_gbytes_s"
    )
    intra = _positive(get(d, "intra_node_gbps", float, at, PCIE4_GBPS), f"{at}.intra_node_gbps")
    return GpuSpec(
        name=name,
        mem_bytes=int(mem_gb * catalog.GIB),
        peak_tflops=max(v for _, v in by_precision),
        mem_bandwidth_gbytes_s=bandwidth,
        intra_node_gbps=intra,
        pcie_gbps=min(intra, PCIE4_GBPS),
        nvlink=False,
        description=get(d, "description", str, at, f"defined in the cluster file ({name})"),
        peak_tflops_by_precision=by_precision,
    )


def _peaks(raw: Any, at: str) -> tuple[tuple[str, float], ...]:
    """One number (every precision) or a mapping precision -> dense TFLOP/s."""
    if not isinstance(raw, Mapping):
        value = _positive(coerce(raw, float, at), at)
        return tuple((p, value) for p in PRECISIONS)
    d = as_mapping(raw, at)
    if not d:
        raise ConfigError(f"{at}: give at least one of {', '.join(PRECISIONS)}, e.g. {{bf16: 150}}")
    check_keys(d, at, [], PRECISIONS)
    return tuple((p, _positive(coerce(d[p], float, f"{at}.{p}"), f"{at}.{p}")) for p in d)


def _positive(value: float, at: str) -> float:
    if not value > 0:
        raise ConfigError(f"{at}: must be positive, got {value}")
    return value


def resolve_gpu_type(raw: str, defined: Mapping[str, GpuSpec]) -> str:
    """A host's ``gpus.type``: a defined name (in any case), else a catalog spelling."""
    for name in defined:
        if name.lower() == raw.lower():
            return name
    try:
        return catalog.canonical_gpu_name(raw)
    except UnknownNameError:
        raise UnknownNameError(catalog.unknown_gpu_message(raw, defined)) from None


def spec_of(name: str, defined: Mapping[str, GpuSpec]) -> GpuSpec:
    """The figures of a resolved type name: the cluster's definition, else the catalog."""
    found = defined.get(name) or catalog.CATALOG.get(name)
    if found is None:
        raise UnknownNameError(catalog.unknown_gpu_message(name, defined))
    return found


def gpu_types_to_dict(defined: Mapping[str, GpuSpec]) -> dict[str, Any]:
    """The ``gpu_types:`` section that ``parse_gpu_types`` reads back unchanged."""
    return {
        name: {
            "mem_gb": s.mem_bytes / catalog.GIB,
            "peak_tflops": dict(s.peak_tflops_by_precision),
            "mem_bandwidth_gbytes_s": s.mem_bandwidth_gbytes_s,
            "intra_node_gbps": s.intra_node_gbps,
            "description": s.description,
        }
        for name, s in defined.items()
    }
