"""``--init-from`` on every rank: load, agree, and say what was loaded.

Each rank reads only its own layers and TP shard (``hf_weights.load_stage``), so a
problem may show on one stage alone (a tensor holding NaN, a file one host lacks).
A rank that stopped there alone would leave the others waiting at their first
collective until the timeout, and the launch would report whichever rank died
last. Instead every rank hands its outcome to one ``all_gather_object`` before
training: if any rank failed, every rank raises the first failure's message, so
all stop at once with the same root cause. Rank 0 then prints two lines: the
checkpoint (directory, files, tensors, bytes, dtypes, that every name and shape
matched) and what each stage read, converted to which dtype; and a third when the
plan's model deliberately changes the weights' context (another rope, a longer
window: ``hfconfig.CONTEXT_FIELDS``), so that such a change is never silent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from autohet_cli.errors import AutohetError
from autohet_cli.limits import size_text
from autohet_cli.models import ModelSpec
from autohet_cli.runtime.hf_files import HFWeightsError
from autohet_cli.runtime.hf_match import DTYPE_NAMES, some
from autohet_cli.runtime.hf_weights import StageLoad, load_stage
from autohet_cli.runtime.topology import RankInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """One rank's load, or why it failed (what ``all_gather_object`` carries)."""

    rank: int
    host: str
    layers: tuple[int, int]
    pipeline: int
    load: StageLoad | None
    problem: str | None


def init_from(
    module: nn.Module,
    spec: ModelSpec,
    directory: str | Path,
    *,
    info: RankInfo,
    global_rank: int,
    say: Callable[[str], None],
) -> None:
    """Load ``module`` from ``directory``; raise on every rank if any rank failed."""
    own: BaseException | None = None
    load, problem = None, None
    try:
        load = load_stage(module, spec, directory)
    except (AutohetError, ValueError) as exc:
        own, problem = exc, str(exc)
    except Exception as exc:  # a bug: still tell the others, then the traceback here
        own, problem = exc, f"{type(exc).__name__}: {exc}"
    mine = Outcome(
        rank=global_rank,
        host=info.device.host,
        layers=(info.layer_start, info.layer_end),
        pipeline=info.pipeline,
        load=load,
        problem=problem,
    )
    outcomes = _gather(mine)
    failure = first_failure(outcomes)
    if failure is not None:
        if own is not None and not isinstance(own, AutohetError | ValueError):
            raise own
        raise HFWeightsError(failure)
    if global_rank == 0:
        for line in lines(outcomes):
            say(line)


def first_failure(outcomes: list[Outcome]) -> str | None:
    """The lowest rank's problem, naming its rank unless every rank had one."""
    failed = [o for o in outcomes if o.problem]
    if not failed:
        return None
    first = failed[0]
    where = "" if len(failed) == len(outcomes) else f"rank {first.rank} on {first.host}: "
    return f"{where}{first.problem}"


def _gather(mine: Outcome) -> list[Outcome]:
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    return [o for o in seen if isinstance(o, Outcome)]


def lines(outcomes: list[Outcome]) -> list[str]:
    """The checkpoint's line, and one with what each stage read (the first pipeline
    that holds each layer range; its TP ranks' bytes summed)."""
    loads = [(o, o.load) for o in outcomes if o.load is not None]
    if not loads:
        return []
    stages: dict[tuple[int, int], list[StageLoad]] = {}
    first_pipeline: dict[tuple[int, int], int] = {}
    for o, load in sorted(loads, key=lambda x: (x[0].pipeline, x[0].rank)):
        if first_pipeline.setdefault(o.layers, o.pipeline) == o.pipeline:
            stages.setdefault(o.layers, []).append(load)
    parts = [
        f"layers {a}-{b - 1}: {max(s.num_tensors for s in shards)} tensors "
        f"({size_text(sum(s.num_bytes for s in shards))}"
        + (f" over {len(shards)} TP ranks)" if len(shards) > 1 else ")")
        for (a, b), shards in sorted(stages.items())
    ]
    stored = sorted({d for _, load in loads for d in load.stored_dtypes})
    dtypes = sorted({load.dtype for _, load in loads})
    names = ", ".join(DTYPE_NAMES.get(d, d) for d in stored)
    out = [
        loads[0][1].checkpoint,
        f"--init-from loaded {names} as {', '.join(dtypes)}; each stage read its own layers "
        f"only: {some(parts, 8)}",
    ]
    changed = loads[0][1].changed
    if changed:
        out.append(
            f"note: --init-from: the plan's model changes the weights' ({'; '.join(changed)}): "
            "a deliberate change of model, weights only; it trains from step 0"
        )
    return out
