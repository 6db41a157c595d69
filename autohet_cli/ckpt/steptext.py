"""How messages name a checkpoint's step, the same way everywhere (pure).

Two numberings meet in what users read, and both are contracts:

- a log line, a metrics line and a run's summary name the step that *ran*, from 0:
  ``step 79 loss 2.31``, ``finished: step 79 ...``;
- a checkpoint is named by the step that runs *next* once it is loaded:
  ``step-00000080`` and its manifest's ``step: 80`` hold the state after steps 0-79
  (80 steps done), and a run resumed from it logs ``step 80`` first.

So a checkpoint "at step 80" follows the log's "step 79". Rather than renumber either
(step directories, manifests and metrics files are read by other tools), every
message that names a checkpoint's step says which logged step it follows:
``checkpoint at step 80 (after step 79)``.
"""

from __future__ import annotations


def after(step: int) -> str:
    """What checkpoint ``step`` holds, in the log's numbering: ``after step 79``."""
    return f"after step {step - 1}" if step > 0 else "before any step"


def ran(first: int, last: int) -> str:
    """Logged steps ``first`` .. ``last`` as a reader counts them: ``steps 50-79``."""
    return f"step {first}" if first == last else f"steps {first}-{last}"
