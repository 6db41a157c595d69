"""The root cause of failed workers, read from real output (issue 31.2).

The logs in tests/data/torchrun are torchrun 2.13's own output, captured from two-worker
runs on this machine where rank 1 failed and torchrun SIGTERMed rank 0: ``giveup``
(exit 3 after one line), ``killed`` (kill -9 of itself), ``flags`` (a user script's
argparse refusal), ``cpuoom`` (torch's CPU allocator), ``pyoom`` (a bare
``MemoryError``) and ``builtin-lrr`` (``autohet launch --train-arg=--lrr=0.1`` before
the launcher checked flags). The worker's own argparse output is made here, live.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from test_launch_stop import _job

from autohet_cli.launch.triage import FAILED, HostState, error_from_output, triage
from autohet_cli.oom import EVIDENCE_PREFIX, evidence_line, kill_counts
from autohet_cli.oom import evidence as oom_evidence
from autohet_cli.runtime.train_args import parse_args

LOGS = Path(__file__).resolve().parents[1] / "data" / "torchrun"
STAGE_HINT = "the stage does not fit"


def log(name: str) -> list[str]:
    return (LOGS / f"{name}.log").read_text().splitlines()


def judge(*hosts: tuple[str, int, list[str]]) -> tuple[str, str]:
    """(root cause headline, the verdict's whole detail) of hosts (name, exit, output)."""
    states = [HostState(name=n, exit_code=c, output_tail=tuple(out)) for n, c, out in hosts]
    verdict = triage(states, stale_after_s=20.0)
    assert verdict is not None and verdict.status == FAILED and verdict.root_cause is not None
    return verdict.root_cause.headline(), verdict.detail


def torchrun_summary(name: str) -> list[str]:
    """torchrun's part of a log: from its SIGTERM to the other workers on."""
    lines = log(name)
    return lines[next(i for i, ln in enumerate(lines) if "closing signal SIGTERM" in ln) :]


def test_the_workers_own_refusal_is_the_root_cause_with_its_rank(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--plan", "p.yaml", "--steps=5", "--lrr=0.1"])
    refused = capsys.readouterr().err.splitlines()
    headline, detail = judge(("localhost", 1, [*refused, *torchrun_summary("builtin-lrr")]))
    assert headline.startswith(
        "rank 0 on localhost: the worker refused its flags: unrecognized arguments: "
        "--lrr=0.1 (did you mean --lr?)"
    ), headline
    assert "memory" not in detail and "SIGTERM" not in detail


def test_the_log_the_issue_saw_names_the_flag_not_a_signal() -> None:
    headline, detail = judge(("localhost", 1, log("builtin-lrr")))
    assert "unrecognized arguments: --lrr=0.1" in headline and "SIGTERM" not in detail
    assert "memory" not in detail


def test_a_user_scripts_argparse_refusal_is_the_root_cause() -> None:
    headline, detail = judge(("localhost", 1, log("flags")))
    assert headline == (
        "rank 1 on localhost: my_train.py refused its arguments: argument --epochs: "
        "invalid int value: 'abc' (exit code 2)"
    ), headline
    assert "memory" not in detail


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("cpuoom", "DefaultCPUAllocator: can't allocate memory: you tried to allocate"),
        ("pyoom", "MemoryError"),
    ],
)
def test_an_out_of_memory_message_is_evidence_and_gets_the_hint(name: str, said: str) -> None:
    headline, detail = judge(("localhost", 1, log(name)))
    assert headline.startswith("rank 1 on localhost: ") and said in headline, headline
    assert STAGE_HINT in detail


def test_cuda_out_of_memory_gets_the_hint() -> None:
    oom = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        "total capacity of 79.19 GiB of which 1.02 GiB is free."
    )
    lines = log("giveup")
    lines[0] = oom
    headline, detail = judge(("gpu-1", 1, lines))
    assert "CUDA out of memory. Tried to allocate 2.00 GiB" in headline and STAGE_HINT in detail


def test_a_sigkill_without_evidence_says_the_signal_and_not_memory() -> None:
    headline, detail = judge(("localhost", 1, log("killed")))
    assert (
        headline.startswith("rank 1 on localhost: ") and "killed by signal 9 (SIGKILL)" in headline
    )
    assert "memory" not in detail.lower() and "SIGTERM" not in headline


