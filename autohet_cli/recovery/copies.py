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
from collections.abc import Callable, Sequence
from pathlib import Path
from secrets import token_hex

from autohet_cli.ckpt.format import COMPLETE, KEY_FILE, MANIFEST
from autohet_cli.cluster import Host
from autohet_cli.errors import AutohetError
from autohet_cli.recovery.direct import direct_copy
from autohet_cli.recovery.errors import RecoveryError, StepLost
from autohet_cli.recovery.transfer import Source, TransferItem, TransferPlan
from autohet_cli.transport.base import Runner
from autohet_cli.transport.fanout import fan_out
from autohet_cli.transport.pool import HostPool

Say = Callable[[str], None]


def execute_transfers(tp: TransferPlan, pool: HostPool, say: Say) -> tuple[int, int]:
    """Copy every item (sources in order, sha256 verified); bytes from peers, from remote.

    Raises StepLost when some file has no intact copy at all (every source delivered
    other bytes), so the caller can fall back to an older step; any other failure
    (a host that stopped answering) is a RecoveryError to fix and rerun."""
    by_dest: dict[str, list[TransferItem]] = {}
    for item in tp.items:
        by_dest.setdefault(item.dest_host, []).append(item)

    def copy_all(host: Host) -> tuple[int, int]:
        peers = remote = 0
        for item in by_dest[host.name]:
            kind = _copy_one(item, pool, say, tp.plan_name)
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
    return sum(p for p, _ in totals), sum(r for _, r in totals)


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


def _copy_one(item: TransferItem, pool: HostPool, say: Say, ns: str) -> str:
    """Each source in turn to a temp name beside the file, verified there, renamed into
    place: a file that fails its sha256 is never seen under its name, even briefly."""
    dest = pool.runner(item.dest_host)
    errors: list[str] = []
    mismatches = 0
    sources = (item.source, *item.fallbacks)
    for source in sources:
        staged = f"{item.dest_path}.{token_hex(4)}.autohet-part"
        try:
            how = _deliver(source, item, staged, pool, say, ns)
            res = dest.run(
                ["sh", "-c", _PLACE, "sh", staged, item.dest_path, item.sha256], timeout_s=600
            )
            if res.exit_code == 0:
                say(f"{item.dest_host}: {item.file} from {_label(source)} ({how}) ok")
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


def _deliver(
    source: Source, item: TransferItem, dest_path: str, pool: HostPool, say: Say, ns: str
) -> str:
    """Copy ``source`` to ``dest_path`` on the item's host. Peers copy host to host
    directly; if that fails (no route), or for remote storage, the bytes go through
    the controller."""
    src_host = pool.host(source.host) if source.host is not None else None
    dest_host = pool.host(item.dest_host)
    if (
        source.kind != "remote"
        and src_host is not None
        and src_host.name != dest_host.name
        and not src_host.is_local
        and not dest_host.is_local
    ):
        try:
            direct_copy(
                pool.runner(src_host.name),
                src_host,
                source.path,
                pool.runner(dest_host.name),
                dest_host,
                dest_path,
                src_key=key_path(pool, src_host.name, ns),
                dest_key=key_path(pool, dest_host.name, ns),
                warn=say,
            )
            return "direct"
        except AutohetError as exc:
            say(f"{item.dest_host}: direct copy of {item.file} from {source.host} failed ({exc})")
    with tempfile.TemporaryDirectory(prefix="autohet-xfer-") as tmp:
        local = Path(tmp) / "blob"
        _fetch(source, local, pool)
        pool.runner(item.dest_host).put(local, dest_path)
    return "relayed"


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
