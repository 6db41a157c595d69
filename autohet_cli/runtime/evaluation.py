"""The validation loss, measured between steps (``--eval-every``).

Split from ``runtime.trainer``: evaluating shares the stage, the pipeline
schedule and the data with a training step but nothing else: no gradients, no
optimizer, no loss scale, and the stage in eval mode (a model's dropout off, so
no random numbers are drawn and training goes on exactly as it would have
without). The trainer decides when (``eval_due``) and hands over what it holds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autohet_cli.runtime.batchcheck import check_token_ids
from autohet_cli.runtime.context import Runtime
from autohet_cli.runtime.data_api import Batches
from autohet_cli.runtime.pipeline import PipelineSchedule
from autohet_cli.runtime.stage import StageModule
from autohet_cli.settings import TrainingSettings


def eval_due(every: int, step: int, last_step: int) -> bool:
    """Whether step ``step`` is followed by a validation loss: every ``every``
    steps (0: never) and after the last step of a fit to ``last_step``."""
    return every > 0 and (step % every == 0 or step == last_step - 1)


@torch.no_grad()
def evaluate(
    stage: StageModule,
    schedule: PipelineSchedule,
    data: Batches,
    runtime: Runtime,
    training: TrainingSettings,
    *,
    num_batches: int,
    vocab_size: int,
) -> float:
    """Mean loss over ``num_batches`` fixed validation batches (forward only, the
    stage in eval mode: a model's dropout off, and no random numbers drawn)."""
    stage.eval()
    try:
        return _evaluate(
            schedule, data, runtime, training, num_batches=num_batches, vocab_size=vocab_size
        )
    finally:
        stage.train()


def _evaluate(
    schedule: PipelineSchedule,
    data: Batches,
    runtime: Runtime,
    training: TrainingSettings,
    *,
    num_batches: int,
    vocab_size: int,
) -> float:
    """Each pipeline's last stage, TP rank 0, sums its share; one all-reduce adds
    the pipelines' shares in float64."""
    info = runtime.info
    total = torch.zeros((), dtype=torch.float64, device=runtime.device)
    for index in range(num_batches):
        batches = data.eval_microbatches(  # type: ignore[attr-defined]
            index,
            batch_size=training.global_batch_size,
            sample_range=runtime.topology.sample_range(info.pipeline),
            micro_batch_size=training.micro_batch_size,
        )
        batches = list(batches)
        check_token_ids(batches, vocab_size, step=index, what="validation batch")
        share = schedule.evaluate(batches)
        if info.is_last_stage and info.tp_rank == 0:
            total += share.double()
    dist.all_reduce(total)
    return float(total.item()) / num_batches
