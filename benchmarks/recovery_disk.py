"""Recovery at the speed of the disk: a ~200M LLaMA on one CPU device, 2.4 GB per save.

``python -m benchmarks recovery_disk``, or ``AUTOHET_BENCH_SIZES=200m-disk`` of
``recovery_e2e`` (whose ``200m`` is the same model on three hosts).
One loopback sshd host trains the model below (fp32, Adam: 12 bytes per parameter
in every save), saving every 2 steps. After step 5, with step 4 durable, the whole
launch is SIGKILLed (the host's sshd and every process under it); the host comes
back and ``autohet launch --resume`` continues. Measured:

blocked    training stood still for a save (``ckpt_blocked_s`` in metrics.jsonl)
persisted  a save's start to its step durable and COMPLETE (``ckpt_persist_s``)
detect     the kill to the launcher's verdict "lost"
transfer   remote-only: the step's files from remote storage, read at
           ``AUTOHET_BENCH_REMOTE_MBPS`` (default 300 MB/s)
build      the relaunched worker's model, optimizer and data (its startup line)
load       the checkpoint load: listing, verification, DCP read (its startup line)
total      the kill to the first resumed step (the sshd restart left out)

Two ways, each ``AUTOHET_BENCH_REPEATS`` times (median): ``autohet`` resumes from
the host's own disk (no remote copy configured: the saves' figures are the disk's
alone); ``remote-only``
uploads every save to remote storage and, after the kill, starts from it alone (the
host's copies deleted). Against the disk's own speed, measured in the same run: a
plain write of a save's bytes with fsync into the same checkpoint directory. Targets:
blocked <= 1/4 of that write, persisted <= 1.5x, build + load <= 1.5x + 3 s.
The page cache survives a killed worker; ``AUTOHET_BENCH_DROP_CACHES=1`` (root) drops
it before the relaunch, as a reboot would, so the load reads the disk.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from autohet_cli.ckpt.format import COMPLETE, step_dir_name
from autohet_cli.hfconfig import load_hf_config
from autohet_cli.launch import session
from autohet_cli.plan import write_plan
from autohet_cli.transport.pool import ConnectOptions
from autohet_cli.yamlio import sha256_file
from benchmarks import recovery_time
from benchmarks._common import table
from benchmarks._recovery import (
    HF_CONFIG_200M,
    REMOTE_ENV,
    Stamped,
    remote_bytes_per_s,
    repeats,
    startup_phases,
)
from benchmarks._sshd import sshd_farm, sshd_missing
from tests.e2e.sshd import FakeSshHost, SshdFarm
from tests.e2e.test_launch import free_port
from tests.planting import plan_of, stage

PLAN_NAME = "bench-disk"
HF_CONFIG = HF_CONFIG_200M
SEQ_LEN = 64
SAVE_EVERY, KILL_AFTER_STEP, DURABLE_STEP = 2, 5, 4
WAIT_S = 1200.0
DROP_CACHES = os.environ.get("AUTOHET_BENCH_DROP_CACHES") == "1"  # root only
_CHUNK = 16 << 20
_METRICS = re.compile(r"^metrics: [^:]+:(\S+)/metrics\.jsonl")
COLS = ("blocked", "persisted", "detect", "transfer", "build", "load", "first_step", "total")


def _plan(tmp: Path, cluster: Path, host: str) -> Path:
    (tmp / "config.json").write_text(json.dumps(HF_CONFIG))
    spec = load_hf_config(str(tmp / "config.json"))  # what `autohet plan` reads
    plan = plan_of(
        [stage(0, spec.num_layers, host)],
        seq_len=SEQ_LEN,
        precision="fp32",
        model=spec,
        name=PLAN_NAME,
        version=0,
        inputs={"cluster": {"path": str(cluster), "sha256": sha256_file(cluster)}},
    )
    return write_plan(plan, tmp / "plans")[1]


def _cluster(h: FakeSshHost, path: Path, remote: Path | None) -> Path:
    doc: dict[str, Any] = {
        "schema": "autohet.cluster/v1",
        "name": "disk",
        "network": {"inter_node_gbps": 10},
        "hosts": [h.cluster_entry()],
    }
    if remote is not None:
        doc["remote_storage"] = str(remote)
    path.write_text(yaml.safe_dump(doc))
    return path


def _wait(what: str, ready: Any, out: Stamped) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready():
        if time.monotonic() > deadline:
            tail = "\n".join(ln for _, ln in out.lines[-30:])
            raise SystemExit(f"{what} never happened:\n{tail}")
        time.sleep(0.2)


def _saves(out: Stamped) -> list[dict[str, Any]]:
    """The ckpt_* records of the run's metrics.jsonl ([] before the async save)."""
    found = out.first(_METRICS.pattern)
    m = _METRICS.match(found[1]) if found else None
    path = Path(os.path.expanduser(m.group(1))) / "metrics.jsonl" if m else None
    if path is None or not path.is_file():
        return []
    records = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return [r for r in records if "ckpt_persist_s" in r]


