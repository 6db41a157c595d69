"""Preemption checks: the cluster file's schema, polling, and what the launcher makes
of the workers' announcement (the runtime's side: tests/dist/test_preempt.py)."""

from __future__ import annotations

import collections
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autohet_cli.cluster import cluster_from_dict, cluster_to_dict
from autohet_cli.errors import ConfigError
from autohet_cli.launch import triage
from autohet_cli.launch.executor import Job
from autohet_cli.launch.hostlines import _with_late_notices
from autohet_cli.preemption import CHECK_ENV, CheckSpec, check_from_dict, check_from_env
from autohet_cli.runtime.preempt import poll_once
from autohet_cli.workerbase.records import AGENT_NOTICE, PREEMPT_PREFIX


def _cluster(host_extra: dict[str, Any], defaults: dict[str, Any] | None = None) -> Any:
    doc: dict[str, Any] = {
        "schema": "autohet.cluster/v1",
        "name": "spot",
        "hosts": [
            {"name": "a", "gpus": {"type": "cpu", "count": 1}, **host_extra},
            {"name": "b", "gpus": {"type": "cpu", "count": 1}},
        ],
    }
    if defaults:
        doc["defaults"] = defaults
    return cluster_from_dict(doc, "spot.yaml")


def test_a_host_check_parses_round_trips_and_reaches_the_workers_env() -> None:
    cl = _cluster({"preemption_check": {"command": "test -e /run/notice", "interval_s": 2}})
    check = cl.host("a").preemption_check
    assert check == CheckSpec(command="test -e /run/notice", interval_s=2.0)
    assert cl.host("b").preemption_check is None  # off by default
    again = cluster_from_dict(cluster_to_dict(cl), "again")
    assert again.host("a").preemption_check == check
    assert check_from_env(check.to_env()) == check

    from autohet_cli.launch.specs import LaunchOptions, build_launch_specs
    from tests.planting import plan_of, stage

    plan = plan_of([stage(0, 3, "a"), stage(3, 6, "b")], microbatches=1, seq_len=8, name="p")
    specs = {s.host: s for s in build_launch_specs(plan, cl, LaunchOptions(run_id="r"))}
    assert check_from_env(specs["a"].env[CHECK_ENV]) == check
    assert CHECK_ENV not in specs["b"].env


def test_defaults_set_a_check_for_every_host_and_a_host_overrides_it() -> None:
    cl = _cluster(
        {"preemption_check": {"command": "true"}},
        defaults={"preemption_check": {"url": "http://169.254.169.254/x"}},
    )
    assert cl.host("a").preemption_check == CheckSpec(command="true")
    assert cl.host("b").preemption_check == CheckSpec(url="http://169.254.169.254/x")


@pytest.mark.parametrize(
    ("check", "message"),
    [
        ({}, "exactly one of command"),
        ({"command": "x", "url": "http://h/"}, "exactly one of command"),
        ({"url": "file:///etc/passwd"}, "preemption_check.url: expected an http"),
        ({"command": "x", "interval_s": 0}, "preemption_check.interval_s: at least"),
        ({"command": "x", "headers": {"A": "b"}}, "preemption_check.headers: only a url"),
        ({"command": "x", "every": 3}, "unknown key 'every'"),
        ({"command": "  "}, "preemption_check.command: empty"),
    ],
)
def test_a_bad_check_is_refused_naming_the_field(check: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        _cluster({"preemption_check": check})
    assert "hosts[0]" in str(info.value)


def test_a_command_check_reports_a_notice_only_when_it_exits_0(tmp_path: Path) -> None:
    flag = tmp_path / "notice"
    spec = check_from_dict({"command": f"test -e {flag} && echo reclaim at 12:00"}, "c")
    assert poll_once(spec) is None
    flag.touch()
    found = poll_once(spec)
    assert found is not None and "reclaim at 12:00" in found
    assert poll_once(CheckSpec(command="exit 3")) is None


class _Metadata(http.server.BaseHTTPRequestHandler):
    """A cloud metadata endpoint: AWS-style 404 until a reclaim, GCP-style FALSE/TRUE."""

    answers: dict[str, tuple[int, str]] = {}
    seen_headers: dict[str, str] = {}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        _Metadata.seen_headers = dict(self.headers)
        code, body = self.answers.get(self.path, (404, "not found"))
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def metadata() -> Iterator[str]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Metadata)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_url_check_follows_the_clouds_conventions(metadata: str) -> None:
    aws = CheckSpec(url=f"{metadata}/spot/instance-action")
    assert poll_once(aws) is None  # 404: nothing scheduled
    _Metadata.answers["/spot/instance-action"] = (200, '{"action": "terminate"}')
    found = poll_once(aws)
    assert found is not None and "terminate" in found
    gcp = check_from_dict(
        {"url": f"{metadata}/preempted", "headers": {"Metadata-Flavor": "Google"}}, "c"
    )
    _Metadata.answers["/preempted"] = (200, "FALSE")
    assert poll_once(gcp) is None
    assert _Metadata.seen_headers.get("Metadata-Flavor") == "Google"
    _Metadata.answers["/preempted"] = (200, "TRUE")
    assert poll_once(gcp) is not None
    assert poll_once(CheckSpec(url="http://127.0.0.1:9/")) is None  # refused: no notice


