"""`autohet recover` moves the bytes (effects): each shard to the hosts that need it.

Peer copies go host to host over a one-shot TCP stream (direct.py) and are
relayed through the controller only when the hosts cannot reach each other;
remote storage is read through fsspec. Every copy lands under a temp name beside
its file, is verified by sha256 on the destination, and only then is renamed into
place: a file that fails its signed manifest's hash is never seen under its name,
not even in a step directory that is already COMPLETE (a loader trusts that
marker). A failed or corrupt copy is removed and the next source tried; when
every source of a file delivers other bytes the step is lost (``StepLost``) and
recover falls back to an older one. Re-running after an interruption re-reads
what is present and copies only what is still missing or wrong.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from secrets import token_hex
from typing import Any

from autohet_cli.ckpt.format import COMPLETE, KEY_FILE, MANIFEST
from autohet_cli.cluster import Host
from autohet_cli.errors import AutohetError
from autohet_cli.limits import size_text
from autohet_cli.recovery.direct import Fetch, Fetched, Servers, fetch_all
from autohet_cli.recovery.errors import RecoveryError, StepLost
from autohet_cli.recovery.transfer import Source, TransferItem, TransferPlan
from autohet_cli.transport.base import Runner
from autohet_cli.transport.fanout import fan_out
from autohet_cli.transport.pool import HostPool

Say = Callable[[str], None]


def execute_transfers(
    tp: TransferPlan, pool: HostPool, say: Say, records: list[dict[str, Any]] | None = None
) -> tuple[int, int]:
    """Copy every item (sources in order, sha256 verified); bytes from peers, from remote.

    Peer copies between two remote hosts go first, all at once over direct streams
    (``recovery.direct``); what did not arrive that way (no route, a refused key,
    bytes that fail their hash) and everything else goes per file through its
    sources in order. ``records`` gets one entry per file that arrived: which way,
    from where, how many bytes in how many seconds.

    Raises StepLost when some file has no intact copy at all (every source delivered
    other bytes), so the caller can fall back to an older step; any other failure
    (a host that stopped answering) is a RecoveryError to fix and rerun."""
    log: list[dict[str, Any]] = [] if records is None else records
    direct, mismatched = _direct_phase(tp, pool, say, log)
    by_dest: dict[str, list[TransferItem]] = {}
    for item in tp.items:
        if (item.dest_host, item.file) not in direct:
            by_dest.setdefault(item.dest_host, []).append(item)

    def copy_all(host: Host) -> tuple[int, int]:
        peers = remote = 0
        for item in by_dest[host.name]:
            first_bad = (item.dest_host, item.file) in mismatched
            kind = _copy_one(item, pool, say, log, first_mismatched=first_bad)
            if kind == "remote":
                remote += item.num_bytes
            else:
                peers += item.num_bytes
        return peers, remote

    results = fan_out([pool.host(h) for h in by_dest], copy_all)
    failed = {h: r for h, r in results.items() if isinstance(r, Exception)}
    detail = "; ".join(f"{h}: {e}" for h, e in failed.items())
    lost = sorted({e.file for e in failed.values() if isinstance(e, _NoIntactCopy)})
    if failed and all(isinstance(e, _NoIntactCopy) for e in failed.values()):
        raise StepLost(
            f"checkpoint {tp.plan_name}/{tp.step_dir}: no intact copy of {', '.join(lost)} "
            f"is left ({detail})",
            step=tp.step,
        )
    if failed:
        raise RecoveryError(f"transfer failed: {detail}")
    totals = [r for r in results.values() if not isinstance(r, Exception)]
    direct_bytes = sum(i.num_bytes for i in tp.items if (i.dest_host, i.file) in direct)
    return direct_bytes + sum(p for p, _ in totals), sum(r for _, r in totals)


def _can_stream(item: TransferItem, pool: HostPool) -> bool:
    """A peer copy between two distinct remote hosts (the controller's own host is
    reached over SFTP, which is direct from here already)."""
    src = item.source
    if src.kind == "remote" or src.host is None or src.host == item.dest_host:
        return False
    return not pool.host(src.host).is_local and not pool.host(item.dest_host).is_local


def _direct_phase(
    tp: TransferPlan, pool: HostPool, say: Say, log: list[dict[str, Any]]
) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """Every streamable item at once; (dest, file) that arrived, and those whose
    bytes from their first source failed the hash."""
    items = [i for i in tp.items if _can_stream(i, pool)]
    done: set[tuple[str, str]] = set()
    mismatched: set[tuple[str, str]] = set()
    if not items:
        return done, mismatched
    servers = Servers(say)
    try:
        by_src: dict[str, list[str]] = {}
        fetchers: dict[str, set[str]] = {}  # source -> addresses of the hosts fetching
        for i in items:
            assert i.source.host is not None
            by_src.setdefault(i.source.host, []).append(i.source.path)
            fetchers.setdefault(i.source.host, set()).add(pool.host(i.dest_host).address)
        fan_out(
            [pool.host(h) for h in by_src],
            lambda h: servers.start(
                pool.runner(h.name),
                h,
                sorted(set(by_src[h.name])),
                key_path(pool, h.name, tp.plan_name),
                sorted(fetchers[h.name]),
            ),
        )
        for host, why in servers.failed.items():
            say(f"{host}: cannot serve its files directly ({why}); they go through the controller")
        by_dest: dict[str, list[TransferItem]] = {}
        for i in items:
            if i.source.host is not None and servers.serves(i.source.host, i.source.path):
                by_dest.setdefault(i.dest_host, []).append(i)

        walls: dict[str, float] = {}

        def fetch(host: Host) -> list[Fetched]:
            t0 = time.monotonic()
            try:
                return _fetch_for(host)
            finally:
                walls[host.name] = time.monotonic() - t0

        def _fetch_for(host: Host) -> list[Fetched]:
            todo = by_dest[host.name]
            wanted = [
                Fetch(
                    path=i.source.path,
                    dest=i.dest_path,
                    num_bytes=i.num_bytes,
                    sha256=i.sha256,
                    source=str(i.source.host),
                )
                for i in todo
            ]
            return fetch_all(
                pool.runner(host.name),
                host,
                wanted,
                servers,
                key_path(pool, host.name, tp.plan_name),
            )

        results = fan_out([pool.host(h) for h in by_dest], fetch)
    finally:
        servers.close()
    for dest, got in results.items():
        if isinstance(got, Exception):
            say(f"{dest}: direct copies failed ({got}); trying the other ways")
            continue
        for item, verdict in zip(by_dest[dest], got, strict=True):
            if verdict.ok:
                done.add((dest, item.file))
                _record(log, item, item.source, "direct", verdict.seconds, say)
                log[-1]["batch_s"] = round(walls.get(dest, 0.0), 6)  # its fetcher, all told
                continue
            if verdict.why == "sha256":
                mismatched.add((dest, item.file))
                why = f"sha256 mismatch ({verdict.got[:16]}...)"
            else:
                why = verdict.why
            say(
                f"{dest}: {item.file} from peer {item.source.host} (direct) failed: {why}; "
                "trying the next way"
            )
    return done, mismatched


def _record(
    log: list[dict[str, Any]], item: TransferItem, source: Source, how: str, secs: float, say: Say
) -> None:
    rate = item.num_bytes / secs if secs > 0 else 0.0
    log.append(
        {
            "file": item.file,
            "dest": item.dest_host,
            "source_kind": source.kind,
            "source": source.name,
            "path": how,
            "bytes": item.num_bytes,
            "seconds": round(secs, 6),
            "bytes_per_s": round(rate, 1),
        }
    )
    say(
        f"{item.dest_host}: {item.file} from {_label(source)} ({how}, "
        f"{size_text(item.num_bytes)} in {secs:.2f} s, {size_text(rate)}/s) ok"
    )


class _NoIntactCopy(RecoveryError):
    """Every source of one file delivered bytes that fail its sha256."""

    def __init__(self, message: str, *, file: str) -> None:
        super().__init__(message)
        self.file = file


# $1 the staged copy, $2 its final name, $3 the manifest's sha256. Exit 0: verified and
# renamed into place; 3: another hash (printed), the copy removed; else: stderr says why.
_PLACE = (
    'h=$(sha256sum -- "$1") || exit 4; h=${h%% *}; '
    'if [ "$h" = "$3" ]; then mv -f -- "$1" "$2" || exit 4; exit 0; fi; '
    'rm -f -- "$1"; echo "$h"; exit 3'
)


def _copy_one(
    item: TransferItem,
    pool: HostPool,
    say: Say,
    log: list[dict[str, Any]],
    *,
    first_mismatched: bool = False,
) -> str:
    """Each source in turn to a temp name beside the file, verified there, renamed into
    place: a file that fails its sha256 is never seen under its name, even briefly.
    ``first_mismatched``: the first source's bytes already failed the hash (streamed)."""
    dest = pool.runner(item.dest_host)
    errors: list[str] = []
    mismatches = 0
    sources: tuple[Source, ...] = (item.source, *item.fallbacks)
    if first_mismatched:
        mismatches = 1
        errors.append(f"{_label(item.source)}: sha256 mismatch after a direct copy")
    for source in sources[1:] if first_mismatched else sources:
        staged = f"{item.dest_path}.{token_hex(4)}.autohet-part"
        try:
            t0 = time.monotonic()
            how = _deliver(source, item, staged, pool)
            res = dest.run(
                ["sh", "-c", _PLACE, "sh", staged, item.dest_path, item.sha256], timeout_s=600
            )
            if res.exit_code == 0:
                _record(log, item, source, how, time.monotonic() - t0, say)
                return source.kind
            if res.exit_code == 3:
                mismatches += 1
                got = res.stdout.strip()[:16]
                errors.append(
                    f"{_label(source)}: sha256 mismatch after copy ({got}..., the manifest "
                    f"signs {item.sha256[:16]}...)"
                )
            else:
                why = res.stderr.strip() or f"exit code {res.exit_code}"
                errors.append(f"{_label(source)}: cannot verify or place the copy: {why}")
                _discard(dest, staged)
        except (AutohetError, OSError) as exc:
            errors.append(f"{_label(source)}: {exc or type(exc).__name__}")
            _discard(dest, staged)
        say(f"{item.dest_host}: {item.file} from {_label(source)} failed, trying the next source")
    message = f"{item.file} to {item.dest_host}: every source failed: " + "; ".join(errors)
    if mismatches == len(sources):
        raise _NoIntactCopy(message, file=item.file)
    raise RecoveryError(message)


