"""Issue 30: where each host's second copy goes (pure)."""

from __future__ import annotations

import pytest

from autohet_cli.peer.placement import PeerHost, parse_budget, place_replicas

GB = 10**9


def _h(name: str, machine: str, domain: str, shard: float, room: float = 100) -> PeerHost:
    return PeerHost(
        name=name,
        machine=machine,
        domain=domain,
        shard_bytes=int(shard * GB),
        room_bytes=int(room * GB),
    )


def test_partners_are_other_machines_and_other_domains_first() -> None:
    hosts = [
        _h("a100-1", "10.0.0.1", "A100/spot", 4),
        _h("a100-2", "10.0.0.2", "A100/spot", 4),
        _h("v100-1", "10.0.0.3", "V100/on-demand", 2),
        _h("v100-2", "10.0.0.4", "V100/on-demand", 2),
    ]
    p = place_replicas(hosts, 1)
    # a spot wave takes both A100s: their copies live on the V100s, and vice versa
    assert {p.partners["a100-1"][0], p.partners["a100-2"][0]} == {"v100-1", "v100-2"}
    assert {p.partners["v100-1"][0], p.partners["v100-2"][0]} == {"a100-1", "a100-2"}
    assert not p.short
    assert set(p.keeps("v100-1")) <= {"a100-1", "a100-2"}


def test_two_entries_on_one_machine_never_partner_each_other() -> None:
    hosts = [_h("x0", "m1", "d", 1), _h("x1", "m1", "d", 1), _h("y", "m2", "d", 1)]
    p = place_replicas(hosts, 1)
    assert p.partners["x0"] == ("y",) and p.partners["x1"] == ("y",)
    assert p.partners["y"][0] in ("x0", "x1")
    only = place_replicas([_h("x0", "m1", "d", 1), _h("x1", "m1", "d", 1)], 1)
    assert only.partners == {"x0": (), "x1": ()}
    assert "no other machine" in only.short["x0"]
    assert place_replicas([_h("solo", "m", "d", 1)], 1).short == {}  # nobody to recover on


def test_budget_is_respected_and_shortfalls_are_named() -> None:
    hosts = [
        _h("big", "m1", "d", 10, room=1),
        _h("small1", "m2", "d", 1, room=11),
        _h("small2", "m3", "d", 1, room=0.5),
    ]
    p = place_replicas(hosts, 1)
    used = {h.name: 0 for h in hosts}
    sizes = {h.name: h.shard_bytes for h in hosts}
    for owner, ps in p.partners.items():
        for partner in ps:
            used[partner] += sizes[owner]
    rooms = {h.name: h.room_bytes for h in hosts}
    assert all(used[n] <= rooms[n] for n in used)  # never beyond a host's room
    assert p.partners["big"] == ("small1",)  # the only one with room for 10 GB
    assert p.partners["small1"] == ("big",)
    # big's 1 GB of room went to small1's shard; small1 has 1 GB left for small2's
    assert p.partners["small2"] == ("small1",)
    tight = place_replicas([_h("a", "m1", "d", 5, room=1), _h("b", "m2", "d", 5, room=1)], 1)
    assert tight.partners == {"a": (), "b": ()}
    assert "no room for 5.00 GB within the replica budget" in tight.short["a"]


def test_two_replicas_spread_and_zero_is_off() -> None:
    hosts = [_h(f"h{i}", f"m{i}", "d", 1) for i in range(4)]
    p = place_replicas(hosts, 2)
    for name, ps in p.partners.items():
        assert len(ps) == 2 and name not in ps and len(set(ps)) == 2
    load = {h.name: len(p.keeps(h.name)) for h in hosts}
    assert max(load.values()) - min(load.values()) <= 1  # spread, not piled up
    assert place_replicas(hosts, 0).partners == {h.name: () for h in hosts}
    with pytest.raises(ValueError):
        place_replicas(hosts, -1)


def test_the_same_facts_give_the_same_placement_in_any_order() -> None:
    hosts = [_h(f"h{i}", f"m{i % 3}", f"d{i % 2}", i + 1) for i in range(6)]
    assert place_replicas(hosts, 1) == place_replicas(list(reversed(hosts)), 1)


@pytest.mark.parametrize(
    ("text", "value"),
    [("auto", None), ("0", 0), ("20GB", 20 * GB), ("1.5 GB", 1_500_000_000), ("512MiB", 512 << 20)],
)
def test_budget_sizes(text: str, value: int | None) -> None:
    assert parse_budget(text) == value


@pytest.mark.parametrize("text", ["", "-1GB", "lots", "5PB", "nan", "1e400GB"])
def test_bad_budget_sizes_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="replica budget"):
        parse_budget(text)
