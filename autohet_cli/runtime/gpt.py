"""Where the built-in GPT used to live; kept so ``--model-fn autohet_cli.runtime.gpt:build`` works.

The model code is now one module per family under ``autohet_cli.runtime.models``
(``gpt2``, ``llama``); ``build`` here is the default model function, which builds
any built-in family the plan's architecture names.
"""

from __future__ import annotations

from autohet_cli.runtime.models import build
from autohet_cli.runtime.models.common import INIT_STD, init_layer, param_seed
from autohet_cli.runtime.models.loss import lm_loss

__all__ = ["INIT_STD", "build", "init_layer", "lm_loss", "param_seed"]
