"""The batch script of a plan on Slurm: one heterogeneous component per host group (pure).

Hosts that use the same GPU type and the same number of GPUs form a group, and
each group is one component of a heterogeneous job (``#SBATCH hetjob``),
pinned to its nodes (``--nodelist``: the plan was made for those hosts). The
script is written into the run directory, which the nodes share with the
launcher, and runs twice over:

* as the batch step, it starts one ``srun --het-group=i`` per component, one task
  per node, each running this same file with the argument ``node``;
* with ``node``, on each node, it finds the node in the plan
  (``$SLURMD_NODENAME``) and runs exactly the torchrun line ``autohet launch``
  runs over SSH there (``launch.specs``): same node rank, same rank mapping,
  same static rendezvous at the first host. The node's exit code goes to
  ``exit/<node>``, its output to ``slurm/<node>.out`` and ``.err``.

Slurm chooses the GPUs of a node and sets ``CUDA_VISIBLE_DEVICES`` itself, so
the launch specs leave it alone here. The job key reaches each node's checkpoint
directory from the run directory (mode 0600), never through the script, which
Slurm keeps and shows to administrators.

The run directory is the one path of this machine in the script (the working
directory's ``runs/``), so whatever its name holds reaches three readers:
bash (every use is shell-quoted), sbatch's own reader of ``#SBATCH`` lines
(``sbatch_word``), and Slurm's output-file patterns (``%j``, ``%N``). A path
none of them can take whole is refused before anything is written
(``check_run_dir``).
"""

from __future__ import annotations

import inspect
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from autohet_cli import privatedir
from autohet_cli.ckpt.format import KEY_FILE
from autohet_cli.cluster import Cluster
from autohet_cli.errors import ConfigError
from autohet_cli.launch.specs import LaunchSpec
from autohet_cli.paths import shell_word
from autohet_cli.plan import Plan
from autohet_cli.slurm import nodeport

SCRIPT_NAME = "job.sbatch"
# CPUs per GPU without ``slurm.cpus_per_gpu``: GPU nodes have 8 or more cores per GPU,
# and four keep a worker's own threads and the data loading off each other's cores.
DEFAULT_CPUS_PER_GPU = 4
KEY_NAME = ".job-key"  # the job key in the run directory, for the nodes to copy
# What an #SBATCH argument may hold unquoted (sbatch splits at whitespace and reads
# quotes, backslashes and '#' itself); anything else goes in double quotes.
_SBATCH_PLAIN = re.compile(r"[A-Za-z0-9_./:@+=,~%-]*")


def check_run_dir(run_dir: str) -> str:
    """``run_dir`` if a batch script can hold it; otherwise a ConfigError naming it.

    A newline (or any control character) would end the ``#SBATCH --output`` line and
    start a shell line of its own; Slurm reads ``%`` in an output path as a pattern
    (``%j``, ``%N``) and a backslash as "expand no pattern", so both would send the
    logs elsewhere (srun's per-node ``%N.out`` files into one). Everything else
    (spaces, quotes, ``$``, backticks, ``#``) is quoted for bash and for sbatch.
    """
    bad = next((c for c in run_dir if ord(c) < 32 or c in "\x7f%\\"), None)
    if bad is None:
        return run_dir
    names = {"\n": "a newline", "\r": "a carriage return", "%": "'%'", "\\": "a backslash"}
    what = names.get(bad, f"a control character ({bad!r})")
    raise ConfigError(
        f"run directory {run_dir!r}: contains {what}, which a Slurm batch script cannot "
        "hold (#SBATCH lines end at a newline; Slurm reads '%' and '\\' in output paths "
        "as patterns); run autohet from a directory whose path has none of these"
    )


def sbatch_word(text: str) -> str:
    """``text`` as one argument of an ``#SBATCH`` line, read back whole by sbatch.

    sbatch's reader (``_get_argument`` in src/sbatch/opt.c) splits at whitespace,
    takes ``"`` and ``'`` as quotes (older releases: ``"`` only), a backslash as
    "the next character as is", and an unquoted ``#`` as the start of a comment
    (in older releases even a quoted one). So: plain text as is; anything else in
    double quotes with ``"``, ``'``, ``#`` and ``\\`` backslashed, which every version
    reads back the same. Newlines cannot be held at all (``check_run_dir``).
    """
    if _SBATCH_PLAIN.fullmatch(text):
        return text
    return '"' + re.sub(r"([\"'#\\])", r"\\\1", text) + '"'


