"""``--model-fn``/``--data-fn`` name a module or a file (``FILE.py:function``): a user's
own file loads without a package or PYTHONPATH, and its sibling modules import."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autohet_cli import fnspec
from autohet_cli.errors import ConfigError
from autohet_cli.runtime.data_api import load_data_fn
from autohet_cli.runtime.model_api import load_model_fn


def test_a_file_spec_loads_its_function_and_its_siblings_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # the file's folder goes first
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "helper_for_fnspec.py").write_text("VALUE = 41\n")
    (lib / "mine.py").write_text(
        "from dataclasses import dataclass\n"
        "import helper_for_fnspec\n"
        "@dataclass\nclass Box:\n    n: int\n"
        "def build(request):\n    return Box(helper_for_fnspec.VALUE + 1)\n"
    )
    spec = f"{lib / 'mine.py'}:build"
    try:
        assert load_data_fn(spec)(None).n == 42  # type: ignore[arg-type]
        assert load_model_fn(spec) is load_data_fn(spec)  # one file, loaded once
        assert sys.path[0] == str(lib)
    finally:
        sys.modules.pop("autohet_user_mine", None)
        sys.modules.pop("helper_for_fnspec", None)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("pkg.mod:build", ("pkg.mod", "build")),
        ("/a/b/mine.py:build", ("/a/b/mine.py", "build")),
        ("no_colon", ("", "")),
    ],
)
def test_split(spec: str, expected: tuple[str, str]) -> None:
    assert fnspec.split(spec) == expected


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot import .*: no such file .*nope\.py"):
        load_data_fn(f"{tmp_path}/nope.py:build")
    with pytest.raises(ConfigError, match="is not a .py file"):
        load_data_fn(f"{tmp_path}/dir/mod:build")
    assert fnspec.is_file("m.py") and fnspec.is_file("a/m") and not fnspec.is_file("a.m")
