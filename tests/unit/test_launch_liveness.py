"""Which hosts went silent: keep-alives unanswered too long, while another host proves
that this side still sends and hears (a stalled launcher or its own network is taken for
a dead host only after the heartbeat timeout, and never right after the launcher's own
pause)."""

from __future__ import annotations

import pytest

from autohet_cli.launch.liveness import Watcher, silent_hosts
from autohet_cli.transport.base import Liveness

AFTER = 1.0


def waiting(since: float) -> Liveness:
    return Liveness(waiting_since_s=since, answered_sent_s=since - 0.25)


def answered(sent: float) -> Liveness:
    return Liveness(waiting_since_s=None, answered_sent_s=sent)


def test_a_host_silent_past_the_limit_while_another_answers_is_silent() -> None:
    pings = {"a": waiting(10.0), "b": answered(11.3), "c": answered(11.2)}
    assert silent_hosts(pings, now_s=11.5, after_s=AFTER) == {"a": 1.5}


def test_under_the_limit_nobody_is_silent() -> None:
    pings = {"a": waiting(10.0), "b": answered(10.7)}
    assert silent_hosts(pings, now_s=10.9, after_s=AFTER) == {}


def test_without_a_later_answer_elsewhere_the_silence_may_be_ours() -> None:
    # b's newest answer went out before a's silence had lasted half the limit: nothing
    # shows that this side sent and heard since (a stalled launcher, its own network).
    pings = {"a": waiting(10.0), "b": answered(10.3)}
    assert silent_hosts(pings, now_s=11.5, after_s=AFTER) == {}
    # Every host silent at once: ours, not theirs.
    assert silent_hosts({"a": waiting(10.0), "b": waiting(10.1)}, now_s=13, after_s=AFTER) == {}


def test_a_lone_host_or_unwatched_hosts_are_never_silent() -> None:
    assert silent_hosts({"a": waiting(10.0)}, now_s=20.0, after_s=AFTER) == {}
    # A local host (nothing to ask: None) is no proof that the network works.
    assert silent_hosts({"a": waiting(10.0), "me": None}, now_s=20.0, after_s=AFTER) == {}
    assert silent_hosts({"me": None, "b": answered(19.9)}, now_s=20.0, after_s=AFTER) == {}


def test_a_silence_long_enough_needs_no_witness() -> None:
    # One remote host, or all at once: after the heartbeat timeout it is a real outage.
    alone = {"a": waiting(10.0), "me": None}
    assert silent_hosts(alone, now_s=25.0, after_s=AFTER, alone_after_s=20.0) == {}
    assert silent_hosts(alone, now_s=30.5, after_s=AFTER, alone_after_s=20.0) == {"a": 20.5}
    both = {"a": waiting(10.0), "b": waiting(10.1)}
    assert set(silent_hosts(both, now_s=31.0, after_s=AFTER, alone_after_s=20.0)) == {"a", "b"}


def test_after_a_pause_of_its_own_the_watcher_looks_again_before_judging() -> None:
    # The launcher was stopped (Ctrl-Z) from 10 s to 40 s: every keep-alive seems to have
    # waited 30 s, though the answers are there, only not read yet.
    watcher = Watcher()
    pings = {"a": waiting(9.9), "b": waiting(9.9)}
    assert watcher.silent(pings, now_s=10.0, alone_after_s=20.0) == {}
    assert watcher.silent(pings, now_s=40.0, alone_after_s=20.0) == {}
    later = {"a": answered(40.1), "b": waiting(9.9)}  # a poll later: only b is silent
    assert watcher.silent(later, now_s=40.25, alone_after_s=20.0) == {"b": pytest.approx(30.35)}
