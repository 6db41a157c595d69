"""Recovery after a lost host: checkpoint choice, replan, shard transfers, report.

Pure modules (no torch, paramiko or subprocess; the effects live beside them:
``executor`` probes and reads, ``copies`` moves shards, ``hostlock`` keeps one
recover per job, ``pins`` keeps the copied step from being pruned):

- ``manifest``  read and validate ``manifest.json`` (``autohet.checkpoint/v1``),
  checkpoint paths, and the newest complete checkpoint from per-host listings
- ``replan``    the new plan: the old plan's contingency entry, or a fresh solve on
  the survivors, weighed against keeping what survived (stability vs. speed)
- ``transfer``  which files every host of the new plan needs and where each comes
  from: already in place, a surviving peer, or remote storage as the last resort
- ``report``    what ``autohet recover --json`` prints

Importing this package loads nothing heavy.
"""
