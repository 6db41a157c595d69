"""Put the new plan's stages on the survivors that already hold their files (pure).

The planner sees GPUs, not checkpoints: after losing a host it may put the first
layers on the survivor that holds the last ones, so both survivors copy most of the
checkpoint to each other, while swapping the two hosts (alike to the cost model)
would leave most of it in place. Partner copies (``--replicas``) make this matter
more: the lost host's files sit on its partner, which is the host that should take
its layers.

So, after solving, hosts that the cost model cannot tell apart (same GPU type and
count, memory, links inside the host, pool and price) are permuted to minimise the
bytes to move: a host's cost for a role (the layers some host of the plan holds) is
the size of the files that role needs (``transfer.needed_files``, the same rule the
transfer uses) which the host does not list. Pairwise swaps until none helps: the
problem is an assignment per class of alike hosts, and swaps find its optimum on the
small classes recovery sees (and a good one on large classes) in milliseconds,
without a solver. The permuted plan is re-evaluated and kept only if its predicted
iteration time is unchanged (links between pairs of hosts may differ).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from itertools import combinations
from typing import Any

from autohet_cli.cluster import Cluster, Host
from autohet_cli.plan import Device, Plan
from autohet_cli.recovery.manifest import Manifest
from autohet_cli.recovery.transfer import needed_files

MAX_SWEEPS = 20  # of pairwise swaps; each improves the bytes to move or ends the search
TIME_RTOL = 1e-9


@dataclass(frozen=True, slots=True, kw_only=True)
class Placed:
    plan: Plan
    bytes_before: int  # to move under the plan as solved
    bytes_after: int  # under the returned plan
    renamed: Mapping[str, str]  # host of the solved plan -> host it now runs on


def bytes_to_move(
    manifest: Manifest, plan: Plan, holders: Mapping[str, Collection[str]]
) -> dict[str, int]:
    """Per host of ``plan``: bytes of the files it needs that it does not list."""
    size = {f.path: f.num_bytes for f in manifest.files}
    return {
        host: sum(size[p] for p in files if host not in holders.get(p, ()))
        for host, files in needed_files(manifest, plan).items()
    }


def _alike(host: Host) -> tuple[Any, ...]:
    return (
        host.gpu_type,
        host.num_gpus,
        host.gpu_mem_bytes,
        host.intra_node_gbps,
        host.spot,
        host.price_per_hour,
    )


def rename_hosts(plan: Plan, mapping: Mapping[str, str]) -> Plan:
    """``plan`` with every host name (devices, contingency entries) mapped."""

    def dev(d: Device) -> Device:
        return Device(host=mapping.get(d.host, d.host), gpu=d.gpu)

    pipelines = tuple(
        replace(
            p,
            stages=tuple(replace(s, devices=tuple(dev(d) for d in s.devices)) for s in p.stages),
        )
        for p in plan.pipelines
    )
    return replace(
        plan,
        pipelines=pipelines,
        contingency={
            mapping.get(k, k): _rename_any(v, mapping) for k, v in plan.contingency.items()
        },
    )


def _rename_any(value: Any, mapping: Mapping[str, str]) -> Any:
    """Host names inside a contingency entry (``host`` fields, lists of hosts)."""
    if isinstance(value, Mapping):
        return {
            k: (
                mapping.get(v, v) if k == "host" and isinstance(v, str) else _rename_any(v, mapping)
            )
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_rename_any(v, mapping) for v in value]
    return value


def place_near_copies(
    plan: Plan,
    cluster: Cluster,
    manifest: Manifest,
    holders: Mapping[str, Collection[str]],
    time_s: Callable[[Plan], float],
) -> Placed:
    """``plan`` with alike hosts permuted so the fewest bytes move (module doc).
    ``holders``: file -> hosts listing it (survivors); ``time_s``: the cost model's
    iteration time of a plan on ``cluster``."""
    size = {f.path: f.num_bytes for f in manifest.files}
    needs = {h: frozenset(fs) for h, fs in needed_files(manifest, plan).items()}
    held: dict[str, set[str]] = {}
    for path, hosts in holders.items():
        for h in hosts:
            held.setdefault(h, set()).add(path)

    def cost(host: str, role: str | None) -> int:
        if role is None:  # an idle host moves nothing
            return 0
        have = held.get(host, set())
        return sum(size[p] for p in needs[role] if p not in have)

    used = set(needs)
    classes: dict[tuple[Any, ...], list[str]] = {}
    for entry in cluster.hosts:
        classes.setdefault(_alike(entry), []).append(entry.name)
    # ident[h]: the plan host whose place h takes (itself at first). Swapping places,
    # not only roles, keeps a whole permutation: an idle host that takes a role
    # leaves its own name (in contingency entries) to the host it freed.
    ident = {h.name: h.name for h in cluster.hosts}

    def role(h: str) -> str | None:  # the plan host whose layers h runs (None: idle)
        return ident[h] if ident[h] in used else None

    before = sum(cost(h, role(h)) for h in ident)
    for members in classes.values():
        if len(members) < 2 or not any(role(m) for m in members):
            continue
        for _ in range(MAX_SWEEPS):
            improved = False
            for a, b in combinations(members, 2):
                if role(a) == role(b):
                    continue
                gain = cost(a, role(a)) + cost(b, role(b)) - cost(a, role(b)) - cost(b, role(a))
                if gain > 0:
                    ident[a], ident[b] = ident[b], ident[a]
                    improved = True
            if not improved:
                break
    mapping = {r: h for h, r in ident.items() if r != h}
    after = sum(cost(h, role(h)) for h in ident)
    if not mapping:
        return Placed(plan=plan, bytes_before=before, bytes_after=before, renamed={})
    moved = rename_hosts(plan, mapping)
    if time_s(moved) > time_s(plan) * (1 + TIME_RTOL):
        return Placed(plan=plan, bytes_before=before, bytes_after=before, renamed={})
    return Placed(plan=moved, bytes_before=before, bytes_after=after, renamed=mapping)
