"""Analytic profiles, re-exported from ``estimates.analytic`` (pure).

The estimates moved below the cost model, which calls them; this module keeps the
old imports working.
"""

from __future__ import annotations

from autohet_cli.estimates.analytic import analytic_entry as analytic_entry
from autohet_cli.estimates.analytic import effective_tflops as effective_tflops
from autohet_cli.estimates.analytic import layer_timing as layer_timing