def plain_write_s(directory: Path, nbytes: int) -> float:
    """The disk's own speed: ``nbytes`` written in 16 MiB pieces and fsynced."""
    path = directory / ".bench-plain-write"
    block = memoryview(os.urandom(_CHUNK))
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[: min(left, _CHUNK)])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def _from_remote(remote: Path, job_dir: Path) -> float:
    """Delete the host's steps, then copy the newest remote COMPLETE step through the
    throttled filesystem (what recover does for files no survivor holds)."""
    for d in job_dir.glob("step-*"):
        shutil.rmtree(d)
    src_job = remote / PLAN_NAME / job_dir.name
    done = sorted(d for d in src_job.glob("step-*") if (d / COMPLETE).is_file())
    assert done, f"no COMPLETE step in {src_job}"
    fs = recovery_time.ThrottledFS()
    start = time.perf_counter()
    dest = job_dir / done[-1].name
    dest.mkdir(mode=0o700)
    for f in sorted(done[-1].iterdir(), key=lambda p: p.name == COMPLETE):  # COMPLETE last
        with fs.open(str(f), "rb") as src, (dest / f.name).open("wb") as out:
            shutil.copyfileobj(src, out, _CHUNK)
    return time.perf_counter() - start


def _once(tmp: Path, h: FakeSshHost, connect: ConnectOptions, mode: str) -> dict[str, Any]:
    tmp.mkdir(parents=True)
    jobs = h.checkpoint_dir / PLAN_NAME
    shutil.rmtree(jobs, ignore_errors=True)  # the previous run's job: one job per run
    h.start()
    remote = tmp / "remote" if mode == "remote-only" else None
    plan = _plan(tmp, _cluster(h, tmp / "cluster.yaml", remote), h.name)
    out = Stamped()
    out.wait_for = f"step {KILL_AFTER_STEP} "
    req = session.LaunchRequest(
        plan_file=plan,
        steps=1000,
        checkpoint_every=str(SAVE_EVERY),
        keep_checkpoints=2,
        master_port=free_port(),
        connect=connect,
        runs_root=tmp / "runs",
    )
    thread = threading.Thread(target=lambda: session.launch(req, out))
    thread.start()
    _wait(f"step {KILL_AFTER_STEP}", out.event.is_set, out)
    durable = step_dir_name(DURABLE_STEP) + "/" + COMPLETE
    _wait(f"{durable} on disk", lambda: any(jobs.glob(f"*/{durable}")), out)
    if remote is not None:
        _wait(f"{durable} uploaded", lambda: any(remote.glob(f"{PLAN_NAME}/*/{durable}")), out)
    killed = time.monotonic()
    h.stop()
    thread.join(600)
    assert out.first(r"^lost: ", after=killed) is not None, out.lines[-20:]
    detected = time.monotonic()
    saves = _saves(out)
    (job_dir,) = [d for d in jobs.iterdir() if d.is_dir()]
    nbytes = sum(f.stat().st_size for f in job_dir.glob(f"{step_dir_name(DURABLE_STEP)}/*"))
    transfer = _from_remote(remote, job_dir) if remote is not None else 0.0
    if DROP_CACHES:  # as after a reboot: the load reads the disk, not the page cache
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    h.start()
    rec = Stamped()
    relaunched = time.monotonic()
    result = session.launch(
        session.LaunchRequest(
            plan_file=plan,
            steps=KILL_AFTER_STEP + 3,
            checkpoint_every="0",
            resume=True,
            master_port=free_port(),
            connect=connect,
            runs_root=tmp / "runs",
        ),
        rec,
    )
    first_step = rec.first(r"\] step \d+ loss ")
    startup = rec.first(r"autohet runtime: startup: ")
    resumed = rec.first(r"resumed from ")
    if result.outcome.exit_code != 0 or not (first_step and startup and resumed):
        log = Path(result.outcome.local_run_dir) / f"{h.name}.log"
        errors = (
            [ln for ln in log.read_text().splitlines() if "rror" in ln] if log.is_file() else []
        )
        raise SystemExit(
            f"the resumed run failed ({result.outcome.detail}; {result.outcome.root_cause}):\n"
            + "\n".join([*errors[-10:], *(ln for _, ln in rec.lines[-15:])])
        )
    phases = startup_phases(startup[1])
    record_bytes = saves[0].get("ckpt_bytes") if saves else None
    write_s = plain_write_s(h.checkpoint_dir, int(record_bytes or nbytes))
    h.stop()
    for d in (tmp, jobs):
        shutil.rmtree(d, ignore_errors=True)
    return {
        "blocked": statistics.median(r["ckpt_blocked_s"] for r in saves) if saves else None,
        "persisted": statistics.median(r["ckpt_persist_s"] for r in saves) if saves else None,
        "detect": detected - killed,
        "transfer": transfer,
        "build": phases.get("build"),
        "load": phases.get("load"),
        "first_step": phases.get("first_step"),
        "total": detected - killed + transfer + first_step[0] - relaunched,
        "write_s": write_s,
        "bytes": int(record_bytes or nbytes),
        "saves": len(saves),
    }


