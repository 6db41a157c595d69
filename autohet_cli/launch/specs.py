"""What runs where: the exact torchrun command, environment and paths per host (pure).

One torchrun agent per host of the plan, static rendezvous at the first host:

    python -m autohet_cli.runtime.agent --nnodes N --node-rank i --nproc-per-node n_i
        --master-addr ADDR --master-port PORT --max-restarts 0 -m autohet_cli.runtime.train ...

(``runtime.agent`` is torchrun with a SIGTERM that waits for the workers' emergency
save; a user script runs under ``python -m torch.distributed.run`` as it is.)

Host order is the order in which hosts first appear in the plan. torchrun numbers
the workers of host i after those of hosts 0..i-1, so global ranks are not the
plan's order; each worker therefore gets ``AUTOHET_HOST`` and finds itself as
the ``LOCAL_RANK``-th device of that host in plan order (the runtime's
Topology.slot_for_host). ``CUDA_VISIBLE_DEVICES`` lists exactly the host's plan
GPUs in that same order, so worker i drives ``cuda:i`` = the plan's GPU.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from autohet_cli.ckpt.notice import NOTICE_S
from autohet_cli.cluster import Cluster, Host, python_for
from autohet_cli.errors import PlanError
from autohet_cli.launch.pathargs import Caller, resolve
from autohet_cli.paths import expand_home, shell_word
from autohet_cli.peer.placement import ADDR_ENV, DOMAIN_ENV
from autohet_cli.plan import Plan
from autohet_cli.preemption import CHECK_ENV
from autohet_cli.runfiles.metricsfile import FOLDER_ENV, STREAM_ENV

DEFAULT_MODULE = "autohet_cli.runtime.train"
AGENT_MODULE = "autohet_cli.runtime.agent"  # torchrun that waits for an emergency save
NOTICE_BUDGET_ENV = "AUTOHET_NOTICE_BUDGET_S"  # read by runtime.train
HOST_ENV = "AUTOHET_HOST"
PLAN_ENV = "AUTOHET_PLAN"
RUN_ENV = "AUTOHET_RUN_DIR"


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchSpec:
    host: str
    address: str
    node_rank: int
    nproc_per_node: int
    gpus: tuple[int, ...]  # plan GPUs of this host, in plan order
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    workdir: str = ""
    plan_path: str = ""  # where the plan is copied on the host
    run_dir: str = ""  # on the host: logs, pid file, heartbeats, metrics
    pid_file: str = ""
    ranks: tuple[int, ...] = ()  # the global ranks torchrun gives this host's workers

    def command_line(self) -> str:
        """The exact shell line (cd, env, argv), for --dry-run and for humans: it runs as
        printed in sh or bash on the host (``~`` paths become ``"$HOME"/...``)."""
        return f"cd {shell_word(self.workdir)} && {self.env_line()}"

    def env_line(self) -> str:
        """``command_line`` without its ``cd``: one simple command (``env`` execs
        torchrun), so that ``LINE &`` makes torchrun itself the shell's child. With the
        ``cd ... &&`` list, ``&`` forks a subshell that stays torchrun's parent and dies
        on a SIGTERM sent to every process (Slurm's ``scancel --signal``)."""
        env = " ".join(
            f"{k}={shell_word(v)}" if _ENV_NAME.match(k) else shlex.quote(f"{k}={v}")
            for k, v in sorted(self.env.items())
        )
        argv = " ".join(shell_word(a) for a in self.argv)
        return f"env {env} {argv}"


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchOptions:
    run_id: str  # e.g. a UTC timestamp; names the run directory
    # The launcher's run folder (absolute, on the launcher's machine): rank 0's metrics
    # go there, written directly when its host is this machine, else streamed to the
    # launcher (runfiles.metricsfile); "": not asked (a dry run, Slurm's shared run dir).
    run_folder: str = ""
    master_port: int = 29500
    script: Sequence[str] = ()  # user script and its args; empty: the built-in trainer
    train_args: Sequence[str] = ()  # extra args for the built-in trainer
    user_env: Mapping[str, str] = field(default_factory=dict)
    remote_storage: str | None = None  # checkpoints' remote copy, for the built-in trainer
    job: str | None = None  # the run namespace of the built-in trainer's checkpoints
    # One run directory for every host (Slurm: on the file system the nodes share with
    # the launcher, which reads logs and heartbeats there); "": per host, in its workdir.
    shared_run_dir: str = ""
    # Slurm sets CUDA_VISIBLE_DEVICES to the GPUs it allocated: keep it.
    gpus_from_scheduler: bool = False
    # Where autohet runs: path flags in train_args are resolved per host from it
    # (launch.pathargs); None: passed as written.
    caller: Caller | None = None


def host_order(plan: Plan) -> list[str]:
    return plan.hosts()


def build_launch_specs(
    plan: Plan,
    cluster: Cluster,
    options: LaunchOptions,
    homes: Mapping[str, str] | None = None,
) -> list[LaunchSpec]:
    """One spec per plan host; no I/O, so --dry-run shows exactly what would run.

    ``homes`` (host → home directory, looked up on the host by the preflight)
    expands a workdir or checkpoint dir that starts with ``~``; without it ``~``
    stays as written and ``command_line`` renders it as ``"$HOME"``.
    """
    hosts = host_order(plan)
    if not hosts:
        raise PlanError(f"plan {plan.name!r} uses no device")
    master = cluster.host(hosts[0])
    master_addr = "127.0.0.1" if master.is_local else master.address
    addresses = [cluster.host(h).address for h in hosts]
    loopback_only = all(a.startswith("127.") or a in ("localhost", "local") for a in addresses)
    specs: list[LaunchSpec] = []
    first_rank = 0
    spot_hosts = [h for h in hosts if cluster.host(h).spot or cluster.host(h).preemption_check]
    for node_rank, name in enumerate(hosts):
        if node_rank:
            first_rank += specs[-1].nproc_per_node
        host = cluster.host(name)
        gpus = tuple(d.gpu for d in plan.devices() if d.host == name)
        workdir = host.workdir.rstrip("/") or "/"
        checkpoint_dir = host.checkpoint_dir
        if homes and name in homes:
            workdir = expand_home(workdir, homes[name])
            checkpoint_dir = expand_home(checkpoint_dir, homes[name])
        run_dir = (
            options.shared_run_dir or f"{workdir}/runs/{plan.name}.v{plan.version}/{options.run_id}"
        )
        plan_path = f"{run_dir}/{plan.name}.v{plan.version}.yaml"
        env = {
            HOST_ENV: name,
            PLAN_ENV: plan_path,
            RUN_ENV: run_dir,
            "PYTHONUNBUFFERED": "1",
            **dict(options.user_env),
        }
        # Where this host's replica receiver listens, and its failure domain, for the
        # placement of checkpoint replicas (peer.replicate).
        env[ADDR_ENV] = "127.0.0.1" if host.is_local else host.address
        env[DOMAIN_ENV] = f"{host.gpu_type}/{'spot' if host.spot else 'on-demand'}"
        if host.preemption_check is not None:
            env[CHECK_ENV] = host.preemption_check.to_env()  # polled by the runtime
        if loopback_only:
            env["GLOO_SOCKET_IFNAME"] = "lo"  # fake hosts on one machine: stay on loopback
        if host.gpu_type == "cpu":
            env.setdefault("OMP_NUM_THREADS", "1")
        else:
            if not options.gpus_from_scheduler:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
            # Segments that grow in place instead of fixed blocks: without it a step's
            # varying shapes (logits, micro-batch buffers) leave reserved but unusable
            # fragments (4.1 GiB on an H100 running GPT-2.7B, the margin between a plan
            # at 92% of memory and out-of-memory), which the cost model cannot predict.
            # It overrides the host's own setting; the launch's user_env (under either
            # name torch reads) overrides it.
            if not {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & set(env):
                env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        if spot_hosts:
            env[NOTICE_BUDGET_ENV] = f"{NOTICE_S:g}"  # a save longer than it is warned about
        if node_rank == 0 and options.run_folder and not options.script:
            # Rank 0, the first worker of the first host, writes the metrics.
            if host.is_local:
                env[FOLDER_ENV] = options.run_folder
            else:
                env[STREAM_ENV] = "1"
        argv = [
            python_for(host),
            "-m",
            # The built-in trainer's hosts run torchrun through our agent, which lets the
            # workers finish an emergency save on SIGTERM (runtime.agent); a user script
            # gets torchrun as it is (autohet need not be installed on its hosts).
            "torch.distributed.run" if options.script else AGENT_MODULE,
            "--nnodes",
            str(len(hosts)),
            "--node-rank",
            str(node_rank),
            "--nproc-per-node",
            str(len(gpus)),
            "--master-addr",
            master_addr,
            "--master-port",
            str(options.master_port),
            "--max-restarts",
            "0",
        ]
        if options.script:
            argv += list(options.script)
        else:
            argv += [
                "-m",
                DEFAULT_MODULE,
                "--plan",
                plan_path,
                "--run-dir",
                run_dir,
                "--checkpoint-dir",
                checkpoint_dir,
                "--remote-storage",
                options.remote_storage or "none",
                *(["--job", options.job] if options.job else []),
                *_train_args(options, host, (homes or {}).get(name)),
            ]
        specs.append(
            LaunchSpec(
                host=name,
                address=host.address,
                node_rank=node_rank,
                nproc_per_node=len(gpus),
                gpus=gpus,
                argv=tuple(argv),
                env=env,
                workdir=workdir,
                plan_path=plan_path,
                run_dir=run_dir,
                # Per host: hosts sharing a home (NFS) share the run directory.
                pid_file=str(PurePosixPath(run_dir) / f"torchrun-{name}.pid"),
                ranks=tuple(range(first_rank, first_rank + len(gpus))),
            )
        )
    return specs


def _train_args(options: LaunchOptions, host: Host, home: str | None) -> tuple[str, ...]:
    """``options.train_args`` with their paths as ``host`` reads them (``pathargs``)."""
    if options.caller is None:
        return tuple(options.train_args)
    return resolve(options.train_args, host, options.caller, home).args
