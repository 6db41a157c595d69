"""What the executor asks a host before judging it (effects: one command each).

When something happens, ``launch.executor.Job`` looks at every host once more: its
run directory's heartbeats, boot marks and error records (``hostcmds.PROBE``), and,
when nobody started, whether its torchrun reached the rendezvous at all.
"""

from __future__ import annotations

from autohet_cli.errors import AutohetError
from autohet_cli.launch import hostcmds
from autohet_cli.launch.specs import LaunchSpec
from autohet_cli.transport.base import Runner

RENDEZVOUS_TIMEOUT_S = 30


def probe(runner: Runner, spec: LaunchSpec, timeout_s: float) -> hostcmds.Probe:
    """The host's run directory as its ranks left it."""
    ranks = " ".join(str(r) for r in spec.ranks)
    res = runner.run(
        ["sh", "-c", hostcmds.PROBE, "sh", spec.run_dir, ranks],
        timeout_s=timeout_s,
    )
    return hostcmds.parse_probe(res.stdout)


def confirmed_probe(runner: Runner, spec: LaunchSpec, timeout_s: float) -> hostcmds.Probe:
    """One slow or failed probe is not a lost host: ask once more, simply (an empty
    probe when it answers that; its error when it does not)."""
    try:
        return probe(runner, spec, timeout_s)
    except AutohetError:
        runner.run(["true"], timeout_s=timeout_s).check()
        return hostcmds.Probe()


def rendezvous(runner: Runner, spec: LaunchSpec, pid: int) -> str:
    """How far the host's torchrun (``pid``) got to the rendezvous: "listening",
    "connected", "none", or "" when the look did not finish."""
    port = spec.argv[list(spec.argv).index("--master-port") + 1]
    res = runner.run(
        ["sh", "-c", hostcmds.RENDEZVOUS, "sh", str(pid), port], timeout_s=RENDEZVOUS_TIMEOUT_S
    )
    words = res.stdout.split()
    if "done" not in words:
        return ""
    return next((w for w in ("listening", "connected") if w in words), "none")
