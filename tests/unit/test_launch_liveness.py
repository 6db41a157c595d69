"""Which hosts went silent: keep-alives unanswered too long, while another host proves
that this side still sends and hears (so a stalled launcher or its own network is never
taken for a dead host)."""

from __future__ import annotations

from autohet_cli.launch.liveness import silent_hosts
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
