"""Run commands and move files on cluster hosts: locally or over SSH (paramiko).

``runner_for(host, ...)`` picks the runner; ``fan_out(hosts, fn)`` runs per host in
parallel and collects each host's result or error. See :class:`Runner`.
"""

from autohet_cli.transport.base import ProcessHandle, Runner, RunResult
from autohet_cli.transport.fanout import fan_out, runner_for
from autohet_cli.transport.lines import LineCallback
from autohet_cli.transport.local import LocalRunner
from autohet_cli.transport.quoting import remote_command
from autohet_cli.transport.ssh import SshRunner
from autohet_cli.transport.target import SshOptions

__all__ = [
    "LineCallback",
    "LocalRunner",
    "ProcessHandle",
    "RunResult",
    "Runner",
    "SshOptions",
    "SshRunner",
    "fan_out",
    "remote_command",
    "runner_for",
]
