"""Checkpoints, in one package: the contract both sides share, and the runtime's side.

Pure (no torch; the launcher and ``autohet recover`` import them):
``format`` (layout, manifest, key), ``policy`` (when to save, ``--checkpoint-every``),
``retention`` (which complete steps stay, ``--keep-checkpoints``, pins),
``notice`` (will a save fit a spot host's notice), ``lineage`` (what model and data
order a checkpoint is of).

The workers' side (torch.distributed, imported only by workers and exports):
``checkpointer`` (save and load, collectively), ``files`` (private directories, the
job key, listing, verified reads), ``state`` (what a state dict holds under which
name), ``schedule`` (the trainer hook), ``prune`` (removing steps), ``remote`` (the
remote copy). ``checkpointer`` is the top of the package: the helpers it drives
(``jobdir``, ``loading``, ``finish``, ``failures``, ``inflight``) never import it;
those that read it see it through ``view``'s protocols, as it sees the runtime's trainer.
"""
