"""``mem_gb: 1e-9``: YAML 1.1 (PyYAML) reads an exponent without a dot, or without a
sign, as text; the error says so and how to write the number (issue 45, item 7d)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autohet_cli.cluster import load_cluster
from autohet_cli.errors import ConfigError
from autohet_cli.yamlio import coerce, parse_yaml, yaml_number_hint

CLUSTER = """\
schema: autohet.cluster/v1
name: tiny
network: {{inter_node_gbps: 10}}
gpu_types:
  T1: {{mem_gb: 16, peak_tflops: {peak}, mem_bandwidth_gbytes_s: 900}}
hosts:
  - name: a
    address: 10.0.0.1
    gpus: {{type: T1, count: {count}, mem_gb: {mem}}}
"""


def _cluster(tmp_path: Path, *, mem: str = "8", peak: str = "100", count: str = "2") -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(CLUSTER.format(mem=mem, peak=peak, count=count))
    return path


@pytest.mark.parametrize(
    ("text", "written"),
    [
        ("1e-9", "1.0e-9"),
        ("1.0e9", "1.0e+9"),
        ("-2E3", "-2.0E+3"),
        ("+5e+2", "+5.0e+2"),
        (".5e3", ".5e+3"),
    ],
)
def test_each_exponent_form_yaml_reads_as_text_gets_its_yaml_spelling(
    text: str, written: str
) -> None:
    assert isinstance(parse_yaml(f"x: {text}", "t")["x"], str)  # the trap itself
    assert isinstance(parse_yaml(f"x: {written}", "t")["x"], float)  # and the way out
    assert yaml_number_hint(text, float) == f"; YAML reads {text} as text; write {written}"


def test_other_text_gets_no_hint() -> None:
    for value in ("fast", "1e", "e5", "1.5", "0x10", 7, None):
        assert yaml_number_hint(value, float) == ""


def test_a_cluster_mem_gb_in_exponent_form_says_how_to_write_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_cluster(_cluster(tmp_path, mem="1e-9"))
    message = str(caught.value)
    assert "gpus.mem_gb" in message and "expected a number, got '1e-9'" in message
    assert message.endswith("YAML reads 1e-9 as text; write 1.0e-9")


def test_every_number_field_gets_the_hint(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"peak_tflops.*YAML reads 1e2 as text; write 1\.0e\+2"):
        load_cluster(_cluster(tmp_path, peak="1e2"))
    with pytest.raises(ConfigError, match=r"count.*YAML reads 1e1 as text; write 10$"):
        load_cluster(_cluster(tmp_path, count="1e1"))


def test_an_integer_field_hint_writes_the_integer() -> None:
    with pytest.raises(ConfigError, match=r"x: expected an integer, got '1e3'; .* write 1000$"):
        coerce("1e3", int, "x")
    with pytest.raises(ConfigError) as caught:
        coerce("1.5e0", int, "x")  # no integer to suggest
    assert "YAML reads" not in str(caught.value)


def test_a_quoted_number_in_yamls_own_spelling_is_told_to_lose_its_quotes() -> None:
    value = parse_yaml('x: "1.0e+9"', "t")["x"]
    with pytest.raises(ConfigError, match=r"got '1\.0e\+9'; write 1\.0e\+9 without quotes$"):
        coerce(value, float, "x")
