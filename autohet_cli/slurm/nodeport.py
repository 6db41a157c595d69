"""The rendezvous port on Slurm: checked on the master node, told to the others (pure).

Over SSH the launcher asks the master host for a free port just before starting
torchrun (``launch.preflight``). On Slurm it cannot reach the node, and the batch
script is written before the job is even scheduled, so a port chosen here was
never checked where it is used: one that is taken there (another job's torchrun,
any service) fails the rendezvous, or worse, the other nodes reach whatever
listens on it.

So the node decides, at run time: the master node (node rank 0) tries the
launcher's port (``--master-port``, else the random one ``slurm.run`` picked,
printed by the launch) and, if something listens there, picks a free one and
says so, or, for a port the user fixed, stops with the reason; it then writes the
port into the run folder, which every node shares, and every node's torchrun
reads it from there. This is the robust and simple option: no port is ever used
unchecked, the nodes need no way to reach each other before the rendezvous, and
the run folder already is where the nodes and the launcher meet. The file is
named after the batch step's start (``AUTOHET_LAUNCH_TIME``), so that a job Slurm
requeues never reads the port of its first run.
"""

from __future__ import annotations

import shlex

from autohet_cli.paths import shell_word

WAIT_S = 300  # how long the other nodes wait for the master node's port
PORT_FILE = '"$run/master-port.${AUTOHET_LAUNCH_TIME:-0}"'
# argv: the port to try, "1" if the user fixed it, the node's name. SO_REUSEADDR as
# torchrun's store binds: only a listener makes a port taken, not a closed connection.
_PROGRAM = r"""
import socket, sys
want, fixed, node = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
def bind(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", port))
        return s.getsockname()[1]
    except OSError:
        return None
    finally:
        s.close()
got = bind(want)
if got is None and fixed:
    sys.exit("autohet runtime: error: --master-port %d is taken on %s, the rendezvous "
             "node; pass another --master-port, or leave it out (a free port is then "
             "picked there)" % (want, node))
if got is None:
    got = bind(0)
    print("autohet: port %d is taken on %s; the rendezvous uses port %d instead"
          % (want, node, got), file=sys.stderr)
print(got)
"""


def lines(master: str, python: str, port: int, *, fixed: bool) -> list[str]:
    """The node part's lines that set ``$port`` (indented for inside ``if node``)."""
    fail = '{ echo 1 > "$run/exit/$node"; exit 1; }'
    ticks = WAIT_S * 10
    return [
        "  # The rendezvous port: checked free on the master node, then shared through",
        "  # the run folder (autohet_cli/slurm/nodeport.py says why).",
        f"  port_file={PORT_FILE}; master={shlex.quote(master)}",
        '  if [ "$node" = "$master" ]; then',
        f"    port=$({shell_word(python)} -S -c {shlex.quote(_PROGRAM)} {port} "
        f'{"1" if fixed else "0"} "$node") || {fail}',
        '    printf \'%s\\n\' "$port" > "$port_file.$$" && '
        f'mv -f -- "$port_file.$$" "$port_file" || {fail}',
        "  else",
        "    ticks=0",
        '    until [ -s "$port_file" ]; do',
        f'      if [ "$ticks" -ge {ticks} ]; then',
        '        echo "autohet runtime: error: no rendezvous port from $master within '
        f'{WAIT_S} s ($port_file)" >&2',
        f"        {fail}",
        "      fi",
        "      sleep 0.1; ticks=$((ticks + 1))",
        "    done",
        '    port=$(cat -- "$port_file")',
        "  fi",
    ]


def use_port(line: str, port: int) -> str:
    """A torchrun line with its fixed ``--master-port`` read from ``$port`` instead."""
    fixed = f" --master-port {port} "
    if fixed not in line:
        raise AssertionError(f"no {fixed.strip()!r} in the torchrun line")
    return line.replace(fixed, ' --master-port "$port" ', 1)