@dataclass(frozen=True, slots=True, kw_only=True)
class Component:
    """One heterogeneous-job component: hosts of one GPU type using as many GPUs each."""

    index: int
    gpu_type: str
    gpus_per_node: int
    hosts: tuple[str, ...]


def components(specs: Sequence[LaunchSpec], cluster: Cluster) -> list[Component]:
    """Group hosts by (GPU type, GPUs used), in the order the plan first names them,
    so the first plan host (the rendezvous master) is in component 0."""
    groups: dict[tuple[str, int], list[str]] = {}
    for s in specs:
        key = (cluster.host(s.host).gpu_type, s.nproc_per_node)
        groups.setdefault(key, []).append(s.host)
    return [
        Component(index=i, gpu_type=t, gpus_per_node=n, hosts=tuple(hosts))
        for i, ((t, n), hosts) in enumerate(groups.items())
    ]


def _directives(comp: Component, cluster: Cluster) -> list[str]:
    st = cluster.slurm
    out = [f"--{k.replace('_', '-')}={v}" for k, v in _job_wide(cluster)]
    out += [
        f"--nodes={len(comp.hosts)}",
        f"--nodelist={','.join(comp.hosts)}",
        "--ntasks-per-node=1",
    ]
    if comp.gpu_type != "cpu":
        t = st.gpu_type(comp.gpu_type)
        out.append(
            f"--gres=gpu:{t.gres}:{comp.gpus_per_node}"
            if t.gres
            else f"--gres=gpu:{comp.gpus_per_node}"
        )
        if t.constraint:
            out.append(f"--constraint={t.constraint}")
    out.append(f"--cpus-per-task={cpus_per_task(comp, cluster)}")
    if st.signal_before_end_s:
        # Before the time limit, every step gets SIGTERM: torchrun forwards it, and
        # the workers save the step they finished and stop (runtime.preempt).
        out.append(f"--signal=TERM@{st.signal_before_end_s}")
    return out + list(st.sbatch_args)


def cpus_per_task(comp: Component, cluster: Cluster) -> int:
    """CPUs for the one task per node (torchrun and all its workers): ``slurm.cpus_per_gpu``
    per GPU; without it ``DEFAULT_CPUS_PER_GPU``, or one per CPU device (each is one
    worker process). Never Slurm's default for a task that asks none: one CPU, which
    every worker of the node would share."""
    per = cluster.slurm.cpus_per_gpu
    if per is None:
        per = 1 if comp.gpu_type == "cpu" else DEFAULT_CPUS_PER_GPU
    return per * comp.gpus_per_node


def _job_wide(cluster: Cluster) -> list[tuple[str, str]]:
    st = cluster.slurm
    pairs = [("partition", st.partition), ("account", st.account), ("qos", st.qos)]
    pairs.append(("time", st.time_limit))
    return [(k, v) for k, v in pairs if v is not None]


def render(
    plan: Plan,
    cluster: Cluster,
    specs: Sequence[LaunchSpec],
    *,
    run_dir: str,
    job: str | None,
    port_fixed: bool = False,
) -> str:
    """The complete batch script (``autohet launch --backend slurm --dry-run`` prints it).
    ``port_fixed``: the user chose the rendezvous port; a taken one stops the job
    (else the master node picks another, ``slurm.nodeport``)."""
    comps = components(specs, cluster)
    run = shlex.quote(check_run_dir(run_dir))
    name = f"{plan.name}.v{plan.version}"
    lines = [
        "#!/bin/bash",
        f"# autohet: plan {name} on Slurm, {len(specs)} host(s) in {len(comps)} "
        "heterogeneous component(s):",
    ]
    for c in comps:
        lines.append(
            f"#   component {c.index}: {', '.join(c.hosts)} ({c.gpu_type}, "
            f"{c.gpus_per_node} GPU(s) each)"
        )
    lines += [
        "# Submitted by `autohet launch` as: sbatch --parsable "
        + shlex.quote(f"{run_dir}/{SCRIPT_NAME}"),
        f"#SBATCH --job-name=autohet-{name}",
        "#SBATCH " + sbatch_word(f"--output={run_dir}/slurm/batch-%j.out"),
    ]
    for c in comps:
        if c.index:
            lines.append("#SBATCH hetjob")
        lines += [f"#SBATCH {d}" for d in _directives(c, cluster)]
    lines += ["set -u", f"run={run}", ""]
    lines += _node_part(specs, plan, job, port_fixed)
    lines += _batch_part(comps)
    return "\n".join(lines) + "\n"


