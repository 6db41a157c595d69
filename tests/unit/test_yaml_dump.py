"""``yamlio.dump_yaml`` emits through libyaml where PyYAML has it (issue 32: 4x faster
on a 256-GPU plan). Plans are immutable artifacts people diff: on every file we ship
and on a planned plan its text is exactly what Python's emitter wrote before. Where
the two emitters fold differently (double-quoted scalars over the width with non-ASCII
characters or tabs, keys over 125 characters: review) the text loads back the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from autohet_cli import yamlio
from autohet_cli.yamlio import dump_yaml
from tests.cli import ROOT


class _PythonNoAlias(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def _python_dump(data: Any) -> str:
    return yaml.dump(
        data, Dumper=_PythonNoAlias, sort_keys=False, default_flow_style=None, width=100
    )


SHIPPED = sorted(
    p for folder in ("profiles", "autohet_cli/data") for p in (ROOT / folder).rglob("*.yaml")
)
TRICKY: dict[str, Any] = {
    "name": "mix-64-OPT-350M",
    "unicode": "Grafikkarte ä – 東京 🚀",
    "long": "word " * 60,
    "multiline": "first line\nsecond line\n",
    "quotes": 'it\'s "quoted": yes # not a comment',
    "looks_like": ["yes", "no", "on", "null", "1e3", "0x1f", "007", "", " lead", "trail "],
    "numbers": [0, -1, 2**63, 1.5, 1e-9, 1e300, float("inf"), float("-inf")],
    "nested": {"a": [{"b": None, "c": True}], "empty_list": [], "empty_map": {}},
    "path": "~/ckpt/../runs/job 1/step-000010",
    "control": "tab\there, bell\x07",
}


def test_libyaml_is_used_where_it_exists() -> None:
    if not hasattr(yaml, "CSafeDumper"):
        pytest.skip("this PyYAML was built without libyaml: the Python emitter is used")
    assert issubclass(yamlio._NoAlias, yaml.CSafeDumper)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_file_dumps_as_python_wrote_it(path: Path) -> None:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert dump_yaml(data) == _python_dump(data)


def test_a_plan_dumps_as_python_wrote_it() -> None:
    from autohet_cli.inputs import load_inputs
    from autohet_cli.plan import plan_to_dict
    from autohet_cli.planner.api import training_for
    from tests.planning import plan_inputs

    inputs = load_inputs(str(ROOT / "profiles" / "clusters" / "paper-mix.yaml"), "gpt-tiny", [])
    training = training_for(16, 64, "fp32", "adam")
    out = plan_inputs(inputs, training, name="dump", time_limit_s=10.0, contingency=True)
    data = plan_to_dict(out.plan)
    assert dump_yaml(data) == _python_dump(data)


def test_tricky_values_dump_as_python_wrote_them_and_round_trip() -> None:
    text = dump_yaml(TRICKY)
    assert text == _python_dump(TRICKY)
    assert yaml.safe_load(text) == TRICKY


FOLDED: dict[str, Any] = {
    "inputs": "/home/José Pérez/experiments 2024/clusters and plans/on-prem and cloud mix.yaml",
    "tabs": "a\tb " * 40,
    "h" * 127: "a host name as a contingency key",
}


@pytest.mark.parametrize("key", list(FOLDED), ids=["non-ascii", "tabs", "long-key"])
def test_what_the_emitters_fold_differently_loads_back_the_same(key: str) -> None:
    data = {key: FOLDED[key], "after": [1, 2]}
    assert yaml.safe_load(dump_yaml(data)) == data


def test_shared_objects_are_written_out_not_aliased() -> None:
    shared = {"gpu": "A100-40"}
    text = dump_yaml({"a": shared, "b": shared})
    assert "&" not in text and "*" not in text
    assert text == _python_dump({"a": shared, "b": shared})
