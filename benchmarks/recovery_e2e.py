"""Recovery end to end: from killing a host (SIGKILL, no notice) to the first resumed step.

Three real sshd "hosts" on loopback train one 3-stage pipeline (one CPU "GPU" per
host; stage cuts balance the parameters, so each host holds a like share of the
checkpoint, the embedding in the first stage and the head in the last), saving every
few steps with a copy in remote storage. Once a save is durable (COMPLETE on the
hosts and in remote storage, and the hosts' files have stopped changing: background
uploads and peer copies are done) the host of the last stage vanishes: its sshd and
every process under it are SIGKILLed. The launcher detects it and stops the others;
then ``autohet recover`` (in this process, as the CLI runs it, with its defaults)
replans on the two survivors, moves the checkpoint and relaunches. Measured, from
the kill:

detect     the launcher's verdict "lost" (the others stopped)
replan     recover's start: survivor probe, checkpoint choice, replan
transfer   the files each new host needs, from peers first, remote for the rest
restart    the relaunch up to the workers' first import: preflight, SSH, torchrun
           and its rendezvous, and the workers' imports, process group and build
load       the checkpoint load in the workers (rank 0)
first step the first resumed step

Two ways, each ``AUTOHET_BENCH_REPEATS`` times (default 3, medians):

autohet      ``autohet launch`` and ``autohet recover`` as they are: survivors keep
             their files, peers send what the new plan needs (partner copies
             included), remote storage only what no survivor holds
remote-only  what a user has today (Varuna-like): stop, restart from remote storage
             alone (every step directory on the survivors, partner copies included,
             deleted before recovering)

Remote storage is read through an fsspec filesystem throttled to a stated rate,
``AUTOHET_BENCH_REMOTE_MBPS`` (default 300 MB/s: one VM reading object storage);
recover then relays what it read to the host that needs it, which costs what it costs.
Printed per way: bytes from peers and from remote, the copy rates recover measured,
the breakdown, a projection of both ways to a 1.2B llama's 15 GB checkpoint on
25 Gbit/s NICs against 2.5 Gbit/s object storage (``recovery_projection``), and
where issue 30's targets stand.

Sizes (``AUTOHET_BENCH_SIZES``, comma-separated, default ``toy,200m``): ``toy`` is
gpt-small (80 MB per save); ``200m`` a ~200M llama (hidden 1024, 12 layers, 2.4 GB
per save) in the same three-host scenario; ``200m-disk`` the one-host disk benchmark
(``python -m benchmarks recovery_disk``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autohet_cli.ckpt.format import COMPLETE, MANIFEST, load_manifest, parse_step_dir
from autohet_cli.hfconfig import load_hf_config
from autohet_cli.launch import session
from autohet_cli.models import ModelSpec, get_model
from autohet_cli.plan import write_plan
from autohet_cli.recovery import executor as rx
from autohet_cli.recovery import session as rsession
from autohet_cli.transport.pool import ConnectOptions
from autohet_cli.yamlio import sha256_file
from benchmarks import recovery_e2e_report, recovery_time
from benchmarks._recovery import (
    HF_CONFIG_200M,
    Stamped,
    balanced_cuts,
    copy_paths,
    copy_rate,
    remote_bytes_per_s,
    repeats,
    startup_phases,
)
from benchmarks._sshd import sshd_farm, sshd_missing
from tests.e2e.sshd import SshdFarm
from tests.e2e.test_launch import _cluster_file, free_port
from tests.planting import plan_of, stage

SIZES = ("toy", "200m", "200m-disk")
DEFAULT_SIZES = ("toy", "200m")
WAYS = ("autohet", "remote-only")
QUIET_S = 1.0  # no file under any checkpoint dir changed for this long: nothing in flight
_IN_FLIGHT = (".autohet-part", ".tmp")  # endings of files still being written (and .tmp-*)


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    size: str
    plan_name: str
    hf_config: Mapping[str, object] | None  # None: the zoo's gpt-small
    save_every: int  # steps to the first save and between saves: room for it to settle
    resumed_steps: int  # the recovered run's steps after its checkpoint
    wait_s: float  # for a durable save, and for the launcher to stop


SCENARIOS = {
    "toy": Scenario(
        size="toy",
        plan_name="bench-rec",
        hf_config=None,
        save_every=20,
        resumed_steps=3,
        wait_s=600,
    ),
    "200m": Scenario(
        size="200m",
        plan_name="bench-rec-200m",
        hf_config=HF_CONFIG_200M,
        save_every=6,
        resumed_steps=2,
        wait_s=1800,
    ),
}


def selected_sizes(raw: str | None) -> list[str]:
    """``AUTOHET_BENCH_SIZES`` (comma-separated; unset: ``toy,200m``)."""
    sizes = [s.strip() for s in (raw or ",".join(DEFAULT_SIZES)).split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or not sizes:
        raise SystemExit(
            f"AUTOHET_BENCH_SIZES: unknown {', '.join(unknown) or '(empty)'}; sizes: "
            f"{', '.join(SIZES)}"
        )
    return sizes


def main() -> None:
    sizes = selected_sizes(os.environ.get("AUTOHET_BENCH_SIZES"))
    count, rate = repeats(os.environ), remote_bytes_per_s(os.environ)
    if sshd_missing():
        return
    for size in sizes:
        print(f"--- size {size}", flush=True)
        with sshd_farm() as (root, farm):
            if size == "200m-disk":
                from benchmarks import recovery_disk

                recovery_disk.run(root, farm)
            else:
                _run(SCENARIOS[size], root, farm, count, rate)


def _model(sc: Scenario, tmp: Path) -> ModelSpec:
    if sc.hf_config is None:
        return get_model("gpt-small")
    (tmp / "config.json").write_text(json.dumps(sc.hf_config))
    return load_hf_config(str(tmp / "config.json"))  # what `autohet plan` reads


def _layout(sc: Scenario, tmp: Path, num_hosts: int) -> tuple[ModelSpec, list[tuple[int, int]]]:
    """The model and its stage cuts (one stage per host, balanced by parameters)."""
    spec = _model(sc, tmp)
    return spec, list(balanced_cuts([x.num_params for x in spec.layers()], num_hosts))


def _plan(sc: Scenario, tmp: Path, cluster: Path, hosts: list[str]) -> Path:
    spec, cuts = _layout(sc, tmp, len(hosts))
    plan = plan_of(
        [stage(a, b, h) for (a, b), h in zip(cuts, hosts, strict=True)],
        precision="fp32",
        model=spec,
        architecture=spec if sc.hf_config is not None else None,
        name=sc.plan_name,
        version=0,
        inputs={"cluster": {"path": str(cluster), "sha256": sha256_file(cluster)}},
    )
    _, path = write_plan(plan, tmp / "plans")
    return path


def _run(sc: Scenario, root: Path, farm: SshdFarm, count: int, rate: float) -> None:
    farm.start(3)
    remote = root / "remote"
    cluster = _cluster_file(farm, root / "cluster.yaml", remote_storage=str(remote))
    connect = ConnectOptions(known_hosts=farm.known_hosts)
    spec, cuts = _layout(sc, root, len(farm.hosts))
    params = [sum(x.num_params for x in spec.layers()[a:b]) for a, b in cuts]
    print(
        f"{spec.name} ({spec.num_params / 1e6:.0f}M parameters) on {len(cuts)} hosts, layers "
        + ", ".join(f"[{a},{b}) {p / 1e6:.1f}M" for (a, b), p in zip(cuts, params, strict=True))
        + f"; the host of the last stage is killed; {count} run(s) of each way",
        flush=True,
    )
    recovery_time.RATE["bytes_per_s"] = rate
    # recover reads the remote copy through this throttled filesystem; the workers
    # write it as the cluster file says (unthrottled: uploads are not measured).
    real_root = rx.remote_root_for
    rx.remote_root_for = lambda cl: f"throttled://{real_root(cl)}"  # type: ignore[assignment]
    results: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    try:
        for i in range(count):
            for way, runs in results.items():
                runs.append(_once(sc, root / f"{way}-{i}", farm, cluster, remote, connect, way))
                print(f"  {sc.size} {way} run {i + 1}: {runs[-1]['total']:.1f} s", flush=True)
    finally:
        rx.remote_root_for = real_root
    from benchmarks import peer_link

    link = peer_link.measure(root / "peer-link", 1536 << 20, 3)
    recovery_e2e_report.report(
        sc.size, results, remote_bytes_per_s=rate, link_bytes_per_s=link.copy_bytes_per_s
    )


def _once(
    sc: Scenario,
    tmp: Path,
    farm: SshdFarm,
    cluster: Path,
    remote: Path,
    connect: ConnectOptions,
    way: str,
) -> dict[str, Any]:
    tmp.mkdir(parents=True)
    for d in (*(h.checkpoint_dir for h in farm.hosts), remote):  # one job per run
        shutil.rmtree(d / sc.plan_name, ignore_errors=True)
    for h in farm.hosts:
        h.start()
    names = [h.name for h in farm.hosts]
    plan = _plan(sc, tmp, cluster, names)
    out = Stamped()
    req = session.LaunchRequest(
        plan_file=plan,
        steps=1_000_000,
        checkpoint_every=str(sc.save_every),
        master_port=free_port(),
        connect=connect,
        runs_root=tmp / "runs",
    )
    done: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: done.update(r=session.launch(req, out)))
    thread.start()
    watched = [*(h.checkpoint_dir for h in farm.hosts), remote]
    step = _wait_durable(sc, farm, remote, watched, out, thread)
    killed = time.monotonic()
    farm.hosts[-1].stop()
    thread.join(sc.wait_s)
    if out.first(r"^lost: ", after=killed) is None:
        raise SystemExit(f"the launcher never declared {names[-1]} lost:\n{out.tail()}")
    detected = time.monotonic()  # launch returned: the others are stopped too
    if way == "remote-only":  # the survivors start empty: every file from remote
        for h in farm.hosts[:-1]:
            for d in [p for p in h.checkpoint_dir.rglob("*step-*") if p.is_dir()]:
                shutil.rmtree(d, ignore_errors=True)
    rec = Stamped()
    rreq = rsession.RecoverRequest(
        plan_file=plan,
        lost=(names[-1],),
        steps=step + sc.resumed_steps,
        checkpoint_every="0",
        master_port=free_port(),
        connect=connect,
        runs_root=tmp / "runs",
    )
    result = rsession.recover(rreq, rec)
    if result.exit_code != 0:
        raise SystemExit(f"recover failed ({result.exit_code}):\n{rec.tail()}")
    return _measure(sc, rec, result.report, remote, killed=killed, detected=detected, step=step)


def _measure(
    sc: Scenario,
    rec: Stamped,
    report: dict[str, Any],
    remote: Path,
    *,
    killed: float,
    detected: float,
    step: int,
) -> dict[str, Any]:
    wrote = rec.first(r"^wrote .*; \d+ file\(s\) copied")
    started = rec.first(r"^\S+: started \d+ worker")
    first_step = rec.first(r"\] step \d+ loss ")
    startup = rec.first(r"autohet runtime: startup: ")
    if not (wrote and started and first_step and startup):
        raise SystemExit(f"recover's output lacks a phase:\n{rec.tail()}")
    phases = startup_phases(startup[1])
    transfer_s = report["phases"]["transfer"]
    tail = first_step[0] - wrote[0]
    load, first = phases.get("load", 0.0), phases.get("first_step", 0.0)
    resumed = int(report.get("resumed_step", step))
    peer_rate, peer_how = copy_rate(report, remote=False)
    remote_rate, _ = copy_rate(report, remote=True)
    return {
        "detect": detected - killed,
        "replan": wrote[0] - detected - transfer_s,
        "transfer": transfer_s,
        "restart": tail - load - first,
        "load": load,
        "first_step": first,
        "total": first_step[0] - killed,
        "bytes_remote": float(report.get("bytes_from_remote", 0)),
        "bytes_peers": float(report.get("bytes_from_peers", 0)),
        "bytes_checkpoint": float(_checkpoint_bytes(remote / sc.plan_name, resumed)),
        "peer_rate": peer_rate,
        "peer_rate_how": peer_how,
        "paths": copy_paths(report),
        "remote_rate": remote_rate,
        "killed_after_step": step,
        "resumed_step": resumed,
        # the restart's parts: recover's bookkeeping and launch's preflight, then
        # what the workers measured (runtime.startup)
        "prep": started[0] - wrote[0],
        **{k: phases.get(k, 0.0) for k in ("launch", "imports", "process_group", "build")},
    }


def _checkpoint_bytes(remote_plan_dir: Path, step: int) -> int:
    """Every file of the step, as its manifest lists them (the remote copy has one)."""
    (manifest,) = remote_plan_dir.glob(f"*/step-{step:08d}/{MANIFEST}")
    return load_manifest(manifest).num_bytes


def _wait_durable(
    sc: Scenario,
    farm: SshdFarm,
    remote: Path,
    watched: list[Path],
    out: Stamped,
    thread: threading.Thread,
) -> int:
    """The newest step COMPLETE on a host and in remote storage, once no file under
    ``watched`` is being written and none changed for QUIET_S (saves, uploads and
    peer copies settled)."""
    deadline = time.monotonic() + sc.wait_s
    last: tuple[tuple[str, int], ...] | None = None
    since = time.monotonic()
    while True:
        if not thread.is_alive():
            raise SystemExit(f"the training stopped before a durable save:\n{out.tail()}")
        if time.monotonic() > deadline:
            raise SystemExit(f"no durable save within {sc.wait_s:.0f} s:\n{out.tail()}")
        snap = _snapshot(watched)
        now = time.monotonic()
        if snap != last:
            last, since = snap, now
        elif now - since >= QUIET_S and not any(_in_flight(p) for p, _ in snap):
            step = _durable_step(
                [h.checkpoint_dir / sc.plan_name for h in farm.hosts], remote / sc.plan_name
            )
            if step is not None:
                return step
        time.sleep(0.25)


def _in_flight(path: str) -> bool:
    return any(part.startswith(".tmp-") or part.endswith(_IN_FLIGHT) for part in Path(path).parts)


def _snapshot(dirs: list[Path]) -> tuple[tuple[str, int], ...]:
    found = []
    for d in dirs:
        for p in d.rglob("*"):
            try:
                if p.is_file():
                    found.append((str(p), p.stat().st_size))
            except FileNotFoundError:
                continue  # removed while we looked: the next look sees it changed
    return tuple(sorted(found))


def _durable_step(host_plan_dirs: list[Path], remote_plan_dir: Path) -> int | None:
    """The newest step COMPLETE in remote storage and on some host (rank 0 writes the
    manifest and COMPLETE once every host's files are in place; any job)."""

    def steps(d: Path) -> set[int]:
        found = {parse_step_dir(c.parent.name) for c in d.glob(f"*/step-*/{COMPLETE}")}
        return {s for s in found if s is not None}

    on_hosts = set().union(*(steps(d) for d in host_plan_dirs))
    common = on_hosts & steps(remote_plan_dir)
    return max(common) if common else None


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
