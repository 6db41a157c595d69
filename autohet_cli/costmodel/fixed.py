"""Fixed costs of a step, re-exported from ``estimates.fixed`` (pure).

The op and message counts moved below the cost model, beside the analytic estimates
that charge them too; this module keeps the old imports working.
"""

from __future__ import annotations

from autohet_cli.estimates.fixed import STEP_COLLECTIVES as STEP_COLLECTIVES
from autohet_cli.estimates.fixed import TP_COLLECTIVES as TP_COLLECTIVES
from autohet_cli.estimates.fixed import dispatch_ms as dispatch_ms
from autohet_cli.estimates.fixed import layer_ops as layer_ops
from autohet_cli.estimates.fixed import param_tensors as param_tensors
from autohet_cli.estimates.fixed import ring_latency_ms as ring_latency_ms
from autohet_cli.estimates.fixed import small_allreduce_ms as small_allreduce_ms
from autohet_cli.estimates.fixed import step_ms as step_ms
from autohet_cli.estimates.fixed import with_dispatch as with_dispatch
