"""The shard transfer plan: which files each host of the new plan needs, and from where (pure).

What a host needs (``rule``)
    ``"layers"`` (the default when the manifest records what each data file
    holds): ``.metadata``, every data file holding ``shared`` entries (entries of
    no layer: ``step``, ``run``, ...; the writer saves them from rank 0 alone, so
    that is rank 0's file), and every data file whose recorded ``layers`` meet the
    layers the host's new ranks hold, closed over ``tied_layers`` (a host holding
    any layer of a tied group needs all of them: a tied parameter's optimizer
    state is filed under the group's first name, e.g. ``layers.0.wte.weight``, by
    whichever holder DCP picked, and a rank holding only the LM head loads it).
    Exact because the writer records, from the metadata DCP returns, which file
    each entry landed in; a loading rank reads only the files its entries are in.

    ``"all"``: every file of the manifest (every DCP data file and
    ``.metadata``). The fallback for a checkpoint whose manifest lacks that record
    (written before it existed); :func:`choose_rule` says why. Either way a file a
    loading rank still lacks is fetched from the remote copy by the loader.

    ``manifest.json`` and ``COMPLETE`` are not transferred: the executor writes the
    manifest it already read (same bytes) and then ``COMPLETE`` on every host listed
    in :attr:`TransferPlan.finalize_hosts`, after all that host's files arrived and
    verified.

Where each file comes from
    1. Already at the destination with the manifest's sha256: nothing to do (listed
       in ``in_place``). A copy with another hash is ignored and replaced.
    2. A surviving peer holding a verified copy: a host on the same machine (same
       address) first, then the peer that finishes it soonest given its link
       (``cluster.link_gbps``) and the bytes already assigned to that peer and to
       the destination (longest files first), which spreads load over the peers.
    3. Remote storage, only when no survivor holds a verified copy.
    Every item lists its fallbacks: the other holders (same machine, then fastest
    link) and remote storage last.

A host is never sent a file it does not need (``skipped``, with the bytes "all"
would have moved on top), and a file no host needs may be lost everywhere.

The plan is idempotent: rerun on the listings after a partial transfer, files
already in place produce no item. Predicted times model each source (and each
destination) as one pipe that moves its files one after another at the link's
bandwidth; remote storage is one pipe of ``remote_gbps``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from autohet_cli.cluster import Cluster
from autohet_cli.plan import Plan
from autohet_cli.recovery.errors import RecoveryError, StepLost
from autohet_cli.recovery.manifest import (
    COMPLETE,
    MANIFEST,
    METADATA,
    REMOTE,
    Manifest,
    ManifestFile,
    local_step_dir,
    remote_step_dir,
    step_dir_name,
)

NeedRule = Literal["all", "layers"]
SourceKind = Literal["local", "peer", "remote"]
DEFAULT_REMOTE_GBPS = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Source:
    kind: SourceKind  # local: another host entry on the same machine
    host: str | None  # None for remote storage
    path: str  # on the source host, or the remote URL
    gbps: float  # to the destination

    @property
    def name(self) -> str:
        return self.host if self.host is not None else REMOTE


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferItem:
    file: str
    dest_host: str
    dest_path: str
    source: Source
    num_bytes: int
    sha256: str
    predicted_s: float
    fallbacks: tuple[Source, ...] = ()

    @property
    def source_kind(self) -> SourceKind:
        return self.source.kind

    @property
    def source_host(self) -> str | None:
        return self.source.host


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferPlan:
    plan_name: str
    step: int
    rule: NeedRule
    needs: Mapping[str, tuple[str, ...]]  # new plan host -> files it needs
    items: tuple[TransferItem, ...]
    in_place: tuple[tuple[str, str], ...]  # (host, file) already verified at the host
    finalize_hosts: tuple[str, ...]  # hosts to write manifest.json then COMPLETE on
    rule_reason: str = ""  # why this rule (choose_rule)
    # (host, file) the host lacks but does not read under the rule, and their bytes:
    # what the "all" rule would have moved on top.
    skipped: tuple[tuple[str, str], ...] = ()
    bytes_skipped: int = 0
    predicted_s_by_source: Mapping[str, float] = field(default_factory=dict)
    predicted_s_by_dest: Mapping[str, float] = field(default_factory=dict)

    @property
    def step_dir(self) -> str:
        return step_dir_name(self.step)

    @property
    def bytes_from_peers(self) -> int:
        return sum(i.num_bytes for i in self.items if i.source.kind != "remote")

    @property
    def bytes_from_remote(self) -> int:
        return sum(i.num_bytes for i in self.items if i.source.kind == "remote")

    @property
    def predicted_time_s(self) -> float:
        """Busiest pipe, source or destination (sources run in parallel)."""
        return max([0.0, *self.predicted_s_by_source.values(), *self.predicted_s_by_dest.values()])

    def items_for(self, dest_host: str) -> list[TransferItem]:
        return [i for i in self.items if i.dest_host == dest_host]

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan_name,
            "step": self.step,
            "rule": self.rule,
            "rule_reason": self.rule_reason,
            "bytes_from_peers": self.bytes_from_peers,
            "bytes_from_remote": self.bytes_from_remote,
            "bytes_skipped": self.bytes_skipped,
            "predicted_time_s": round(self.predicted_time_s, 6),
            "predicted_s_by_source": {
                k: round(v, 6) for k, v in self.predicted_s_by_source.items()
            },
            "needs": {h: list(f) for h, f in self.needs.items()},
            "in_place": [{"host": h, "file": f} for h, f in self.in_place],
            "skipped": [{"host": h, "file": f} for h, f in self.skipped],
            "finalize_hosts": list(self.finalize_hosts),
            "items": [_item_dict(i) for i in self.items],
        }


def _item_dict(i: TransferItem) -> dict[str, Any]:
    def src(s: Source) -> dict[str, Any]:
        return {"kind": s.kind, "host": s.host, "path": s.path, "gbps": s.gbps}

    return {
        "file": i.file,
        "dest_host": i.dest_host,
        "dest_path": i.dest_path,
        "source": src(i.source),
        "bytes": i.num_bytes,
        "sha256": i.sha256,
        "predicted_s": round(i.predicted_s, 6),
        "fallbacks": [src(s) for s in i.fallbacks],
    }


# --------------------------------------------------------------------- needs


def choose_rule(manifest: Manifest, rule: NeedRule | None = None) -> tuple[NeedRule, str]:
    """The rule to use (``None``: "layers" when the manifest allows it, else "all") and
    why, for the report; an explicit "layers" the manifest cannot support is an error."""
    missing = manifest.layer_info_missing()
    if rule is None:
        if missing is None:
            return "layers", "the manifest records the layers of every data file"
        return "all", f"{missing} (written by an older autohet): every file is moved"
    if rule == "layers" and missing is not None:
        raise RecoveryError(f"the 'layers' transfer rule needs the layer record: {missing}")
    if rule not in ("all", "layers"):
        raise RecoveryError(f"unknown transfer rule {rule!r} (use 'all' or 'layers')")
    return rule, "asked for"


def needed_files(
    manifest: Manifest, new_plan: Plan, *, rule: NeedRule | None = None
) -> dict[str, tuple[str, ...]]:
    """Per host of ``new_plan``, the manifest files it needs (see the module doc;
    ``rule`` None: :func:`choose_rule`'s)."""
    rule, _ = choose_rule(manifest, rule)
    if rule == "all":
        every = tuple(f.path for f in manifest.files)
        return dict.fromkeys(new_plan.hosts(), every)
    out: dict[str, tuple[str, ...]] = {}
    for host in new_plan.hosts():
        wanted = host_layers(new_plan, host, manifest.tied_layers or ())
        out[host] = tuple(
            f.path
            for f in manifest.files
            if f.path == METADATA or f.shared or not wanted.isdisjoint(f.layers or ())
        )
    return out


def host_layers(plan: Plan, host: str, tied: Collection[Collection[int]]) -> frozenset[int]:
    """The layers ``host``'s ranks hold under ``plan``, with every layer of a tied
    group any of them holds (groups may chain, so until nothing changes)."""
    held = {
        i
        for p in plan.pipelines
        for s in p.stages
        if s.host == host
        for i in range(s.layer_start, s.layer_end)
    }
    grown = True
    while grown:
        grown = False
        for group in tied:
            if not held.isdisjoint(group) and not held.issuperset(group):
                held |= set(group)
                grown = True
    return frozenset(held)


# --------------------------------------------------------------------- sources


def plan_transfers(
    manifest: Manifest,
    new_plan: Plan,
    cluster: Cluster,
    present: Mapping[str, Mapping[str, str]],
    *,
    remote_root: str,
    remote_files: Collection[str] | None = None,
    lost: Collection[str] = (),
    rule: NeedRule | None = None,
    remote_gbps: float = DEFAULT_REMOTE_GBPS,
    namespace: str | None = None,
) -> TransferPlan:
    """Every file transfer that makes the new plan's hosts able to load ``manifest``.

    ``present`` maps each reachable host to the files in its step directory and
    their sha256 as computed on the host (``manifest.json``/``COMPLETE`` may map
    to anything). ``remote_files`` lists the remote copy's files (None: all of
    them, e.g. when its ``COMPLETE`` is there). Lost hosts are never sources.
    ``rule`` None picks one (:func:`choose_rule`). Raises RecoveryError naming the
    needed files whose every copy is gone.
    """
    if remote_gbps <= 0:
        raise RecoveryError(f"remote_gbps must be positive, got {remote_gbps}")
    # Where the step lives below a checkpoint or remote root: the job namespace
    # ``<plan>/<job>`` (``autohet_cli.ckpt.format``), or the plan name alone.
    plan_name = namespace or manifest.plan_name
    gone = set(lost)
    known = {h.name for h in cluster.hosts}
    missing_hosts = [h for h in new_plan.hosts() if h not in known]
    if missing_hosts:
        raise RecoveryError(f"the new plan uses hosts not in the cluster: {missing_hosts}")
    rule, why = choose_rule(manifest, rule)
    needs = needed_files(manifest, new_plan, rule=rule)
    by_path = {f.path: f for f in manifest.files}
    holders = {
        f.path: [
            h
            for h in present
            if h in known and h not in gone and present[h].get(f.path) == f.sha256
        ]
        for f in manifest.files
    }
    in_place: list[tuple[str, str]] = []
    todo: list[tuple[ManifestFile, str]] = []
    skipped: list[tuple[str, str]] = []  # what "all" would move that the host does not read
    for host, files in needs.items():
        wanted = set(files)
        for f in manifest.files:
            if host in holders[f.path]:
                if f.path in wanted:
                    in_place.append((host, f.path))
            elif f.path in wanted:
                todo.append((f, host))
            else:
                skipped.append((host, f.path))
    lost_files = sorted(
        {
            f.path
            for f, _ in todo
            if not holders[f.path] and remote_files is not None and f.path not in remote_files
        }
    )
    if lost_files:
        detail = ", ".join(f"{p} (written on {by_path[p].host})" for p in lost_files)
        raise StepLost(
            f"checkpoint {plan_name}/{step_dir_name(manifest.step)}: every copy of {detail} "
            "is lost (no surviving host has it with the right sha256, nor the remote copy); "
            "recover from an older checkpoint",
            step=manifest.step,
        )
    src_busy: dict[str, float] = {}
    dst_busy: dict[str, float] = {}
    items: list[TransferItem] = []
    # Longest files first: greedy list scheduling balances the pipes well.
    for f, dest in sorted(todo, key=lambda x: (-x[0].num_bytes, x[0].path, x[1])):
        options = [
            _peer(cluster, h, dest, plan_name, manifest.step, f.path) for h in holders[f.path]
        ]
        options.sort(key=lambda s: (s.kind != "local", -s.gbps, s.name))
        remote = Source(
            kind="remote",
            host=None,
            path=f"{remote_step_dir(remote_root, plan_name, manifest.step)}/{f.path}",
            gbps=remote_gbps,
        )
        if remote_files is None or f.path in remote_files:
            options.append(remote)
        if options[0].kind == "remote":
            best = remote
        else:

            def finish(s: Source, nbytes: int = f.num_bytes, d: str = dest) -> tuple[Any, ...]:
                t = _seconds(nbytes, s.gbps)
                start = max(src_busy.get(s.name, 0.0), dst_busy.get(d, 0.0))
                return (s.kind != "local", start + t, src_busy.get(s.name, 0.0) + t, s.name)

            best = min((s for s in options if s.kind != "remote"), key=finish)
        t = _seconds(f.num_bytes, best.gbps)
        src_busy[best.name] = src_busy.get(best.name, 0.0) + t
        dst_busy[dest] = dst_busy.get(dest, 0.0) + t
        items.append(
            TransferItem(
                file=f.path,
                dest_host=dest,
                dest_path=f"{_dir(cluster, dest, plan_name, manifest.step)}/{f.path}",
                source=best,
                num_bytes=f.num_bytes,
                sha256=f.sha256,
                predicted_s=t,
                fallbacks=tuple(s for s in options if s is not best),
            )
        )
    items.sort(key=lambda i: (i.dest_host, i.file))
    finalize = tuple(h for h in needs if not {MANIFEST, COMPLETE} <= set(present.get(h, {})))
    return TransferPlan(
        plan_name=plan_name,
        step=manifest.step,
        rule=rule,
        rule_reason=why,
        needs=needs,
        items=tuple(items),
        in_place=tuple(sorted(in_place)),
        skipped=tuple(sorted(skipped)),
        bytes_skipped=sum(by_path[f].num_bytes for _, f in skipped),
        finalize_hosts=finalize,
        predicted_s_by_source=dict(sorted(src_busy.items())),
        predicted_s_by_dest=dict(sorted(dst_busy.items())),
    )


def _dir(cluster: Cluster, host: str, plan_name: str, step: int) -> str:
    return local_step_dir(cluster.host(host).checkpoint_dir, plan_name, step)


def _peer(cluster: Cluster, src: str, dest: str, plan_name: str, step: int, path: str) -> Source:
    a, b = cluster.host(src), cluster.host(dest)
    same = a.address == b.address or (a.is_local and b.is_local)
    gbps = cluster.link_gbps(src, dest)
    return Source(
        kind="local" if same else "peer",
        host=src,
        path=f"{_dir(cluster, src, plan_name, step)}/{path}",
        gbps=max(gbps, a.intra_node_gbps) if same else gbps,
    )


def _seconds(nbytes: int, gbps: float) -> float:
    return nbytes * 8 / (gbps * 1e9)
