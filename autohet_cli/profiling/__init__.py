"""Profiling: measuring what each GPU type does per model layer (the SSH probe,
importers, calibration from runs). The profile artifact it writes and the analytic
estimates that fill what it did not measure sit below the cost model, in ``estimates``."""