def _discard(runner: Runner, path: str) -> None:
    try:
        runner.run(["rm", "-f", "--", path], timeout_s=60)
    except AutohetError:
        pass  # the host is gone; remove_partials clears it on the next recover


def key_path(pool: HostPool, host: str, ns: str) -> str:
    return f"{pool.checkpoint_dir(host).rstrip('/')}/{ns}/{KEY_FILE}"


def _deliver(source: Source, item: TransferItem, dest_path: str, pool: HostPool) -> str:
    """Copy ``source`` to ``dest_path`` on the item's host through the controller
    (remote storage through fsspec, a peer over SFTP): the way that needs no route
    between the hosts (direct streams went first, ``_direct_phase``)."""
    if (
        source.kind == "local"
        and source.host is not None
        and _same_machine(pool, source.host, item.dest_host)
    ):
        res = pool.runner(item.dest_host).run(["cp", "--", source.path, dest_path], timeout_s=None)
        if res.exit_code == 0:
            return "copied on the machine"
    with tempfile.TemporaryDirectory(prefix="autohet-xfer-") as tmp:
        local = Path(tmp) / "blob"
        _fetch(source, local, pool)
        pool.runner(item.dest_host).put(local, dest_path)
    return "relayed"


def _same_machine(pool: HostPool, a: str, b: str) -> bool:
    ha, hb = pool.host(a), pool.host(b)
    return ha.address == hb.address or (ha.is_local and hb.is_local)


