"""``autohet profile run``: ship the probe to hosts over the transport, collect profiles.

Effects live here (SSH, files on hosts); the conversion of what the probe
prints into profile entries is pure (measure.py). One host per GPU type is
measured unless ``all_hosts``: same type, same numbers. Each host runs in its
own thread of a bounded pool, so a dead host costs its timeout, not the run.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from autohet_cli.cluster import Cluster, Host, python_for
from autohet_cli.errors import AutohetError, ConfigError, ProfileError
from autohet_cli.estimates.profile import Profile
from autohet_cli.models import ModelSpec
from autohet_cli.profiling.measure import DTYPES, profile_from_probe, spec_for
from autohet_cli.profiling.probepack import PROBE_FILE, write_probe
from autohet_cli.transport.base import Runner
from autohet_cli.transport.fanout import fan_out, runner_for
from autohet_cli.transport.pool import remote_home

Event = Callable[[str, str], None]  # (host, what is happening)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileRunRequest:
    cluster: Cluster
    model: ModelSpec
    seq_len: int
    tps: Sequence[int] = (1, 2, 4, 8)
    micro_batch_sizes: Sequence[int] = (1, 2, 4)
    hosts: Sequence[str] = ()  # empty: choose
    all_hosts: bool = False
    timeout_s: float = 900.0
    connect_timeout_s: float = 10.0
    known_hosts: Path | None = None
    accept_new_host_keys: bool = False
    max_parallel: int = 8
    time_budget_s: float | None = None
    measure_network: bool = True
    base_port: int = 29611
    # The precision the probe times layers in (``measure.DTYPES``): auto is the
    # probe's choice per host (bf16 or fp16 on a GPU, fp32 on a CPU).
    precision: str = "auto"
    # Phase 2 (``runcheck``): short runs of the runtime itself on each probed host.
    runtime_runs: bool = True
    runtime_steps: int = 8
    runtime_budget_s: float = 120.0


@dataclass(frozen=True, slots=True, kw_only=True)
class HostOutcome:
    host: str
    gpu_type: str
    seconds: float
    profile: Profile | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileRunResult:
    profile: Profile | None
    outcomes: tuple[HostOutcome, ...] = field(default_factory=tuple)

    @property
    def failed(self) -> list[HostOutcome]:
        return [o for o in self.outcomes if o.error is not None]


def select_hosts(cluster: Cluster, names: Sequence[str], all_hosts: bool) -> list[Host]:
    """The hosts to measure: the named ones, or every host, or per GPU type the
    host with the most GPUs (so TP all-reduces can be measured at every degree)."""
    if names:
        known = {h.name for h in cluster.hosts}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ConfigError(
                f"--hosts: {', '.join(unknown)} not in cluster {cluster.name!r} "
                f"(hosts: {', '.join(sorted(known))})"
            )
        return [h for h in cluster.hosts if h.name in names]
    if all_hosts:
        return list(cluster.hosts)
    best: dict[str, Host] = {}
    for h in cluster.hosts:
        if h.gpu_type not in best or h.num_gpus > best[h.gpu_type].num_gpus:
            best[h.gpu_type] = h
    return list(best.values())


def check_precision(hosts: Sequence[Host], precision: str) -> None:
    """Refuse a precision no plan could use before any host is reached: the runtime
    trains in fp32 on a CPU whatever a plan asks (``runtime.trainer``), so a CPU
    timed in 16 bits would file numbers no run of it ever shows."""
    if precision not in DTYPES:
        raise ConfigError(f"--precision: expected one of {', '.join(DTYPES)}, got {precision!r}")
    cpus = [h.name for h in hosts if h.gpu_type == "cpu"]
    if precision in ("auto", "fp32") or not cpus:
        return
    which = "is a CPU host" if len(cpus) == 1 else "are CPU hosts"
    raise ConfigError(
        f"--precision {precision}: {', '.join(cpus)} {which} (gpus.type cpu in the "
        "cluster file), and the runtime trains in fp32 on a CPU whatever a plan asks, so "
        f"{precision} times there would predict nothing that runs; measure with "
        "--precision auto or fp32 and plan with --precision fp32, or leave the CPU hosts "
        "out with --hosts"
    )


def measured_precision(outcome: HostOutcome) -> str | None:
    """The precision ``outcome``'s entries were measured in ("fp32, bf16" if mixed);
    None when the host failed or only its device facts were measured."""
    if outcome.profile is None:
        return None
    dtypes = sorted({e.dtype for e in outcome.profile.entries.values()})
    return ", ".join(dtypes) or None


def run_profiling(req: ProfileRunRequest, on_event: Event | None = None) -> ProfileRunResult:
    note = on_event or (lambda _h, _m: None)
    if req.known_hosts is None and req.cluster.known_hosts is not None:
        # The cluster file's known_hosts, as launch and recover read it (--known-hosts wins).
        req = replace(req, known_hosts=Path(req.cluster.known_hosts).expanduser())
    hosts = select_hosts(req.cluster, req.hosts, req.all_hosts)
    check_precision(hosts, req.precision)

    def one(host: Host) -> HostOutcome:
        start = time.monotonic()
        try:
            prof = profile_host(host, req, lambda msg: note(host.name, msg))
            if req.runtime_runs:
                prof = runtime_runs(host, req, prof, lambda msg: note(host.name, msg), stop)
        except AutohetError as exc:
            note(host.name, f"failed: {exc}")
            return HostOutcome(
                host=host.name,
                gpu_type=host.gpu_type,
                seconds=time.monotonic() - start,
                error=str(exc),
            )
        note(host.name, "done")
        return HostOutcome(
            host=host.name, gpu_type=host.gpu_type, seconds=time.monotonic() - start, profile=prof
        )

    stop = threading.Event()  # Ctrl-C: the runtime runs stop their hosts' workers
    try:
        results = fan_out(hosts, one, max_workers=req.max_parallel)
    except KeyboardInterrupt:
        stop.set()
        raise
    outcomes = []
    for h in hosts:
        got = results[h.name]
        if isinstance(got, Exception):  # a bug, not a host problem: keep the others
            got = HostOutcome(
                host=h.name, gpu_type=h.gpu_type, seconds=0.0, error=f"{type(got).__name__}: {got}"
            )
        outcomes.append(got)
    profile = combine(outcomes)
    if profile is not None and req.measure_network:
        ok = [h for h, o in zip(hosts, outcomes, strict=True) if o.error is None]
        links = measure_links(ok, req, note)
        if links:
            profile = replace(profile, meta={**profile.meta, "network": links})
    return ProfileRunResult(profile=profile, outcomes=tuple(outcomes))


def runtime_runs(
    host: Host,
    req: ProfileRunRequest,
    prof: Profile,
    say: Callable[[str], None],
    stop: threading.Event | None = None,
) -> Profile:
    """``prof`` refitted from short runs of the runtime on ``host`` (``runcheck``);
    whatever goes wrong there, the probe's measurements are kept and it is said."""
    from autohet_cli.profiling.runcheck import RunCheckOptions, check_host
    from autohet_cli.transport.pool import ConnectOptions

    options = RunCheckOptions(
        steps=req.runtime_steps,
        budget_s=req.runtime_budget_s,
        connect=ConnectOptions(
            known_hosts=req.known_hosts,
            accept_new_host_keys=req.accept_new_host_keys,
            connect_timeout_s=req.connect_timeout_s,
        ),
    )
    one = Cluster(
        name=req.cluster.name,
        hosts=(host,),
        inter_node_gbps=req.cluster.inter_node_gbps,
        gpu_specs=req.cluster.gpu_specs,
    )
    tps = [t for t in req.tps if t <= host.num_gpus]
    try:
        refit, _ = check_host(
            host,
            one,
            req.model,
            prof,
            seq_len=req.seq_len,
            tps=tps,
            mbs_candidates=req.micro_batch_sizes,
            options=options,
            say=say,
            stop=stop,
        )
    except Exception as exc:  # noqa: BLE001 - a bug here must not cost the probe's work
        record = {"shape": "-", "status": "failed", "why": f"{type(exc).__name__}: {exc}"}
        return replace(prof, meta={**prof.meta, "runtime_runs": {host.name: [record]}})
    return refit


