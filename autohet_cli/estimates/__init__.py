"""What layers and steps cost before any plan: profiles and pure estimates.

The layer below the cost model (cli -> profiling -> ... -> planner -> costmodel ->
estimates -> models/catalog): the profile artifact that holds per-layer times,
measured or not (``profile``, ``profile_io``), the analytic estimates that fill what
nobody measured (``analytic``) and the fixed per-op and per-step costs both the
estimates and the cost model charge (``fixed``). Nothing here runs a command or
opens a connection; the profiling package, which does, writes what this one reads.
"""
