"""The shell lines the launcher runs on each host, what their output means, and how a
host's processes are stopped (effects, through a runner).

Every line is fixed text of ours; what varies (paths, pids, ports, ranks) comes in
as ``$1``, ``$2``, ... so no user text is ever parsed by a shell.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from autohet_cli.errors import AutohetError
from autohet_cli.transport.base import ProcessHandle, Runner

# One command per host and check, over that host's ranks only ($2: "0 1 2"; hosts that
# share a home on NFS share the run directory): heartbeat ages (on the host's clock),
# boot marks, and the ranks' error records (none while all is well: a test per rank).
PROBE = (
    'd="$1"; now=$(date +%s); n=0; for r in $2; do f="$d/heartbeat/rank$r"; '
    # A rank that said done or failed beats no more: only running ranks can go stale.
    # Its age comes from the time it wrote (the host's clock), not the file's mtime,
    # which a network file system sets from the server's clock.
    'if [ -f "$f" ] && grep -q \'"state": "running"\' "$f"; then '
    't=$(sed -n \'s/.*"time": \\([0-9]*\\).*/\\1/p\' "$f"); '
    '[ -n "$t" ] && echo "hb $((now - t))"; fi; '
    '{ [ -f "$d/boot/rank$r" ] || [ -f "$f" ]; } && n=$((n+1)); '
    'if [ -f "$d/errors/rank$r.json" ]; then '
    'printf "err "; head -c 8192 "$d/errors/rank$r.json"; echo; fi; done; echo "boot $n"'
)
# Make the run directory; one that exists is refused unless this very launch made it
# (another host sharing the directory): a run directory is never reused. The maker
# writes the launch's token whole (a rename); a host that finds the directory waits a
# few seconds for the token, since the host that made it may not have written it yet
# (hosts on one NFS home start together: under load one was refused its own run).
MKRUN = (
    'umask 077; mkdir -p -- "$1" "$2" || exit 1; if mkdir -- "$3" 2>/dev/null; then '
    'printf "%s" "$4" > "$3/.launch.$$" && mv -f -- "$3/.launch.$$" "$3/.launch"; else '
    'i=0; while [ ! -s "$3/.launch" ] && [ "$i" -lt 25 ]; do sleep 0.2; i=$((i+1)); done; '
    '[ "$(cat "$3/.launch" 2>/dev/null)" = "$4" ]; fi'
)


# Which of the process tree under $1 holds the TCP port $2 (listening: the
# rendezvous store on the master) or a connection to it (an agent that joined).
RENDEZVOUS = r"""
pids="$1 $(ps -eo pid=,ppid= | awk -v r="$1" '{k[$2]=k[$2]" "$1}
  END {n=1; q[1]=r; while (n>0) {p=q[n]; n--; m=split(k[p],c," ");
  for (i=1;i<=m;i++) {print c[i]; q[++n]=c[i]}}}')"
inodes=$(for p in $pids; do ls -l /proc/$p/fd 2>/dev/null; done |
  sed -n 's/.*socket:\[\([0-9]*\)\].*/\1/p')
port=$(printf "%04X" "$2")
awk -v port="$port" -v inodes="$inodes" '
  BEGIN {n=split(inodes,a," "); for (i=1;i<=n;i++) want[a[i]]=1}
  FNR>1 && ($10 in want) {split($2,l,":"); split($3,r,":");
    if ($4=="0A" && l[2]==port) print "listening";
    else if ($4=="01" && r[2]==port) print "connected"}' /proc/net/tcp /proc/net/tcp6 2>/dev/null
echo done
"""

# Every process below $1 (by parent pid). torchrun starts each worker in a session of
# its own, so the workers are not in its process group: they are found here.
TREE = (
    'ps -eo pid=,ppid= | awk -v root="$1" \'{kids[$2]=kids[$2]" "$1} END {n=split(root,q," "); '
    'while (n>0) {p=q[n]; n--; m=split(kids[p],c," "); for (i=1;i<=m;i++) {print c[i]; '
    "q[++n]=c[i]}}}'"
)
# The tree under $1, its process group and $1 itself, killed in one round trip.
KILL_TREE = (
    f'tree=$({TREE}); kill -KILL -- "-$1" 2>/dev/null; kill -KILL "$1" 2>/dev/null; '
    'for p in $tree; do [ "$p" -gt 1 ] && kill -KILL "$p" 2>/dev/null; done; true'
)
# After the kill: how long the host's sshd may take to close the channel (it does once
# every process holding the output is gone) before our side closes it.
CLOSE_WAIT_S = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Probe:
    """What ``PROBE`` found on one host."""

    heartbeat_ages_s: tuple[int, ...] = ()
    booted: int = 0
    errors: str = ""


def parse_probe(stdout: str) -> Probe:
    ages, booted, errors = [], 0, []
    for line in stdout.splitlines():
        kind, _, value = line.partition(" ")
        if kind == "hb" and value.lstrip("-").isdigit():
            ages.append(int(value))
        elif kind == "boot" and value.isdigit():
            booted = int(value)
        elif kind == "err":
            errors.append(value)
    return Probe(heartbeat_ages_s=tuple(ages), booted=booted, errors="\n".join(errors))


def stop_tree(runner: Runner, handle: ProcessHandle, grace_s: float) -> None:
    """Stop a host's torchrun and everything under it, by pid, never by name.

    ``grace_s`` > 0 (a stop on request): TERM the process group, KILL what is left
    after ``grace_s``, then the workers collected from the tree beforehand (a stopped
    or hung worker ignores TERM). 0 (a verdict: nothing to save): everything is
    killed at once, in one round trip."""
    try:
        if grace_s <= 0:
            _kill_now(runner, handle)
            return
        tree: list[str] = []
        if handle.pid is not None and handle.poll() is None:
            res = runner.run(["sh", "-c", TREE, "sh", str(handle.pid)], timeout_s=20)
            tree = [p for p in res.stdout.split() if p.isdigit() and int(p) > 1]
        handle.kill(grace_s)
        if tree:
            runner.run(["kill", "-KILL", *tree], timeout_s=20)  # by pid; gone ones are fine
    except AutohetError:
        pass  # the host is gone: nothing left to stop there that we could reach


def _kill_now(runner: Runner, handle: ProcessHandle) -> None:
    if handle.pid is not None and handle.poll() is None:
        runner.run(["sh", "-c", KILL_TREE, "sh", str(handle.pid)], timeout_s=20)
        # Its last lines arrive before sshd closes the channel: wait for that, briefly
        # (something outside the tree may hold the output open).
        deadline = time.monotonic() + CLOSE_WAIT_S
        while handle.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
    handle.kill(0.0)  # our side of it closed, its output read; KILL to any straggler
