"""Start, signal and stop each host's torchrun over the transport (effects).

Every host's torchrun runs in its own process group; its pid goes to a pid file on
the host before torchrun runs, and stopping is always by that pid, never by process
name. ``launch.executor.Job`` runs these on every host at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from autohet_cli.errors import AutohetError
from autohet_cli.launch import hostcmds
from autohet_cli.launch.outcome import LaunchError
from autohet_cli.launch.specs import LaunchSpec
from autohet_cli.transport.base import ProcessHandle, Runner
from autohet_cli.workerbase.records import LAUNCH_TIME_ENV

PID_WAIT_S = 15.0  # the SSH pid line arrives asynchronously


def prepare_host(
    runner: Runner, spec: LaunchSpec, plan_file: Path, token: str, ping_every_s: float
) -> None:
    """Make the host's run directory (never reusing one), copy the plan there and
    start answering keep-alives (``liveness``)."""
    res = runner.run(
        ["sh", "-c", hostcmds.MKRUN, "sh"]
        + [spec.workdir, str(Path(spec.run_dir).parent), spec.run_dir, token],
        timeout_s=60,
    )
    if res.exit_code != 0:
        raise LaunchError(
            f"{spec.host}: cannot create the run directory {spec.run_dir}: "
            f"{res.stderr.strip() or 'exists'}; a run directory is never reused "
            "(its old heartbeats would be judged): pick another --run-id"
        )
    runner.put(plan_file, spec.plan_path)
    runner.start_pings(ping_every_s)  # answered from now on: see liveness


def start_host(
    runner: Runner, spec: LaunchSpec, on_line: Callable[[str, str], None]
) -> ProcessHandle:
    """Start the host's torchrun; returns once its pid is known (or it ended)."""
    # The workers measure their start-up from this moment (runtime.startup).
    env = {**spec.env, LAUNCH_TIME_ENV: f"{time.time():.3f}"}
    handle = runner.start(
        spec.argv,
        env=env,
        cwd=spec.workdir,
        on_line=on_line,
        pid_file=spec.pid_file,  # before torchrun runs: recover sees it at once
    )
    deadline = time.monotonic() + PID_WAIT_S
    while handle.pid is None and handle.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return handle


def notify(runner: Runner, pid: int) -> None:
    """One SIGTERM to the host's torchrun agent (its process group ``pid``): the
    workers' preemption notice (``runtime.agent`` forwards it, ``runtime.preempt``
    saves)."""
    try:
        runner.run(
            ["sh", "-c", 'kill -TERM -- "-$1" 2>/dev/null || kill -TERM "$1"', "sh"] + [str(pid)],
            timeout_s=20,
        )
    except AutohetError:
        pass  # unreachable: the watch judges it


def stop_hosts(
    handles: Mapping[str, ProcessHandle], runner: Callable[[str], Runner], grace_s: float
) -> set[str]:
    """Stop these hosts' torchrun and the workers under it (``hostcmds.stop_tree``),
    all at once: TERM, ``grace_s`` to save, then KILL; ``grace_s`` 0: KILL at once.
    Returns the hosts whose stop ended in time."""
    threads = []
    for host, handle in handles.items():
        t = threading.Thread(
            target=hostcmds.stop_tree,
            args=(runner(host), handle, grace_s),
            name=f"{host}-stop",
            daemon=True,
        )
        t.start()
        threads.append((host, t))
    stopped = set()
    for host, t in threads:
        t.join(grace_s + 20)
        if not t.is_alive():
            stopped.add(host)
    return stopped
