"""Issue 46.6: a worker's refusal reaches the console as its own line, without torchrun's
``ChildFailedError`` traceback and ``Root Cause`` box; the host's log file and the
tail that triage reads keep every line, and a worker's own traceback stays on the
console. The torchrun text is real (tests/data/torchrun, see test_triage_evidence)."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from autohet_cli.cluster import Cluster, Host
from autohet_cli.launch.consolefilter import MAX_HELD_LINES, Console, StreamFilter
from autohet_cli.launch.executor import Job
from autohet_cli.launch.specs import LaunchSpec
from autohet_cli.launch.triage import error_from_output
from autohet_cli.transport.pool import ConnectOptions, HostPool

LOGS = Path(__file__).resolve().parents[1] / "data" / "torchrun"
OWN = "autohet runtime: error: --init-from /m: config.json does not describe the plan's model"


def log(name: str) -> list[str]:
    return (LOGS / f"{name}.log").read_text().splitlines()


def echoed(lines: list[str]) -> list[str]:
    f = StreamFilter()
    return [shown for line in lines for shown in f.feed(line)] + f.flush()


def _agent_part(name: str) -> list[str]:
    """torchrun's own lines of a log: from its first log line (``W1126 ...``) on."""
    lines = log(name)
    return lines[next(i for i, ln in enumerate(lines) if ln.startswith("W1126")) :]


def test_torchruns_traceback_and_box_are_left_out_and_the_workers_line_stays() -> None:
    lines = [OWN, *_agent_part("giveup")]
    shown = echoed(lines)
    assert shown[0] == OWN
    text = "\n".join(shown)
    for gone in ("Traceback", "ChildFailedError", "Root Cause", "=====", "Failures:", "rank  "):
        assert gone not in text, text
    # torchrun's two log lines (which worker failed, with which exit code) stay.
    assert [ln[:5] for ln in shown[1:]] == ["W1126", "E1126"], shown
    assert len(lines) == 42 and len(shown) == 3


def test_a_workers_own_traceback_is_shown_whole_in_order() -> None:
    lines = log("pyoom")  # the worker's MemoryError traceback, then torchrun's
    shown = echoed(lines)
    assert shown[:5] == lines[:5] and shown[4] == "MemoryError"
    assert "ChildFailedError" not in "\n".join(shown)
    assert shown.count("Traceback (most recent call last):") == 1
    # The same for an argparse refusal and torch's own allocator error.
    for name in ("flags", "cpuoom", "killed", "builtin-lrr"):
        shown = echoed(log(name))
        assert "Root Cause (first observed failure):" not in shown, name
        assert any(ln.startswith("E1126") for ln in shown), name


def test_a_held_traceback_is_never_lost() -> None:
    f = StreamFilter()
    cut = ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>']
    assert [f.feed(ln) for ln in cut] == [[], []]
    assert f.flush() == cut  # the job ended before the exception line
    long = ["Traceback (most recent call last):"] + ["  deep"] * MAX_HELD_LINES
    assert [s for ln in long for s in f.feed(ln)] == long  # echoed once too long to hold
    # A ChildFailedError without a box: the next line is shown.
    assert echoed([cut[0], "x.ChildFailedError: ", "after"]) == ["after"]


def test_the_job_logs_every_line_and_triage_still_reads_the_root_cause(tmp_path: Path) -> None:
    host = Host(
        name="a", address="localhost", gpu_type="cpu", num_gpus=1, gpu_mem_bytes=1,
        intra_node_gbps=1.0,
    )  # fmt: skip
    pool = HostPool(Cluster(name="c", hosts=(host,), inter_node_gbps=1.0), ConnectOptions())
    spec = LaunchSpec(host="a", address="localhost", node_rank=0, nproc_per_node=1, gpus=(0,),
                      argv=("true",))  # fmt: skip
    said: list[str] = []
    job = Job([spec], pool, tmp_path / "plan.yaml", tmp_path, printer=said.append)
    job._logs["a"] = (tmp_path / "a.log").open("a", encoding="utf-8")
    job._tails["a"] = collections.deque()
    lines = [OWN, *_agent_part("giveup")]
    for line in lines:
        job._on_line("a")("stderr", line)
    job.close()
    assert said == [f"[a] {OWN}", *(f"[a] {ln}" for ln in lines[1:3])]
    assert (tmp_path / "a.log").read_text().splitlines() == [f"stderr: {ln}" for ln in lines]
    cause = error_from_output("a", list(job._tails["a"]))
    assert cause is not None and cause.message == OWN.split("error: ", 1)[1]


def test_console_flushes_what_each_host_holds_at_the_end() -> None:
    said: list[str] = []
    console = Console(said.append)
    console.echo("a", "stderr", "Traceback (most recent call last):")
    console.echo("b", "stdout", "step 1 loss 2.0 tokens/s 3")
    console.flush()
    assert said == ["[b] step 1 loss 2.0 tokens/s 3", "[a] Traceback (most recent call last):"]


def test_a_refusal_every_rank_prints_is_shown_once_per_host() -> None:
    """Issue 46: both ranks of a host refused the same --init-from; the console had
    their two texts run together on one line, then an empty one."""
    other = "autohet runtime: error: rank 1: something else"
    shown = echoed([OWN, OWN, other, OWN, *_agent_part("giveup")])
    assert shown[:2] == [OWN, other] and shown.count(OWN) == 1
    console: list[str] = []
    c = Console(console.append)
    for host in ("a", "b"):
        c.echo(host, "stderr", OWN)
        c.echo(host, "stderr", OWN)
    assert console == [f"[a] {OWN}", f"[b] {OWN}"]


def test_a_workers_line_is_one_write_with_its_newline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers share their host's unbuffered stderr: ``print`` wrote the text and the
    newline in two writes, so two ranks' refusals interleaved into one line."""
    import io
    import sys

    from autohet_cli.workerbase.records import say

    writes: list[str] = []

    class Pipe(io.StringIO):
        def write(self, s: str) -> int:
            writes.append(s)
            return len(s)

    monkeypatch.setattr(sys, "stderr", Pipe())
    say("error: no")
    assert writes == ["autohet runtime: error: no\n"]