def test_preempted_verdict_names_the_leaving_hosts_and_is_recoverable() -> None:
    notice = triage.Preemption(hosts=(("c", "SIGTERM"),), step=7, saved=True)
    # The leaving host's torchrun exited non-zero on its own SIGTERM: still preempted.
    failed = triage.Verdict(status=triage.FAILED, exit_code=1, failed_hosts=("c",))
    v = triage.preempted(failed, notice, ["a", "b", "c"])
    assert (v.status, v.lost_hosts, v.recoverable) == (triage.PREEMPTED, ("c",), True)
    assert "every rank saved step 7" in v.detail
    # It vanished before the others finished: the same, and a lost host leaves too.
    lost = triage.Verdict(status=triage.HOST_LOST, exit_code=1, lost_hosts=("c", "b"))
    assert triage.preempted(lost, notice, ["a", "b", "c"]).lost_hosts == ("c", "b")
    unsaved = triage.Preemption(hosts=(("c", "SIGTERM"),), step=7, saved=False)
    finished = triage.Verdict(status=triage.FINISHED, exit_code=0)
    assert "last periodic" in triage.preempted(finished, unsaved, ["a", "c"]).detail


def test_the_launcher_reads_rank_0s_preemption_lines(tmp_path: Path) -> None:
    printed: list[str] = []
    job = Job(
        [],
        pool=None,  # type: ignore[arg-type]  # never asked: no host is started
        plan_file=tmp_path / "p.yaml",
        local_run_dir=tmp_path,
        printer=printed.append,
    )
    job._logs["a"] = (tmp_path / "a.log").open("a")
    job._tails["a"] = collections.deque()
    on_line = job._on_line("a")
    hosts = {"c": "preemption check: command 'x' exited 0"}
    on_line("stdout", PREEMPT_PREFIX + json.dumps({"event": "notice", "step": 9, "hosts": hosts}))
    assert job.preemption == triage.Preemption(hosts=tuple(hosts.items()), step=9, saved=False)
    # A host whose notice came during the save is named by the saved line: it leaves too.
    late = {**hosts, "d": "SIGTERM"}
    on_line("stdout", PREEMPT_PREFIX + json.dumps({"event": "saved", "step": 9, "hosts": late}))
    assert job.preemption is not None and job.preemption.saved
    assert job.preemption.hosts == (*hosts.items(), ("d", "SIGTERM"))
    assert triage.preempted(
        triage.Verdict(status=triage.FINISHED, exit_code=0), job.preemption, ["a", "c", "d"]
    ).lost_hosts == ("c", "d")
    assert printed[0].startswith("host preempting: c (preemption check")
    assert printed[1] == "emergency checkpoint: step 9 saved on every rank"
    # A host whose agent took its TERM after the save (slurmd signals each node on its
    # own) leaves as well: the verdict adds it once, after the workers' hosts.
    job._logs["e"] = (tmp_path / "e.log").open("a")
    job._tails["e"] = collections.deque()
    for _ in range(2):
        job._on_line("e")("stderr", f"{AGENT_NOTICE}; forwarded to 1 worker(s), which ...")
    job._on_line("a")("stderr", "SIGTERM: a preemption notice, quoted by a user's script")
    final = _with_late_notices(job.preemption, job._agent_notices)
    assert final.hosts == (*hosts.items(), ("d", "SIGTERM"), ("e", "SIGTERM"))
    assert _with_late_notices(final, ["c", "e"]) is final  # nothing new: unchanged
    on_line("stdout", PREEMPT_PREFIX + "not json")  # ignored, not a crash
    job.close()
