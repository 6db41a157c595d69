"""Checkpoints, in one package: the contract both sides share, and the runtime's side.

Pure (no torch; the launcher and ``autohet recover`` import them):
``format`` (the manifest, its key and authentication; it re-exports ``layout``:
directories, names, the job, the remote root), ``policy`` (when to save,
``--checkpoint-every``), ``retention`` (which complete steps stay,
``--keep-checkpoints``, pins), ``notice`` (will a save fit a spot host's notice),
``lineage`` (what model and data order a checkpoint is of), ``steptext`` (how messages
name a checkpoint's step).

The workers' side (torch.distributed, imported only by workers and exports):
``checkpointer`` (save and load, collectively), ``files`` (private directories, the
job key, listing, verified reads), ``state`` (what a state dict holds under which
name), ``prune`` (removing steps), ``remote`` (the remote copy). ``checkpointer`` is
the top of the package: the helpers it drives (``jobdir``, ``loading``, ``finish``,
``failures``, ``inflight``) never import it; those that read it see it through
``view``'s protocols, as it sees the runtime's trainer.

Among the workers' packages ckpt sits below ``runtime`` (which drives it: the trainer
hook that saves is ``runtime.checkpoint_hook``) and ``runfiles``, and above ``peer``
(the partner copies it makes) and ``workerbase`` (log lines, a step directory's names,
parameter names): it imports nothing above it.
"""
