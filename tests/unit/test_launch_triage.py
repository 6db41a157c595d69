"""Failure triage: a lost host, failed workers (with their root cause), workers that never start."""

from __future__ import annotations

import json

from autohet_cli.launch.triage import (
    FAILED,
    FINISHED,
    HOST_LOST,
    NOT_STARTED,
    HostState,
    WorkerError,
    error_from_output,
    hint_for,
    parse_records,
    root_cause,
    triage,
)

STALE = 20.0


def host(name: str, **kw: object) -> HostState:
    return HostState(name=name, **kw)  # type: ignore[arg-type]


def test_all_running_and_fresh_is_no_verdict() -> None:
    hosts = [host("a", heartbeat_age_s=1.0), host("b", heartbeat_age_s=3.0)]
    assert triage(hosts, stale_after_s=STALE) is None


def test_all_exited_zero_is_finished() -> None:
    v = triage([host("a", exit_code=0), host("b", exit_code=0)], stale_after_s=STALE)
    assert v is not None and v.status == FINISHED and v.exit_code == 0


def test_unreachable_host_is_lost_and_only_it_is_offered_to_recover() -> None:
    hosts = [
        host("a", exit_code=1, errors=(WorkerError(host="a", kind="peer_lost", message="x"),)),
        host("b", unreachable="connection refused"),
    ]
    v = triage(hosts, stale_after_s=STALE)
    assert v is not None and v.status == HOST_LOST and v.recoverable
    assert v.lost_hosts == ("b",) and "connection refused" in v.detail


def test_stale_heartbeats_of_running_workers_mean_a_lost_host() -> None:
    v = triage([host("a", heartbeat_age_s=2), host("b", heartbeat_age_s=25)], stale_after_s=STALE)
    assert v is not None and v.status == HOST_LOST and v.lost_hosts == ("b",)


def test_a_crash_is_failed_workers_with_the_earliest_own_error_not_a_lost_host() -> None:
    crash = WorkerError(host="b", kind="error", message="ValueError: bad lr", rank=3, time_unix=10)
    later = WorkerError(host="a", kind="error", message="RuntimeError: later", rank=0, time_unix=11)
    consequence = WorkerError(host="a", kind="peer_lost", message="lost rank 3", time_unix=9)
    hosts = [
        host("a", exit_code=1, errors=(later, consequence)),
        host("b", exit_code=1, errors=(crash,)),
    ]
    v = triage(hosts, stale_after_s=STALE)
    assert v is not None and v.status == FAILED and not v.recoverable
    assert v.lost_hosts == () and v.failed_hosts == ("a", "b")
    assert v.root_cause == crash and "rank 3 on b" in v.detail and "bad lr" in v.detail


def test_peer_reports_count_only_without_an_own_error() -> None:
    peer = WorkerError(host="a", kind="peer_lost", message="lost contact with rank 1", time_unix=5)
    assert root_cause([host("a", exit_code=1, errors=(peer,))]) == peer


def test_torchrun_failure_without_records_is_read_from_the_output_with_a_hint() -> None:
    lines = (
        "Traceback (most recent call last):",
        '  File "x.py", line 3, in <module>',
        "torch.distributed.DistNetworkError: The server socket has failed to listen on any "
        "local network address. port: 29500, code: -98, name: EADDRINUSE",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    )
    v = triage([host("m", exit_code=1, output_tail=lines)], stale_after_s=STALE)
    assert v is not None and v.status == FAILED
    assert v.root_cause is not None and "EADDRINUSE" in v.root_cause.message
    assert "leave out --master-port" in v.detail


def test_runtime_error_line_beats_python_noise_and_signals_are_named() -> None:
    out = ["autohet runtime: error: vocab 7 not divisible", "ValueError: something else"]
    got = error_from_output("h", out)
    assert got is not None and got.message == "vocab 7 not divisible"
    killed = error_from_output("h", ["Signal 9 (SIGKILL) received by PID 4242"])
    assert killed is not None and "signal 9" in killed.message and "4242" in killed.message
    assert error_from_output("h", ["all good"]) is None


def test_workers_that_never_start_blame_that_host_after_the_deadline() -> None:
    hosts = [host("a", booted=True, heartbeat_age_s=1), host("b", booted=False)]
    assert triage(hosts, stale_after_s=STALE) is None  # before the deadline: wait
    v = triage(hosts, stale_after_s=STALE, start_deadline_passed=True)
    assert v is not None and v.status == NOT_STARTED and v.not_started_hosts == ("b",)
    assert not v.recoverable and "b did not start" in v.detail


def test_nothing_started_anywhere_points_at_the_rendezvous() -> None:
    hosts = [host("a", booted=False, output_tail=("waiting",)), host("b", booted=False)]
    v = triage(hosts, stale_after_s=STALE, start_deadline_passed=True)
    assert v is not None and v.status == NOT_STARTED and v.not_started_hosts == ("a", "b")
    assert "rendezvous" in v.detail and "a: waiting" in v.detail and "b: no output" in v.detail


def test_parse_records_reads_runtime_error_files_and_skips_garbage() -> None:
    rec = {"rank": 2, "host": "h", "kind": "error", "message": "boom", "time": 3.5, "place": "p"}
    got = parse_records("h", json.dumps(rec) + "\nnot json\n" + json.dumps({"x": 1}))
    assert got == [
        WorkerError(host="h", kind="error", message="boom", rank=2, place="p", time_unix=3.5)
    ]


def test_a_sigterm_is_never_called_out_of_memory_and_yields_to_a_telling_cause() -> None:
    """Issue 29: a resume on a full disk and a bad training flag were both reported as
    "killed by signal 15 (SIGTERM); out of memory?" with the stage-does-not-fit hint."""
    term = ["  traceback : Signal 15 (SIGTERM) received by PID 11"]
    got = error_from_output("h", term)
    assert got is not None and "out of memory" not in got.message
    assert "torchrun stops every worker this way once one fails" in got.message
    assert hint_for(got.message) == ""
    both = ["Signal 9 (SIGKILL) received by PID 12", *term]
    got = error_from_output("h", both)
    assert got is not None and "pid 12" in got.message
    # Issue 31: a SIGKILL is out of memory only with evidence (test_triage_evidence.py).
    assert got.message == "a worker (pid 12) was killed by signal 9 (SIGKILL)"


def test_a_flag_the_worker_refuses_is_the_root_cause() -> None:
    out = [
        "usage: python -m autohet_cli.runtime.train [-h] --plan PLAN",
        "python -m autohet_cli.runtime.train: error: unrecognized arguments: --lrr=0.1",
        "  traceback : Signal 15 (SIGTERM) received by PID 11",
    ]
    got = error_from_output("h", out)
    assert got is not None
    assert got.message.startswith(
        "the worker refused its flags: unrecognized arguments: --lrr=0.1 (check --train-arg"
    )
