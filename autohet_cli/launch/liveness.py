"""Which hosts went silent: the launcher's rule over its SSH keep-alives (pure).

Every watched host is asked for a sign of life every ``PING_EVERY_S``
(``transport.pings``); sshd answers within a round trip whatever the host's
workers do, so 100% CPU, a long step or a long save do not delay it. A host
whose oldest unanswered keep-alive is older than ``SILENT_AFTER_S`` is silent,
but only while some other host proves that this side still sends and hears:
it answered a keep-alive sent at least half that limit after the silence began.
A stalled launcher, or its own network gone, silences every host at once, and
that is not taken for a lost host until it lasts ``alone_after_s`` (the launcher
passes its heartbeat timeout, 20 s): only then are hosts with no witness (a job on
one remote host, or every host at once) silent too. And silence is only judged
by a watcher that kept looking (``Watcher``): after a pause of its own (the
launcher stopped with Ctrl-Z, or starved of CPU) the answers that waited meanwhile
get a moment to land before anyone is called silent.

What it takes, from a death to the ``lost:`` line: up to ``PING_EVERY_S`` until
the first keep-alive goes unanswered, ``SILENT_AFTER_S``, up to one watch poll,
and the round trip that checks the other hosts: about 1.5 s. The limit rides out
two TCP retransmissions of a lost packet (200 + 400 ms at Linux's minimum RTO)
and any scheduling delay of a loaded host's sshd; a network that drops every
packet for longer than a second is taken for a lost host.
"""

from __future__ import annotations

from collections.abc import Mapping

from autohet_cli.transport.base import Liveness

PING_EVERY_S = 0.25
SILENT_AFTER_S = 1.0


def silent_hosts(
    pings: Mapping[str, Liveness | None],
    *,
    now_s: float,
    after_s: float = SILENT_AFTER_S,
    alone_after_s: float | None = None,
) -> dict[str, float]:
    """``{host: seconds silent}`` of the hosts that count as gone (see the module)."""
    out: dict[str, float] = {}
    for name, state in pings.items():
        since = state.waiting_since_s if state is not None else None
        if since is None or now_s - since <= after_s:
            continue
        if alone_after_s is not None and now_s - since > alone_after_s:
            out[name] = now_s - since
            continue
        heard = [
            other.answered_sent_s
            for n, other in pings.items()
            if n != name and other is not None and other.answered_sent_s is not None
        ]
        if any(sent >= since + after_s / 2 for sent in heard):
            out[name] = now_s - since
    return out


def silence_reason(seconds: float) -> str:
    """The ``lost:`` line's words for a silent host."""
    return (
        f"no answer to SSH keep-alives for {seconds:.1f} s (host down, frozen, or its "
        "network gone?)"
    )


class Watcher:
    """``silent_hosts`` over time: no verdict right after a pause of the watcher's own
    (longer than half the limit since it last looked), when answers that arrived
    meanwhile may not have been read yet; the next look, a poll later, judges."""

    def __init__(self) -> None:
        self._looked_at_s: float | None = None

    def silent(
        self,
        pings: Mapping[str, Liveness | None],
        *,
        now_s: float,
        after_s: float = SILENT_AFTER_S,
        alone_after_s: float | None = None,
    ) -> dict[str, float]:
        paused = self._looked_at_s is not None and now_s - self._looked_at_s > after_s / 2
        self._looked_at_s = now_s
        if paused:
            return {}
        return silent_hosts(pings, now_s=now_s, after_s=after_s, alone_after_s=alone_after_s)
