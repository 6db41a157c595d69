"""A fresh clone, with nothing beside it, must pass its own tests and benchmarks.

Data that tests and benchmarks read lives inside the repository (Sailor's
measurements under tests/data/sailor); nothing reaches outside the checkout,
neither by a path to the folder kept beside the repository for the developers
(named in ``SIBLING`` below) nor by climbing ``Path(__file__).parents`` past the
repository root.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

THIS = Path(__file__).resolve()
ROOT = THIS.parents[2]
SCANNED = ("tests", "benchmarks", ".ci", "Makefile")
# The sibling folder's name is spelled in two pieces so that this guard, which must
# name it, is not itself a line that reaches for it.
SIBLING = "sha" + "red"
_S = re.escape(SIBLING)
OUTSIDE = re.compile(rf"\.\./{_S}|/{_S}/data|[\"']{_S}[\"']\s*/\s*[\"']data[\"']|/work/{_S}")
PARENTS = re.compile(r"parents\[(\d+)\]")


def _scanned_files() -> list[Path]:
    files: list[Path] = []
    for name in SCANNED:
        top = ROOT / name
        candidates = [top] if top.is_file() else sorted(top.rglob("*"))
        files += [
            p for p in candidates if p.is_file() and "__pycache__" not in p.parts and p != THIS
        ]
    return files


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return ""


def test_the_scan_sees_the_files_that_used_to_reach_outside() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in _scanned_files()}
    assert {"tests/unit/test_sailor_import.py", "tests/unit/test_cli_profile.py"} <= names
    assert {"Makefile", ".ci/run"} <= names
    assert any(n.startswith("benchmarks/") for n in names)


def test_no_test_benchmark_or_ci_file_reads_outside_the_repository() -> None:
    offenders = []
    for path in _scanned_files():
        rel = path.relative_to(ROOT)
        for lineno, line in enumerate(_text(path).splitlines(), start=1):
            if OUTSIDE.search(line):
                offenders.append(f"{rel}:{lineno}: {line.strip()}")
            for m in PARENTS.finditer(line):
                # Path(__file__).parents[k] of a file k+1 levels deep is outside the clone.
                if path.suffix == ".py" and int(m.group(1)) >= len(rel.parts):
                    offenders.append(f"{rel}:{lineno}: climbs above the repository: {line.strip()}")
    assert not offenders, "files reaching outside the checkout:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    "line", [f'X = ROOT.parent / "{SIBLING}" / "data"', f"cat ../{SIBLING}/x", f"/work/{SIBLING}/d"]
)
def test_the_guard_catches_both_spellings(line: str) -> None:
    assert OUTSIDE.search(line)


def test_sailor_data_ships_with_its_licence_and_provenance() -> None:
    sailor = ROOT / "tests" / "data" / "sailor"
    assert "MIT License" in (sailor / "LICENSE").read_text(encoding="utf-8")
    readme = (sailor / "README.md").read_text(encoding="utf-8")
    assert "eth-easl/sailor" in readme and "ETH Z" in readme and "unchanged" in readme
    assert (sailor / "llm_info.json").is_file()
    assert len(list((sailor / "profiles").glob("*/*/profile.json"))) == 17
