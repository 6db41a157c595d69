"""Which hosts keep a second copy of each host's checkpoint shards (pure).

Preemptions come in waves: a spot market reclaims one instance type in one zone at
a time, so a copy on a host of the same GPU type and pool is likely to vanish with
the original. A partner is therefore chosen, in order of preference, from

1. another machine (a host entry at another address: two entries on one machine
   share its fate, and a directory they share holds one copy, not two),
2. another failure domain (``domain``: GPU type and spot or on-demand, as the
   launcher describes the host),
3. the partner that keeps the fewest bytes for others so far (then the most room
   left), so the copies spread over the hosts instead of piling onto one,

and never beyond a host's room (``room_bytes``: its ``--replica-budget`` and what
its disk has free, less a reserve). Hosts are placed largest first, so the big
shards get the roomiest partners. A host that gets fewer partners than asked (no
other machine, or no room) is listed in :attr:`Placement.short` with the reason,
for the warning. Deterministic: every rank computes the same placement from the
same gathered facts, without another collective.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autohet_cli.limits import size_text

# The launcher tells each worker where its host is and which failure domain it is in
# (launch.specs sets them; peer.replicate reads them). Here, in the pure module, so
# the launcher can name them without importing the torch side.
ADDR_ENV = "AUTOHET_HOST_ADDR"  # the host's cluster address
DOMAIN_ENV = "AUTOHET_FAILURE_DOMAIN"  # "<gpu type>/<spot|on-demand>"

MAX_REPLICAS = 8  # copies beyond a few only cost disk and bandwidth


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerHost:
    """What placement knows of one host of the plan."""

    name: str
    machine: str  # its address (two host entries on one machine share it)
    domain: str  # failure domain, e.g. "A100/spot"
    shard_bytes: int  # its own shards in this save
    room_bytes: int  # the most it may keep for others in this save


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    partners: Mapping[str, tuple[str, ...]]  # host -> hosts keeping a copy of its shards
    short: Mapping[str, str]  # host -> why it has fewer partners than asked

    def keeps(self, host: str) -> tuple[str, ...]:
        """The hosts whose shards ``host`` keeps a copy of."""
        return tuple(h for h, ps in self.partners.items() if host in ps)


def place_replicas(hosts: Sequence[PeerHost], replicas: int) -> Placement:
    """Up to ``replicas`` partners per host (see the module doc)."""
    if replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {replicas}")
    names = [h.name for h in hosts]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate host names in {names}")
    left = {h.name: max(0, h.room_bytes) for h in hosts}
    kept = dict.fromkeys(left, 0)
    partners: dict[str, tuple[str, ...]] = {}
    short: dict[str, str] = {}
    if replicas == 0:
        return Placement(partners={h.name: () for h in hosts}, short={})
    ring = {n: i for i, n in enumerate(sorted(names))}
    for h in sorted(hosts, key=lambda x: (-x.shard_bytes, x.name)):
        others = [o for o in hosts if o.machine != h.machine]
        if not others:
            partners[h.name] = ()
            if len(hosts) > 1:  # one host alone has no survivor to recover on anyway
                short[h.name] = "no other machine in the plan to keep a copy"
            continue
        fits = [o for o in others if left[o.name] >= h.shard_bytes]
        # Ties go round the ring of names (the next host after h first), which spreads
        # equal shards evenly instead of onto the first names.
        fits.sort(
            key=lambda o: (
                o.domain == h.domain,
                kept[o.name],
                -left[o.name],
                (ring[o.name] - ring[h.name]) % len(ring),
            )
        )
        chosen = tuple(o.name for o in fits[:replicas])
        for name in chosen:
            left[name] -= h.shard_bytes
            kept[name] += h.shard_bytes
        partners[h.name] = chosen
        if len(chosen) < replicas:
            full = [o.name for o in others if o not in fits]
            why = (
                f"{', '.join(full)} {'has' if len(full) == 1 else 'have'} no room for "
                f"{size_text(h.shard_bytes)} within the replica budget"
                if full
                else f"only {len(others)} other machine(s)"
            )
            short[h.name] = why
    return Placement(partners={n: partners[n] for n in names}, short=short)


def shard_bytes_by_host(files: Sequence[Mapping[str, object]]) -> dict[str, int]:
    """Bytes of each host's files in a save's manifest entries (``host``, ``bytes``)."""
    out: dict[str, int] = {}
    for f in files:
        host = str(f["host"])
        out[host] = out.get(host, 0) + int(str(f["bytes"]))
    return out


_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_budget(text: str) -> int | None:
    """``--replica-budget``: ``auto`` (None: what the disk has free, less a reserve),
    bytes, or a number with KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB."""
    raw = str(text).strip()
    if raw.lower() == "auto":
        return None
    num = raw.rstrip("bBkKmMgGtTiI ")
    unit = raw[len(num) :].strip().upper()
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not value >= 0 or value * _UNITS[unit] >= 2**62:
        raise ValueError(
            f"replica budget {raw!r}: expected 'auto', bytes, or a size such as 20GB or 512MiB"
        )
    return int(value * _UNITS[unit])