def _fetch(source: Source, local: Path, pool: HostPool) -> None:
    if source.kind == "remote" or source.host is None:
        import fsspec

        with fsspec.open(source.path, "rb") as src, open(local, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        return
    pool.runner(source.host).get(source.path, local)


def _label(source: Source) -> str:
    return "remote storage" if source.kind == "remote" else f"peer {source.host}"


def finalize(tp: TransferPlan, manifest_text: str, pool: HostPool) -> None:
    """manifest.json (as written, with its HMAC), then COMPLETE, on every host that now
    holds the checkpoint."""
    with tempfile.TemporaryDirectory(prefix="autohet-fin-") as tmp:
        man = Path(tmp) / MANIFEST
        man.write_text(manifest_text, encoding="utf-8")
        done = Path(tmp) / COMPLETE
        done.write_text("", encoding="utf-8")
        for host in tp.finalize_hosts:
            d = f"{pool.checkpoint_dir(host).rstrip('/')}/{tp.plan_name}/step-{tp.step:08d}"
            pool.runner(host).put(man, f"{d}/{MANIFEST}")
            pool.runner(host).put(done, f"{d}/{COMPLETE}")


_PARTIALS = 'cd "$1" 2>/dev/null || exit 0; rm -f -- *.autohet-part .*.tmp; true'


def remove_partials(pool: HostPool, hosts: Sequence[str], ns: str, step_dir: str) -> None:
    """Temp files an interrupted recover (or copy) left in a step directory."""

    def clean(host: Host) -> None:
        d = f"{pool.checkpoint_dir(host.name).rstrip('/')}/{ns}/{step_dir}"
        pool.runner(host.name).run(["sh", "-c", _PARTIALS, "sh", d], timeout_s=60)

    fan_out([pool.host(h) for h in hosts], clean)
