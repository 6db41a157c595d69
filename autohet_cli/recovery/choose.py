"""Which job a recover resumes, with its key, and from which checkpoint step.

The job is ``--job`` or the newest of the plan on the survivors; its key is read
from a survivor (it never leaves our hosts, so remote storage alone never makes a
step that loads). The step is the newest whose manifest authenticates with that key
and whose files have a copy somewhere (``recovery.manifest``), or ``--step``; each
newer step skipped is said with the reason, and a checkpoint of another model than
the plan's is refused. ``recovery.session`` calls these once the survivors are known.
"""

from __future__ import annotations

from collections.abc import Callable

from autohet_cli.launch import jobs
from autohet_cli.plan import Plan
from autohet_cli.recovery import executor as rx
from autohet_cli.recovery.errors import RecoveryError
from autohet_cli.recovery.manifest import CheckpointChoice, newest_complete, parse_step_dir
from autohet_cli.transport.pool import HostPool

Say = Callable[[str], None]


def job_and_key(
    old: Plan, survivors: list[str], pool: HostPool, wanted: str | None, say: Say
) -> tuple[str, bytes]:
    """The job to recover (``--job``, else the newest on the survivors) and its key,
    read from a survivor: the key never leaves our hosts, so remote storage alone
    can never make a step that loads."""
    found = jobs.list_jobs(pool, survivors, old.name)
    if wanted is not None:
        if wanted not in found:
            raise RecoveryError(
                f"--job {wanted}: no survivor has it (jobs of {old.name} there: "
                f"{', '.join(found) or 'none'})"
            )
        info = found[wanted]
    elif not found:
        where = ", ".join(f"{h}:{pool.checkpoint_dir(h)}/{old.name}/" for h in survivors)
        raise _never_checkpointed(f"no job of {old.name} in {where}")
    else:
        info = list(found.values())[-1]
        others = [j for j in found.values() if j is not info and j.newest_step is not None]
        if info.newest_step is None and others:
            listed = ", ".join(f"{j.name} at step {j.newest_step}" for j in others)
            say(
                f"note: the newest job {info.name} has no complete checkpoint on the "
                f"survivors; older ones do ({listed}): pass --job to pick one"
            )
    if not info.key_hosts:
        raise RecoveryError(
            f"job {info.name}: no survivor holds its key (.autohet-key), so its checkpoints "
            "cannot be authenticated (written by an older autohet?); nothing is loaded"
        )
    return info.name, jobs.fetch_key(pool, info.key_hosts[0], old.name, info.name)


def _never_checkpointed(what: str) -> RecoveryError:
    return RecoveryError(
        f"the run never checkpointed: {what}. Nothing to resume from: start again with "
        "autohet launch (checkpoints are on by default; --checkpoint-every 0 with "
        "--no-emergency-save turns them off)"
    )


def choose_checkpoint(
    old: Plan,
    survivors: list[str],
    pool: HostPool,
    root: str | None,
    ns: str,
    key: bytes,
    step: int | None,
    before: int | None,
    say: Say,
) -> tuple[CheckpointChoice, dict[str, set[str]], str]:
    """The checkpoint to resume from (and its manifest text), saying why newer ones
    were skipped and when it exists only in remote storage; ``before``: a step
    found lost, so only older ones."""
    listings = rx.list_checkpoints(survivors, ns, pool)
    remote = rx.list_remote(root, ns)
    found = [d for lst in [*listings.values(), remote] for d in lst]
    if not any(parse_step_dir(d) is not None for d in found):
        where = ", ".join(f"{h}:{pool.checkpoint_dir(h)}/{ns}/" for h in survivors)
        remote_too = f" nor in remote storage {root}/{ns}/" if root else ""
        raise _never_checkpointed(f"no checkpoint in {where}{remote_too}")
    manifests, texts = rx.read_manifests(
        listings, remote, ns, root, pool, key=key, plan_name=old.name
    )
    if before is None and step is not None:
        before = step + 1
    choice = newest_complete(listings, manifests, remote=remote, before_step=before)
    for d, why in choice.skipped:
        say(f"skipped {d}: {why}")
    _check_model(old, choice)
    if step is not None and choice.step != step:
        raise RecoveryError(
            f"--step {step}: no usable checkpoint of that step "
            f"({'; '.join(f'{d}: {w}' for d, w in choice.skipped) or 'not found'}); "
            f"the newest usable one before it is step {choice.step} (pass --step {choice.step})"
        )
    if not any(choice.step_dir in lst for lst in listings.values()):
        say(
            f"warning: {choice.step_dir} exists only in remote storage {root} (no survivor "
            "has it); it is used because its manifest authenticates with the job's key"
        )
    elif choice.remote_only:
        say(
            f"note: {len(choice.remote_only)} file(s) of {choice.step_dir} exist only in "
            f"remote storage {root}: {', '.join(choice.remote_only)}"
        )
    return choice, remote, texts[choice.step_dir]


def _check_model(old: Plan, choice: CheckpointChoice) -> None:
    """The plan recovered from must describe the model the checkpoint holds: an edited
    plan file of the same name would replan (and resume) another architecture."""
    from autohet_cli.ckpt.lineage import model_differences, model_record
    from autohet_cli.models import get_model

    saved = choice.manifest.model
    if saved is None:
        return  # an older writer: nothing recorded to compare
    differ = model_differences(saved, model_record(old.architecture or get_model(old.model_name)))
    if differ:
        raise RecoveryError(
            f"{choice.step_dir} holds the weights of another model than plan "
            f"{old.name}.v{old.version}: {'; '.join(differ)}. Recover with the plan the job "
            "ran with"
        )
