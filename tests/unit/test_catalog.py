"""The GPU catalog: canonical names, coverage, and sanity of the datasheet figures."""

from __future__ import annotations

import re

import pytest

from autohet_cli.catalog import CATALOG, GIB, canonical_gpu_name, gpu_spec
from autohet_cli.errors import UnknownNameError

REQUIRED = (
    "V100-16",
    "V100-32",
    "A100-40",
    "A100-80",
    "A10G",
    "L4",
    "L40S",
    "T4",
    "RTX-3090",
    "RTX-4090",
    "H100-80",
    "H200-141",
    "GH-96",
    "cpu",
)


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("A100-40GB", "A100-40"),
        ("a100_40g", "A100-40"),
        ("NVIDIA A100-SXM4-40GB", "A100-40"),
        ("NVIDIA A100-SXM4-80GB", "A100-80"),
        ("NVIDIA A100 80GB PCIe", "A100-80"),
        ("Tesla V100-SXM2-32GB", "V100-32"),
        ("Tesla V100-SXM2-16GB", "V100-16"),
        ("Tesla V100-PCIE-16GB", "V100-16"),
        ("NVIDIA GeForce RTX 3090", "RTX-3090"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("NVIDIA H100 80GB HBM3", "H100-80"),
        ("GH200", "GH-96"),
        ("NVIDIA A10G", "A10G"),
        ("Tesla T4", "T4"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("h200", "H200-141"),
        ("CPU", "cpu"),
    ],
)
def test_spellings_map_to_canonical_names(raw: str, canonical: str) -> None:
    assert canonical_gpu_name(raw) == canonical
    assert gpu_spec(raw) is CATALOG[canonical]


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_canonical_names_are_fixed_points(name: str) -> None:
    assert canonical_gpu_name(name) == name
    assert CATALOG[name].name == name


@pytest.mark.parametrize("raw", ["A200-40", "RTX-9090", "MI300X", "", "gpu", "A100-48"])
def test_unknown_names_raise_listing_known_types(raw: str) -> None:
    with pytest.raises(UnknownNameError) as info:
        canonical_gpu_name(raw)
    msg = str(info.value)
    assert repr(raw) in msg and "known types:" in msg
    assert "A100-40" in msg and "cpu" in msg


def test_catalog_covers_required_types() -> None:
    missing = [name for name in REQUIRED if name not in CATALOG]
    assert not missing


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_figures_are_plausible(name: str) -> None:
    s = CATALOG[name]
    assert s.mem_bytes > 0 and s.peak_tflops > 0 and s.mem_bandwidth_gbytes_s > 0
    assert s.intra_node_gbps > 0 and s.pcie_gbps > 0
    assert 0 < s.matmul_efficiency <= 1
    assert 0 < s.runtime_reserve_bytes < s.mem_bytes
    if s.nvlink:
        assert s.intra_node_gbps > s.pcie_gbps
    else:
        assert s.intra_node_gbps == s.pcie_gbps


def test_generations_get_faster() -> None:
    for attr in ("peak_tflops", "mem_bandwidth_gbytes_s"):
        v100, a100, h100 = (getattr(CATALOG[n], attr) for n in ("V100-16", "A100-40", "H100-80"))
        assert v100 < a100 < h100, attr
    assert CATALOG["RTX-3090"].peak_tflops < CATALOG["RTX-4090"].peak_tflops
    assert CATALOG["T4"].peak_tflops < CATALOG["V100-16"].peak_tflops
    assert CATALOG["A100-80"].mem_bandwidth_gbytes_s > CATALOG["A100-40"].mem_bandwidth_gbytes_s
    assert CATALOG["H200-141"].mem_bandwidth_gbytes_s > CATALOG["H100-80"].mem_bandwidth_gbytes_s
    assert all(CATALOG["cpu"].peak_tflops < s.peak_tflops for n, s in CATALOG.items() if n != "cpu")


# RTX-3090 and the like end in a model number, not a memory size
SIZED = sorted(n for n in CATALOG if re.search(r"-\d+$", n) and not n.startswith("RTX-"))


def test_sized_names_cover_the_datacenter_cards() -> None:
    assert set(SIZED) == {
        "V100-16",
        "V100-32",
        "A100-40",
        "A100-80",
        "H100-80",
        "H200-141",
        "GH-96",
    }


@pytest.mark.parametrize("name", SIZED)
def test_memory_is_as_named(name: str) -> None:
    gb = int(name.rsplit("-", 1)[1])
    assert CATALOG[name].mem_bytes == gb * GIB


@pytest.mark.parametrize(
    ("name", "gb"),
    [("RTX-3090", 24), ("RTX-4090", 24), ("A10G", 24), ("L4", 24), ("L40S", 48), ("T4", 16)],
)
def test_memory_of_cards_without_size_in_name(name: str, gb: int) -> None:
    assert CATALOG[name].mem_bytes == gb * GIB


def test_nvlink_cards_beat_pcie_cards_inside_a_node() -> None:
    nvlink = [s.intra_node_gbps for s in CATALOG.values() if s.nvlink]
    pcie = [s.intra_node_gbps for n, s in CATALOG.items() if not s.nvlink and n != "cpu"]
    assert {n for n, s in CATALOG.items() if s.nvlink} >= {"V100-16", "A100-40", "H100-80"}
    assert not {n for n, s in CATALOG.items() if s.nvlink} & {"RTX-3090", "RTX-4090", "T4", "L4"}
    assert min(nvlink) > max(pcie)
    assert CATALOG["A100-40"].intra_node_gbps == 2400  # NVLink 3: 300 GB/s each way