def link_pairs(hosts: Sequence[Host]) -> list[tuple[Host, Host]]:
    """Every pair on small clusters; a ring of neighbours on big ones."""
    if len(hosts) <= 4:
        return [(a, b) for i, a in enumerate(hosts) for b in hosts[i + 1 :]]
    return [(hosts[i], hosts[(i + 1) % len(hosts)]) for i in range(len(hosts))]


def measure_links(
    hosts: Sequence[Host], req: ProfileRunRequest, note: Event
) -> list[dict[str, object]]:
    """Inter-host Gbit/s per pair, one pair at a time so links do not contend."""
    out: list[dict[str, object]] = []
    for i, (a, b) in enumerate(link_pairs(hosts)):
        note(a.name, f"bandwidth to {b.name}")
        try:
            gbps = measure_link(a, b, req, port=req.base_port + i)
        except AutohetError as exc:
            out.append({"hosts": [a.name, b.name], "error": str(exc)})
            continue
        out.append({"hosts": [a.name, b.name], "gbps": round(gbps, 3)})
    return out


def combine(outcomes: Sequence[HostOutcome]) -> Profile | None:
    """Merge per-host profiles; meta lists every host measured and every failure."""
    merged: Profile | None = None
    for o in outcomes:
        if o.profile is not None:
            merged = o.profile if merged is None else merged.merged_with(o.profile)
    if merged is None:
        return None
    meta = dict(merged.meta)
    meta["hosts"] = sorted(o.host for o in outcomes if o.profile is not None)
    meta["unreachable"] = {o.host: o.error for o in outcomes if o.error is not None}
    runs = {
        host: records
        for o in outcomes
        if o.profile is not None
        for host, records in o.profile.meta.get("runtime_runs", {}).items()
    }
    if runs:
        meta["runtime_runs"] = runs
    return replace(merged, meta=meta)


