"""What runs inside each worker: execute an autohet plan with torch.distributed.

- ``topology``  rank mapping, layer segments, sync groups, batch shares (pure)
- ``context``   environment, device, process groups
- ``model_api`` the plug-in point for models (``--model-fn``); ``gpt`` the built-in GPT
- ``data_api``  the plug-in point for batches (``--data``, ``--data-fn``; token files in
  ``autohet_cli.dataset``); ``data`` the synthetic batches, a function of (seed, step)
- ``stage``     this rank's layers, named like the whole model; tensor parallelism
- ``pipeline``  1F1B over the pipeline's own micro-batches
- ``gradsync``  per-segment gradient all-reduce across pipelines
- ``fsdp_stage`` a ``shard: weights`` stage under FSDP2 over its holders (issue 48)
- ``optim``     AdamW/SGD, the learning-rate schedule, global-norm clipping
- ``trainer``   the step loop with hooks; ``train`` the entry point. Below the trainer,
  its helpers see it through ``trainer_api`` (hooks, checkpoint state), never import it
- ``timing``, ``report``, ``metrics``  what a run measures and reports
- ``checkpoint_hook`` saves on ``--checkpoint-every``'s schedule, through ``ckpt``

Importing this package loads nothing heavy; the submodules import torch.
"""

import time as _time

# When a worker's interpreter began importing us: ``startup`` measures from here.
IMPORT_START_UNIX = _time.time()