def test_a_sigkill_with_the_agents_oom_kill_evidence_says_so() -> None:
    evidence = f"{EVIDENCE_PREFIX}/proc/vmstat oom_kill 4 -> 5"
    lines = log("killed")
    at = next(i for i, ln in enumerate(lines) if ln.startswith("Traceback"))
    headline, detail = judge(("localhost", 1, [*lines[:at], evidence, *lines[at:]]))
    assert "killed by signal 9 (SIGKILL)" in headline
    assert "the kernel's out-of-memory killer" in headline and "oom_kill 4 -> 5" in headline
    assert STAGE_HINT in detail


def test_a_worker_that_says_nothing_telling_gets_its_exit_code_and_last_lines() -> None:
    headline, detail = judge(("localhost", 1, log("giveup")))
    assert headline == (
        "rank 1 on localhost: exited with code 3; its last lines: step 3: loss is nan, giving up"
    ), headline
    assert "memory" not in detail and "SIGTERM" not in detail


def test_hosts_whose_workers_were_stopped_or_lost_their_peer_are_not_the_root_cause() -> None:
    """Hosts in plan order: the first one's workers were SIGTERMed, the second's lost
    their peer; the third host's worker failed first."""
    sigterm = [ln for ln in torchrun_summary("killed") if "SIGKILL" not in ln and "-9" not in ln]
    peer = [
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
        "closed by peer [127.0.0.1]:41234",
        "E1126 06:49:53.625000 18587 torch/distributed/elastic/multiprocessing/api.py:1002] "
        "failed (exitcode: 1) local_rank: 0 (pid: 18788) of binary: /usr/bin/python3",
    ]
    headline, _ = judge(("a", 1, sigterm), ("b", 1, peer), ("c", 1, log("flags")))
    assert headline.startswith("rank 1 on c: my_train.py refused its arguments"), headline
    headline, _ = judge(("a", 1, sigterm), ("b", 1, peer))
    assert headline.startswith("b: RuntimeError: ") and "Connection closed by peer" in headline


def test_a_sigterm_alone_is_named_as_a_consequence_never_memory() -> None:
    only = [ln for ln in torchrun_summary("killed") if "SIGKILL" not in ln and "-9" not in ln]
    got = error_from_output("h", only)
    assert got is not None and "memory" not in got.message


# ------------------------------------------------------------ kernel OOM-kill counters


