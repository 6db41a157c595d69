"""The checkpoint contract shared by the runtime (writer) and recovery (reader): pure.

``policy``: when to save (``--checkpoint-every``).
``retention``: which complete steps stay (``--keep-checkpoints``) and pins.
"""
