"""ZeRO-1's slicing of a flat bucket (pure) and the plan field that asks for it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autohet_cli.errors import ConfigError
from autohet_cli.plan import plan_from_dict, plan_to_dict
from autohet_cli.runtime.zero import pieces, slice_bounds
from tests.unit.test_plan_artifact import make_plan


def test_slices_by_hand() -> None:
    # 10 elements over 3 members: chunks of 4, the last one short.
    assert [slice_bounds([3, 7], 3, i) for i in range(3)] == [(4, 0, 4), (4, 4, 8), (4, 8, 10)]
    assert pieces([3, 7], 0, 4) == [(0, 0, 3), (1, 0, 1)]
    assert pieces([3, 7], 4, 8) == [(1, 1, 5)]
    # more members than elements: the last members hold nothing
    assert slice_bounds([2], 4, 3) == (1, 2, 2) and pieces([2], 2, 2) == []


@settings(deadline=None, max_examples=200, derandomize=True)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=6), st.integers(1, 7))
def test_slices_tile_every_parameter_exactly_once(numels: list[int], members: int) -> None:
    covered = [[0] * n for n in numels]
    for i in range(members):
        chunk, start, end = slice_bounds(numels, members, i)
        assert end - start <= chunk and chunk * members >= sum(numels)
        for j, lo, hi in pieces(numels, start, end):
            for x in range(lo, hi):
                covered[j][x] += 1
    assert all(c == 1 for row in covered for c in row)


def test_plan_field_round_trips_and_is_written_only_when_true() -> None:
    plan = make_plan()
    assert "zero1" not in plan_to_dict(plan)["training"]
    sharded = replace(plan, training=replace(plan.training, zero1=True))
    raw = plan_to_dict(sharded)
    assert raw["training"]["zero1"] is True
    assert plan_from_dict(raw, "p.yaml").training.zero1 is True
    raw["training"]["zero1"] = "yes"
    with pytest.raises(ConfigError, match=r"p.yaml: training.zero1"):
        plan_from_dict(raw, "p.yaml")