def test_oom_kill_counters_are_read_from_vmstat_and_the_cgroup_v1_or_v2(tmp_path: Path) -> None:
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 123\noom_kill 4\nnr_zone_active_file 9\n")
    v1 = tmp_path / "v1"
    (v1 / "memory" / "process_api" / "abc").mkdir(parents=True)
    (v1 / "memory" / "process_api" / "abc" / "memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n"
    )
    self_v1 = tmp_path / "self-v1"
    self_v1.write_text("5:pids:/\n4:memory:/process_api/abc\n0::/\n")
    got = kill_counts(vmstat=vmstat, root=v1, self_cgroup=self_v1)
    # the job's own cgroup counter where it is readable: vmstat counts the whole host
    assert got == {f"{v1}/memory/process_api/abc/memory.oom_control oom_kill": 1}
    assert kill_counts(vmstat=vmstat, root=tmp_path / "none", self_cgroup=self_v1) == {
        "/proc/vmstat oom_kill": 4
    }
    v2 = tmp_path / "v2"
    scope = v2 / "user.slice" / "session-3.scope"
    scope.mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("cpu memory pids\n")
    (scope / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\n")
    self_v2 = tmp_path / "self-v2"
    self_v2.write_text("0::/user.slice/session-3.scope\n")
    got = kill_counts(vmstat=tmp_path / "none", root=v2, self_cgroup=self_v2)
    assert got == {f"{scope}/memory.events oom_kill": 2}


def test_evidence_is_only_a_counter_that_rose() -> None:
    before = {"/proc/vmstat oom_kill": 4, "cg oom_kill": 0}
    assert oom_evidence(before, dict(before)) == ""
    assert oom_evidence(before, {}) == ""
    rose = oom_evidence(before, {"/proc/vmstat oom_kill": 5, "cg oom_kill": 0})
    assert rose == "/proc/vmstat oom_kill 4 -> 5"


def test_this_machines_counters_are_read() -> None:
    got = kill_counts()  # the cgroup's where readable, else /proc/vmstat (Linux 4.13+)
    assert len(got) == 1 and next(iter(got)).endswith("oom_kill"), got


def test_host_wide_evidence_is_worded_as_such() -> None:
    from autohet_cli.launch.logcause import signal_words

    wide = signal_words(9, 77, "/proc/vmstat oom_kill 4 -> 5")
    assert "probably the kernel's out-of-memory killer (it killed a process on this host" in wide
    own = signal_words(9, 77, "/sys/fs/cgroup/job/memory.events oom_kill 0 -> 1")
    assert own.endswith(
        "the kernel's out-of-memory killer (/sys/fs/cgroup/job/memory.events oom_kill 0 -> 1)"
    )


# ------------------------------------------------------------ what feeds triage


def test_the_last_lines_of_an_ended_host_are_read_before_it_is_judged(tmp_path: Path) -> None:
    """``--lr=abc`` once gave no root cause: the exit code was seen while the error line
    was still in the pipe. Here the line comes 0.5 s after the host's process ended."""
    late = "(sleep 0.5; echo 'autohet runtime: error: the late line' >&2) & exit 1"
    job, pool = _job(tmp_path, {"a": late}, f"late-{uuid.uuid4().hex[:8]}")
    with pool:
        job.start()
        outcome = job.watch()
        job.close()
    assert outcome.status == "failed", outcome
    assert outcome.root_cause is not None and outcome.root_cause["message"] == "the late line"


def test_the_agents_line_says_which_counter_rose_since_torchrun_started() -> None:
    now = kill_counts()
    assert evidence_line(now) == ""
    earlier = {k: v - 1 for k, v in now.items()}
    line = evidence_line(earlier)
    assert line.startswith(EVIDENCE_PREFIX) and "oom_kill" in line
    cause = error_from_output("h", [line, "  traceback : Signal 9 (SIGKILL) received by PID 7"])
    assert cause is not None and "the kernel's out-of-memory killer" in cause.message


# NCCL's wordings (PyTorch's ProcessGroupNCCL / c10d), as a GPU run prints them.
NCCL_PEER_DIED = [
    "[rank0]: torch.distributed.DistBackendError: NCCL error in: "
    "/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, remote process exited "
    "or there was a network error, NCCL version 2.27.3",
    "E1126 06:49:53.625000 18587 torch/distributed/elastic/multiprocessing/api.py:1002] "
    "failed (exitcode: 1) local_rank: 0 (pid: 18788) of binary: /usr/bin/python3",
]
NCCL_WATCHDOG = [
    "[rank2]:[E1126 06:49:50.100000 0 ProcessGroupNCCL.cpp:632] [Rank 2] Watchdog caught "
    "collective operation timeout: WorkNCCL(SeqNum=41, OpType=ALLREDUCE, NumelIn=1, "
    "Timeout(ms)=600000) ran for 600013 milliseconds before timing out.",
    "E1126 06:59:53.625000 18587 torch/distributed/elastic/multiprocessing/api.py:1002] "
    "failed (exitcode: -6) local_rank: 0 (pid: 18790) of binary: /usr/bin/python3",
]


def test_on_nccl_the_survivors_that_lost_their_peer_are_not_the_root_cause() -> None:
    """A host whose worker was SIGKILLed (the one that failed) against survivors that
    say NCCL lost its peer, or whose watchdog aborted them (SIGABRT)."""
    headline, _ = judge(("a", 1, NCCL_PEER_DIED), ("b", 1, NCCL_WATCHDOG), ("c", 1, log("killed")))
    assert headline.startswith("rank 1 on c: ") and "SIGKILL" in headline, headline
    # alone, the survivors' words still say what happened
    headline, _ = judge(("a", 1, NCCL_PEER_DIED))
    assert "remote process exited" in headline
