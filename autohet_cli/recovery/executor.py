"""`autohet recover`, the effects: probe hosts, read checkpoints and manifests.

The decisions are pure (manifest.py, replan.py, transfer.py); this module only
looks at hosts. Moving the shards is copies.py; one recover per job at a time is
hostlock.py.

Only a host that cannot be reached counts as lost. A host that answers but
refuses us (changed host key, rejected key, unreadable checkpoint directory)
stops recovery with that message: carrying on without it would throw away a
healthy host's GPUs and shards because of a fixable mistake.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path

from autohet_cli.ckpt import sums
from autohet_cli.ckpt.format import (
    MANIFEST,
    Manifest,
    belongs_to,
    verified_manifest,
)
from autohet_cli.cluster import Cluster, Host, python_for
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.errors import AutohetError, CommandTimeout, HostUnreachable
from autohet_cli.inputs import load_inputs, tables_for
from autohet_cli.models import ModelSpec
from autohet_cli.plan import Plan
from autohet_cli.recovery.errors import RecoveryError
from autohet_cli.recovery.manifest import remote_root
from autohet_cli.transport.fanout import fan_out
from autohet_cli.transport.pool import HostPool

Say = Callable[[str], None]
_SUMS_SOURCE = inspect.getsource(sums)


def is_unreachable(exc: BaseException) -> bool:
    """Loss is not answering at all; a refusal (key, auth, permissions) is not loss."""
    return isinstance(exc, HostUnreachable | CommandTimeout)


def earlier_hosts(plans_dir: Path, name: str) -> set[str]:
    """Hosts of every version of plan ``name`` beside it (the job's history)."""
    from autohet_cli.plan import load_plan

    found: set[str] = set()
    for path in plans_dir.glob(f"{name}.v*.yaml"):
        try:
            found.update(load_plan(path).hosts())
        except AutohetError:
            continue  # not a plan we can read: it names nobody
    return found


def check_lost_names(
    plan: Plan, cluster: Cluster, lost: Sequence[str], earlier: Collection[str] = ()
) -> None:
    """Lost hosts are named against the job: the plan's, the cluster file's, or an
    earlier version's (hosts an earlier recovery moved away from): none is added back."""
    hosts = plan.hosts()
    listed = {h.name for h in cluster.hosts}
    unknown = [h for h in lost if h not in hosts and h not in listed and h not in earlier]
    if unknown:
        raise RecoveryError(
            f"--lost {','.join(unknown)}: not a host of plan {plan.name}.v{plan.version} "
            f"(its hosts: {', '.join(hosts)}) nor of cluster {cluster.name!r} (which lists "
            f"{', '.join(sorted(listed))}); check the spelling"
        )


def _answers(pool: HostPool, host: Host) -> None:
    """Raises unless ``host`` runs a command now (the probe every check starts with)."""
    pool.runner(host.name).run(["true"], timeout_s=pool.connect.connect_timeout_s + 5).check()


def unreachable(pool: HostPool, names: Sequence[str]) -> list[str]:
    """Which of ``names`` do not answer now (a refusal is an answer: not loss)."""
    results = fan_out([pool.host(n) for n in names], lambda h: _answers(pool, h))
    return sorted(n for n, r in results.items() if isinstance(r, Exception) and is_unreachable(r))


def probe_additions(
    plan: Plan, cluster: Cluster, pool: HostPool, excluded: Sequence[str], say: Say
) -> list[str]:
    """Cluster hosts the plan does not use that do not answer now: never added back.

    A wave of spot losses leaves earlier victims in the cluster file; a replan from
    memory would add a host lost an hour ago and the relaunch would die connecting
    to it. Only a host that answers now joins; one that answers but refuses us is
    left out too (said, not fatal: the job does not need it)."""

    todo = [h for h in cluster.hosts if h.name not in plan.hosts() and h.name not in excluded]
    results = fan_out(todo, lambda h: _answers(pool, h))
    absent = []
    for name, r in results.items():
        if isinstance(r, Exception):
            why = "does not answer" if is_unreachable(r) else "answers but refuses us"
            say(f"{name}: in the cluster file but {why} ({r}); not added to the plan")
            absent.append(name)
    for name in excluded:
        if name not in plan.hosts():
            say(f"{name}: named lost (not in plan {plan.name}.v{plan.version}); not added back")
    return sorted(absent)


def probe_survivors(plan: Plan, pool: HostPool, given_lost: Sequence[str], say: Say) -> list[str]:
    """Every plan host not named lost: does it answer, can we read its checkpoints?

    Returns the hosts found unreachable. Any other failure stops recovery with
    its cause, as do workers of this plan still running on a survivor.
    """

    def probe(host: Host) -> None:
        _answers(pool, host)
        d = pool.checkpoint_dir(host.name)
        res = pool.runner(host.name).run(
            ["sh", "-c", 'umask 077; mkdir -p -- "$1" && test -r "$1"', "sh", d], timeout_s=30
        )
        if res.exit_code != 0:
            raise RecoveryError(
                f"{host.name}: its checkpoint directory {d} cannot be created or read "
                f"({res.stderr.strip() or 'permission denied'}); fix it and run recover again"
            )

    todo = [pool.host(h) for h in plan.hosts() if h not in given_lost]
    results = fan_out(todo, probe)
    unreachable = [n for n, r in results.items() if isinstance(r, Exception) and is_unreachable(r)]
    refused = {
        n: r for n, r in results.items() if isinstance(r, Exception) and n not in unreachable
    }
    for name in unreachable:
        say(f"{name}: lost ({results[name]})")
    if refused:
        detail = "; ".join(f"{n}: {r}" for n, r in refused.items())
        raise RecoveryError(
            f"cannot check every survivor: {detail}. These hosts answer, so they are not "
            "lost; fix the cause (or name a host with --lost if it really is gone)"
        )
    lost = [*given_lost, *unreachable]
    if all(h in lost for h in plan.hosts()):
        reasons = "; ".join(f"{n}: {results[n]}" for n in unreachable) or "all named by --lost"
        raise RecoveryError(
            f"no host of plan {plan.name}.v{plan.version} survives ({reasons}). Recover "
            "moves a job to the plan's surviving hosts and needs one: the job's key and its "
            "checkpoints are on them (a host only in the cluster file has neither). Once "
            "the hosts answer again (or if only the workers had stopped), resume the job "
            "where it was with: autohet launch PLAN --resume"
        )
    running = running_workers(plan, [h for h in plan.hosts() if h not in lost], pool)
    if running:
        detail = "; ".join(f"{h}: pid {', '.join(p)}" for h, p in running.items())
        raise RecoveryError(
            f"workers of {plan.name}.v{plan.version} are still running ({detail}); stop them "
            "first (Ctrl-C the launch, or kill those process groups), then recover"
        )
    return lost


_RUNNING = (
    'for f in "$1"/runs/"$2"/*/torchrun-"$3".pid "$1"/runs/"$2"/*/torchrun.pid; do '
    '[ -f "$f" ] || continue; '
    'p=$(cat "$f"); case "$p" in ""|*[!0-9]*) continue;; esac; '
    'kill -0 "$p" 2>/dev/null && echo "$p"; done; true'
)


def running_workers(plan: Plan, names: Sequence[str], pool: HostPool) -> dict[str, list[str]]:
    """Hosts where a torchrun of this plan (by its pid file) is still alive."""

    def alive(host: Host) -> list[str]:
        res = pool.runner(host.name).run(
            ["sh", "-c", _RUNNING, "sh", pool.workdir(host.name), f"{plan.name}.v{plan.version}"]
            + [host.name],
            timeout_s=30,
        )
        return res.stdout.split()

    results = fan_out([pool.host(n) for n in names], alive)
    return {n: r for n, r in results.items() if not isinstance(r, Exception) and r}


def expanded_cluster(pool: HostPool, names: Sequence[str]) -> Cluster:
    """The cluster with ``~`` in these hosts' checkpoint and work dirs expanded on them."""
    hosts = tuple(
        dataclasses.replace(
            h, checkpoint_dir=pool.checkpoint_dir(h.name), workdir=pool.workdir(h.name)
        )
        if h.name in names
        else h
        for h in pool.cluster.hosts
    )
    return dataclasses.replace(pool.cluster, hosts=hosts)


def list_checkpoints(
    names: Sequence[str], ns: str, pool: HostPool
) -> dict[str, dict[str, set[str]]]:
    """host → step dir → files, for every survivor's job directory ``<ckpt>/<ns>``."""

    def listing(host: Host) -> dict[str, set[str]]:
        root = f"{pool.checkpoint_dir(host.name).rstrip('/')}/{ns}"
        out = (
            pool.runner(host.name)
            .run(
                ["sh", "-c", 'cd "$1" 2>/dev/null && find . -mindepth 2 -maxdepth 2 -type f', "sh"]
                + [root],
                timeout_s=60,
            )
            .stdout
        )
        steps: dict[str, set[str]] = {}
        for line in out.splitlines():
            parts = line.strip().removeprefix("./").split("/")
            if len(parts) == 2:
                steps.setdefault(parts[0], set()).add(parts[1])
        return steps

    results = fan_out([pool.host(n) for n in names], listing)
    failed = {n: r for n, r in results.items() if isinstance(r, Exception)}
    if failed:
        raise RecoveryError(
            "cannot list checkpoints on "
            + "; ".join(f"{n}: {e}" for n, e in failed.items())
            + " (the host answered a moment ago; run recover again)"
        )
    return {n: r for n, r in results.items() if not isinstance(r, Exception)}


def list_remote(root: str | None, ns: str) -> dict[str, set[str]]:
    """step dir → files of the remote copy of a job ({} without a remote copy)."""
    if root is None:
        return {}
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(f"{root.rstrip('/')}/{ns}")
        if not fs.exists(path):
            return {}
        out: dict[str, set[str]] = {}
        for step in fs.ls(path, detail=False):
            name = str(step).rstrip("/").rsplit("/", 1)[-1]
            out[name] = {str(f).rstrip("/").rsplit("/", 1)[-1] for f in fs.ls(step, detail=False)}
    except (OSError, ValueError, ImportError) as exc:
        raise RecoveryError(f"cannot list remote storage {root}: {exc}") from None
    return out


def read_manifests(
    listings: Mapping[str, Mapping[str, set[str]]],
    remote: Mapping[str, set[str]],
    ns: str,
    root: str | None,
    pool: HostPool,
    *,
    key: bytes,
    plan_name: str,
) -> tuple[dict[str, Manifest | str], dict[str, str]]:
    """Every step dir's manifest, verified with the job key (peer copy first, then remote):
    step dir → manifest or why not, and step dir → the manifest's text as written."""
    out: dict[str, Manifest | str] = {}
    texts: dict[str, str] = {}
    steps = {s for lst in listings.values() for s in lst} | set(remote)
    for step in sorted(steps):
        why = "no manifest.json anywhere"
        for text in _manifest_copies(listings, remote, ns, root, pool, step):
            # Every copy is tried: one corrupt or planted copy must not hide a good one.
            try:
                manifest = verified_manifest(text, key, f"{step}/{MANIFEST}")
            except AutohetError as exc:
                why = str(exc)
                continue
            if not belongs_to(manifest, plan_name):
                why = f"written by plan {manifest.plan}, not by the {plan_name} lineage"
                continue
            out[step], texts[step] = manifest, text
            break
        else:
            out[step] = why
    return out, texts


def _manifest_copies(
    listings: Mapping[str, Mapping[str, set[str]]],
    remote: Mapping[str, set[str]],
    ns: str,
    root: str | None,
    pool: HostPool,
    step: str,
) -> Iterator[str]:
    """The texts of a step's manifest: each survivor's copy, then the remote one."""
    for host, lst in listings.items():
        if MANIFEST in lst.get(step, set()):
            path = f"{pool.checkpoint_dir(host).rstrip('/')}/{ns}/{step}"
            res = pool.runner(host).run(["cat", f"{path}/{MANIFEST}"], timeout_s=60)
            if res.exit_code == 0:
                yield res.stdout
    if root is not None and MANIFEST in remote.get(step, set()):
        import fsspec

        try:
            with fsspec.open(f"{root.rstrip('/')}/{ns}/{step}/{MANIFEST}", "r") as fh:
                yield str(fh.read())
        except (OSError, UnicodeDecodeError):
            return


def hashes_present(
    names: Sequence[str], ns: str, step_dir: str, pool: HostPool
) -> dict[str, dict[str, str]]:
    """host → file → sha256 computed on the host, for the chosen step dir."""

    def hashes(host: Host) -> dict[str, str]:
        d = f"{pool.checkpoint_dir(host.name).rstrip('/')}/{ns}/{step_dir}"
        # The files' recorded sha256 where they are unchanged since written or
        # received (ckpt.sums), the rest read on the host, several at a time.
        res = pool.runner(host.name).run([python_for(host), "-c", _SUMS_SOURCE, d], timeout_s=600)
        out: dict[str, str] = {}
        for line in res.stdout.splitlines():
            digest, _, name = line.partition("  ")
            if name:
                out[name.strip()] = digest.strip()
        return out

    results = fan_out([pool.host(n) for n in names], hashes)
    return {n: r for n, r in results.items() if not isinstance(r, Exception)}


def plan_inputs_tables(plan: Plan, cluster_path: str) -> CostTables:
    """The old plan's cost tables, with the model the plan carries when it has one (the
    config.json it was made from may have moved since), else by recorded path or name."""
    profiles = [v["path"] for k, v in plan.inputs.items() if k.startswith("profile")]
    model: str | ModelSpec = (
        plan.architecture
        if plan.architecture is not None
        else plan.inputs.get("model", {}).get("path") or plan.model_name
    )
    inputs = load_inputs(cluster_path, model, [p for p in profiles if os.path.exists(p)])
    return tables_for(inputs, plan.training)


def remote_root_for(cluster: Cluster) -> str | None:
    """The remote copy as this machine sees it (``~`` is this user's home here)."""
    root = remote_root(cluster.remote_storage, os.environ)
    return os.path.expanduser(root) if root is not None and root.startswith("~") else root
