"""The ``slurm`` backend (``launch.backend``): one heterogeneous batch job per attempt.

``dry_run_text`` is the complete batch script as it would be written and
submitted; ``check`` is what can be checked before the job runs (Slurm's
commands, a run folder the nodes share: ``slurm.precheck``; the nodes themselves
are not reached before then); ``run`` writes, submits and follows the job
(``slurm.run``); checkpoint directories are read locally, from the file system
the nodes share with this machine.
"""

from __future__ import annotations

from autohet_cli.cluster import Cluster
from autohet_cli.launch.attempt import Attempt, Prepared
from autohet_cli.launch.executor import JobOutcome
from autohet_cli.launch.pathargs import Caller
from autohet_cli.slurm import precheck
from autohet_cli.slurm.run import LocalPool, build, run_slurm_job
from autohet_cli.transport.pool import ConnectOptions, HostPool


class SlurmBackend:
    name = "slurm"

    def checkpoint_pool(self, cluster: Cluster, connect: ConnectOptions) -> HostPool:
        return LocalPool(cluster, connect)

    def dry_run_text(self, p: Prepared, attempt: Attempt, job: str | None, who: Caller) -> str:
        rid = attempt.run_id
        assert rid is not None  # the session chose it
        return build(
            p.plan,
            p.cluster,
            run_dir=(attempt.runs_root / f"{p.plan.name}.v{p.plan.version}" / rid).resolve(),
            run_id=rid,
            master_port=attempt.master_port,
            script=attempt.script,
            train_args=attempt.train_args,
            remote_storage=p.remote_storage,
            job=job,
        ).script

    def check(
        self, p: Prepared, attempt: Attempt, connect: ConnectOptions, who: Caller
    ) -> list[str]:
        precheck.check(p.cluster, p.plan.hosts(), attempt.runs_root)
        return [
            "dry run: checked Slurm's commands and the run folder (shared with the nodes); "
            "the nodes are not reached before the job runs; nothing was submitted"
        ]

    def run(self, p: Prepared, pool: HostPool, attempt: Attempt) -> JobOutcome:
        return run_slurm_job(p, attempt)


BACKEND = SlurmBackend()
