"""Defaults the worker's flags name, in a module without torch.

The launcher checks the built-in trainer's flags with the worker's own parser
(``runtime.train_args``) before anything starts, in well under a second; importing
torch would take several. So the defaults that parser shows live here, and the
modules that use them at run time (``runtime.health``, ``runtime.model_api``) import
them from here; where checkpoints go by default (``CHECKPOINT_DIR_ENV``,
``DEFAULT_JOB``) is the checkpoint layout's, ``ckpt.layout``, as free of torch.
"""

from __future__ import annotations

HEARTBEAT_INTERVAL_S = 2.0
DEFAULT_MODEL_FN = "autohet_cli.runtime.models:build"