def remote_workdir(runner: Runner, host: Host) -> str:
    """The host's workdir with a leading ``~`` expanded on that host."""
    if not host.workdir.startswith("~"):
        return host.workdir
    return remote_home(runner) + host.workdir[1:]


def private_workdir(runner: Runner, host: Host, path: str, workdir: str) -> None:
    """Make ``path`` under the host's workdir by the private-directory rule: the probe
    sent there runs as the user, so nobody else may be able to swap it."""
    from autohet_cli.launch.preflight import private_dir_argv

    res = runner.run(private_dir_argv(host, path, workdir), timeout_s=30)
    if res.exit_code != 0:  # not .check(): it would print the whole program
        tail = " | ".join(res.stderr.strip().splitlines()[-3:]) or "no output"
        raise ProfileError(f"host {host.name}: cannot make {path} (exit {res.exit_code}): {tail}")
    why = res.stdout.strip()
    if why:
        raise ProfileError(
            f"host {host.name}: refusing the workdir {workdir}: {why}; the probe sent there "
            "runs as you, so someone else could swap it. Use a directory only you can write "
            "(the default is ~/autohet)"
        )


def profile_host(host: Host, req: ProfileRunRequest, say: Callable[[str], None]) -> Profile:
    """Copy the probe and its spec to ``host``, run it, bring the result back."""
    tps = [t for t in req.tps if t <= host.num_gpus] or [1]
    spec = spec_for(
        req.model,
        req.seq_len,
        tps,
        req.micro_batch_sizes,
        req.precision,
        time_budget_s=req.time_budget_s,
        cpu_threads=1 if host.gpu_type == "cpu" and host.num_gpus > 1 else None,
    )
    say("connecting")
    with (
        runner_for(
            host,
            known_hosts=req.known_hosts,
            accept_new_host_keys=req.accept_new_host_keys,
            connect_timeout_s=req.connect_timeout_s,
        ) as runner,
        tempfile.TemporaryDirectory(prefix="autohet-probe-") as tmp,
    ):
        workdir = remote_workdir(runner, host)
        remote = f"{workdir.rstrip('/')}/profile-{uuid.uuid4().hex[:8]}"
        private_workdir(runner, host, remote, workdir)
        local_spec = Path(tmp) / "spec.json"
        local_spec.write_text(json.dumps(spec), encoding="utf-8")
        say("copying the probe")
        runner.put(write_probe(Path(tmp) / PROBE_FILE), f"{remote}/{PROBE_FILE}")
        runner.put(local_spec, f"{remote}/spec.json")
        say("measuring")
        argv = [
            python_for(host),
            f"{remote}/{PROBE_FILE}",
            "--spec",
            f"{remote}/spec.json",
            "--out",
            f"{remote}/result.json",
        ]
        runner.run(
            argv, timeout_s=req.timeout_s, on_line=lambda _stream, line: say(line[-80:])
        ).check()
        local_out = Path(tmp) / "result.json"
        runner.get(f"{remote}/result.json", local_out)
        runner.run(["rm", "-rf", remote], timeout_s=30)
        try:
            result = json.loads(local_out.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ProfileError(f"host {host.name}: probe wrote invalid JSON: {exc}") from None
    return profile_from_probe(req.model, result, host=host.name, gpu_type=host.gpu_type)


NETPROBE = Path(__file__).with_name("netprobe.py")


def measure_link(a: Host, b: Host, req: ProfileRunRequest, port: int) -> float:
    """Gbit/s of a two-rank all-reduce between hosts ``a`` (rank 0) and ``b``."""
    runners = [
        runner_for(
            h,
            known_hosts=req.known_hosts,
            accept_new_host_keys=req.accept_new_host_keys,
            connect_timeout_s=req.connect_timeout_s,
        )
        for h in (a, b)
    ]
    try:
        handles = []
        for rank, (host, runner) in enumerate(zip((a, b), runners, strict=True)):
            workdir = remote_workdir(runner, host)
            remote = f"{workdir.rstrip('/')}/netprobe-{uuid.uuid4().hex[:8]}.py"
            private_workdir(runner, host, workdir, workdir)
            runner.put(NETPROBE, remote)
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": a.address,
                "MASTER_PORT": str(port),
            }
            if a.address.startswith("127.") and b.address.startswith("127."):
                env["GLOO_SOCKET_IFNAME"] = "lo"  # keep loopback tests on loopback
            handles.append((runner, remote, runner.start([python_for(host), remote], env=env)))
        codes = [h.wait(req.timeout_s) for _, _, h in handles]
        for (runner, remote, _), code in zip(handles, codes, strict=True):
            runner.run(["rm", "-f", remote], timeout_s=30)
            if code != 0:
                raise ProfileError(
                    f"bandwidth probe between {a.name} and {b.name} failed on "
                    f"{runner.host_name} (exit {code})"
                )
        out = handles[0][2].stdout.strip().splitlines()
        return float(json.loads(out[-1])["gbps"])
    finally:
        for r in runners:
            r.close()