def main() -> None:
    """``python -m benchmarks recovery_disk`` (also ``AUTOHET_BENCH_SIZES=200m-disk`` of
    ``recovery_e2e``)."""
    if sshd_missing():
        return
    with sshd_farm() as (root, farm):
        run(root, farm)


def run(root: Path, farm: SshdFarm) -> None:
    """Both ways ``AUTOHET_BENCH_REPEATS`` times on one sshd host of ``farm``; prints the
    table."""
    (h,) = farm.start(1)
    h.stop()
    connect = ConnectOptions(known_hosts=farm.known_hosts)
    recovery_time.RATE["bytes_per_s"] = remote_bytes_per_s(os.environ)
    results: dict[str, list[dict[str, Any]]] = {"autohet": [], "remote-only": []}
    for i in range(repeats(os.environ)):
        for mode, runs in results.items():
            runs.append(_once(root / f"{mode}-{i}", h, connect, mode))
            print(f"  200m {mode} run {i + 1}: {runs[-1]['total']:.1f} s", flush=True)
    report(results)


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def report(results: dict[str, list[dict[str, Any]]]) -> None:
    every = [r for runs in results.values() for r in runs]
    write_s = statistics.median(r["write_s"] for r in every)
    nbytes = statistics.median(r["bytes"] for r in every)
    print(
        f"200m: {nbytes / 1e9:.2f} GB per save; plain write + fsync of as many bytes to the "
        f"same disk: {write_s:.2f} s ({nbytes / write_s / 1e9:.2f} GB/s, median of "
        f"{len(every)}); remote storage read at {recovery_time.RATE['bytes_per_s'] / 1e6:.0f} "
        f"MB/s ({REMOTE_ENV}); page "
        f"cache {'dropped' if DROP_CACHES else 'kept'} before the relaunch; "
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
    )
    rows = [[mode, *(_fmt(_median(runs, c)) for c in COLS)] for mode, runs in results.items()]
    print(table(["median s", *COLS], rows))
    ours = results["autohet"]
    if not any(r["saves"] for r in ours):
        print("blocked/persisted: n/a (no ckpt_* records in metrics.jsonl: saves not async yet)")
    build, load = _median(ours, "build"), _median(ours, "load")
    resume = None if build is None or load is None else build + load
    for name, got, bound in (
        ("blocked", _median(ours, "blocked"), write_s / 4),
        ("persisted", _median(ours, "persisted"), 1.5 * write_s),
        ("build + load", resume, 1.5 * write_s + 3),
    ):
        verdict = "n/a" if got is None else ("PASS" if got <= bound else "MISS")
        print(f"  {name:13} {_fmt(got):>8} s <= {bound:7.2f} s: {verdict}")
    base, mine = _median(results["remote-only"], "total"), _median(ours, "total")
    if base and mine:
        print(
            f"kill to first resumed step: autohet {mine:.1f} s, remote-only {base:.1f} s: "
            f"{base / mine:.2f}x faster"
        )


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"