_WORKDIR_CHECK = """
import sys
why = make_private_dir(Path(sys.argv[1]), Path(sys.argv[1]))
if why:
    sys.exit("autohet runtime: error: workdir %s is not yours alone: %s (the workers "
             "import code from it: make it and its parents writable by you only)"
             % (sys.argv[1], why))
"""


def _workdir_program() -> str:
    """``privatedir``'s source (standard library only: it runs before any code of
    ours is on the node's path) and the check of ``sys.argv[1]``, which it creates."""
    return inspect.getsource(privatedir) + _WORKDIR_CHECK


def _node_part(
    specs: Sequence[LaunchSpec], plan: Plan, job: str | None, port_fixed: bool
) -> list[str]:
    master = specs[0]
    port = int(master.argv[list(master.argv).index("--master-port") + 1])
    out = [
        "# On each node (srun runs this file with `node`): this node's torchrun.",
        'if [ "${1:-}" = node ]; then',
        '  node="${SLURMD_NODENAME:-}"',
        "  # The workdir, where the workers import code from, must be this user's alone",
        "  # (autohet_cli/privatedir.py, the rule checkpoint directories follow).",
        f"  check_workdir={shlex.quote(_workdir_program())}",
        *nodeport.lines(master.host, master.argv[0], port, fixed=port_fixed),
        '  case "$node" in',
    ]
    for s in specs:
        out.append(f"    {shlex.quote(s.host)})")
        out.append(
            f'      {shell_word(s.argv[0])} -S -c "$check_workdir" {shell_word(s.workdir)} '
            "|| exit 1"
        )
        if job is not None:
            ckpt = s.argv[list(s.argv).index("--checkpoint-dir") + 1]
            d = f"{shell_word(ckpt)}/{shlex.quote(plan.name)}/{shlex.quote(job)}"
            out.append(
                f"      (umask 077 && mkdir -p -- {d} && chmod 700 -- {d} && "
                f'{{ [ -e {d}/{KEY_FILE} ] || cp -- "$run/{KEY_NAME}" {d}/{KEY_FILE}; }}) '
                "|| exit 1"
            )
        # cd first, then one simple command in the background: $! is then torchrun
        # itself (see the wait below), not a subshell between it and this shell.
        out.append(f"      cd {shell_word(s.workdir)} || exit 1")
        out.append(f"      {nodeport.use_port(s.env_line(), port)} &")
        out.append("      ;;")
    out += [
        '    *) echo "autohet: node $node is not a host of this plan" >&2; exit 2 ;;',
        "  esac",
        "  # Stay torchrun's parent until it ends: Slurm's TERM would otherwise end this",
        "  # shell first, and proctrack/linuxproc, which follows the process tree, would",
        "  # lose the orphaned torchrun and never kill it. A TERM that Slurm sends to every",
        "  # process of the step (scancel --signal, the time limit's --signal) reaches",
        "  # torchrun too; the one forwarded here is the same notice (runtime.agent).",
        "  child=$!",
        "  trap 'kill -TERM \"$child\" 2>/dev/null' TERM INT",
        "  while :; do",
        '    wait "$child"; rc=$?',
        '    kill -0 "$child" 2>/dev/null || break',
        "  done",
        '  echo "$rc" > "$run/exit/$node"',
        "  exit $rc",
        "fi",
        "",
    ]
    return out


def _batch_part(comps: Sequence[Component]) -> list[str]:
    out = [
        "# The batch step: one srun per component, one task (torchrun) per node.",
        'mkdir -p -- "$run/slurm" "$run/exit"',
        "export AUTOHET_LAUNCH_TIME=$(date +%s.%N)",
    ]
    for c in comps:
        # A job of one component is not heterogeneous: srun refuses --het-group there.
        group = f"--het-group={c.index} " if len(comps) > 1 else ""
        out.append(
            f"srun {group}--nodes={len(c.hosts)} --ntasks-per-node=1 "
            '--kill-on-bad-exit=1 --output="$run/slurm/%N.out" --error="$run/slurm/%N.err" '
            f'bash "$run/{SCRIPT_NAME}" node &'
        )
    out += [
        "# A component that fails stops the others: its peers could only wait for it.",
        f"left={len(comps)}; rc=0",
        'while [ "$left" -gt 0 ]; do',
        "  wait -n; c=$?; left=$((left - 1))",
        '  if [ "$c" -ne 0 ] && [ "$rc" -eq 0 ]; then',
        '    rc=$c; echo "autohet: a component ended with exit code $c; stopping the others" >&2',
        "    kill $(jobs -p) 2>/dev/null",
        "  fi",
        "done",
        'exit "$rc"',
    ]
    return out
