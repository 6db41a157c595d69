"""`autohet recover`, the effects: probe hosts, read checkpoints, copy shards, relaunch.

The decisions are pure (manifest.py, replan.py, transfer.py); this module only
looks at hosts and moves bytes. Peer copies go host to host over a one-shot
TCP stream (direct.py) and are relayed through the controller only when the
hosts cannot reach each other; remote storage is read through fsspec. Every
copy is verified by sha256 on the destination; a failed or corrupt copy falls
back to the next source. Re-running after an interruption re-reads what is
present and copies only what is still missing or wrong.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from autohet_cli.cluster import Cluster, Host
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.errors import AutohetError
from autohet_cli.inputs import load_inputs
from autohet_cli.launch.executor import ConnectOptions
from autohet_cli.plan import Plan
from autohet_cli.recovery.direct import direct_copy
from autohet_cli.recovery.errors import RecoveryError
from autohet_cli.recovery.manifest import (
    COMPLETE,
    MANIFEST,
    CheckpointChoice,
    Manifest,
    manifest_from_json,
    newest_complete,
    remote_root,
)
from autohet_cli.recovery.transfer import Source, TransferItem, TransferPlan, plan_transfers
from autohet_cli.transport.base import Runner
from autohet_cli.transport.fanout import fan_out, runner_for

Say = Callable[[str], None]


@dataclass
class Hosts:
    """One runner per reachable host, opened lazily and closed together."""

    cluster: Cluster
    connect: ConnectOptions

    def __post_init__(self) -> None:
        self._runners: dict[str, Runner] = {}

    def runner(self, name: str) -> Runner:
        if name not in self._runners:
            self._runners[name] = runner_for(
                self.cluster.host(name),
                known_hosts=self.connect.known_hosts,
                accept_new_host_keys=self.connect.accept_new_host_keys,
                connect_timeout_s=self.connect.connect_timeout_s,
            )
        return self._runners[name]

    def close(self) -> None:
        for r in self._runners.values():
            try:
                r.close()
            except AutohetError:
                pass


def detect_lost(plan: Plan, hosts: Hosts, say: Say) -> list[str]:
    """Plan hosts that do not answer, or whose checkpoint dir cannot be read."""

    def probe(host: Host) -> bool:
        runner = hosts.runner(host.name)
        runner.run(["true"], timeout_s=hosts.connect.connect_timeout_s + 5).check()
        runner.run(
            ["sh", "-c", 'mkdir -p "$1" && test -r "$1"', "sh", host.checkpoint_dir], timeout_s=30
        ).check()
        return True

    results = fan_out([hosts.cluster.host(h) for h in plan.hosts()], probe)
    lost = [name for name, r in results.items() if isinstance(r, Exception)]
    for name in lost:
        say(f"{name}: lost ({results[name]})")
    running = running_workers(plan, [h for h in plan.hosts() if h not in lost], hosts)
    if running:
        detail = "; ".join(f"{h}: pid {', '.join(p)}" for h, p in running.items())
        raise RecoveryError(
            f"workers of {plan.name}.v{plan.version} are still running ({detail}); stop them "
            "first (Ctrl-C the launch, or kill those process groups), then recover"
        )
    return lost


_RUNNING = (
    'for f in "$1"/runs/"$2"/*/torchrun.pid; do [ -f "$f" ] || continue; '
    'p=$(cat "$f"); case "$p" in ""|*[!0-9]*) continue;; esac; '
    'kill -0 "$p" 2>/dev/null && echo "$p"; done; true'
)


def running_workers(plan: Plan, names: Sequence[str], hosts: Hosts) -> dict[str, list[str]]:
    """Hosts where a torchrun of this plan (by its pid file) is still alive."""

    def alive(host: Host) -> list[str]:
        home = host.workdir
        if home.startswith("~"):
            from autohet_cli.profiling.run import remote_workdir

            home = remote_workdir(hosts.runner(host.name), host)
        res = hosts.runner(host.name).run(
            ["sh", "-c", _RUNNING, "sh", home, f"{plan.name}.v{plan.version}"], timeout_s=30
        )
        return res.stdout.split()

    results = fan_out([hosts.cluster.host(n) for n in names], alive)
    return {n: r for n, r in results.items() if not isinstance(r, Exception) and r}


def list_checkpoints(
    names: Sequence[str], plan_name: str, hosts: Hosts
) -> dict[str, dict[str, set[str]]]:
    """host → step dir → files, for every reachable host's checkpoint dir."""

    def listing(host: Host) -> dict[str, set[str]]:
        root = f"{host.checkpoint_dir.rstrip('/')}/{plan_name}"
        out = (
            hosts.runner(host.name)
            .run(
                [
                    "sh",
                    "-c",
                    'cd "$1" 2>/dev/null && find . -mindepth 2 -maxdepth 2 -type f',
                    "sh",
                    root,
                ],
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

    results = fan_out([hosts.cluster.host(n) for n in names], listing)
    return {n: r for n, r in results.items() if not isinstance(r, Exception)}


def list_remote(root: str, plan_name: str) -> dict[str, set[str]]:
    import fsspec

    fs, path = fsspec.core.url_to_fs(f"{root.rstrip('/')}/{plan_name}")
    if not fs.exists(path):
        return {}
    out: dict[str, set[str]] = {}
    for step in fs.ls(path, detail=False):
        name = str(step).rstrip("/").rsplit("/", 1)[-1]
        out[name] = {str(f).rstrip("/").rsplit("/", 1)[-1] for f in fs.ls(step, detail=False)}
    return out


def read_manifests(
    listings: Mapping[str, Mapping[str, set[str]]],
    remote: Mapping[str, set[str]],
    plan_name: str,
    cluster: Cluster,
    root: str,
    hosts: Hosts,
) -> dict[str, Manifest | str]:
    """The manifest of every step dir that has one somewhere (peer first, then remote)."""
    out: dict[str, Manifest | str] = {}
    steps = {s for lst in listings.values() for s in lst} | set(remote)
    for step in sorted(steps):
        text = None
        for host, lst in listings.items():
            if MANIFEST in lst.get(step, set()):
                path = f"{cluster.host(host).checkpoint_dir.rstrip('/')}/{plan_name}/{step}"
                res = hosts.runner(host).run(["cat", f"{path}/{MANIFEST}"], timeout_s=60)
                if res.exit_code == 0:
                    text = res.stdout
                    break
        if text is None and MANIFEST in remote.get(step, set()):
            import fsspec

            with fsspec.open(f"{root.rstrip('/')}/{plan_name}/{step}/{MANIFEST}", "r") as fh:
                text = fh.read()
        if text is None:
            out[step] = "no manifest.json anywhere"
            continue
        try:
            out[step] = manifest_from_json(text, f"{step}/{MANIFEST}")
        except AutohetError as exc:
            out[step] = str(exc)
    return out


def choose_checkpoint(
    plan_name: str, survivors: Sequence[str], cluster: Cluster, hosts: Hosts, root: str
) -> tuple[CheckpointChoice, dict[str, set[str]]]:
    listings = list_checkpoints(survivors, plan_name, hosts)
    remote = list_remote(root, plan_name)
    manifests = read_manifests(listings, remote, plan_name, cluster, root, hosts)
    return newest_complete(listings, manifests, remote=remote), remote


def hashes_present(
    names: Sequence[str], cluster: Cluster, plan_name: str, step_dir: str, hosts: Hosts
) -> dict[str, dict[str, str]]:
    """host → file → sha256 computed on the host, for the chosen step dir."""

    def hashes(host: Host) -> dict[str, str]:
        d = f"{host.checkpoint_dir.rstrip('/')}/{plan_name}/{step_dir}"
        res = hosts.runner(host.name).run(
            [
                "sh",
                "-c",
                'cd "$1" 2>/dev/null && sha256sum -- * .metadata 2>/dev/null; true',
                "sh",
                d,
            ],
            timeout_s=600,
        )
        out: dict[str, str] = {}
        for line in res.stdout.splitlines():
            digest, _, name = line.partition("  ")
            if name:
                out[name.strip()] = digest.strip()
        return out

    results = fan_out([cluster.host(n) for n in names], hashes)
    return {n: r for n, r in results.items() if not isinstance(r, Exception)}


def execute_transfers(tp: TransferPlan, hosts: Hosts, say: Say) -> tuple[int, int]:
    """Copy every item (sources in order, sha256 verified); bytes from peers, from remote."""
    by_dest: dict[str, list[TransferItem]] = {}
    for item in tp.items:
        by_dest.setdefault(item.dest_host, []).append(item)

    def copy_all(host: Host) -> tuple[int, int]:
        peers = remote = 0
        for item in by_dest[host.name]:
            kind = _copy_one(item, hosts, say)
            if kind == "remote":
                remote += item.num_bytes
            else:
                peers += item.num_bytes
        return peers, remote

    results = fan_out([hosts.cluster.host(h) for h in by_dest], copy_all)
    failed = {h: r for h, r in results.items() if isinstance(r, Exception)}
    if failed:
        raise RecoveryError("transfer failed: " + "; ".join(f"{h}: {e}" for h, e in failed.items()))
    totals = [r for r in results.values() if not isinstance(r, Exception)]
    return sum(p for p, _ in totals), sum(r for _, r in totals)


def _copy_one(item: TransferItem, hosts: Hosts, say: Say) -> str:
    dest = hosts.runner(item.dest_host)
    errors = []
    for source in (item.source, *item.fallbacks):
        try:
            how = _deliver(source, item, hosts)
            got = dest.run(["sha256sum", "--", item.dest_path], timeout_s=600)
            if got.exit_code == 0 and got.stdout.split()[0] == item.sha256:
                say(f"{item.dest_host}: {item.file} from {_label(source)} ({how}) ok")
                return source.kind
            errors.append(f"{_label(source)}: sha256 mismatch after copy")
        except (AutohetError, OSError) as exc:
            errors.append(f"{_label(source)}: {exc}")
        say(f"{item.dest_host}: {item.file} from {_label(source)} failed, trying the next source")
    raise RecoveryError(
        f"{item.file} to {item.dest_host}: every source failed: " + "; ".join(errors)
    )


def _deliver(source: Source, item: TransferItem, hosts: Hosts) -> str:
    """Peers copy host to host directly; if that fails (no route), or for remote
    storage, the bytes go through the controller."""
    if source.kind != "remote" and source.host is not None and source.host != item.dest_host:
        try:
            direct_copy(
                hosts.runner(source.host),
                hosts.cluster.host(source.host),
                source.path,
                hosts.runner(item.dest_host),
                hosts.cluster.host(item.dest_host),
                item.dest_path,
            )
            return "direct"
        except AutohetError:
            pass  # relay below
    with tempfile.TemporaryDirectory(prefix="autohet-xfer-") as tmp:
        local = Path(tmp) / "blob"
        _fetch(source, local, hosts)
        hosts.runner(item.dest_host).put(local, item.dest_path)
    return "relayed"


def _fetch(source: Source, local: Path, hosts: Hosts) -> None:
    if source.kind == "remote" or source.host is None:
        import fsspec

        with fsspec.open(source.path, "rb") as src, open(local, "wb") as dst:
            dst.write(src.read())
        return
    hosts.runner(source.host).get(source.path, local)


def _label(source: Source) -> str:
    return "remote storage" if source.kind == "remote" else f"peer {source.host}"


def finalize(tp: TransferPlan, manifest_text: str, cluster: Cluster, hosts: Hosts) -> None:
    """manifest.json, then COMPLETE, on every host that now holds the checkpoint."""
    with tempfile.TemporaryDirectory(prefix="autohet-fin-") as tmp:
        man = Path(tmp) / MANIFEST
        man.write_text(manifest_text, encoding="utf-8")
        done = Path(tmp) / COMPLETE
        done.write_text("", encoding="utf-8")
        for host in tp.finalize_hosts:
            d = f"{cluster.host(host).checkpoint_dir.rstrip('/')}/{tp.plan_name}/step-{tp.step:08d}"
            hosts.runner(host).put(man, f"{d}/{MANIFEST}")
            hosts.runner(host).put(done, f"{d}/{COMPLETE}")


def plan_inputs_tables(plan: Plan, cluster_path: str) -> CostTables:
    profiles = [v["path"] for k, v in plan.inputs.items() if k.startswith("profile")]
    model_ref = plan.inputs.get("model", {}).get("path") or plan.model_name
    inputs = load_inputs(cluster_path, model_ref, [p for p in profiles if os.path.exists(p)])
    return CostTables(inputs.model, inputs.profile, plan.training)


def remote_root_for(cluster: Cluster) -> str:
    return remote_root(cluster.remote_storage, os.environ)


def manifest_text(m: Manifest) -> str:
    import json

    from autohet_cli.recovery.manifest import manifest_to_dict

    return json.dumps(manifest_to_dict(m), indent=2) + "\n"


def transfers_for(
    choice: CheckpointChoice,
    new_plan: Plan,
    cluster: Cluster,
    present: Mapping[str, Mapping[str, str]],
    remote: Mapping[str, set[str]],
    lost: Sequence[str],
    root: str,
) -> TransferPlan:
    # Only files listed in the remote step dir count as remote copies.
    remote_files = set(remote.get(choice.step_dir, set()))
    return plan_transfers(
        choice.manifest,
        new_plan,
        cluster,
        present,
        remote_root=root,
        remote_files=remote_files,
        lost=lost,
    )
